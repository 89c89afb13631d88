"""Does replay help? The baseline, RLEP and ExGRPO (and replay variants), each with several
seeds on the same budget, and what they reach, with standard errors.

    python bench/replay_study.py [--preset tiny-cpu-hard] [--seeds 0 1 2]
                                 [--arms baseline rlep exgrpo] [--out runs/study-<preset>]
                                 [--eval-questions 2000] [--eval-samples 4] [--report-only]
                                 [--<config field> VALUE ...]

For each seed (it changes the data order and every sampling draw, never the base policy):
the GRPO/DAPO baseline trains from the base policy; for the RLEP arms, the baseline's final
checkpoint samples that seed's experience pool; then every other arm trains from the base
policy with the same budget. Every run evaluates on one test set (`--eval-questions` x
`--eval-samples` answers at T = 1, the same seeds for every evaluation), large enough that
one evaluation's standard error stays small (printed per arm).

Printed and written to `<out>/study.json` and `<out>/study.png` (mean curve per arm, a band
of +/- one standard error over seeds): per arm the mean +/- standard error over seeds of
the peak and final test pass@1, and of the step at which a seed first reaches the
baseline's mean peak (with how many seeds do); and, paired with the same seed's baseline
(same data order, same evaluation draws), the mean +/- standard error of the difference
in final pass@1 and in the mean over evaluations after step 0.

Restarted with the same `--out`, it reuses every finished run and pool, continues a stopped
run from its latest checkpoint, and runs only what is missing; a finished run that ran with
other settings than asked for now (another preset value, another option) is refused, naming
the field, before anything runs. The table is rewritten after every run, so a partial study
shows what it has; its `replayed %` column says how much of each arm's training was replay
(an arm that never replayed measured something else).

Arms: `baseline`, `rlep`, `exgrpo` (its Dr.GRPO advantage, as its paper; the baseline keeps
the std-normalised one: one difference between the arms besides replay), and the variants
`rlep-adaptive` (replay only into groups with at most 2 fresh successes), `rlep-is`
(replayed answers weighted by truncated importance ratios to their recorded behaviour
log-probs, cap 2), `rlep-grow` (the pool grows with each step's fresh successes),
`baseline-drgrpo` (the baseline without std scaling: ExGRPO's own on-policy baseline), and
the ExGRPO ablations `exgrpo-fullfresh` (the baseline's 64 fresh questions plus 32 replayed),
`baseline-half` (the baseline on 32 questions a step), `baseline-96` (the baseline on
`exgrpo-fullfresh`'s 96 questions a step, all fresh) and `exgrpo-paper-sigma` (the paper's
bucket weighting instead of the code's).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rayrep.config import Config, parse_cli# noqa: E402
from rayrep.plots import load_run_metrics, plot_study
from rayrep.eval.study import study_table, summarize_study# noqa: E402
from rayrep.pipelines.compare import check_finished_run, run_stage  # noqa: E402
from rayrep.run.layout import RunFolder  # noqa: E402

ARMS: dict[str, dict] = {
    "baseline": {"algorithm.name": "grpo"},
    "rlep": {"algorithm.name": "rlep"},
    "exgrpo": {"algorithm.name": "exgrpo", "algorithm.std_normalize": False},
    "rlep-adaptive": {"algorithm.name": "rlep", "algorithm.rlep.replay_if_at_most": 2},
    "rlep-is": {"algorithm.name": "rlep", "learner.behaviour_cap": 2.0},
    "rlep-grow": {"algorithm.name": "rlep", "algorithm.rlep.grow_pool": True},
    "baseline-drgrpo": {"algorithm.name": "grpo", "algorithm.std_normalize": False},
    # Why ExGRPO trails the baseline on the tiny presets: its batches hold half as many fresh
    # questions. `exgrpo-fullfresh` keeps the baseline's fresh stream and adds the replays on
    # top once the buffer runs: 96 questions, floor(96 x 0.34) = 32 of them replayed (1/3
    # gives 31), mini-batches of 48 (two optimizer steps a step, as every arm); until the
    # buffer holds 32 questions (the on-policy start and the first collecting step) its
    # batches are 96 fresh questions. `baseline-half` is what halving the fresh stream costs
    # alone: 32 questions, mini-batches of 16.
    "exgrpo-fullfresh": {"algorithm.name": "exgrpo", "algorithm.std_normalize": False,
                         "algorithm.prompts_per_step": 96, "learner.mini_batch_prompts": 48,
                         "algorithm.exgrpo.replay_ratio": 0.34},
    "baseline-half": {"algorithm.name": "grpo", "algorithm.prompts_per_step": 32, "learner.mini_batch_prompts": 16},
    # What `exgrpo-fullfresh` gains from its larger batches alone (96 questions, mini-batches
    # of 48), all fresh: the control that tells a gain from replay from one of batch size.
    "baseline-96": {"algorithm.name": "grpo", "algorithm.prompts_per_step": 96, "learner.mini_batch_prompts": 48},
    "exgrpo-paper-sigma": {"algorithm.name": "exgrpo", "algorithm.std_normalize": False,
                           "algorithm.exgrpo.bucket_sigma": "paper"},
}
DEFAULT_ARMS = ("baseline", "rlep", "exgrpo")


def seed_config(cfg: Config, out: Path, seed: int) -> Config:
    return cfg.replace(**{"run.seed": seed, "logging.out_dir": str(out / f"seed-{seed}")})


def collect_seed_pool(seeded: Config, seed_dir: Path, baseline_checkpoint: str, log) -> None:
    """The seed's experience pool, `seed_dir/pool.parquet`, from its baseline's final checkpoint;
    `pool.json` is written after it, so that both are complete when it exists."""
    from rayrep.pipelines.collect import collect_pool

    stats = collect_pool(seeded, baseline_checkpoint, seed_dir / "pool.parquet", log=log)
    (seed_dir / "pool.json").write_text(json.dumps(stats, indent=2))


def arm_config(seeded: Config, arm: str, seed_dir: Path) -> Config:
    """One arm's run config for one seed: RLEP arms replay the seed's pool; the arms after
    the baseline take its step-0 evaluation (the same base policy, test set and evaluation
    seeds: the same answers) instead of repeating it."""
    changes = {**ARMS[arm], "logging.run_name": arm}
    if changes["algorithm.name"] == "rlep":
        changes["algorithm.rlep.pool"] = str(seed_dir / "pool.parquet")
    if arm != "baseline":
        changes["run.start_eval"] = str(seed_dir / "baseline")
    return seeded.replace(**changes)


def finished_curves(out: Path, arms: list[str], seeds: list[int]) -> tuple[dict[str, list[list[dict]]], dict[str, list[int]]]:
    """The eval curves of every finished run, by arm, in seed order, and their seeds."""
    curves: dict[str, list[list[dict]]] = {}
    found: dict[str, list[int]] = {}
    for arm in arms:
        for seed in seeds:
            run_dir = out / f"seed-{seed}" / arm
            if RunFolder(run_dir).finished():
                curves.setdefault(arm, []).append(json.loads(RunFolder(run_dir).evals.read_text()))
                found.setdefault(arm, []).append(seed)
    return curves, found


def mean_replay_share(run_dir: Path) -> float:
    """The mean over a run's steps of the share of its trained answers that were replayed."""
    steps = [r for r in load_run_metrics(run_dir) if r.get("step", 0) > 0 and "accuracy" in r]
    return sum(r.get("replay_share", 0.0) for r in steps) / len(steps) if steps else 0.0


