"""The comparison pipeline behind `jobs/rlep.py` and `jobs/exgrpo.py`: a replay method
against the GRPO/DAPO baseline on the same budget.

1. the baseline trains from the base policy (or a finished baseline run is reused);
2. for RLEP, the baseline's final checkpoint samples the experience pool (or a pool is given);
3. the replay method trains from the base policy with the same budget;
4. both runs' test accuracy curves go into a plot, a JSON file and a table: each run's
   peak and final test pass@1, and the step at which the method first reaches the
   baseline's peak.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rayrep.algos.registry import ALGORITHMS, GRPO
from rayrep.buffer.files import check_pool_file
from rayrep.config import Config, ConfigError, InputError, differing_fields
from rayrep.eval.evaluate import evaluate_checkpoint
from rayrep.stats.study import compare_runs, comparison_table
from rayrep.pipelines.collect import collect_pool
from rayrep.pipelines.summary import PAGE, PLOT, RECORD, eval_table, pipeline_record, render
from rayrep.plots import plot_curves
from rayrep.run.lifecycle import RunResult
from rayrep.run.checkpoints import latest_checkpoint
from rayrep.run.layout import RunFolder
from rayrep.run.log import keep_metrics_until
from rayrep.train import train_resuming


def checkpoint_evals(checkpoint: str, cfg: Config) -> list[dict]:
    """The test-set eval curve of the run that wrote `checkpoint` (its `evals.json`), or, for
    a checkpoint from elsewhere, one evaluation of it (a curve of one point)."""
    evals_file = RunFolder.of_checkpoint(checkpoint).evals
    if evals_file.is_file():
        return json.loads(evals_file.read_text())
    metrics = evaluate_checkpoint(cfg, checkpoint)
    return [{"step": cfg.run.steps, **{f"test_{k}": v for k, v in metrics.items() if "@" in k}}]


def compare_with_baseline(
    cfg: Config,
    method: str,
    out: Path,
    baseline_checkpoint: str | None = None,
    pool: str | None = None,
    log=print,
    resume: bool = False,
    restarts: int = 0,
) -> dict:
    """Run the pipeline into `out` and return the comparison (also written to
    `out/comparison.json`, with the plot beside it). `cfg` holds the method's settings;
    the baseline run takes the same config with `algorithm.name = "grpo"`: the same
    advantage, loss and schedule, so the comparison isolates replay (against ExGRPO, the
    paper's on-policy baseline with its Dr.GRPO advantage).

    `resume`: continue a stopped pipeline in `out` at the stage it stopped: a finished run is
    reused, a stopped one resumes from its latest checkpoint, a written pool is kept.
    `restarts`: how many times a training stage whose learner died continues on its own
    (`rayrep.train.train_resuming`)."""
    # What is given on the command line is checked before any stage starts.
    if cfg.replay.pool:
        raise InputError(f"replay.pool={cfg.replay.pool!r}: this pipeline compares runs of their own buffers; to "
                         f"replay a shared pool, train with jobs/train.py --algorithm.name {method} --replay.pool {cfg.replay.pool}")
    if baseline_checkpoint and not (Path(baseline_checkpoint) / "config.json").is_file():
        raise InputError(f"baseline checkpoint {baseline_checkpoint}: not a checkpoint folder (no config.json in it)")
    if pool:
        check_pool_file(pool)
    start = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    cfg = cfg.replace(**{"logging.out_dir": str(out)})
    RunFolder(out).config.write_text(cfg.to_json())  # what `--resume <out>` starts from
    algorithm = ALGORITHMS[method]
    label, stages = algorithm.label, 4 if algorithm.pool_from_baseline else 3
    method_cfg = cfg.replace(**{"algorithm.name": method, "logging.run_name": method})
    if baseline_checkpoint:
        checkpoint, base_evals = baseline_checkpoint, checkpoint_evals(baseline_checkpoint, cfg)
    else:
        log(f"== 1/{stages} baseline ({GRPO.label}) ==")
        baseline = run_stage(cfg.replace(**{"algorithm.name": GRPO.name, "logging.run_name": "baseline"}), resume, log, restarts)
        checkpoint, base_evals = baseline.final_checkpoint, baseline.evals
        # Both start from the base policy and evaluate the same draws: one step-0 evaluation.
        method_cfg = method_cfg.replace(**{"run.start_eval": str(baseline.run_dir)})

    comparison: dict = {}
    if algorithm.pool_from_baseline:
        if not pool and resume and (out / "pool.json").is_file():  # written after its pool: both complete
            pool = json.loads((out / "pool.json").read_text())["pool"]
            log(f"== 2/{stages} experience pool: {pool}, collected before ==")
        if not pool:
            log(f"== 2/{stages} experience pool from {checkpoint} ==")
            stats = collect_pool(cfg, checkpoint, out / "pool.parquet", log=log)
            pool = stats["pool"]
            (out / "pool.json").write_text(json.dumps(stats, indent=2))
        method_cfg = method_cfg.replace(**{"algorithm.rlep.pool": str(pool)})
        comparison["pool"] = str(pool)

    log(f"== {stages - 1}/{stages} {label} from the base policy ==")
    run = run_stage(method_cfg, resume, log, restarts)

    log(f"== {stages}/{stages} comparison ==")
    comparison.update(compare_runs(base_evals, run.evals))
    plot = plot_curves({f"baseline ({GRPO.label})": base_evals, label: run.evals}, out / PLOT,
                       title=f"{label} vs baseline, {cfg.model.path} policy")
    comparison.update({"plot": str(plot), "minutes": round((time.monotonic() - start) / 60, 1)})
    (out / "comparison.json").write_text(json.dumps(comparison, indent=2))
    # The whole pipeline as one record, and as the README shows such a record (`summary`).
    record = pipeline_record(out, cfg, ("baseline", method), label, {"baseline": base_evals, method: run.evals},
                             comparison)
    (out / RECORD).write_text(json.dumps(record, indent=1) + "\n")
    (out / PAGE).write_text(render(record))
    log(comparison_table(("baseline", label), comparison))
    log("\n".join(eval_table(record)))
    log(f"plot: {plot}\nresults: {out / PAGE}\npipeline folder: {out} ({comparison['minutes']} min)")
    return comparison


def run_stage(cfg: Config, resume: bool, log=print, restarts: int = 0):
    """One training stage of the pipeline; resuming, a finished run is reused (when it ran
    with these settings: `check_finished_run`) and a stopped one continues from its latest
    checkpoint under these settings, as `--resume` does (one stopped before its first
    checkpoint starts over)."""
    folder = RunFolder.of(cfg)
    if resume:
        if folder.finished():
            check_finished_run(cfg, folder.path)
            log(f"{folder.path}: finished before, reused")
            return RunResult(folder.path, str(folder.final), json.loads(folder.evals.read_text()))
        if latest_checkpoint(folder.path) is not None:
            return train_resuming(cfg, log=log, resume=True, restarts=restarts)
        keep_metrics_until(folder.metrics, -1)  # a start that saved nothing: start over
    return train_resuming(cfg, log=log, restarts=restarts)


def check_finished_run(cfg: Config, run_dir: Path) -> None:
    """A finished run stands for the run `cfg` asks for only if it ran with the same settings
    (its `config.json`); refused with the first field that differs. Fields that cannot have
    changed what it did may differ: its logging settings, `run.start_eval` (which only spares
    the step-0 evaluation), and the sections of other algorithms (`algorithm.exgrpo.*` for
    an RLEP run)."""
    try:
        saved = json.loads(RunFolder(run_dir).config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{run_dir}: a finished run without a readable config.json ({err})") from None

    def matters(name: str) -> bool:
        section = name.split(".")
        other_algorithm = section[0] == "algorithm" and len(section) > 2 and section[1] != cfg.algorithm.name
        return not (other_algorithm or section[0] == "logging" or name == "run.start_eval")

    differences = differing_fields(saved, json.loads(cfg.to_json()), keep=matters)
    if differences:
        name, there, here = differences[0]
        raise ConfigError(f"{run_dir} finished with {name} = {there!r}, not the {here!r} asked for now: remove "
                          "that folder to run it again with these settings, or write to another folder")
