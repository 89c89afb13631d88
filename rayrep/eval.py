"""Evaluation: avg@k, unbiased pass@k, maj@k, and the one path that evaluates a policy.

Cheap to import (no torch, no ray): `maj_at_k` loads the math verifier only when called,
`evaluate` runs on a runtime's generator and verifier pools; `format_table`, `eval_report`
and `write_report` turn its metrics into the table and the JSON file of `jobs/eval.py`.
"""

from __future__ import annotations

import json
import math
import operator
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rayrep.config import Config
    from rayrep.generator.pool import PendingRollouts
    from rayrep.progress import Progress
    from rayrep.runtime import Runtime
    from rayrep.types import Prompt
    from rayrep.verifier.pool import VerifierPool
    from rayrep.verifier.sandbox import MathSandbox

__all__ = ["avg_at_k", "check_report_path", "default_report_path", "eval_report", "eval_slices", "evaluate",
           "evaluate_checkpoint", "format_table", "maj_at_k", "pass_at_k", "pass_ks", "score_answers", "summarize",
           "summarize_by_source", "write_report"]


def _as_count(name: str, value: object) -> int:
    """`value` as a non-negative int (numpy integers welcome), or an error naming `name`."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        count = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if count < 0:
        raise ValueError(f"{name} must be >= 0, got {count}")
    return count


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from n samples of which c are correct.

    The chance that at least one of k samples drawn without replacement from the n is
    correct: ``1 - C(n-c, k) / C(n, k)`` (Chen et al., 2021).
    """
    n, c, k = _as_count("n", n), _as_count("c", c), _as_count("k", k)
    if k == 0:
        raise ValueError("k must be >= 1, got 0")
    if k > n:
        raise ValueError(f"k must be <= n, got k={k} > n={n}")
    if c > n:
        raise ValueError(f"c must be <= n, got c={c} > n={n}")
    if n - c < k:
        return 1.0  # every draw of k includes a correct sample
    # C(n-c, k) / C(n, k) == prod_{i=n-c+1..n} (1 - k/i): no huge binomials, no overflow.
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def _correctness_rows(correct: Iterable[Iterable[object]]) -> list[list[float]]:
    """Validate a problems x samples matrix of 0/1 (or bools) into lists of floats."""
    rows = []
    for index, row in enumerate(correct):
        try:
            values = [float(v) for v in row]
        except TypeError:
            raise ValueError(
                f"correct[{index}] is not a row of samples: pass one row of 0/1 per problem (2-D)"
            ) from None
        if not values:
            raise ValueError(f"correct[{index}] is empty: every problem needs at least one sample")
        bad = next((v for v in values if v not in (0.0, 1.0)), None)
        if bad is not None:
            raise ValueError(
                f"correct[{index}] holds {bad!r}: expected 0/1 or bools (for rewards, use r > 0)"
            )
        rows.append(values)
    if not rows:
        raise ValueError("correct is empty: need at least one problem")
    return rows


def avg_at_k(correct: Iterable[Iterable[object]]) -> float:
    """Mean correctness over each problem's samples, averaged over problems.

    `correct` holds one row of 0/1 (or bools) per problem: a list of lists or a 2-D array.
    Rows may differ in length; each problem weighs the same.
    """
    rows = _correctness_rows(correct)
    return sum(sum(row) / len(row) for row in rows) / len(rows)


def summarize(correct: Iterable[Iterable[object]], ks: Sequence[int] | None = None) -> dict[str, float]:
    """Metrics of a problems x n-samples correctness matrix, for logs and reports.

    Returns ``{"avg@n": ..., "pass@k": ... for each k in ks, "num_problems": ...,
    "samples_per_problem": n}``, pass@k being the mean over problems of `pass_at_k`.
    `ks` defaults to (1, n). Every problem must have the same number of samples n.
    """
    rows = _correctness_rows(correct)
    n = len(rows[0])
    for index, row in enumerate(rows):
        if len(row) != n:
            raise ValueError(
                f"correct[{index}] has {len(row)} samples but correct[0] has {n}: summarize needs equal rows"
            )
    wanted = sorted({1, n} if ks is None else {_as_count("ks", k) for k in ks})
    for k in wanted:
        if not 1 <= k <= n:
            raise ValueError(f"ks must lie between 1 and the {n} samples per problem, got {k}")
    summary: dict[str, float] = {f"avg@{n}": avg_at_k(rows)}
    for k in wanted:
        summary[f"pass@{k}"] = sum(pass_at_k(n, int(sum(row)), k) for row in rows) / len(rows)
    summary["num_problems"] = len(rows)
    summary["samples_per_problem"] = n
    return summary


