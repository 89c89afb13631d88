"""ExGRPO on the same budget as the baseline, and the comparison of the two.

    python jobs/exgrpo.py                                           # baseline, then ExGRPO
    python jobs/exgrpo.py --baseline-checkpoint runs/p/baseline/checkpoints/final   # reuse a baseline run

ExGRPO's advantage is the group mean subtracted with no std scaling; this job sets
`algorithm.std_normalize = false` unless the command line says otherwise explicitly.
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
    parser.add_argument("--baseline-checkpoint", help="skip the baseline run: use this checkpoint's run (evals.json)")
    parser.add_argument("--out", help="folder for both runs (default: runs/exgrpo-<time>)")
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a.startswith("--algorithm.std_normalize") for a in argv):
        argv += ["--algorithm.std_normalize", "false"]
    args, cfg = parse_job_args(parser, argv)
    out = Path(args.out or Path(cfg.logging.out_dir) / f"exgrpo-{time.strftime('%Y%m%d-%H%M%S')}")
    cfg = cfg.replace(**{"logging.out_dir": str(out)})

    from rayrep.train import train

    if args.baseline_checkpoint:
        base_evals = checkpoint_evals(args.baseline_checkpoint, cfg)
    else:
        print("== baseline (GRPO/DAPO) ==")
        base_evals = train(cfg.replace(**{"algorithm.name": "grpo", "algorithm.std_normalize": True,
                                          "logging.run_name": "baseline"})).evals
    print("== ExGRPO ==")
    run = train(cfg.replace(**{"algorithm.name": "exgrpo", "logging.run_name": "exgrpo"}))
    comparison = compare_runs(base_evals, run.evals)
    comparison["plot"] = str(plot_curves({"baseline (GRPO/DAPO)": base_evals, "ExGRPO": run.evals},
                                         out / "comparison.png", title="ExGRPO vs baseline"))
    (out / "comparison.json").write_text(json.dumps(comparison, indent=2))
    print(comparison_table(("baseline", "ExGRPO"), comparison))
    return comparison


if __name__ == "__main__":
    main()
