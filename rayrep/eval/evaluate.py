"""The one path that evaluates a policy (training-time evaluations, `jobs/eval.py`, a
pipeline's checkpoint): sample on a runtime's generators in slices, score on its
verifiers, summarize per benchmark (`rayrep.stats.formulas`)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence

from rayrep.config import Config
from rayrep.stats.formulas import summarize_by_source
from rayrep.generator.group import PendingRollouts, Share, split_evenly
from rayrep.progress import Progress
from rayrep.roles.system import Runtime
from rayrep.types import Prompt, Rollout
from rayrep.verifier.group import VerifierGroup


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
    verifiers: VerifierGroup,
    prompts: Sequence[Prompt],
    slices: Sequence[range],
    sample_slice: Callable[[range], Sequence[Share | PendingRollouts]],
    progress: Progress | None,
    complete: Callable[..., tuple[list[PendingRollouts], list]] | None = None,
) -> dict[str, float]:
    """Sample each slice of questions (`sample_slice(indices)`; the next slice's sampling starts
    before this one is scored), score it on the verifier group, and summarize every verdict at
    the end: the metrics are those of one slice holding all questions, whatever the slicing.
    `complete`: `GeneratorGroup.complete`, which hands a slice's answers to the verifiers as
    they arrive (a dead generator replaced, its prompts asked again); its counts are reported
    as `generator_replaced` and `generator_retried_prompts` when not zero. None: the answers
    are given (`sample_slice` returns them as `PendingRollouts`), scored as they are."""
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
        checking = verifiers.checking([prompts[i] for i in part], majority=True)
        if complete is not None:
            _, answers = complete(pending, recovery, on_arrival=checking.send)
            lengths.extend(a.length for sampled in answers for a in sampled)
        else:
            for answers in pending:
                checking.send(answers)
        verdicts = checking.result()
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
    tokens, on the generator group; the verifier group scores them and judges each question's
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

    def sample_slice(part: range) -> list[Share]:
        return runtime.generators.generate(
            [prompt_ids[i] for i in part], n=[samples[i] for i in part], temperature=gen.eval_temperature,
            top_p=gen.eval_top_p, max_tokens=gen.max_response_tokens, seeds=[seeds[i] for i in part],
            parts=gen.answer_parts,
        )

    return _score_in_slices(runtime.verifiers, prompts, slices, sample_slice, progress, runtime.generators.complete)


def score_answers(
    verifiers: VerifierGroup,
    prompts: Sequence[Prompt],
    answers: Sequence[Sequence[str]],
    progress: Progress | None = None,
) -> dict[str, float]:
    """`evaluate`'s metrics for given answer texts instead of sampled ones: `answers[i]` are
    the k answers to `prompts[i]`. The same slicing, verifier-group scoring and summary; no
    `mean_response_tokens` (texts have no token ids). Needs Ray (answers travel as objects)."""
    import ray

    if len(answers) != len(prompts):
        raise ValueError(f"{len(answers)} lists of answers for {len(prompts)} prompts")
    rollouts = [[Rollout([], [], [], text, "stop") for text in texts] for texts in answers]
    shares = max(1, len(verifiers.workers))
    slices = [range(len(prompts))] if progress is None else eval_slices([len(t) for t in answers], shares)

    def sample_slice(part: range) -> list[PendingRollouts]:
        # one share per verifier, indexed within the slice, as the generator group hands them out
        return [PendingRollouts(share, ray.put([rollouts[part[i]] for i in share]))
                for share in split_evenly(len(part), shares) if len(share)]

    summary = _score_in_slices(verifiers, prompts, slices, sample_slice, progress)
    del summary["mean_response_tokens"]
    return summary


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

    prompts = load_split(cfg.data, "test") if prompts is None else prompts
    read_model_config(model_path)  # names the path when it holds no checkpoint
    prompt_ids = encode_prompts(AutoTokenizer.from_pretrained(model_path), prompts, cfg.data.max_prompt_tokens)
    runtime = Runtime.start(cfg, model_path, train=False)
    try:
        return evaluate(runtime, cfg, prompts, prompt_ids, progress)
    finally:
        runtime.shutdown()
