"""Evaluate a policy checkpoint on the test split: avg@k, pass@k and maj@k.

    python jobs/eval.py                       # the embedded tiny policy (built on first use)
    python jobs/eval.py --checkpoint runs/x/checkpoints/final --generator.eval_samples 8

The same evaluation as a training run's (`rayrep.eval.evaluate`), on a generator and a
verifier pool started for it.
"""

import json
import time
from pathlib import Path

from rayrep.config import job_parser, parse_job_args, run_job
from rayrep.eval import evaluate_checkpoint
from rayrep.models import resolve_policy


def main(argv: list[str]) -> dict:
    parser = job_parser(__doc__, trains=False)
    parser.add_argument("--checkpoint", help="policy to evaluate (default: the config's model.path)")
    parser.add_argument("--out", help="also write the metrics as JSON to this file")
    args, cfg = parse_job_args(parser, argv)

    model_path = args.checkpoint or resolve_policy(cfg)
    start = time.monotonic()
    metrics = evaluate_checkpoint(cfg, model_path)
    metrics["eval_seconds"] = round(time.monotonic() - start, 1)
    print(f"\npolicy: {model_path}")
    print(f"test questions: {metrics['questions']}, sampled at T={cfg.generator.eval_temperature}")
    for name, value in metrics.items():
        if "@" in name:
            print(f"  {name:>24}: {100 * value:5.1f}%")
    print(f"  mean response tokens: {metrics['mean_response_tokens']:.1f}; "
          f"verifier timeouts/errors: {metrics['verifier_timeouts']}/{metrics['verifier_errors']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"policy": model_path, **metrics}, indent=2))
    return metrics


if __name__ == "__main__":
    run_job(main)
