"""The driver: the single controller of a training run.

    plan -> generate (vLLM) -> verify (math-verify) -> build (+ replay) -> update -> sync

Each step is written out below in that order, with typed calls on the actor groups. With
asynchronous rollouts (`run.max_policy_lag` = N > 0) the next N steps' rounds are planned
and start generating before the update, so the generators sample while the learners train;
their answers are then up to N policy versions old.
"""

from __future__ import annotations

import json
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from rayrep.algos import make_algorithm
from rayrep.algos.grpo import GRPO, keep_informative
from rayrep.checkpoint import (RunState, begin_save, finish_save, latest_checkpoint, link_files, mark_final,
                               read_run_state, rng_state, set_rng_state)
from rayrep.config import Config, InputError
from rayrep.data import PromptSampler, encode_prompts, load_split
from rayrep.eval import evaluate, known_start_evaluation
from rayrep.learner import LearnerDied
from rayrep.library_output import LIBRARY_LOG
from rayrep.metrics import MetricsLog, plot_run, step_fields
from rayrep.models import resolve_policy
from rayrep.progress import Progress
from rayrep.runtime import Runtime
from rayrep.generator.pool import PendingRollouts
from rayrep.types import Group, StepPlan


@dataclass
class RunResult:
    run_dir: Path
    final_checkpoint: str
    evals: list[dict] = field(default_factory=list)
    """One record per evaluation: {"step", "test_pass@1", ...}."""


def run_dir_for(cfg: Config) -> Path:
    name = cfg.logging.run_name or f"{cfg.algorithm.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return Path(cfg.logging.out_dir) / name


@contextmanager
def timed(record: dict, phase: str) -> Iterator[None]:
    """Adds the block's wall time to `record["time_<phase>"]` (phases that run in several
    rounds of a step, such as a dynamic-sampling refill, add up)."""
    start = time.perf_counter()
    yield
    record[f"time_{phase}"] = record.get(f"time_{phase}", 0.0) + time.perf_counter() - start


