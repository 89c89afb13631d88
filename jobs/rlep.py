"""The whole RLEP pipeline: baseline run -> experience pool -> RLEP run -> comparison.

    python jobs/rlep.py                                   # everything, tiny-cpu preset
    python jobs/rlep.py --baseline-checkpoint runs/p/baseline/checkpoints/final   # reuse a baseline
    python jobs/rlep.py --baseline-checkpoint ... --pool runs/p/pool.parquet      # reuse both

1. the GRPO/DAPO baseline trains from the base policy;
2. its final checkpoint samples the experience pool (RLEP phase 1);
3. RLEP trains from the base policy again, with the same budget, replaying the pool;
4. both runs' test accuracy curves go into a plot and a table: each run's peak and final
   test pass@1, and the step at which RLEP first reaches the baseline's peak.
"""

import json
import sys
import time
from pathlib import Path

from rayrep.config import job_parser, parse_job_args
from rayrep.eval import checkpoint_evals
from rayrep.metrics import compare_runs, comparison_table, plot_curves


def main(argv=None) -> dict:
    parser = job_parser(__doc__)
    parser.add_argument("--baseline-checkpoint", help="skip the baseline run: use this checkpoint (its run's evals.json if any)")
    parser.add_argument("--pool", help="skip collection: replay this experience pool")
    parser.add_argument("--out", help="pipeline folder (default: runs/rlep-pipeline-<time>)")
    args, cfg = parse_job_args(parser, argv)
    out = Path(args.out or Path(cfg.logging.out_dir) / f"rlep-pipeline-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    cfg = cfg.replace(**{"logging.out_dir": str(out)})
    start = time.monotonic()

    from rayrep.algos.rlep import collect_pool
    from rayrep.train import train

    if args.baseline_checkpoint:
        checkpoint, base_evals = args.baseline_checkpoint, checkpoint_evals(args.baseline_checkpoint, cfg)
    else:
        print("== 1/4 baseline (GRPO/DAPO) ==")
        baseline = train(cfg.replace(**{"algorithm.name": "grpo", "logging.run_name": "baseline"}))
        checkpoint, base_evals = baseline.final_checkpoint, baseline.evals

    pool = args.pool
    if not pool:
        print(f"== 2/4 experience pool from {checkpoint} ==")
        stats = collect_pool(cfg, checkpoint, out / "pool.parquet")
        pool = stats["pool"]
        (out / "pool.json").write_text(json.dumps(stats, indent=2))

    print("== 3/4 RLEP from the base policy ==")
    rlep = train(cfg.replace(**{"algorithm.name": "rlep", "algorithm.rlep.pool": str(pool), "logging.run_name": "rlep"}))

    print("== 4/4 comparison ==")
    comparison = compare_runs(base_evals, rlep.evals)
    plot = plot_curves({"baseline (GRPO/DAPO)": base_evals, "RLEP": rlep.evals}, out / "comparison.png",
                       title=f"RLEP vs baseline, {cfg.model.path} policy")
    comparison.update({"plot": str(plot), "pool": str(pool), "minutes": round((time.monotonic() - start) / 60, 1)})
    (out / "comparison.json").write_text(json.dumps(comparison, indent=2))
    print(comparison_table(("baseline", "RLEP"), comparison))
    print(f"plot: {plot}\npipeline folder: {out} ({comparison['minutes']} min)")
    return comparison


if __name__ == "__main__":
    main(sys.argv[1:])
