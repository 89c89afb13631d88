"""RLEP's phase 1: a finished run's checkpoint samples n answers per training question, the
verifiers mark them, and the successes of questions with enough of them are written as an
experience pool (token ids, behaviour log-probs, text, source checkpoint)."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from rayrep.buffer.files import write_pool
from rayrep.config import Config
from rayrep.data import PromptSampler, encode_prompts, load_split
from rayrep.progress import Progress
from rayrep.roles.system import Runtime
from rayrep.types import Prompt
from rayrep.verifier.group import check_checkers
from rayrep.verifier.tools import check_tools


def questions_to_collect(cfg: Config, prompts: list[Prompt]) -> list[Prompt]:
    """The training questions a pool covers: all, or the first `collect_questions` the
    run's prompt sampler visits (the same seeded order the replay run will follow)."""
    limit = cfg.algorithm.rlep.collect_questions
    if not limit or limit >= len(prompts):
        return list(prompts)
    sampler = PromptSampler(prompts, seed=cfg.seed("data"))
    seen, ordered = set(), []
    while len(ordered) < limit:
        for prompt in sampler.next(cfg.algorithm.prompts_per_step):
            if prompt.uid not in seen:
                seen.add(prompt.uid)
                ordered.append(prompt)
    return ordered[:limit]


def collect_pool(cfg: Config, checkpoint: str, out_path: str | Path, log=print) -> dict:
    """RLEP phase 1: sample, verify, keep the successes of questions with enough of them."""
    from transformers import AutoTokenizer

    settings = cfg.algorithm.rlep
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompts = questions_to_collect(cfg, load_split(cfg.data, "train"))
    prompt_ids = encode_prompts(tokenizer, prompts, cfg.data.max_prompt_tokens)
    check_checkers(cfg, prompts)  # a user's checker: loaded and called once, before any actor starts
    check_tools(cfg, tokenizer, str(checkpoint))  # the template's tool role, a turn's budget, a user's tool loaded
    start = time.perf_counter()
    runtime = Runtime.start(cfg, checkpoint, train=False, log_dir=Path(out_path).parent)
    rows, kept_questions, samples = [], 0, 0
    recovery: Counter = Counter()
    progress = Progress(len(prompts), "collect", unit="question", log=log)
    try:
        # Slices bound the memory of one generate call; every generator works on each slice.
        size = max(64, 8 * len(runtime.generators.workers))
        seeds = cfg.sampling_seeds("collect", len(prompts))
        for begin in range(0, len(prompts), size):
            part, ids = prompts[begin : begin + size], prompt_ids[begin : begin + size]
            shares = runtime.generators.generate(
                ids, n=settings.collect_samples, temperature=settings.collect_temperature,
                top_p=settings.collect_top_p, max_tokens=cfg.generator.max_response_tokens,
                seeds=seeds[begin : begin + size], parts=cfg.generator.answer_parts,
            )
            # Scored as they arrive; a dead generator: replaced, its unanswered prompts asked again.
            checking = runtime.verifiers.checking(part)
            arrived, _ = runtime.generators.complete(shares, recovery, on_arrival=checking.send)
            verdicts = checking.result()
            rollouts = runtime.generators.read(arrived)  # (this process writes the pool file: it reads the answers)
            for prompt, sampled, marks, scores in zip(part, rollouts, verdicts.correct, verdicts.scores):
                samples += len(sampled)
                successes = [(r, 1.0 if score is None else score)
                             for r, ok, score in zip(sampled, marks, scores) if ok]
                if len(successes) < settings.min_successes:
                    continue
                kept_questions += 1
                rows += [{
                    "uid": prompt.uid, "prompt": prompt.messages, "ground_truth": prompt.ground_truth,
                    "data_source": prompt.data_source, "prompt_ids": r.prompt_ids, "response_ids": r.response_ids,
                    "logprobs": r.logprobs, "tool_mask": r.tool_mask, "text": r.text, "reward": reward,
                    "version": r.version,
                } for r, reward in successes]
            progress.update(begin + len(part), kept=kept_questions, successes=len(rows))
    finally:
        runtime.shutdown()
    if not rows:
        raise RuntimeError(f"no question had {settings.min_successes} verified successes: the pool would be empty")
    routing = runtime.verifiers.routing
    write_pool(rows, Path(out_path), source_checkpoint=str(checkpoint),
               checkers={source: routing.checker(source) for source in {row["data_source"] for row in rows}})
    return {
        "pool": str(out_path), "questions": len(prompts), "kept_questions": kept_questions, "successes": len(rows),
        "samples": samples, "success_rate": len(rows) / max(1, samples), "seconds": time.perf_counter() - start,
        **{f"generator_{name}": n for name, n in recovery.items() if n},
    }