def train(cfg: Config, log=print, resume: bool = False) -> RunResult:
    """Run `cfg.run.steps` steps; `resume`: continue the run in `run_dir_for(cfg)` from its
    latest complete checkpoint (`rayrep.checkpoint`), as if it had never stopped."""
    model_path = resolve_policy(cfg, log=log)

    # Everything that can be wrong with the data (or an experience pool, or the checkpoint
    # to resume from) fails here, before any actor starts and before the run's folder is written.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train_prompts = load_split(cfg.data, "train")
    test_prompts = load_split(cfg.data, "test")
    prompt_ids = dict(zip((p.uid for p in train_prompts), encode_prompts(tokenizer, train_prompts, cfg.data.max_prompt_tokens)))
    test_ids = encode_prompts(tokenizer, test_prompts, cfg.data.max_prompt_tokens)
    algorithm = make_algorithm(cfg, train_prompts, prompt_ids)
    run_dir = run_dir_for(cfg)
    checkpoint, state = resume_point(cfg, run_dir) if resume else (None, None)
    known_start = known_start_evaluation(cfg) if cfg.run.start_eval and state is None else None

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.to_json())
    sampler = PromptSampler(train_prompts, seed=cfg.seed("data"))
    questions = cfg.algorithm.prompts_per_step
    result = RunResult(run_dir, final_checkpoint="")
    if state is not None:
        sampler.restore(state.sampler)
        result.evals = state.evals
        keep_metrics_until(run_dir / "metrics.jsonl", state.step)
    # A resumed run's generators start from the checkpoint's weights; its learners from the
    # base policy, whose every weight the learner checkpoint's fp32 masters then replace.
    runtime = Runtime.start(cfg, model_path, policy_version=state.policy_version if state else 0,
                            generator_path=str(checkpoint) if checkpoint else None, log_dir=run_dir)
    log(f"run folder: {run_dir} (libraries' output: {LIBRARY_LOG} there)")
    metrics = MetricsLog(run_dir, cfg.to_dict(), cfg.logging.wandb, cfg.logging.wandb_project, cfg.logging.wandb_mode)

    def evaluation(step: int) -> dict:
        if step == 0 and known_start is not None:  # the same start, evaluated by another run
            result.evals.append(known_start)
            return known_start
        start = time.perf_counter()
        summary = evaluate(runtime, cfg, test_prompts, test_ids)
        record = {"step": step, "time_eval": time.perf_counter() - start}
        record.update({f"test_{k}": v for k, v in summary.items() if "@" in k})
        record.update({f"eval_{k}": v for k, v in summary.items() if k.startswith("generator_")})
        result.evals.append(record)
        return record

    replay_dir = run_dir / "replay"

    def snapshot_buffer() -> None:
        """The buffer as it is now in `replay_dir`, the restore point of a shard that dies
        (not written again when nothing changed)."""
        if runtime.buffer.changed or runtime.buffer.restore_point != replay_dir:
            runtime.buffer.snapshot(replay_dir)

    def save(step: int) -> Path:
        partial = begin_save(run_dir, step)
        runtime.learners.save(str(partial))  # the policy, as a Hugging Face checkpoint
        learner = runtime.learners.save_state(str(partial / "learner")) if resumable(cfg) else None
        if runtime.buffer is not None:
            snapshot_buffer()
            link_files(replay_dir, partial / "buffer")
        return finish_save(partial, RunState(
            step=step, policy_version=runtime.sync.version, sampler=sampler.state(),
            buffer_rng=rng_state(runtime.buffer.rng) if runtime.buffer is not None else None,
            algorithm=algorithm.state(), evals=result.evals, learner=learner, config=cfg.to_dict(),
        ), cfg.run.keep_checkpoints)

    first = state.step + 1 if state else 1
    step, saved = first, checkpoint  # (the step in progress, the latest checkpoint: what a learner's death reports)
    try:
        if state is not None:
            runtime.learners.load_state(str(checkpoint / "learner"), state.learner)
        algorithm.attach(runtime.buffer, runtime.learners)
        progress = Progress(cfg.run.steps, "train", unit="step", log=log, done=first - 1)
        if state is None:
            metrics.log(evaluation(step=0))
            progress.update(0, **step_fields(result.evals[-1]))  # step 0 is not a step: the ETA leaves it out
        else:
            if runtime.buffer is not None:
                runtime.buffer.restore(checkpoint / "buffer")
                set_rng_state(runtime.buffer.rng, state.buffer_rng)
            algorithm.load_state(state.algorithm)
            log(f"resumed {run_dir} at step {state.step} (policy version {state.policy_version}) from {checkpoint.name}")
            progress.update(state.step)
        if runtime.buffer is not None:
            snapshot_buffer()  # (RLEP's pool, a resumed buffer): what a shard that dies comes back with
        ahead: deque[Round] = deque()  # later steps' rounds, sampling already (asynchronous rollouts)
        for step in range(first, cfg.run.steps + 1):
            record: dict = {"step": step}
            step_start = time.perf_counter()

            # plan -> generate -> verify; the planned replays join their groups
            started = ahead.popleft() if ahead else start_round(runtime, cfg, algorithm, sampler, prompt_ids, step)
            groups = finish_round(runtime, cfg, started, record)
            dropped: list[Group] = []
            if cfg.algorithm.dynamic_sampling:
                groups, dropped, kept = keep_informative(groups, questions, lambda taken: finish_round(
                    runtime, cfg, start_round(runtime, cfg, algorithm, sampler, prompt_ids, step,
                                              record["sampling_rounds"] + 1, taken), record))
                record.update(kept)
            groups, stale = drop_stale(groups, runtime.sync.version, cfg.run.max_policy_lag)
            record.update(stale)

            # The learners take the GPUs (colocated GPUs: the engines sleep meanwhile) before
            # ExGRPO's entropy pass chooses the replays it planned.
            with timed(record, "hand_over"):
                runtime.hand_over_to_learners()
            groups, chosen = algorithm.join_replays(groups)
            record.update(chosen)
            with timed(record, "build"):
                step_batch = algorithm.build(groups, dropped)

            # Asynchronous rollouts: the next steps' rounds sample on these weights while the
            # learners update (the weight sync waits for them). Never across a checkpoint: a
            # resumed run starts its next round afresh, as the uninterrupted run does.
            while len(ahead) < rounds_ahead(cfg, step):
                ahead.append(start_round(runtime, cfg, algorithm, sampler, prompt_ids, step + 1 + len(ahead)))

            with timed(record, "update"):
                record.update(runtime.learners.update(step_batch.batch, step_batch.loss))

            with timed(record, "sync"):
                record.update(runtime.sync.push())
                runtime.hand_over_to_generators()

            record.update(algorithm.after_update(step, step_batch))
            if runtime.buffer is not None:
                if cfg.replay.snapshot_every and step % cfg.replay.snapshot_every == 0:
                    with timed(record, "snapshot"):
                        snapshot_buffer()
                record.update(runtime.buffer.take_recovery())  # replay shards that died this step
            record.update(step_batch.metrics)
            record.update(rollout_stats(step_batch.seen, record["time_generate"]))
            record.update(policy_lag_stats(step_batch.groups, runtime.sync.version - 1))
            record["time_step"] = time.perf_counter() - step_start
            if cfg.run.eval_every and step % cfg.run.eval_every == 0 or step == cfg.run.steps:
                record.update(evaluation(step))
            metrics.log(record)  # before the checkpoint: a checkpoint's steps are all in the log
            if step == cfg.run.steps or cfg.run.save_every and step % cfg.run.save_every == 0:
                saved = save(step)
            progress.update(step, **step_fields(record))

        if saved is None:  # no steps to take: the checkpoint of the policy as it is
            saved = save(cfg.run.steps)
        result.final_checkpoint = str(mark_final(run_dir, saved))
        (run_dir / "evals.json").write_text(json.dumps(result.evals, indent=2))
    except Exception as error:
        # A learner's state (its shard of the weights and optimizer) dies with it: the run
        # cannot go on, but its last checkpoint can.
        dead = runtime.learners.dead()
        if dead:
            ranks = "; ".join(f"learner rank {rank} died ({why})" for rank, why in sorted(dead.items()))
            raise LearnerDied(
                f"{ranks}: the run stopped in step {step}. Its latest complete checkpoint is "
                f"{saved or 'none yet'}; continue with --resume {run_dir} (a pipeline: --resume <its folder>), "
                "or give the job --auto-resume to restart on its own", run_dir) from error
        raise
    finally:
        metrics.close()
        runtime.shutdown()
    if cfg.logging.plots:
        write_plots(run_dir, log)
    return result


