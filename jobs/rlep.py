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

import time
from pathlib import Path

from rayrep.cli import job_parser, parse_job_args, run_job


def main(argv: list[str]) -> dict:
    parser = job_parser(__doc__, sets={
        "algorithm.name": (None, "grpo for the baseline, rlep for the method; jobs/train.py runs one algorithm"),
        "algorithm.rlep.pool": (None, "from the collect stage; --pool replays a pool of your own"),
    })
    parser.add_argument("--baseline-checkpoint", help="skip the baseline run: use this checkpoint (its run's evals.json if any)")
    parser.add_argument("--pool", help="skip collection: replay this experience pool")
    parser.add_argument("--out", help="pipeline folder (default: runs/rlep-pipeline-<time>)")
    args, cfg = parse_job_args(parser, argv)
    from rayrep.pipelines.compare import compare_with_baseline  # Ray, torch, vLLM: once the command line holds

    if args.resume == "":
        parser.error("--resume takes the pipeline folder to continue: --resume runs/rlep-pipeline-<time>")
    out = Path(args.resume or args.out or Path(cfg.logging.out_dir) / f"rlep-pipeline-{time.strftime('%Y%m%d-%H%M%S')}")
    return compare_with_baseline(cfg, "rlep", out, args.baseline_checkpoint, args.pool,
                                 resume=args.resume is not None, restarts=args.auto_resume)


if __name__ == "__main__":
    run_job(main)
