"""Does replay help? The baseline, RLEP and ExGRPO (and replay variants), each with several
seeds on the same budget, and what they reach, with standard errors.

    python bench/replay_study.py [--preset tiny-cpu-hard] [--seeds 0 1 2]
                                 [--arms baseline rlep exgrpo] [--out runs/study-<preset>]
                                 [--eval-questions 2000] [--eval-samples 4] [--report-only]
                                 [--record bench/results/study-<preset>]
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
in final pass@1 and in the mean over evaluations after step 0; and the same paired
differences between the ablations and their controls (`CONTRASTS`, below).

Restarted with the same `--out`, it reuses every finished run and pool, continues a stopped
run from its latest checkpoint, and runs only what is missing; a finished run that ran with
other settings than asked for now (another preset value, another option) is refused, naming
the field, before anything runs. With `--record DIR` each finished run's settings,
evaluations and step records, and each seed's RLEP pool, are copied to DIR, and a run
recorded there stands for the run (reported, checked, not run again) on a machine without
its folder: the docs' tables come from `bench/results/study-tiny-cpu-hard`. The table is
rewritten after every run, so a partial study shows what it has; its `replayed %` column
says how much of each arm's training was replay (an arm that never replayed measured
something else).

Arms: `baseline`, `rlep`, `exgrpo` (its Dr.GRPO advantage, as its paper; the baseline keeps
the std-normalised one: one difference between the arms besides replay), and the variants
`rlep-adaptive` (replay only into groups with at most 2 fresh successes), `rlep-is`
(replayed answers weighted by truncated importance ratios to their recorded behaviour
log-probs, cap 2), `rlep-grow` (the pool grows with each step's fresh successes),
`baseline-drgrpo` (the baseline without std scaling: ExGRPO's own on-policy baseline), and
the ExGRPO ablations `exgrpo-fullfresh` (the baseline's 64 fresh questions plus 32 replayed),
`baseline-half` (the baseline on 32 questions a step), `baseline-96` (the baseline on
`exgrpo-fullfresh`'s 96 questions a step, all fresh) and `exgrpo-paper-sigma` (the paper's
bucket weighting instead of the code's); `baseline-partial` (the baseline with partial
rollouts, `run.partial_rollouts 0.5`); and answer-level replay and the generation pruner:
`prioritized`, `baseline-prune`, `prioritized-prune`, and the ablations
`prioritized-nodecay` (priority |A| alone) and `prioritized-noevict` (no age bound); and
the baseline with a LoRA adapter instead of full fine-tuning: `baseline-lora8`,
`baseline-lora1` (ranks 8 and 1, lr 1e-3); and the baseline under other objectives:
`baseline-gspo`, `baseline-cispo` (docs/objectives.md); on a preset whose answers call a
tool (`--preset tiny-cpu-tool`), `baseline-notool`, the baseline without it (docs/tools.md).

Every arm is also measured in compute: its mean curve against the tokens it generated and
the seconds its steps took, and, at three targets (`targets` in study.json: the baseline's
mean final and mean peak, and the highest level every seed of every arm reaches), the tokens
and seconds each seed spent until it first reached it and, paired by seed, its tokens over
its own baseline's (`compute` in study.json, the second table; the plot `study-tokens.png`,
the baselines at 16, 32 (60 and 120 steps), 64 and 96 fresh questions a step drawn as the reference frontier).
The arms where replay replaces generation: `baseline-16` (the baseline on 16 fresh questions
a step), `exgrpo-paper-16` (ExGRPO with the paper's weights on 16 fresh + 48 replayed;
`exgrpo-paper-sigma` is 32 + 32), `prioritized-32` (answer-level replay on 32 fresh
questions, stored answers filling the batch to 64 questions' worth), `rlep-32` (RLEP on 32
fresh questions), and `baseline-half-epochs2` (two passes over each batch of 32: reuse
without a buffer, the control any replay method must beat); and at the baseline's
generation, 120 steps of 32 fresh questions (evaluated every 20): `baseline-half-120`,
`rlep-32-120` and `rlep-32-prune-120` (the generation pruner on the best of these).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rayrep.config import Config, ConfigError, parse_cli  # noqa: E402
from rayrep.stats.study import (compute_table, frontier_targets, spent, study_table, summarize_compute,  # noqa: E402
                                summarize_study)
from rayrep.plots import load_run_metrics, plot_study, plot_study_tokens  # noqa: E402
from rayrep.pipelines.compare import check_finished_run, run_stage  # noqa: E402
from rayrep.run.evaluation import START_SECTIONS  # noqa: E402
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
    # Partial rollouts: half again as many questions in flight, a step trains on the first 64
    # groups done and the next finishes the others under newer weights.
    "baseline-partial": {"algorithm.name": "grpo", "run.partial_rollouts": 0.5},
    # Answer-level prioritised replay (a quarter of each batch's answers replayed, priority
    # |A| x exp(-age / 4), none older than 8 versions), the generation pruner (a question whose
    # group taught nothing sits out its next visit, twice as long after each re-check that
    # confirms it), both, and the ablations: priority without decay, decay without eviction.
    "prioritized": {"algorithm.name": "prioritized"},
    "baseline-prune": {"algorithm.name": "grpo", "algorithm.prune.after": 1},
    "prioritized-prune": {"algorithm.name": "prioritized", "algorithm.prune.after": 1},
    "prioritized-nodecay": {"algorithm.name": "prioritized", "algorithm.prioritized.decay_versions": 0.0},
    "prioritized-noevict": {"algorithm.name": "prioritized", "algorithm.prioritized.max_age": -1},
    # The baseline training a LoRA adapter (alpha 32, every projection) instead of every weight,
    # at rank 8 and at rank 1, at 10x the full fine-tuning rate (LoRA's best rate sits about
    # 10x above full fine-tuning's, "LoRA Without Regret"; one rate, not a sweep): what a
    # rank-limited adapter costs on this task (docs/lora.md).
    "baseline-lora8": {"algorithm.name": "grpo", "learner.lora_rank": 8, "learner.lr": 1e-3},
    "baseline-lora1": {"algorithm.name": "grpo", "learner.lora_rank": 1, "learner.lr": 1e-3},
    # The baseline under the objectives peers ship (docs/objectives.md), each with its recipe's
    # settings in verl: GSPO's sequence ratio clipped to [1 - 3e-4, 1 + 4e-4] with verl's
    # sequence-mean aggregation; CISPO's weight clipped above at 1.2 and (nearly) not below.
    "baseline-gspo": {"algorithm.name": "grpo", "learner.objective": "gspo", "learner.clip_low": 3e-4,
                      "learner.clip_high": 4e-4, "learner.loss_agg": "seq-mean-token-mean"},
    "baseline-cispo": {"algorithm.name": "grpo", "learner.objective": "cispo", "learner.clip_low": 0.999,
                       "learner.clip_high": 0.2},
    # A preset whose answers call a tool (tiny-cpu-tool): the same policy without it, a call
    # then answered by nothing (docs/tools.md).
    "baseline-notool": {"algorithm.name": "grpo", "tools.name": ""},
    # Replay that replaces generation (the compute frontier): the baseline on 16 fresh
    # questions a step (with `baseline-half` on 32, `baseline` on 64 and `baseline-96`, the
    # frontier that more or fewer fresh questions give), and each method on fewer fresh
    # questions, two optimizer steps a step as every arm but the two-pass control (four):
    # ExGRPO with the paper's bucket weights on 16 fresh + 48 replayed (`exgrpo-paper-sigma` is
    # 32 + 32); answer-level replay on 32 fresh questions, stored answers filling the batch to
    # 64 questions' worth; RLEP on 32 fresh questions with its pool; and reuse without a
    # buffer, two passes over each batch of 32.
    "baseline-16": {"algorithm.name": "grpo", "algorithm.prompts_per_step": 16, "learner.mini_batch_prompts": 8},
    "exgrpo-paper-16": {"algorithm.name": "exgrpo", "algorithm.std_normalize": False,
                        "algorithm.exgrpo.bucket_sigma": "paper", "algorithm.exgrpo.replay_ratio": 0.75},
    "prioritized-32": {"algorithm.name": "prioritized", "algorithm.prompts_per_step": 32,
                       "learner.mini_batch_prompts": 16, "algorithm.prioritized.replay_share": 0.5},
    "rlep-32": {"algorithm.name": "rlep", "algorithm.prompts_per_step": 32, "learner.mini_batch_prompts": 16},
    "baseline-half-epochs2": {"algorithm.name": "grpo", "algorithm.prompts_per_step": 32,
                              "learner.mini_batch_prompts": 16, "learner.epochs": 2},
    # At the baseline's generation: the arms on 32 fresh questions a step run 120 steps, so that
    # they generate what the baseline's 60 do and an arm that is still rising at step 60 is not
    # judged on half the budget; evaluated every 20 steps, the tokens the baseline generates
    # between its evaluations. RLEP on 32 ended highest at step 60 of the arms that generate
    # half the baseline's tokens a step, so the generation pruner goes on it (it acts from the
    # second epoch: a question is met once in 80 steps of 32).
    "baseline-half-120": {"algorithm.name": "grpo", "algorithm.prompts_per_step": 32, "learner.mini_batch_prompts": 16,
                          "run.steps": 120, "run.eval_every": 20},
    "rlep-32-120": {"algorithm.name": "rlep", "algorithm.prompts_per_step": 32, "learner.mini_batch_prompts": 16,
                    "run.steps": 120, "run.eval_every": 20},
    "rlep-32-prune-120": {"algorithm.name": "rlep", "algorithm.prompts_per_step": 32, "learner.mini_batch_prompts": 16,
                          "algorithm.prune.after": 1, "run.steps": 120, "run.eval_every": 20},
}
DEFAULT_ARMS = ("baseline", "rlep", "exgrpo")
FRONTIER_ARMS = ("baseline-16", "baseline-half", "baseline-half-120", "baseline", "baseline-96")
"""The baseline at 16, 32 (60 and 120 steps), 64 and 96 fresh questions a step: drawn as the
reference frontier of the tokens plot, which an arm above it beats at equal generation."""
# Paired by seed, a - b, beside every arm against the baseline: what each ablation isolates.
CONTRASTS = (
    ("exgrpo-fullfresh", "baseline-96"),  # 32 replayed questions against 32 fresh ones, on 64 fresh and one batch size
    ("exgrpo", "baseline-half"),  # 32 replayed questions on top of 32 fresh ones (twice the batch)
    ("exgrpo-paper-sigma", "baseline-half"),  # the same, replayed by the paper's bucket weights
    ("exgrpo-fullfresh", "exgrpo"),  # ExGRPO given the baseline's fresh stream back
    ("exgrpo-paper-sigma", "exgrpo"),  # the paper's bucket weights against the code's
    ("exgrpo", "baseline-drgrpo"),  # ExGRPO against its own on-policy baseline (the same advantage)
    ("rlep-adaptive", "rlep"), ("rlep-is", "rlep"), ("rlep-grow", "rlep"),  # the variants against the paper's RLEP
    ("baseline-partial", "baseline"),  # partial rollouts against waiting for every answer
    ("prioritized-prune", "prioritized"), ("prioritized-prune", "baseline-prune"),  # what each part adds to the other
    ("prioritized-nodecay", "prioritized"), ("prioritized-noevict", "prioritized"),  # the decay and the eviction
    ("baseline-lora1", "baseline-lora8"),  # rank 1 against rank 8
    ("baseline-gspo", "baseline-cispo"),  # the two objectives against each other
    # On the generation of 32 fresh questions a step, what each reuse of it adds:
    ("rlep-32", "baseline-half"),  # RLEP's pool
    ("prioritized-32", "baseline-half"),  # stored answers filling the batch
    ("baseline-half-epochs2", "baseline-half"),  # a second pass over the batch, no buffer
    ("rlep-32", "baseline-half-epochs2"),  # each replay method against the cheapest reuse
    ("prioritized-32", "baseline-half-epochs2"),
    ("exgrpo-paper-16", "exgrpo-paper-sigma"),  # 48 replayed questions of 64 against 32
    # At the baseline's generation (120 steps of 32 fresh questions):
    ("rlep-32-120", "baseline-half-120"),  # RLEP's pool
    ("rlep-32-prune-120", "rlep-32-120"),  # the pruner on the best of them
)


# A study's record (`--record DIR`): what its finished runs leave for the report (settings,
# evaluations, step records; about 100 KB a run) and each seed's RLEP pool, copied there as
# they finish. Run folders hold checkpoints (megabytes each) and stay in `runs/`; a record
# is small enough to keep in the repository, so the docs' tables can be rebuilt, and a study
# continued, on a machine that holds none of the run folders. A run recorded there is not
# run again; its record stands for it (checked against the settings asked for, as a
# finished run folder is).
RECORD_FILES = ("config.json", "machine.json", "metrics.jsonl", "evals.json")  # evals.json last: it marks a whole record
NOT_IN_OLDER_RUNS = {"machine.json"}  # the kernels a run used, which runs before it was written lack
POOL_FILES = ("pool.parquet", "pool.json")  # pool.json last, as collect_seed_pool writes them


def copy_files(names: tuple[str, ...], source: Path, target: Path) -> None:
    """Copy `names` from `source` to `target` in order, each through a temporary file, so
    that a copy cut off leaves no file that looks whole (the last name marks the whole)."""
    target.mkdir(parents=True, exist_ok=True)
    for name in names:
        if name in NOT_IN_OLDER_RUNS and not (source / name).exists():
            continue
        partial = target / f".{name}.partial"
        shutil.copyfile(source / name, partial)
        os.replace(partial, target / name)


def keep_record(names: tuple[str, ...], source: Path, target: Path) -> None:
    """Record `names` from `source` in `target` unless the record is whole already (its last
    name there): a recorded run or pool is never rewritten, and one cut off is copied again."""
    if not (target / names[-1]).is_file():
        copy_files(names, source, target)


def finished_run(out: Path, record: Path | None, seed: int, arm: str) -> Path | None:
    """Where a finished run of `arm` for `seed` is: its run folder, else its record, else None."""
    run_dir = out / f"seed-{seed}" / arm
    if RunFolder(run_dir).finished():
        return run_dir
    kept = record / f"seed-{seed}" / arm if record is not None else None
    return kept if kept is not None and (kept / RECORD_FILES[-1]).is_file() else None


def seed_config(cfg: Config, out: Path, seed: int) -> Config:
    return cfg.replace(**{"run.seed": seed, "logging.out_dir": str(out / f"seed-{seed}")})


def collect_seed_pool(seeded: Config, seed_dir: Path, baseline_checkpoint: str, log) -> None:
    """The seed's experience pool, `seed_dir/pool.parquet`, from its baseline's final checkpoint;
    `pool.json` is written after it, so that both are complete when it exists."""
    from rayrep.pipelines.collect import collect_pool

    stats = collect_pool(seeded, baseline_checkpoint, seed_dir / "pool.parquet", log=log)
    (seed_dir / "pool.json").write_text(json.dumps(stats, indent=2))


def seed_pool(seeded: Config, seed_dir: Path, record: Path | None, log) -> None:
    """The seed's RLEP pool in `seed_dir`: there already, else copied from the record, else
    collected from the baseline's final checkpoint; then recorded, if it is not."""
    kept = record / seed_dir.name if record is not None else None
    if not (seed_dir / POOL_FILES[-1]).is_file():
        if kept is not None and (kept / POOL_FILES[-1]).is_file():
            copy_files(POOL_FILES, kept, seed_dir)
        else:
            final = RunFolder(seed_dir / "baseline").final
            log(f"== {seed_dir.name}: experience pool from {final} ==")
            collect_seed_pool(seeded, seed_dir, str(final), log)
    if kept is not None:
        keep_record(POOL_FILES, seed_dir, kept)


