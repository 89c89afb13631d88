"""The driver: the single controller of a training run.

    prompts -> generate (vLLM) -> verify (math-verify) -> groups (+ replay) -> update -> sync

Each step is written out below in that order, with typed calls on the actor groups.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from rayrep.algos import make_algorithm
from rayrep.config import Config
from rayrep.data import PromptSampler, encode_prompts, load_split
from rayrep.eval import summarize
from rayrep.metrics import MetricsLog, progress_line
from rayrep.models import resolve_policy
from rayrep.runtime import Runtime


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
def timed(record: dict, phase: str):
    start = time.perf_counter()
    yield
    record[f"time_{phase}"] = time.perf_counter() - start


def train(cfg: Config, log=print) -> RunResult:
    run_dir = run_dir_for(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.to_json())
    model_path = resolve_policy(cfg, log=log)

    # Everything that can be wrong with the data fails here, before any actor starts.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train_prompts = load_split(cfg.data, "train")
    test_prompts = load_split(cfg.data, "test")
    prompt_ids = dict(zip((p.uid for p in train_prompts), encode_prompts(tokenizer, train_prompts, cfg.data.max_prompt_tokens)))
    test_ids = encode_prompts(tokenizer, test_prompts, cfg.data.max_prompt_tokens)
    algorithm = make_algorithm(cfg, train_prompts, prompt_ids)

    runtime = Runtime.start(cfg, model_path)
    algorithm.attach(runtime)
    metrics = MetricsLog(run_dir, cfg.to_dict(), cfg.logging.wandb, cfg.logging.wandb_project)
    sampler = PromptSampler(train_prompts, seed=cfg.data.shuffle_seed)
    result = RunResult(run_dir, final_checkpoint="")
    try:
        result.evals.append(evaluate(runtime, cfg, test_prompts, test_ids, step=0))
        metrics.log(result.evals[-1])
        log(progress_line(result.evals[-1]))
        for step in range(1, cfg.run.steps + 1):
            record: dict = {"step": step}
            step_start = time.perf_counter()

            with timed(record, "generate"):
                fresh = generate(runtime, cfg, algorithm.plan_rollouts(sampler.next(cfg.algorithm.prompts_per_step)), prompt_ids)

            with timed(record, "verify"):
                verify(runtime, fresh, record)

            if cfg.algorithm.dynamic_sampling:
                with timed(record, "refill"):
                    fresh = keep_informative(runtime, cfg, algorithm, sampler, prompt_ids, fresh, record)
            prompts, answers, correct = fresh.prompts, fresh.answers, fresh.correct

            with timed(record, "replay"):
                groups = algorithm.make_groups(prompts, answers, correct)
                batch = algorithm.build_batch(groups)

            with timed(record, "update"):
                record.update(runtime.learners.update(batch, algorithm.loss_spec()))

            with timed(record, "sync"):
                record.update(runtime.sync.push())

            record.update(algorithm.after_update(step, groups))
            record.update(rollout_stats(groups, answers, correct, record["time_generate"]))
            record["time_step"] = time.perf_counter() - step_start
            if cfg.run.eval_every and step % cfg.run.eval_every == 0 or step == cfg.run.steps:
                result.evals.append(evaluate(runtime, cfg, test_prompts, test_ids, step))
                record.update(result.evals[-1])
            if cfg.run.save_every and step % cfg.run.save_every == 0:
                runtime.learners.save(str(run_dir / "checkpoints" / f"step-{step}"))
            metrics.log(record)
            log(progress_line(record))

        result.final_checkpoint = runtime.learners.save(str(run_dir / "checkpoints" / "final"))
        algorithm.save(run_dir)
        (run_dir / "evals.json").write_text(json.dumps(result.evals, indent=2))
        return result
    finally:
        metrics.close()
        algorithm.shutdown()
        runtime.shutdown()


@dataclass
class Rollouts:
    """Fresh answers of one step: questions, their sampled answers, and the verifier's marks."""

    prompts: list
    answers: list
    chunks: list
    correct: list = field(default_factory=list)

    def select(self, keep: list[int]) -> "Rollouts":
        return Rollouts([self.prompts[i] for i in keep], [self.answers[i] for i in keep], [], [self.correct[i] for i in keep])

    def extend(self, other: "Rollouts") -> "Rollouts":
        return Rollouts(self.prompts + other.prompts, self.answers + other.answers, [], self.correct + other.correct)


