"""Two runs sharing one replay pool, at the same time: what each stored, what each replayed
of the other's, and what the pool holds at the end.

    python bench/shared_pool.py [--preset tiny-cpu] [--steps 20] [--seeds 0 1] [--out runs/shared-pool]

It starts a local Ray cluster of its own (stopped at the end), then runs exactly what
docs/pool.md shows: `jobs/pool.py start`, one `jobs/train.py` ExGRPO run per seed attached
with `--replay.pool`, all at once, each its own job process, then `jobs/pool.py stats` and
`stop`. The pool's home is `<out>/pool`; the runs are `<out>/seed-<n>`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import ray

from rayrep.run.log import read_metrics

ROOT = Path(__file__).resolve().parents[1]


def job(script: str, *args: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "jobs" / script), *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finished(process: subprocess.Popen) -> str:
    output, _ = process.communicate()
    if process.returncode:
        sys.exit(f"{' '.join(process.args[1:3])} failed:\n{output[-3000:]}")
    return output


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny-cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--out", default="runs/shared-pool")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    if out.exists():
        sys.exit(f"{out} exists: give another --out")

    ray.init(address="local", num_cpus=2 * len(args.seeds), include_dashboard=False, log_to_driver=False)
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    try:
        finished(job("pool.py", "start", "--name", "shared", "--snapshot-dir", str(out / "pool"), "--shards", "2",
                     env=env))
        start = time.monotonic()
        runs = [job("train.py", "--preset", args.preset, "--algorithm.name", "exgrpo", "--algorithm.std_normalize",
                    "false", "--replay.pool", "shared", "--run.steps", str(args.steps), "--run.seed", str(seed),
                    "--logging.out_dir", str(out), "--logging.run_name", f"seed-{seed}", "--logging.plots", "false",
                    env=env) for seed in args.seeds]
        for run in runs:
            finished(run)
        seconds = time.monotonic() - start
        stats = json.loads(finished(job("pool.py", "stats", "--name", "shared", env=env)))
        finished(job("pool.py", "stop", "--name", "shared", env=env))
    finally:
        ray.shutdown()

    print(f"\n{len(args.seeds)} ExGRPO runs of {args.steps} steps on {args.preset}, attached to one pool at once: "
          f"{seconds / 60:.1f} min")
    print(f"{'run':>8}{'stored':>9}{'replayed':>10}{'of others':>11}{'first replay':>14}{'final pass@1':>14}")
    result = {"seconds": seconds, "pool": stats, "runs": {}}
    for seed in args.seeds:
        records = [r for r in read_metrics(out / f"seed-{seed}" / "metrics.jsonl") if r["step"] > 0]
        replaying = [r["step"] for r in records if r.get("replayed_questions", 0) > 0]
        evals = json.loads((out / f"seed-{seed}" / "evals.json").read_text())
        row = {"stored": sum(r.get("buffer_stored", 0) for r in records),
               "replayed": sum(r.get("replayed_questions", 0) for r in records),
               "of_others": sum(r.get("exgrpo_replays_from_others", 0) for r in records),
               "first_replay": replaying[0] if replaying else None, "final": evals[-1]["test_pass@1"]}
        result["runs"][seed] = row
        print(f"{'seed-' + str(seed):>8}{row['stored']:>9.0f}{row['replayed']:>10.0f}{row['of_others']:>11.0f}"
              f"{str(row['first_replay']):>14}{100 * row['final']:>13.1f}%")
    print(f"pool: {stats['questions']} questions, {stats['answers']} answers, {stats['retired']} retired, "
          f"{stats['bytes'] / 1e6:.1f} MB; by run {json.dumps({Path(k).name: v for k, v in stats['by_run'].items()})}; "
          f"version {stats['version']['writes']}")
    return result


if __name__ == "__main__":
    main()
