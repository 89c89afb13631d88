"""Evaluation: avg@k, unbiased pass@k, maj@k, and the one path that evaluates a policy.

Cheap to import (no torch, no ray): `maj_at_k` loads the math verifier only when called,
`evaluate` runs on a runtime's generator and verifier pools.
"""

from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING, Iterable, Sequence

if TYPE_CHECKING:
    from rayrep.config import Config
    from rayrep.runtime import Runtime
    from rayrep.types import Prompt
    from rayrep.verifier.sandbox import MathSandbox

__all__ = ["avg_at_k", "evaluate", "evaluate_checkpoint", "maj_at_k", "pass_at_k", "pass_ks", "summarize",
           "summarize_by_source"]


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


def summarize_by_source(
    sources: Sequence[str], correct: Sequence[Sequence[object]], majority: Sequence[bool]
) -> dict[str, float]:
    """Every metric per benchmark (`data_source`), and the aggregates the papers report.

    Per source s with k samples per question: `s/avg@k`, `s/pass@j` for j in `pass_ks(k)`,
    `s/maj@k`, `s/questions`. Aggregates: `pass@1`, pooled over all questions (each
    question weighs the same), and `mean_pass@1` and `mean_maj@k`, the plain mean of the
    benchmarks' scores (ExGRPO's average, where a large benchmark does not dominate). When
    every question has the same k, the pooled `avg@k`, `pass@j` and `maj@k` too (RLEP
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
    out["mean_pass@1"] = sum(pass1) / len(pass1)
    out["mean_maj@k"] = sum(votes) / len(votes)
    widths = {len(row) for row in correct}
    if len(widths) == 1:
        (k,) = widths
        out.update({name: value for name, value in summarize(correct, ks=pass_ks(k)).items() if "@" in name})
        out[f"maj@{k}"] = sum(map(bool, majority)) / len(majority)
    out["questions"] = len(correct)
    return out


def evaluate(runtime: Runtime, cfg: Config, prompts: Sequence[Prompt], prompt_ids: Sequence[list[int]]) -> dict[str, float]:
    """The one evaluation path (training-time evaluations and `jobs/eval.py`): avg@k,
    pass@k and maj@k of the generators' current weights on `prompts`, per benchmark and
    aggregated (`summarize_by_source`).

    Samples `cfg.eval_samples(data_source)` answers per question (`generator.eval_samples`,
    or a benchmark's own count from `generator.eval_samples_by_source`) at
    `generator.eval_temperature` on the generator pool; the verifier pool scores them and
    judges each question's majority answer. Also returns the mean response length and the
    verifier's timeouts and errors.
    """
    gen = cfg.generator
    pending = runtime.generators.generate(
        list(prompt_ids), n=[cfg.eval_samples(p.data_source) for p in prompts], temperature=gen.eval_temperature,
        top_p=1.0, max_tokens=gen.max_response_tokens,
    )
    verdicts = runtime.verifiers.check(pending, [p.ground_truth for p in prompts], majority=True)
    lengths = [len(r.response_ids) for per_prompt in runtime.generators.gather(pending) for r in per_prompt]
    summary = summarize_by_source([p.data_source for p in prompts], verdicts.correct, verdicts.majority)
    summary["mean_response_tokens"] = sum(lengths) / max(1, len(lengths))
    summary["verifier_timeouts"] = verdicts.statuses.get("timeout", 0)
    summary["verifier_errors"] = verdicts.statuses.get("error", 0)
    return summary


def evaluate_checkpoint(cfg: Config, model_path: str) -> dict[str, float]:
    """`evaluate` of the policy at `model_path` on the configured test split, on a runtime
    of generators and verifiers started for it (and stopped afterwards)."""
    from transformers import AutoTokenizer

    from rayrep.data import encode_prompts, load_split
    from rayrep.runtime import Runtime

    prompts = load_split(cfg.data, "test")
    prompt_ids = encode_prompts(AutoTokenizer.from_pretrained(model_path), prompts, cfg.data.max_prompt_tokens)
    runtime = Runtime.start(cfg, model_path, train=False)
    try:
        return evaluate(runtime, cfg, prompts, prompt_ids)
    finally:
        runtime.shutdown()