def generate(runtime: Runtime, cfg: Config, plan, prompt_ids: dict) -> Rollouts:
    """Sample each planned question's answers on the generator pool."""
    gen = cfg.generator
    prompts = [prompt for prompt, _ in plan]
    chunks = runtime.generators.generate(
        [prompt_ids[p.uid] for p in prompts], n=[n for _, n in plan],
        temperature=gen.temperature, top_p=gen.top_p, max_tokens=gen.max_response_tokens,
    )
    return Rollouts(prompts, runtime.generators.gather(chunks), chunks)


def verify(runtime: Runtime, rollouts: Rollouts, record: dict) -> None:
    """Mark every answer correct or not, counting the verifier's statuses into `record`."""
    verdicts = runtime.verifiers.check(rollouts.chunks, [p.ground_truth for p in rollouts.prompts])
    rollouts.correct = verdicts.correct
    for status, n in verdicts.statuses.items():
        record[f"verifier_{status}"] = record.get(f"verifier_{status}", 0) + n


def keep_informative(runtime, cfg, algorithm, sampler, prompt_ids, rollouts: Rollouts, record, max_rounds: int = 4) -> Rollouts:
    """DAPO's dynamic sampling: drop questions whose answers are all right or all wrong
    (no learning signal) and sample more questions until the batch is full again.

    Gives up after `max_rounds` extra rounds and trains on what it has.
    """
    wanted = cfg.algorithm.prompts_per_step

    def informative(r: Rollouts) -> Rollouts:
        return r.select([i for i, marks in enumerate(r.correct) if 0 < sum(marks) < len(marks)])

    kept = informative(rollouts)
    record["dynamic_sampling_kept"] = len(kept.prompts) / max(1, len(rollouts.prompts))
    rounds = 0
    while len(kept.prompts) < wanted and rounds < max_rounds:
        rounds += 1
        more = generate(runtime, cfg, algorithm.plan_rollouts(sampler.next(wanted)), prompt_ids)
        verify(runtime, more, record)
        kept = kept.extend(informative(more))
    record["dynamic_sampling_rounds"] = rounds
    return kept.select(list(range(min(wanted, len(kept.prompts)))))


def rollout_stats(groups, answers, correct, generate_seconds: float) -> dict:
    fresh = [r for group in answers for r in group]
    flat = [c for group in correct for c in group]
    rewards = [r for g in groups for r, replayed in zip(g.rewards, g.replayed) if not replayed]
    tokens = sum(len(r.response_ids) for r in fresh)
    return {
        "reward_mean": sum(rewards) / max(1, len(rewards)),
        "accuracy": sum(flat) / max(1, len(flat)),
        "response_length": tokens / max(1, len(fresh)),
        "truncated": sum(r.finish_reason == "length" for r in fresh) / max(1, len(fresh)),
        "groups_all_equal": sum(len(set(g.rewards)) == 1 for g in groups) / max(1, len(groups)),
        "generated_tokens": tokens,
        "tokens_per_second": tokens / max(generate_seconds, 1e-9),
    }


def evaluate(runtime: Runtime, cfg: Config, prompts, prompt_ids, step: int) -> dict:
    """Test-set avg@k / pass@k with the generators' current weights."""
    start = time.perf_counter()
    gen = cfg.generator
    chunks = runtime.generators.generate(
        prompt_ids, n=gen.eval_samples, temperature=gen.eval_temperature, top_p=1.0, max_tokens=gen.max_response_tokens
    )
    checked = runtime.verifiers.check(chunks, [p.ground_truth for p in prompts])
    summary = summarize(checked.correct, ks=sorted({1, gen.eval_samples}))
    record = {"step": step, "time_eval": time.perf_counter() - start}
    record.update({f"test_{k}": v for k, v in summary.items() if "@" in k})
    return record
