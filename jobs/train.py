"""One training run of any algorithm, without the baseline comparison of the pipelines.

    python jobs/train.py --algorithm.name exgrpo                   # (its advantage without the std: set by choosing it)
    python jobs/train.py --algorithm.name rlep --algorithm.rlep.pool runs/p/pool.parquet
    python jobs/train.py --resume runs/exgrpo-20261201-120000      # continue a stopped run
    python jobs/train.py --auto-resume                             # a learner that dies: continue from the last checkpoint

`jobs/grpo.py` is this job for the baseline; `jobs/rlep.py` and `jobs/exgrpo.py` run a
method against the baseline.
"""

from rayrep.cli import job_parser, parse_job_args, run_job


def main(argv: list[str]):
    parser = job_parser(__doc__)
    args, cfg = parse_job_args(parser, argv)

    from rayrep.train import train_resuming

    result = train_resuming(cfg, resume=args.resume is not None, restarts=args.auto_resume)
    first, last = result.evals[0], result.evals[-1]
    print(f"\nrun: {result.run_dir}\nfinal checkpoint: {result.final_checkpoint}")
    print(f"test pass@1: {first['test_pass@1']:.3f} at step {first['step']} -> {last['test_pass@1']:.3f} "
          f"at step {last['step']}")
    return result


if __name__ == "__main__":
    run_job(main)
