"""A training step's time under two revisions of rayrep, side by side: what a change costs.

    python bench/revisions.py BASE [--rounds 3] [--steps 8] [config overrides...]

BASE is a git revision (a commit, a tag, `HEAD~1`); it is checked out into a temporary
worktree, and short runs of `jobs/train.py` (the tiny preset unless overridden) alternate
between it and this checkout, round after round (this machine's speed drifts). Each run is a
process of its own, with its own local Ray cluster, and the same config and seed. Printed:
per revision, the median step time and the median of each phase (`time_*`, the first step
of each run left out as warm-up), and the ratios of this checkout's to BASE's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_once(tree: Path, out: Path, steps: int, overrides: list[str]) -> list[dict]:
    """A short run of `jobs/train.py` from the tree `tree`; its step records after the first."""
    subprocess.run([sys.executable, str(tree / "jobs" / "train.py"), "--run.steps", str(steps), "--run.eval_every", "0",
                    "--logging.out_dir", str(out), "--logging.run_name", "bench", *overrides],
                   cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, check=True, capture_output=True, text=True)
    metrics = next(out.glob("**/metrics.jsonl"))
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("step", 0) >= 2 and "time_step" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    args, overrides = parser.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="rayrep-revisions-") as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base_tree), args.base], check=True,
                       capture_output=True)
        try:
            trees = {"base": base_tree, "this": ROOT}
            steps: dict[str, list[dict]] = {name: [] for name in trees}
            for round_ in range(args.rounds):
                order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
                for name in order:
                    out = Path(tmp) / f"{name}-{round_}"
                    steps[name] += run_once(trees[name], out, args.steps, overrides)
                    print(f"round {round_ + 1}: {name} done", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base_tree)], check=False)
    phases = sorted({k for records in steps.values() for r in records for k in r if k.startswith("time_")},
                    key=lambda k: (k != "time_step", k))
    median = {name: {k: statistics.median(r[k] for r in records if k in r) for k in phases
                     if any(k in r for r in records)} for name, records in steps.items()}
    print(f"{'median seconds':<22} {'base ' + args.base:>16} {'this':>10} {'this / base':>12}")
    for k in phases:
        base, this = median["base"].get(k), median["this"].get(k)
        if base is None or this is None:
            continue
        print(f"{k:<22} {base:>16.3f} {this:>10.3f} {this / base if base else float('nan'):>12.3f}")
    print(f"steps measured: base {len(steps['base'])}, this {len(steps['this'])}")


if __name__ == "__main__":
    main()