def maj_at_k(
    answers: Sequence[str],
    ground_truth: str,
    k: int | None = None,
    *,
    timeout_s: float = 1.0,
    sandbox: MathSandbox | None = None,
) -> float:
    """1.0 if the majority final answer of the first k completions equals the ground truth.

    Final answers are extracted as the verifier does (the last ``\\boxed{}``, else what
    math-verify finds at the end of the text); completions without one do not vote.
    Answers join the first group whose first answer they are math-verify-equivalent to
    (equivalence is checked against that representative only, so it need not be
    transitive). The largest group wins; a tie goes to the group whose first answer came
    earliest. 0.0 when no completion has an answer. `k` defaults to all completions;
    `sandbox` defaults to the process-wide one of `rayrep.verifier.math`.
    """
    if isinstance(answers, str):
        raise TypeError("answers must be a sequence of completions, not one string")
    answers = list(answers)
    k = len(answers) if k is None else _as_count("k", k)
    if not 1 <= k <= len(answers):
        raise ValueError(f"k must lie between 1 and len(answers)={len(answers)}, got {k}")

    from rayrep.verifier import math as math_verifier

    checker = sandbox if sandbox is not None else math_verifier.default_sandbox()
    representatives: list[str] = []
    votes: list[int] = []
    group_of: dict[str, int] = {}  # identical strings skip the sandbox
    for answer in checker.extract_answers(answers[:k], timeout_s):
        if answer is None:
            continue
        group = group_of.get(answer)
        if group is None:
            same = checker.equivalent_batch([(rep, answer) for rep in representatives], timeout_s)
            group = next((i for i, match in enumerate(same) if match), None)
            if group is None:
                representatives.append(answer)
                votes.append(0)
                group = len(representatives) - 1
            group_of[answer] = group
        votes[group] += 1
    if not votes:
        return 0.0
    # Groups were created in order of first occurrence, so the lowest index wins a tie.
    winner = max(range(len(votes)), key=lambda i: (votes[i], -i))
    return 1.0 if checker.equivalent(ground_truth, representatives[winner], timeout_s) else 0.0


def pass_ks(n: int) -> list[int]:
    """The k of pass@k reported for n samples per question: 1, the powers of two up to n, and n."""
    return sorted({1, n} | {2**i for i in range(1, n.bit_length()) if 2**i <= n})