def check_reuse(cfg: Config, out: Path, seed: int, arm: str, run_dir: Path) -> None:
    """Refuse a finished run or record of `arm` that ran otherwise than asked for now, naming
    the field (`check_finished_run`). A recorded RLEP run names the pool it replayed by its
    path where it ran (another checkout, another `--out`); that pool is its seed's, recorded
    beside it, so the path itself is not compared."""
    expected = arm_config(seed_config(cfg, out, seed), arm, out / f"seed-{seed}")
    if expected.algorithm.name == "rlep" and run_dir != out / f"seed-{seed}" / arm:
        try:
            pool = json.loads(RunFolder(run_dir).config.read_text())["algorithm"]["rlep"]["pool"]
            expected = expected.replace(**{"algorithm.rlep.pool": pool})
        except (OSError, ValueError, KeyError, TypeError):
            pass  # check_finished_run names what is wrong with it
    check_finished_run(expected, run_dir)


def arm_config(seeded: Config, arm: str, seed_dir: Path, baseline_dir: Path | None = None) -> Config:
    """One arm's run config for one seed: RLEP arms replay the seed's pool; the arms after
    the baseline take its step-0 evaluation (the same base policy, test set and evaluation
    seeds: the same answers) instead of repeating it, from `baseline_dir` (its run folder
    or its record; by default its run folder), unless they change what it depends on."""
    changes = {**ARMS[arm], "logging.run_name": arm}
    if changes["algorithm.name"] == "rlep":
        changes["algorithm.rlep.pool"] = str(seed_dir / "pool.parquet")
    # (An arm that changes what the step-0 evaluation depends on, the tool say, evaluates its own.)
    if arm != "baseline" and not any(name.split(".")[0] in START_SECTIONS for name in ARMS[arm]):
        changes["run.start_eval"] = str(baseline_dir or seed_dir / "baseline")
    return seeded.replace(**changes)


