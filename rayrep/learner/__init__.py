"""The learners: FSDP2 / DeepSpeed workers training one policy (`group.LearnerGroup`)."""

from pathlib import Path


class LearnerDied(RuntimeError):
    """A learner actor died: the run stopped with its checkpoints intact
    (`rayrep.train.train_resuming` continues it from the latest). Light to import: jobs catch it."""

    def __init__(self, message: str, run_dir: Path):
        super().__init__(message)
        self.run_dir = run_dir
