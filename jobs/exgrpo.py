"""ExGRPO on the same budget as the baseline, and the comparison of the two.

    python jobs/exgrpo.py                                           # baseline, then ExGRPO
    python jobs/exgrpo.py --baseline-checkpoint runs/p/baseline/checkpoints/final   # reuse a baseline run

ExGRPO's advantage is the group mean subtracted with no std scaling; this job sets
`algorithm.std_normalize = false` unless the command line says otherwise explicitly, for
both runs: the baseline is the paper's on-policy one (the same advantage, loss and
schedule), so that the comparison isolates replay.
"""

import time
from pathlib import Path

from rayrep.cli import job_parser, parse_job_args, run_job


def main(argv: list[str]) -> dict:
    parser = job_parser(__doc__, sets={
        "algorithm.name": (None, "grpo for the baseline, exgrpo for the method; jobs/train.py runs one algorithm")})
    parser.add_argument("--baseline-checkpoint", help="skip the baseline run: use this checkpoint's run (evals.json)")
    parser.add_argument("--out", help="folder for both runs (default: runs/exgrpo-<time>)")
    if not any(a.startswith("--algorithm.std_normalize") for a in argv):
        argv = [*argv, "--algorithm.std_normalize", "false"]
    args, cfg = parse_job_args(parser, argv)
    from rayrep.pipelines.compare import compare_with_baseline  # Ray, torch, vLLM: once the command line holds

    if args.resume == "":
        parser.error("--resume takes the pipeline folder to continue: --resume runs/exgrpo-<time>")
    out = Path(args.resume or args.out or Path(cfg.logging.out_dir) / f"exgrpo-{time.strftime('%Y%m%d-%H%M%S')}")
    return compare_with_baseline(cfg, "exgrpo", out, args.baseline_checkpoint, resume=args.resume is not None,
                                 restarts=args.auto_resume)


if __name__ == "__main__":
    run_job(main)
