"""Run checkpoints: everything a run needs to continue exactly where it stopped.

    <run>/checkpoints/step-<N>/     one complete checkpoint after step N
        config.json, model.safetensors, tokenizer files   the policy (a Hugging Face checkpoint)
        learner/rank-<r>-of-<W>.safetensors                fp32 masters and AdamW moments, by rank
        buffer/answers.parquet, questions.parquet          the replay buffer (replay methods)
        run_state.json                                     step, policy version, sampler position,
                                                           random state, algorithm state, evaluations
    <run>/checkpoints/final -> step-<last>                 the end of the run (a link)

A checkpoint is written in `.step-<N>.partial` and renamed into place when complete, so
every `step-<N>` folder is complete: a process killed mid-save leaves the previous ones as
they were, and the next save or resume sweeps the partial folder away. Nothing in a
checkpoint is pickled: safetensors, Parquet and JSON only. The learner files hold each
rank's shards and load into a learner group of any size.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rayrep.algos.interface import Algorithm
from rayrep.buffer.replay import ReplayStore
from rayrep.config import Config
from rayrep.config.strategies import SHARDING_STRATEGIES
from rayrep.data import PromptSampler
from rayrep.errors import InputError
from rayrep.run.layout import STATE_FILE, RunFolder
from rayrep.run.record import StepRecord
from rayrep.roles.system import Runtime

FORMAT = 1


@dataclass
class RunState:
    """What a run's driver holds besides the actors' state."""

    step: int
    policy_version: int
    sampler: dict
    """`PromptSampler.state()`: epoch, position, and the retired questions (those the epoch
    under way leaves out, and all)."""
    buffer_rng: list | None
    """The replay buffer client's random state (`random.Random.getstate()` as JSON), or None."""
    algorithm: dict
    """`algorithm.state()`: e.g. ExGRPO's one-way switch."""
    evals: list[dict]
    learner: dict | None
    """The learner checkpoint's shared state (None: the strategy keeps none, weights only)."""
    config: dict = field(default_factory=dict)
    format: int = FORMAT


def rng_state(rng: random.Random) -> list:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def set_rng_state(rng: random.Random, state: list) -> None:
    version, internal, gauss = state
    rng.setstate((version, tuple(internal), gauss))


def checkpoints_dir(run_dir: Path) -> Path:
    return RunFolder(Path(run_dir)).checkpoints


def step_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """The complete step checkpoints of a run, oldest first."""
    return RunFolder(Path(run_dir)).step_checkpoints()


def latest_checkpoint(run_dir: Path) -> Path | None:
    return RunFolder(Path(run_dir)).newest_checkpoint()


def read_run_state(checkpoint: Path) -> RunState:
    """A checkpoint's run state, or an InputError naming the file and what is wrong."""
    path = Path(checkpoint) / STATE_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as err:  # ValueError: bad UTF-8, bad JSON, huge numbers
        raise InputError(f"{path}: not a readable run state ({err})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise InputError(f"{path}: run-state format {data.get('format') if isinstance(data, dict) else None!r}, "
                         f"this version reads format {FORMAT}")
    try:
        return RunState(**data)
    except TypeError as err:
        raise InputError(f"{path}: {err}") from None


def begin_save(run_dir: Path, step: int) -> Path:
    """A fresh partial folder for the checkpoint of `step` (earlier partial ones removed)."""
    sweep_partial(run_dir)
    partial = checkpoints_dir(run_dir) / f".step-{step}.partial"
    partial.parent.mkdir(parents=True, exist_ok=True)
    return partial


def finish_save(partial: Path, state: RunState, keep: int) -> Path:
    """Write the run state last, make the checkpoint current by renaming it into place, and
    prune: the newest `keep` step checkpoints stay (0: all), and always the final one."""
    (partial / STATE_FILE).write_text(json.dumps(asdict(state), indent=1))
    _sync(partial)
    if os.environ.get("RAYREP_FAILPOINT") == f"save-{state.step}":  # tests: die with the checkpoint all but done
        os.kill(os.getpid(), signal.SIGKILL)
    target = partial.parent / f"step-{state.step}"
    if target.exists():  # the same step saved again (a resumed run's end): replaced whole
        shutil.rmtree(target)
    os.replace(partial, target)
    _sync(partial.parent)
    if keep:
        final = final_target(partial.parent.parent)
        for _, old in step_checkpoints(partial.parent.parent)[:-keep]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    return target


def link_files(source: Path, target: Path) -> None:
    """`source`'s files in `target` as hard links (copies where the file system has none):
    a checkpoint takes the run's latest buffer snapshot without writing it again; the
    snapshot's next write replaces its files (new ones, renamed in), never the linked ones."""
    target.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.iterdir()):
        if path.is_file():
            try:
                os.link(path, target / path.name)
            except OSError:
                shutil.copy2(path, target / path.name)


def mark_final(run_dir: Path, checkpoint: Path) -> Path:
    """Point `<run>/checkpoints/final` at `checkpoint` (atomically: a new link renamed over the old)."""
    final = RunFolder(Path(run_dir)).final
    link = final.with_name(".final.link")
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(checkpoint.name)
    if final.is_dir() and not final.is_symlink():  # a folder from an older version
        shutil.rmtree(final)
    os.replace(link, final)
    return final


