"""The GRPO/DAPO baseline (DAPO without dynamic sampling, the RLEP paper's baseline).

    python jobs/grpo.py                                   # tiny-cpu preset, local Ray cluster
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python jobs/grpo.py
    python jobs/grpo.py --dry-run --preset qwen2.5-math-7b-rlep   # the placement and memory plans only
"""

from rayrep.cli import job_parser, parse_job_args, run_job


def main(argv: list[str]):
    parser = job_parser(__doc__, sets={"algorithm.name": ("grpo", "the baseline; jobs/train.py runs any algorithm")})
    args, cfg = parse_job_args(parser, argv)

    from rayrep.train import train_resuming

    result = train_resuming(cfg, resume=args.resume is not None, restarts=args.auto_resume)
    first, last = result.evals[0], result.evals[-1]
    print(f"\nrun: {result.run_dir}\nfinal checkpoint: {result.final_checkpoint}")
    print(f"test pass@1: {first['test_pass@1']:.3f} at step 0 -> {last['test_pass@1']:.3f} at step {last['step']}")
    return result


if __name__ == "__main__":
    run_job(main)