def train_resuming(cfg: Config, log=print, resume: bool = False, restarts: int = 0) -> RunResult:
    """`train`, started again when a learner dies, up to `restarts` times: from the run's
    latest complete checkpoint (as `resume` does), or from the beginning when it has none."""
    attempt = 0
    while True:
        try:
            return train(cfg, log=log, resume=resume)
        except LearnerDied as death:
            attempt += 1
            if attempt > restarts:
                raise
            # The same run folder again (a run named by its start time would get a new one).
            cfg = cfg.replace(**{"logging.out_dir": str(death.run_dir.parent), "logging.run_name": death.run_dir.name})
            latest = latest_checkpoint(death.run_dir)
            resume = latest is not None and resumable(cfg)
            if not resume:
                keep_metrics_until(death.run_dir / "metrics.jsonl", -1)  # it starts over
            log(f"{death}\nrestart {attempt} of {restarts}: "
                f"{'from ' + latest.name if resume else 'from the beginning (no checkpoint to resume from)'}")


def resumable(cfg: Config) -> bool:
    """Whether the learners' strategy keeps a checkpoint of its optimizer state (FSDP2 does;
    with DeepSpeed a run's checkpoints hold the policy weights and the driver's state only)."""
    return cfg.learner.strategy == "fsdp2"


