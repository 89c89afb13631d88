"""rayrep's GRPO step against TRL's `GRPOTrainer`, on the same checkpoint, prompts and batch.

    pip install -e ".[bench]"          # TRL (and what it needs); not part of a rayrep install
    python bench/vs_trl.py [--steps 6] [--rounds 2] [config overrides...]

Both train the tiny policy from the same checkpoint on the same training questions (the
run's sampler order), with B questions x G answers per step (the preset's 64 x 8), at
most the preset's new tokens per answer (48), temperature 1, one optimizer step per
rollout (AdamW at the preset's learning rate, no KL term), and the same 0/1 verifier
reward (`rayrep.verifier.math.score`). They alternate in one process, `--rounds` times
each (this machine's speed drifts); the first step of every run is left out as warm-up.

Printed: each framework's median step time and their ratio, for three settings of rayrep:
the preset's synchronous loop (one engine, then one learner rank, each on every core); the
same loop with one engine and one learner rank per core (`generator.num_workers` and
`learner.num_workers` the cores, `placement.threads 1`, `pin_cores`, DeepSpeed ZeRO-2, whose
ranks hold whole parameters and so share each question's prompt pass); and the asynchronous
loop (`run.max_policy_lag 1`, generator and learner on cores of their own, the learner
borrowing the generator's once its round is sampled: `placement.lend_idle_cores`).

TRL runs with its defaults for everything not named above. `--trl-generation` picks how
it generates (a row each; the ratios are against the fastest): `generate` (its default,
transformers' `generate` with the model it trains, on all of this process's cores),
`continuous` (transformers' continuous batching) or `vllm` (vLLM in TRL's colocated mode;
set `VLLM_CPU_KVCACHE_SPACE` on CPU). rayrep generates with vLLM.
"""

import os
import statistics
import sys
import time

from rayrep.cli import job_parser, parse_job_args
from rayrep.run.layout import RunFolder
from rayrep.run.log import read_metrics


GENERATION = {
    "generate": {},
    "continuous": {"use_transformers_continuous_batching": True},
    "vllm": {"use_vllm": True, "vllm_mode": "colocate"},
}


def trl_step_seconds(cfg, model_path: str, steps: int, out_dir: str, generation: str = "generate") -> list[float]:
    """Seconds of each of TRL's `steps` optimizer steps (one rollout each). `generation`:
    "generate" (transformers' `generate`, TRL's default), "continuous" (transformers'
    continuous batching, `use_transformers_continuous_batching`) or "vllm" (vLLM in TRL's
    colocated mode: an engine in this process, the trained weights pushed before each rollout)."""
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rayrep.data import PromptSampler, load_split
    from rayrep.verifier.math import score

    questions, group = cfg.algorithm.prompts_per_step, cfg.algorithm.group_size
    sampler = PromptSampler(load_split(cfg.data, "train"), seed=cfg.seed("data"))
    prompts = [p for _ in range(steps) for p in sampler.next(questions)]
    dataset = Dataset.from_list([{"prompt": list(p.messages), "ground_truth": p.ground_truth} for p in prompts])

    def correct(completions, ground_truth, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [score(text, truth) for text, truth in zip(texts, ground_truth)]

    class Clock(TrainerCallback):
        def __init__(self):
            self.marks = [time.perf_counter()]

        def on_step_end(self, args, state, control, **kwargs):
            self.marks.append(time.perf_counter())

    clock = Clock()
    args = GRPOConfig(
        output_dir=out_dir, max_steps=steps, learning_rate=cfg.learner.lr, lr_scheduler_type="constant",
        per_device_train_batch_size=questions, gradient_accumulation_steps=group, num_generations=group,
        max_completion_length=cfg.generator.max_response_tokens, temperature=cfg.generator.temperature,
        beta=0.0, shuffle_dataset=False, use_cpu=True, report_to="none", save_strategy="no", logging_steps=steps,
        seed=cfg.run.seed, **GENERATION[generation],
    )
    trainer = GRPOTrainer(model=model_path, reward_funcs=[correct], args=args, train_dataset=dataset,
                          processing_class=AutoTokenizer.from_pretrained(model_path), callbacks=[clock])
    trainer.train()
    return [b - a for a, b in zip(clock.marks, clock.marks[1:])]


def rayrep_step_seconds(cfg, name: str) -> list[float]:
    from rayrep.train import train

    run = train(cfg.replace(**{"logging.run_name": name}), log=lambda _: None)
    return [r["time_step"] for r in read_metrics(RunFolder(run.run_dir).metrics) if r["step"] >= 1]


def main(argv=None):
    parser = job_parser(__doc__)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--trl-generation", nargs="+", choices=sorted(GENERATION), default=["generate"],
                        help="TRL's generation settings to run (each a row)")
    args, cfg = parse_job_args(parser, argv)
    out = f"runs/bench-vs-trl-{int(time.time())}"
    cfg = cfg.replace(**{"run.steps": args.steps, "run.eval_every": 0, "logging.out_dir": out, "logging.plots": False,
                         "learner.mini_batch_prompts": cfg.algorithm.prompts_per_step, "learner.warmup_steps": 0,
                         "learner.lr_schedule": "constant"})
    cores = os.cpu_count() or 1
    per_core = cfg.replace(**{"generator.num_workers": cores, "learner.num_workers": cores,
                              "learner.strategy": "deepspeed", "placement.threads": 1, "placement.pin_cores": True})
    asynchronous = cfg.replace(**{"run.max_policy_lag": 1, "placement.mode": "disaggregated", "placement.threads": 1,
                                  "placement.pin_cores": True, "placement.lend_idle_cores": True})

    from rayrep.models import resolve_policy

    model_path = resolve_policy(cfg)
    trl_rows = {f"TRL GRPOTrainer, {generation}": generation for generation in args.trl_generation}
    rayrep_rows = {"rayrep GRPO": cfg, "rayrep GRPO, an engine and a rank per core": per_core,
                   "rayrep GRPO, one step ahead": asynchronous}
    times: dict[str, list[float]] = {name: [] for name in [*trl_rows, *rayrep_rows]}
    for round_index in range(args.rounds):
        for name, generation in trl_rows.items():
            times[name] += trl_step_seconds(cfg, model_path, args.steps, f"{out}/trl-{generation}-{round_index}",
                                            generation)[1:]
        for index, (name, row_cfg) in enumerate(rayrep_rows.items()):
            times[name] += rayrep_step_seconds(row_cfg, f"rayrep-{index}-{round_index}")[1:]

    # The bar is TRL's fastest setting that ran.
    trl = min(statistics.median(times[name]) for name in trl_rows)
    print(f"\n{cfg.algorithm.prompts_per_step} questions x {cfg.algorithm.group_size} answers, at most "
          f"{cfg.generator.max_response_tokens} new tokens, one optimizer step per rollout; "
          f"{args.rounds} rounds of {args.steps} steps, first step of each run left out")
    print(f"{'':<44}{'median step':>12}{'fastest TRL / this':>20}")
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(f"{name:<44}{median:>10.2f} s{trl / median:>20.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
