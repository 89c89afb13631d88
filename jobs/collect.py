"""RLEP phase 1: build an experience pool from a checkpoint.

    python jobs/collect.py --checkpoint runs/grpo-x/checkpoints/final --out pool.parquet
    python jobs/collect.py --import-text dapo_rlep_pool.parquet --checkpoint <policy> --out pool.parquet

The checkpoint samples `algorithm.rlep.collect_samples` answers per training question at
`collect_temperature` / `collect_top_p`; verified successes of questions with at least
`min_successes` of them are written with token ids, behaviour log-probs, text, reward,
length and the source checkpoint. `--import-text` converts a public RLEP pool (text
candidates in `reward_model.candidates`) by tokenizing it with the checkpoint's tokenizer.
"""

import json

from rayrep.cli import job_parser, parse_job_args, run_job


def main(argv: list[str]) -> dict:
    parser = job_parser(__doc__, trains=False)
    parser.add_argument("--checkpoint", required=True, help="policy that samples (or whose tokenizer imports)")
    parser.add_argument("--out", required=True, help="experience pool to write (.parquet)")
    parser.add_argument("--import-text", help="a text-only RLEP pool (verl/DAPO rows) to convert instead of sampling")
    args, cfg = parse_job_args(parser, argv)
    from rayrep.pipelines.collect import collect_pool  # Ray, torch, vLLM: once the command line holds

    if args.import_text:
        from transformers import AutoTokenizer

        from rayrep.buffer.files import import_text_pool

        imported = import_text_pool(args.import_text, AutoTokenizer.from_pretrained(args.checkpoint), args.out,
                                    max_response_tokens=cfg.generator.max_response_tokens)
        print(f"imported {imported.candidates} candidate answers of {imported.questions - imported.questions_without} "
              f"questions into {imported.path}; {imported.questions_without} of the {imported.questions} questions had "
              f"none (null or empty candidates) and are left out. Text carries no behaviour log-probs: replay "
              f"recomputes them (algorithm.rlep.old_logprobs = 'recompute').")
        return {"pool": str(imported.path), "successes": imported.candidates, "questions": imported.questions,
                "questions_without_candidates": imported.questions_without}
    stats = collect_pool(cfg, args.checkpoint, args.out)
    print(json.dumps(stats, indent=2))
    return stats


if __name__ == "__main__":
    run_job(main)