def resume_point(cfg: Config, run_dir: Path) -> tuple[Path, RunState]:
    """The latest complete checkpoint of the run and its state, or an InputError that says
    why the run cannot be resumed (checked before anything starts)."""
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        raise InputError(f"{run_dir}: no complete checkpoint to resume from (checkpoints/step-<N>)")
    state = read_run_state(checkpoint)
    if state.learner is None or not resumable(cfg):
        raise InputError(f"{checkpoint}: resuming needs the learners' optimizer state, which only "
                         "learner.strategy='fsdp2' keeps (this run's or the checkpoint's is 'deepspeed')")
    if state.step > cfg.run.steps:
        raise InputError(f"{checkpoint} is at step {state.step}, beyond run.steps={cfg.run.steps}")
    saved_algorithm = state.config.get("algorithm", {}).get("name")
    if saved_algorithm != cfg.algorithm.name:
        raise InputError(f"{checkpoint} is a {saved_algorithm!r} run; this config's algorithm.name is {cfg.algorithm.name!r}")
    return checkpoint, state


def keep_metrics_until(path: Path, step: int) -> None:
    """Drop the records a stopped run logged after its checkpoint's step (the resumed run
    logs them again), atomically."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step]
    staging = path.with_suffix(".jsonl.tmp")
    staging.write_text("".join(line + "\n" for line in kept))
    staging.replace(path)


def write_plots(run_dir: Path, log=print) -> None:
    """The run's learning curves in `<run_dir>/plots`; a failure to draw them is a warning,
    not a failed run (the checkpoint and metrics are already written)."""
    try:
        paths = plot_run(run_dir)
    except Exception as err:  # whatever matplotlib raises, the run stands
        log(f"warning: no plots for {run_dir}: {type(err).__name__}: {err}")
        return
    log(f"plots: {', '.join(p.name for p in paths)} in {run_dir / 'plots'}")


@dataclass
class Round:
    """One round of a step's rollouts, started: what was planned, the generate call's shares
    (still sampling), and the planning's metrics, for the step that finishes it."""

    plan: StepPlan
    pending: list[PendingRollouts]
    metrics: dict


def start_round(
    runtime: Runtime,
    cfg: Config,
    algorithm: GRPO,
    sampler: PromptSampler,
    prompt_ids: dict[str, list[int]],
    step: int,
    number: int = 1,
    exclude: frozenset[str] = frozenset(),
) -> Round:
    """Round `number` of step `step`: the algorithm plans it (B questions, from the sampler
    and, for the replay methods, the buffer; none of `exclude`), and the generators start
    sampling the planned fresh rollouts, each prompt with its own seed (the step and round
    decide it). Returns at once."""
    metrics: dict = {}
    with timed(metrics, "plan"):
        plan = algorithm.plan(sampler, cfg.algorithm.prompts_per_step, exclude)
    for name, value in plan.metrics.items():
        metrics[name] = metrics.get(name, 0.0) + value if name.startswith("time_") else value
    gen = cfg.generator
    pending = runtime.generators.generate(
        [prompt_ids[p.uid] for p in plan.prompts], n=[n for _, n in plan.requests],
        temperature=gen.temperature, top_p=gen.top_p, max_tokens=gen.max_response_tokens,
        seeds=cfg.sampling_seeds(f"rollout-{step}-{number}", len(plan.prompts)),
    )
    return Round(plan, pending, metrics)


