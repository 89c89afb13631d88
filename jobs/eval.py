"""Evaluate a policy checkpoint: avg@k, unbiased pass@k and maj@k, per benchmark and overall.

    python jobs/eval.py                                  # the embedded tiny policy on the embedded test split
    python jobs/eval.py --checkpoint runs/grpo-20250101-120000/checkpoints/final --generator.eval_samples 8
    python jobs/eval.py --preset qwen2.5-math-7b-rlep --checkpoint Qwen/Qwen2.5-Math-7B \\
        --prompts data/aime24.parquet data/aime25.parquet data/amc23.parquet

Prompt files are .jsonl, .json or .parquet in the verl/DAPO row format (`data_source`,
`prompt`, `reward_model.ground_truth`; see rayrep/data/loaders.py); each `data_source` is a
benchmark, a row of the table. Each question gets `generator.eval_samples` answers (a
benchmark's own count from `generator.eval_samples_by_source`) sampled at
`generator.eval_temperature` and `generator.eval_top_p`, up to
`generator.max_response_tokens` tokens; the paper presets hold the papers' settings.

Prints a progress line with an ETA as slices of questions finish, then the table; writes
every number, with the checkpoint, the prompt files, the sampling settings and the time
taken, to a JSON file: `<logging.out_dir>/eval/<checkpoint>-<time>.json`, or `--out`.
The same evaluation as a training run's (`rayrep.eval.evaluate`), on a generator and a
verifier group started for it.
"""

import time
from pathlib import Path

from rayrep.cli import job_parser, parse_job_args, run_job
from rayrep.data import load_split
from rayrep.eval.report import check_report_path, default_report_path, eval_report, format_table, write_report
from rayrep.models import resolve_policy
from rayrep.progress import Progress, format_duration


def main(argv: list[str]) -> dict:
    parser = job_parser(__doc__, trains=False)
    parser.add_argument("--checkpoint", help="policy to evaluate, a checkpoint folder or hub id (default: the config's "
                                             "model.path)")
    parser.add_argument("--prompts", nargs="+", metavar="FILE",
                        help="prompt files to evaluate on (sets data.test_files; default: the config's, or the "
                             "embedded task's test split)")
    parser.add_argument("--out", help="write the JSON report here (default: "
                                      "<logging.out_dir>/eval/<checkpoint>-<time>.json)")
    args, cfg = parse_job_args(parser, argv)
    from rayrep.eval.evaluate import evaluate_checkpoint  # Ray, torch, vLLM: once the command line holds
    from rayrep.verifier.group import check_checkers

    if args.prompts:
        cfg = cfg.replace(**{"data.test_files": args.prompts})

    # Bad input stops here, before a policy is built or an actor starts.
    prompts = load_split(cfg.data, "test")
    check_checkers(cfg, prompts)
    out = Path(args.out) if args.out else None
    if out:
        check_report_path(out)
    model_path = args.checkpoint or resolve_policy(cfg)
    if cfg.tools.enabled:  # the template's tool role, a turn's budget, a user's tool loaded
        from transformers import AutoTokenizer

        from rayrep.verifier.tools import check_tools

        check_tools(cfg, AutoTokenizer.from_pretrained(model_path), str(model_path))
    if not out:
        out = default_report_path(cfg.logging.out_dir, model_path)
        check_report_path(out)

    start = time.monotonic()
    progress = Progress(len(prompts), "eval", unit="question")
    metrics = evaluate_checkpoint(cfg, model_path, prompts, progress=progress)
    seconds = time.monotonic() - start
    report = eval_report(cfg, model_path, prompts, metrics, seconds)

    gen = cfg.generator
    print(f"\ncheckpoint: {model_path}")
    print(f"prompts: {', '.join(cfg.data.test_files) or 'the embedded test split'} ({len(prompts)} questions); "
          f"T={gen.eval_temperature}, top_p={gen.eval_top_p}, up to {gen.max_response_tokens} tokens")
    print(format_table(metrics))
    print(f"mean response tokens {metrics['mean_response_tokens']:.1f}; verifier timeouts/errors "
          f"{metrics['verifier_timeouts']}/{metrics['verifier_errors']}; took {format_duration(seconds)}")
    print(f"report: {write_report(out, report)}")
    return report


if __name__ == "__main__":
    run_job(main)
