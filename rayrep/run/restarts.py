"""What happens when a learner dies: its state (a shard of the weights and optimizer) dies
with it, so the run stops with its checkpoints intact (`LearnerDied`, naming what died, the
checkpoint left and how to resume); a job given `--auto-resume N` continues from that
checkpoint on its own, up to N times (`restarting`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rayrep.config import Config
from rayrep.learner import LearnerDied
from rayrep.run.checkpoints import latest_checkpoint, resumable
from rayrep.run.layout import RunFolder
from rayrep.run.log import keep_metrics_until
from rayrep.roles.system import Runtime


def learner_death(runtime: Runtime, folder: RunFolder, step: int, saved: Path | None) -> LearnerDied | None:
    """The report of the learners that died in step `step` (None when all live), with the
    run's latest checkpoint `saved` and how to continue from it."""
    dead = runtime.learners.dead() if runtime.learners is not None else {}
    if not dead:
        return None
    ranks = "; ".join(f"learner rank {rank} died ({why})" for rank, why in sorted(dead.items()))
    return LearnerDied(
        f"{ranks}: the run stopped in step {step}. Its latest complete checkpoint is "
        f"{saved or 'none yet'}; continue with --resume {folder.path} (a pipeline: --resume <its folder>), "
        "or give the job --auto-resume to restart on its own", folder.path)


def restarting(train: Callable[[Config, bool], object], cfg: Config, log=print, resume: bool = False,
               restarts: int = 0):
    """`train(cfg, resume)`, started again when a learner dies, up to `restarts` times: from
    the run's latest complete checkpoint (as `resume` does), or from the beginning when it has none."""
    attempt = 0
    while True:
        try:
            return train(cfg, resume)
        except LearnerDied as death:
            attempt += 1
            if attempt > restarts:
                raise
            # The same run folder again (a run named by its start time would get a new one).
            cfg = cfg.replace(**{"logging.out_dir": str(death.run_dir.parent), "logging.run_name": death.run_dir.name})
            latest = latest_checkpoint(death.run_dir)
            resume = latest is not None and resumable(cfg)
            if not resume:
                keep_metrics_until(RunFolder(death.run_dir).metrics, -1)  # it starts over
            log(f"{death}\nrestart {attempt} of {restarts}: "
                f"{'from ' + latest.name if resume else 'from the beginning (no checkpoint to resume from)'}")