def final_target(run_dir: Path) -> Path | None:
    final = RunFolder(Path(run_dir)).final
    return final.resolve() if final.is_symlink() else None


def sweep_partial(run_dir: Path) -> None:
    """Remove what a save killed half-way left behind."""
    folder = checkpoints_dir(run_dir)
    if folder.is_dir():
        for entry in folder.glob(".step-*"):  # partial folders and the policy's staging ones
            shutil.rmtree(entry, ignore_errors=True)


def _sync(path: Path) -> None:
    """Flush a folder's entries to disk, so that a rename after it is not reordered before it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------- a run's save and restore


def resumable(cfg: Config) -> bool:
    """Whether the learners' strategy keeps a checkpoint of its optimizer state (FSDP2 does;
    with DeepSpeed a run's checkpoints hold the policy weights and the driver's state only)."""
    return cfg.learner.sharding.resumable


def resume_point(cfg: Config, folder: RunFolder) -> tuple[Path, RunState]:
    """The latest complete checkpoint of the run and its state, or an InputError that says
    why the run cannot be resumed (checked before anything starts)."""
    checkpoint = latest_checkpoint(folder.path)
    if checkpoint is None:
        raise InputError(f"{folder.path}: no complete checkpoint to resume from (checkpoints/step-<N>)")
    state = read_run_state(checkpoint)
    if state.learner is None or not resumable(cfg):
        keeping = " or ".join(repr(s.name) for s in SHARDING_STRATEGIES.values() if s.resumable)
        raise InputError(f"{checkpoint}: resuming needs the learners' optimizer state, which only "
                         f"learner.strategy={keeping} keeps (this run's or the checkpoint's does not)")
    if state.step > cfg.run.steps:
        raise InputError(f"{checkpoint} is at step {state.step}, beyond run.steps={cfg.run.steps}")
    saved_algorithm = state.config.get("algorithm", {}).get("name")
    if saved_algorithm != cfg.algorithm.name:
        raise InputError(f"{checkpoint} is a {saved_algorithm!r} run; this config's algorithm.name is {cfg.algorithm.name!r}")
    return checkpoint, state


class BufferSnapshots:
    """The replay buffer's latest snapshot in `<run>/replay`: what a shard that dies comes back
    with, taken every `replay.snapshot_every` steps and with every checkpoint (not written
    again when nothing changed). Nothing to do for a run without a buffer."""

    def __init__(self, buffer: ReplayStore | None, folder: RunFolder, every: int):
        # A store that keeps itself (a named pool the run is attached to) is snapshotted
        # nothing of by the run, which counts its shards' restarts from their answers.
        self.buffer, self.folder, self.every = buffer, folder, every
        self.keeps = buffer is not None and buffer.keeps_snapshots

    def take(self) -> None:
        if self.keeps and (self.buffer.changed or self.buffer.restore_point != self.folder.replay):
            self.buffer.snapshot(self.folder.replay)

    def after_step(self, step: int, record: StepRecord) -> None:
        """The scheduled snapshot, and the count of shards that died this step (`replay_shard_*`)."""
        if self.buffer is None:
            return
        if self.keeps and self.every and step % self.every == 0:
            with record.timed("snapshot"):
                self.take()
        record.count(self.buffer.take_counts())


def save_run(cfg: Config, folder: RunFolder, step: int, runtime: Runtime, algorithm: Algorithm,
             sampler: PromptSampler, snapshots: BufferSnapshots, evals: list[dict]) -> Path:
    """The checkpoint of `step`: the policy (a Hugging Face checkpoint), the learners' state
    (where the strategy keeps one), the buffer (its latest snapshot, linked) and the driver's
    state. Complete or absent (see the module's docstring)."""
    partial = begin_save(folder.path, step)
    learner = runtime.save_learners(str(partial), state=resumable(cfg))
    if snapshots.keeps:
        snapshots.take()
        link_files(folder.replay, partial / "buffer")
    return finish_save(partial, RunState(
        step=step, policy_version=runtime.version, sampler=sampler.state(),
        buffer_rng=rng_state(runtime.buffer.rng) if runtime.buffer is not None else None,
        algorithm=algorithm.state(), evals=evals, learner=learner, config=cfg.to_dict(),
    ), cfg.run.keep_checkpoints)


def restore_run(checkpoint: Path, state: RunState, runtime: Runtime, algorithm: Algorithm) -> None:
    """The learners', buffer's and algorithm's state of `checkpoint` (the sampler's and the
    evaluations' are restored before anything starts; the generators start from its weights)."""
    runtime.restore_learners(str(checkpoint / "learner"), state.learner)
    if runtime.buffer is not None:
        runtime.buffer.resume(checkpoint / "buffer")  # (a shared pool went on without this run)
        set_rng_state(runtime.buffer.rng, state.buffer_rng)
    algorithm.load_state(state.algorithm)