def finished_curves(out: Path, arms: list[str], seeds: list[int], record: Path | None = None
                    ) -> tuple[dict[str, list[list[dict]]], dict[str, list[int]], dict[str, list[Path]]]:
    """The eval curves of every finished run (run folder or record), by arm, in seed order,
    their seeds and where they are."""
    curves: dict[str, list[list[dict]]] = {}
    found: dict[str, list[int]] = {}
    where: dict[str, list[Path]] = {}
    for arm in arms:
        for seed in seeds:
            run_dir = finished_run(out, record, seed, arm)
            if run_dir is not None:
                curves.setdefault(arm, []).append(json.loads(RunFolder(run_dir).evals.read_text()))
                found.setdefault(arm, []).append(seed)
                where.setdefault(arm, []).append(run_dir)
    return curves, found, where


def mean_replay_share(run_dir: Path) -> float:
    """The mean over a run's steps of the share of its trained answers that were replayed."""
    steps = [r for r in load_run_metrics(run_dir) if r.get("step", 0) > 0 and "accuracy" in r]
    return sum(r.get("replay_share", 0.0) for r in steps) / len(steps) if steps else 0.0


def report(out: Path, arms: list[str], seeds: list[int], preset: str, log, record: Path | None = None) -> dict | None:
    curves, found, where = finished_curves(out, arms, seeds, record)
    if "baseline" not in curves:
        return None
    summary = summarize_study(curves, seeds=found, contrasts=CONTRASTS)
    summary.update({"preset": preset, "seeds": seeds, "runs": found})
    for arm, run_dirs in where.items():
        # How much each arm replayed: an arm that never replayed (say, ExGRPO whose batches
        # never reach its start pass rate) measured something else than replay.
        shares = [mean_replay_share(run_dir) for run_dir in run_dirs]
        summary["arms"][arm]["replay_share"] = sum(shares) / len(shares)
    # What each arm spent: generated tokens and its steps' seconds up to each evaluation.
    used = {arm: [spent([r for r in load_run_metrics(run_dir) if r.get("step", 0) > 0 and "accuracy" in r], evals)
                  for run_dir, evals in zip(where[arm], curves[arm])] for arm in curves}
    summary["targets"] = frontier_targets(used)
    summary["compute"] = summarize_compute(used, summary["targets"], found)
    out.mkdir(parents=True, exist_ok=True)
    plot = plot_study(curves, out / "study.png", title=f"test pass@1 on {preset}: mean +/- SE over seeds")
    tokens_plot = plot_study_tokens(summary["compute"], out / "study-tokens.png",
                                    title=f"test pass@1 on {preset} against what the runs spent: mean +/- SE over seeds",
                                    reference=FRONTIER_ARMS)
    (out / "study.json").write_text(json.dumps(summary, indent=2))
    log(study_table(summary))
    log("")
    log(compute_table(summary["compute"]))
    log(f"plots: {plot}, {tokens_plot}")
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
    parser.add_argument("--record", help="the study's record: finished runs' settings, evaluations and step records and "
                                         "each seed's RLEP pool are copied there; a run recorded there is not run again")
    args, overrides = parser.parse_known_args(argv)
    if "baseline" not in args.arms:
        args.arms.insert(0, "baseline")  # every other arm is measured against it, and RLEP's pool comes from it
    cfg = parse_cli(["--preset", args.preset, "--data.arithmetic_test_size", str(args.eval_questions),
                     "--generator.eval_samples", str(args.eval_samples), *overrides])
    for arm in args.arms:  # every arm's config is checked before anything runs
        cfg.replace(**ARMS[arm])
    out = Path(args.out or REPO / "runs" / f"study-{args.preset}").resolve()
    record = Path(args.record).resolve() if args.record else None
    if args.report_only:
        return report(out, args.arms, args.seeds, args.preset, print, record)
    # A finished run (or its record) is reused only if it is the run asked for (a changed
    # preset or option would otherwise be compared under the old settings), and an RLEP arm
    # still to run needs its seed's pool or the baseline's checkpoint to collect it: both
    # checked before anything runs.
    for seed in args.seeds:
        seed_dir = out / f"seed-{seed}"
        for arm in args.arms:
            run_dir = finished_run(out, record, seed, arm)
            if run_dir is not None:
                check_reuse(cfg, out, seed, arm, run_dir)
        rlep_to_run = [arm for arm in args.arms if ARMS[arm]["algorithm.name"] == "rlep" and finished_run(out, record, seed, arm) is None]
        pool_kept = (seed_dir / POOL_FILES[-1]).is_file() or (record is not None and (record / seed_dir.name / POOL_FILES[-1]).is_file())
        baseline = finished_run(out, record, seed, "baseline")
        if rlep_to_run and not pool_kept and baseline is not None and baseline.parent != seed_dir:
            raise ConfigError(f"{rlep_to_run[0]} for seed {seed}: its baseline is only recorded ({baseline}), without "
                              f"its checkpoint or the seed's pool ({record / seed_dir.name / POOL_FILES[0]}): remove "
                              "that record to run the seed's baseline again")
    out.mkdir(parents=True, exist_ok=True)
    (out / "study-args.json").write_text(json.dumps({"argv": argv if argv is not None else sys.argv[1:]}, indent=2))

    def log(line: str) -> None:
        print(line, flush=True)

    def run(seeded: Config, seed: int, arm: str) -> None:
        """Run one arm for one seed (continuing a stopped run), unless it is recorded; keep its record."""
        seed_dir = out / f"seed-{seed}"
        if finished_run(out, record, seed, arm) not in (None, seed_dir / arm):
            log(f"== seed {seed}: {arm} is recorded in {record} ==")
            return
        log(f"== seed {seed}: {arm} ==")
        run_stage(arm_config(seeded, arm, seed_dir, finished_run(out, record, seed, "baseline")), resume=True, log=log)
        if record is not None:
            keep_record(RECORD_FILES, seed_dir / arm, record / seed_dir.name / arm)

    start = time.monotonic()
    for seed in args.seeds:
        seeded, seed_dir = seed_config(cfg, out, seed), out / f"seed-{seed}"
        run(seeded, seed, "baseline")
        for arm in args.arms:
            if arm == "baseline":
                continue
            if ARMS[arm]["algorithm.name"] == "rlep" and finished_run(out, record, seed, arm) is None:
                seed_pool(seeded, seed_dir, record, log)
            run(seeded, seed, arm)
            report(out, args.arms, args.seeds, args.preset, log, record)
        if record is not None and (seed_dir / POOL_FILES[-1]).is_file():
            keep_record(POOL_FILES, seed_dir, record / seed_dir.name)  # for arms still to come, elsewhere
    summary = report(out, args.arms, args.seeds, args.preset, log, record)
    log(f"study folder: {out} ({(time.monotonic() - start) / 60:.1f} min this time)")
    return summary


if __name__ == "__main__":
    main()