def finish_round(runtime: Runtime, cfg: Config, started: Round, record: dict) -> list[Group]:
    """The round's rollouts (a generator that died is replaced and its prompts asked again,
    counted as `generator_replaced` and `generator_retried_prompts`), marked by the
    verifiers, with the planned replays in their groups. `record` gains the round's metrics
    (times add up over a step's rounds)."""
    for name, value in started.metrics.items():
        record[name] = record.get(name, 0.0) + value if name.startswith("time_") else record.get(name, value)
    record["sampling_rounds"] = record.get("sampling_rounds", 0) + 1
    with timed(record, "generate"):  # the wait: with asynchronous rollouts, what the update did not hide
        recovery: Counter = Counter()
        pending, rollouts = runtime.generators.complete(started.pending, recovery)
    for name, n in recovery.items():
        record[f"generator_{name}"] = record.get(f"generator_{name}", 0) + n

    plan = started.plan
    with timed(record, "verify"):
        verdicts = runtime.verifiers.check(pending, [p.ground_truth for p in plan.prompts])
    for status, n in verdicts.statuses.items():
        record[f"verifier_{status}"] = record.get(f"verifier_{status}", 0) + n

    fresh = [
        Group(prompt, tuple(sampled), tuple(marks), (False,) * len(sampled))
        for prompt, sampled, marks in zip(plan.prompts, rollouts, verdicts.correct)
    ]
    return plan.complete(fresh)


def rounds_ahead(cfg: Config, step: int) -> int:
    """How many later steps' rounds sample while step `step` updates: `run.max_policy_lag`,
    but none past the run's end or across a step that saves a checkpoint."""
    ahead = 0
    while ahead < cfg.run.max_policy_lag and step + ahead < cfg.run.steps:
        if cfg.run.save_every and (step + ahead) % cfg.run.save_every == 0:
            break
        ahead += 1
    return ahead


def drop_stale(groups: list[Group], version: int, max_lag: int) -> tuple[list[Group], dict[str, int]]:
    """Groups whose fresh rollouts are more than `max_lag` versions older than `version`
    (the learners' policy, which the update starts from) are not trained on; counted."""
    kept = [g for g in groups
            if all(version - r.version <= max_lag for r, replayed in zip(g.rollouts, g.replayed) if not replayed)]
    stale = len(groups) - len(kept)
    return kept, ({"stale_groups_dropped": stale} if stale else {})


def policy_lag_stats(groups: Sequence[Group], version: int) -> dict[str, float]:
    """How many versions older than the policy the update started from (`version`) the
    trained answers are: fresh ones' histogram (`fresh_lag_<k>`: answers), mean and max; replayed ones' mean."""
    fresh = [version - r.version for g in groups for r, replayed in zip(g.rollouts, g.replayed) if not replayed]
    replay = [version - r.version for g in groups for r, replayed in zip(g.rollouts, g.replayed) if replayed]
    stats: dict[str, float] = {f"fresh_lag_{k}": n for k, n in sorted(Counter(fresh).items())}
    if fresh:
        stats.update(fresh_lag_mean=sum(fresh) / len(fresh), fresh_lag_max=max(fresh))
    if replay:
        stats["replay_lag_mean"] = sum(replay) / len(replay)
    return stats


def rollout_stats(groups: Sequence[Group], generate_seconds: float) -> dict[str, float]:
    """What this step's fresh rollouts looked like (every verified group, trained or not)."""
    fresh = [r for g in groups for r, replayed in zip(g.rollouts, g.replayed) if not replayed]
    marks = [ok for g in groups for ok, replayed in zip(g.correct, g.replayed) if not replayed]
    tokens = sum(len(r.response_ids) for r in fresh)
    return {
        "accuracy": sum(marks) / max(1, len(marks)),
        "response_length": tokens / max(1, len(fresh)),
        "truncated": sum(r.finish_reason == "length" for r in fresh) / max(1, len(fresh)),
        "generated_tokens": tokens,
        "tokens_per_second": tokens / max(generate_seconds, 1e-9),
    }