def report(out: Path, arms: list[str], seeds: list[int], preset: str, log) -> dict | None:
    curves, found = finished_curves(out, arms, seeds)
    if "baseline" not in curves:
        return None
    summary = summarize_study(curves, seeds=found)
    summary.update({"preset": preset, "seeds": seeds, "runs": found})
    for arm, arm_seeds in found.items():
        # How much each arm replayed: an arm that never replayed (say, ExGRPO whose batches
        # never reach its start pass rate) measured something else than replay.
        shares = [mean_replay_share(out / f"seed-{seed}" / arm) for seed in arm_seeds]
        summary["arms"][arm]["replay_share"] = sum(shares) / len(shares)
    plot = plot_study(curves, out / "study.png", title=f"test pass@1 on {preset}: mean +/- SE over seeds")
    (out / "study.json").write_text(json.dumps(summary, indent=2))
    log(study_table(summary))
    log(f"plot: {plot}")
    return summary


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny-cpu-hard")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), choices=list(ARMS))
    parser.add_argument("--out", help="study folder (default: runs/study-<preset>)")
    # 2,000 x 4 rather than 1,000 x 8 (the same answers to sample): the questions' own spread
    # dominates the standard error; measured on tiny-cpu-hard at ~21%, 1,000 x 8 gave 0.76-0.78
    # points, and these numbers predict ~0.6 for 2,000 x 4.
    parser.add_argument("--eval-questions", type=int, default=2000, help="test questions of every evaluation")
    parser.add_argument("--eval-samples", type=int, default=4, help="answers per test question (T = 1)")
    parser.add_argument("--report-only", action="store_true", help="only the table and plot of the runs finished so far")
    args, overrides = parser.parse_known_args(argv)
    if "baseline" not in args.arms:
        args.arms.insert(0, "baseline")  # every other arm is measured against it, and RLEP's pool comes from it
    cfg = parse_cli(["--preset", args.preset, "--data.arithmetic_test_size", str(args.eval_questions),
                     "--generator.eval_samples", str(args.eval_samples), *overrides])
    for arm in args.arms:  # every arm's config is checked before anything runs
        cfg.replace(**ARMS[arm])
    out = Path(args.out or REPO / "runs" / f"study-{args.preset}").resolve()
    if args.report_only:
        return report(out, args.arms, args.seeds, args.preset, print)
    # A finished run is reused only if it is the run asked for (a changed preset or option
    # would otherwise be compared under the old settings): checked before anything runs.
    for seed in args.seeds:
        for arm in args.arms:
            run_dir = out / f"seed-{seed}" / arm
            if RunFolder(run_dir).finished():
                check_finished_run(arm_config(seed_config(cfg, out, seed), arm, out / f"seed-{seed}"), run_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "study-args.json").write_text(json.dumps({"argv": argv if argv is not None else sys.argv[1:]}, indent=2))

    def log(line: str) -> None:
        print(line, flush=True)

    start = time.monotonic()
    for seed in args.seeds:
        seeded, seed_dir = seed_config(cfg, out, seed), out / f"seed-{seed}"
        log(f"== seed {seed}: baseline ==")
        baseline = run_stage(arm_config(seeded, "baseline", seed_dir), resume=True, log=log)
        for arm in args.arms:
            if arm == "baseline":
                continue
            if ARMS[arm]["algorithm.name"] == "rlep" and not (seed_dir / "pool.json").is_file():
                log(f"== seed {seed}: experience pool from {baseline.final_checkpoint} ==")
                collect_seed_pool(seeded, seed_dir, baseline.final_checkpoint, log)
            log(f"== seed {seed}: {arm} ==")
            run_stage(arm_config(seeded, arm, seed_dir), resume=True, log=log)
            report(out, args.arms, args.seeds, args.preset, log)
    summary = report(out, args.arms, args.seeds, args.preset, log)
    log(f"study folder: {out} ({(time.monotonic() - start) / 60:.1f} min this time)")
    return summary


if __name__ == "__main__":
    main()
