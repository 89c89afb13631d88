"""Where a training step's time goes, and how fast weights sync, on the tiny preset.

    python bench/step.py [--steps 8] [config overrides...]

Runs a short GRPO run on a local Ray cluster and prints each phase's share of the step
time (median over steps, the first one left out as warm-up), then the weight-sync rate
next to the rate of a plain in-memory copy of the same bytes measured in the same run,
and their ratio.
"""

import statistics
import sys
import time

import torch

from rayrep.config import job_parser, parse_job_args
from rayrep.metrics import read_metrics

PHASES = ("generate", "verify", "replay", "old_logprobs", "update", "sync")


def in_memory_copy_gbps(num_bytes: int, repeats: int = 20) -> float:
    source = torch.empty(num_bytes, dtype=torch.uint8).random_()
    target = torch.empty_like(source)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - start)
    return num_bytes / statistics.median(times) / 1e9


def main(argv=None):
    parser = job_parser(__doc__)
    parser.add_argument("--steps", type=int, default=8)
    args, cfg = parse_job_args(parser, argv)
    cfg = cfg.replace(**{"run.steps": args.steps, "run.eval_every": 0, "logging.run_name": f"bench-step-{int(time.time())}"})

    from rayrep.train import train

    result = train(cfg, log=lambda line: None)
    records = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if r["step"] >= 2 and "time_step" in r]
    for r in records:  # the learner times its old-log-prob pass inside the update call
        r["time_update"] -= r.get("time_old_logprobs", 0.0)
    step_time = statistics.median(r["time_step"] for r in records)
    print(f"\n{cfg.algorithm.name} on the {cfg.model.path} policy: {len(records)} steps measured, "
          f"median step {step_time:.2f} s")
    print(f"{'phase':<14}{'median s':>10}{'share':>8}")
    for phase in PHASES:
        seconds = statistics.median(r[f"time_{phase}"] for r in records)
        print(f"{phase:<14}{seconds:>10.3f}{100 * seconds / step_time:>7.1f}%")
    size = records[-1]["sync_bytes"]
    sync = statistics.median(r["sync_gbps"] for r in records)
    copy = in_memory_copy_gbps(size)
    print(f"\nweight sync of {size / 1e6:.1f} MB: {sync:.3f} GB/s; in-memory copy of the same bytes: "
          f"{copy:.2f} GB/s; ratio sync/copy = {sync / copy:.4f}")
    print(f"generated tokens/s (median): {statistics.median(r['tokens_per_second'] for r in records):.0f}")


if __name__ == "__main__":
    main(sys.argv[1:])