def standard_error(values: Sequence[float]) -> float:
    """The standard error of the mean of `values` (sample standard deviation / sqrt(n)); 0 for fewer than two."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def summarize_by_source(
    sources: Sequence[str], correct: Sequence[Sequence[object]], majority: Sequence[bool]
) -> dict[str, float]:
    """Every metric per benchmark (`data_source`), and the aggregates the papers report.

    Per source s with k samples per question: `s/avg@k`, `s/pass@j` for j in `pass_ks(k)`,
    `s/maj@k`, `s/questions`. Aggregates: `pass@1`, pooled over all questions (each
    question weighs the same), with its standard error `pass@1_se`; `mean_pass@1` and
    `mean_maj@k`, the plain mean of the benchmarks' scores (ExGRPO's average, where a
    large benchmark does not dominate). When every question has the same k, the pooled `avg@k`, `pass@j` and `maj@k` too (RLEP
    reports its benchmarks one by one: the per-source entries).
    """
    if not (len(sources) == len(correct) == len(majority)):
        raise ValueError(f"sources, correct and majority differ in length: {len(sources)}, {len(correct)}, {len(majority)}")
    by_source: dict[str, list[int]] = {}
    for index, source in enumerate(sources):
        by_source.setdefault(source, []).append(index)
    out: dict[str, float] = {}
    pass1, votes = [], []
    for source, rows in sorted(by_source.items()):
        matrix = [correct[i] for i in rows]
        k = len(matrix[0])
        part = summarize(matrix, ks=pass_ks(k))
        vote = sum(bool(majority[i]) for i in rows) / len(rows)
        out.update({f"{source}/{name}": value for name, value in part.items() if "@" in name})
        out[f"{source}/maj@{k}"] = vote
        out[f"{source}/questions"] = len(rows)
        pass1.append(part["pass@1"])
        votes.append(vote)
    per_question = [sum(map(float, row)) / len(row) for row in correct]
    out["pass@1"] = sum(per_question) / len(per_question)
    # The standard error of pass@1 as an estimate of the policy's accuracy on questions of
    # this kind: the spread of per-question scores (question difficulty and sampling noise
    # together) over the square root of the number of questions.
    out["pass@1_se"] = standard_error(per_question)
    out["mean_pass@1"] = sum(pass1) / len(pass1)
    out["mean_maj@k"] = sum(votes) / len(votes)
    widths = {len(row) for row in correct}
    if len(widths) == 1:
        (k,) = widths
        out.update({name: value for name, value in summarize(correct, ks=pass_ks(k)).items() if "@" in name})
        out[f"maj@{k}"] = sum(map(bool, majority)) / len(majority)
    out["questions"] = len(correct)
    return out


# ---------------------------------------------------------------------------------------
# evaluating a policy: sampling and scoring in slices, the table, the report

EVAL_SLICES = 20
"""An evaluation that reports progress cuts its questions into about this many slices, a line each..."""
MIN_SLICE_ANSWERS = 256
"""...but gives each generator at least this many answers per slice: an engine's batch lasts as long
as its slowest answer, so small slices would leave the engines idle between them."""


def eval_slices(samples: Sequence[int], generators: int = 1) -> list[range]:
    """Contiguous ranges of question indices covering all of them in order, `samples[i]` being
    the answers sampled for question i: each range holds about 1/EVAL_SLICES of the answers,
    and at least MIN_SLICE_ANSWERS per generator (the last one may hold fewer)."""
    target = max(math.ceil(sum(samples) / EVAL_SLICES), MIN_SLICE_ANSWERS * max(1, generators))
    slices, start, answers = [], 0, 0
    for index, count in enumerate(samples):
        answers += count
        if answers >= target:
            slices.append(range(start, index + 1))
            start, answers = index + 1, 0
    if start < len(samples):
        slices.append(range(start, len(samples)))
    return slices


def _score_in_slices(
    verifiers: VerifierPool,
    prompts: Sequence[Prompt],
    slices: Sequence[range],
    sample_slice: Callable[[range], list[PendingRollouts]],
    progress: Progress | None,
    complete: Callable[[list[PendingRollouts], Counter], tuple[list[PendingRollouts], list]] | None = None,
) -> dict[str, float]:
    """Sample each slice of questions (`sample_slice(indices)`; the next slice's sampling starts
    before this one is scored), score it on the verifier pool, and summarize every verdict at
    the end: the metrics are those of one slice holding all questions, whatever the slicing.
    `complete`: `GeneratorPool.complete`, which makes a slice's shares whole (a dead generator
    replaced, its prompts asked again) before they are scored; its counts are reported as
    `generator_replaced` and `generator_retried_prompts` when not zero."""
    from rayrep.generator.pool import GeneratorPool

    if not prompts:
        raise ValueError("no questions to evaluate")
    correct: list[list[bool]] = []
    majority: list[bool] = []
    lengths: list[int] = []
    statuses: Counter = Counter()
    recovery: Counter = Counter()
    if progress is not None:
        progress.update(0)  # the roles are up: the rate clock starts now
    upcoming = sample_slice(slices[0])
    for position, part in enumerate(slices):
        pending = upcoming
        if position + 1 < len(slices):
            upcoming = sample_slice(slices[position + 1])  # the generators go on while this slice is scored
        if complete is not None:
            pending, rollouts = complete(pending, recovery)
        else:
            rollouts = GeneratorPool.gather(pending)
        verdicts = verifiers.check(pending, [prompts[i].ground_truth for i in part], majority=True)
        lengths.extend(len(r.response_ids) for sampled in rollouts for r in sampled)
        correct.extend(verdicts.correct)
        majority.extend(verdicts.majority)
        statuses.update(verdicts.statuses)
        if progress is not None:
            progress.update(part.stop, **{"pass@1": sum(sum(row) / len(row) for row in correct) / len(correct)})
    summary = summarize_by_source([p.data_source for p in prompts], correct, majority)
    summary["mean_response_tokens"] = sum(lengths) / max(1, len(lengths))
    summary["verifier_timeouts"] = statuses.get("timeout", 0)
    summary["verifier_errors"] = statuses.get("error", 0)
    summary.update({f"generator_{name}": n for name, n in recovery.items() if n})
    return summary


def evaluate(
    runtime: Runtime,
    cfg: Config,
    prompts: Sequence[Prompt],
    prompt_ids: Sequence[list[int]],
    progress: Progress | None = None,
) -> dict[str, float]:
    """The one evaluation path (training-time evaluations and `jobs/eval.py`): avg@k,
    pass@k and maj@k of the generators' current weights on `prompts`, per benchmark and
    aggregated (`summarize_by_source`).

    Samples `cfg.eval_samples(data_source)` answers per question (`generator.eval_samples`,
    or a benchmark's own count from `generator.eval_samples_by_source`) at
    `generator.eval_temperature` and `eval_top_p`, up to `generator.max_response_tokens`
    tokens, on the generator pool; the verifier pool scores them and judges each question's
    majority answer. Also returns the mean response length and the verifier's timeouts and
    errors, and, when a generator died meanwhile (replaced, its questions sampled again with
    their seeds), `generator_replaced` and `generator_retried_prompts`.

    `progress`: sample and score the questions in slices (`eval_slices`) and report each
    (questions done, pooled pass@1 so far); each question is sampled with its own seed
    (`Config.sampling_seeds("eval", ...)`), so the answers and metrics are those of one
    call for all questions.
    None (training's evaluations): one generate call for all questions, no output.
    """
    gen = cfg.generator
    samples = [cfg.eval_samples(p.data_source) for p in prompts]
    seeds = cfg.sampling_seeds("eval", len(prompts))  # per question: the same answers however sliced
    slices = [range(len(prompts))] if progress is None else eval_slices(samples, len(runtime.generators.workers))

    def sample_slice(part: range) -> list[PendingRollouts]:
        return runtime.generators.generate(
            [prompt_ids[i] for i in part], n=[samples[i] for i in part], temperature=gen.eval_temperature,
            top_p=gen.eval_top_p, max_tokens=gen.max_response_tokens, seeds=[seeds[i] for i in part],
        )

    return _score_in_slices(runtime.verifiers, prompts, slices, sample_slice, progress, runtime.generators.complete)


def score_answers(
    verifiers: VerifierPool,
    prompts: Sequence[Prompt],
    answers: Sequence[Sequence[str]],
    progress: Progress | None = None,
) -> dict[str, float]:
    """`evaluate`'s metrics for given answer texts instead of sampled ones: `answers[i]` are
    the k answers to `prompts[i]`. The same slicing, verifier-pool scoring and summary; no
    `mean_response_tokens` (texts have no token ids). Needs Ray (answers travel as objects)."""
    import ray

    from rayrep.generator.pool import PendingRollouts, split_evenly
    from rayrep.types import Rollout

    if len(answers) != len(prompts):
        raise ValueError(f"{len(answers)} lists of answers for {len(prompts)} prompts")
    rollouts = [[Rollout([], [], [], text, "stop") for text in texts] for texts in answers]
    shares = max(1, len(verifiers.workers))
    slices = [range(len(prompts))] if progress is None else eval_slices([len(t) for t in answers], shares)

    def sample_slice(part: range) -> list[PendingRollouts]:
        # one share per verifier, indexed within the slice, as the generator pool hands them out
        return [PendingRollouts(share, ray.put([rollouts[part[i]] for i in share]))
                for share in split_evenly(len(part), shares) if len(share)]

    summary = _score_in_slices(verifiers, prompts, slices, sample_slice, progress)
    del summary["mean_response_tokens"]
    return summary


START_SECTIONS = ("model", "data", "generator", "verifier")
"""What the step-0 evaluation depends on besides `run.seed`: the policy, the test set, the
sampling and the scoring."""


def known_start_evaluation(cfg: Config) -> dict:
    """The step-0 evaluation of the run folder `run.start_eval`, checked to be this run's
    own start: every field of `START_SECTIONS` and `run.seed` equal, so the policy, the test
    questions, their sampling seeds and the scoring are the same and evaluating again would
    draw the same answers. Refused with the first field that differs, or the file missing."""
    from rayrep.config import ConfigError, differing_fields

    folder = Path(cfg.run.start_eval)
    try:
        other = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        evals = json.loads((folder / "evals.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"run.start_eval: {folder} is not a finished run's folder ({err})") from None
    if not (isinstance(evals, list) and evals and isinstance(evals[0], dict) and evals[0].get("step") == 0):
        raise ConfigError(f"run.start_eval: {folder / 'evals.json'} has no step-0 evaluation")
    mine = json.loads(cfg.to_json())  # as the other run saved its own (lists, not tuples)
    differences = differing_fields(
        other, mine, keep=lambda name: name.split(".")[0] in START_SECTIONS or name == "run.seed")
    if differences:
        name, there, here = differences[0]
        raise ConfigError(f"run.start_eval: {folder} started otherwise: {name} = {there!r} there, {here!r} here")
    return {**evals[0], "time_eval": 0.0}


def evaluate_checkpoint(
    cfg: Config, model_path: str, prompts: Sequence[Prompt] | None = None, progress: Progress | None = None
) -> dict[str, float]:
    """`evaluate` of the policy at `model_path` on `prompts` (default: the configured test
    split), on a runtime of generators and verifiers started for it (and stopped afterwards).
    Bad input (a prompt file or row, a folder that is not a checkpoint, a prompt too long)
    fails with an `InputError` before any actor starts."""
    from transformers import AutoTokenizer

    from rayrep.data import encode_prompts, load_split
    from rayrep.models import read_model_config
    from rayrep.runtime import Runtime

    prompts = load_split(cfg.data, "test") if prompts is None else prompts
    read_model_config(model_path)  # names the path when it holds no checkpoint
    prompt_ids = encode_prompts(AutoTokenizer.from_pretrained(model_path), prompts, cfg.data.max_prompt_tokens)
    runtime = Runtime.start(cfg, model_path, train=False)
    try:
        return evaluate(runtime, cfg, prompts, prompt_ids, progress)
    finally:
        runtime.shutdown()


POOLED, MEAN = "all (pooled)", "mean of benchmarks"
"""The table's aggregate rows: every question weighs the same; every benchmark weighs the same."""


def format_table(metrics: Mapping[str, float]) -> str:
    """The evaluation's table, in percent: one row per benchmark (`data_source`) with its
    questions, k, avg@k, pass@1, pass@j for j in `pass_ks(k)` and maj@k; then the aggregates
    of `summarize_by_source`: pooled over all questions (avg@k, pass@j and maj@k only when
    every benchmark has the same k) and the plain mean over benchmarks (pass@1 and maj@k).
    "-" where a row has no such number. Pure: `metrics` as `evaluate` returns them."""
    per_source: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        source, slash, name = key.rpartition("/")
        if slash:
            per_source.setdefault(source, {})[name] = value

    def k_of(values: Mapping[str, float]) -> int | None:
        return next((int(name[4:]) for name in values if name.startswith("avg@")), None)

    extra_ks = sorted({int(name[5:]) for values in per_source.values() for name in values
                       if name.startswith("pass@")} - {1})
    header = ["benchmark", "questions", "k", "avg@k", "pass@1", *(f"pass@{j}" for j in extra_ks), "maj@k"]

    def percent(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.1f}"

    def row(label: str, questions: object, k: int | None, values: Mapping[str, float], maj: float | None) -> list[str]:
        return [label, "-" if questions is None else str(questions), "-" if k is None else str(k),
                percent(values.get(f"avg@{k}")), *(percent(values.get(f"pass@{j}")) for j in [1, *extra_ks]),
                percent(maj)]

    rows = [header]
    for source, values in sorted(per_source.items()):
        k = k_of(values)
        rows.append(row(source, int(values["questions"]), k, values, values.get(f"maj@{k}")))
    pooled = {name: value for name, value in metrics.items() if "/" not in name}
    k = k_of(pooled)
    rows.append(row(POOLED, int(pooled["questions"]), k, pooled, pooled.get(f"maj@{k}")))
    rows.append(row(MEAN, None, None, {"pass@1": metrics["mean_pass@1"]}, metrics["mean_maj@k"]))
    widths = [max(len(r[column]) for r in rows) for column in range(len(header))]
    lines = ["  ".join([r[0].ljust(widths[0]), *(cell.rjust(width) for cell, width in zip(r[1:], widths[1:]))])
             for r in rows]
    lines.insert(len(per_source) + 1, "-" * len(lines[0]))
    return "\n".join(lines)


def eval_report(
    cfg: Config, checkpoint: str, prompts: Sequence[Prompt], metrics: Mapping[str, float], seconds: float
) -> dict:
    """Everything an evaluation produced, as `jobs/eval.py` writes it to JSON: the checkpoint,
    the prompt files (none: the embedded task's test split), the sampling settings (k per
    benchmark), every metric, the time taken, and the whole config."""
    gen = cfg.generator
    return {
        "checkpoint": checkpoint,
        "prompt_files": list(cfg.data.test_files),
        "questions": len(prompts),
        "sampling": {
            "temperature": gen.eval_temperature,
            "top_p": gen.eval_top_p,
            "max_tokens": gen.max_response_tokens,
            "k": {source: cfg.eval_samples(source) for source in sorted({p.data_source for p in prompts})},
            "seed": cfg.seed("generator"),
        },
        "metrics": dict(metrics),
        "eval_seconds": round(seconds, 1),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": cfg.to_dict(),
    }


def default_report_path(out_dir: str | Path, checkpoint: str, when: float | None = None) -> Path:
    """`<out_dir>/eval/<checkpoint name>-<YYYYmmdd-HHMMSS>.json`: a run's checkpoint
    (`<run>/checkpoints/<name>`) is named `<run>-<name>`, a hub id by its last part."""
    path = Path(checkpoint)
    name = path.name or "checkpoint"
    if path.parent.name == "checkpoints" and path.parent.parent.name:
        name = f"{path.parent.parent.name}-{name}"
    return Path(out_dir) / "eval" / f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(when))}.json"


def check_report_path(path: str | Path) -> None:
    """Refuse, before any sampling, a report path that cannot be written (a folder, or under a
    folder that cannot be created or written), with an `InputError` naming it."""
    from rayrep.config import InputError

    path = Path(path)
    if path.is_dir():
        raise InputError(f"report {path}: is a folder; give a file name")
    existing = path.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"report {path}: cannot be written ({existing} is not a writable folder)")


def write_report(path: str | Path, report: Mapping) -> Path:
    """Write `report` as JSON to `path` atomically: a temporary file beside it, then a rename,
    so that no reader sees half a file and a failed write leaves none behind."""
    import tempfile

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            json.dump(report, file, indent=2)
            file.write("\n")
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path
