"""Turns on the GPUs: what moves where at each hand-over of a run, asked in one place.

Colocated (`placement.takes_turns`), a learner rank and an engine worker share each GPU and
take turns (`SharedGpus`): the engines sleep while the learners update, the learners' state
leaves for host memory while the engines sample, in the order the memory plan's timeline
gives (`rayrep.cluster.memory.timeline`). Elsewhere (disaggregated GPUs, CPU runs) each role
keeps its devices and a hand-over moves nothing (`OwnDevices`); it makes no call either: a
call would wait behind the generators' work in flight (asynchronous rollouts).

The runtime (`rayrep.roles.system.Runtime`) calls the same methods in either case and
reports the transitions both share; each of these methods reports those of its own moves
(`observe`, the device-memory ledger's view).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from rayrep.cluster.memory import RunPhase
from rayrep.generator.group import GeneratorGroup
from rayrep.learner.group import LearnerGroup


class Turn(Enum):
    """Whose turn it is on shared GPUs."""

    GENERATORS = "generators"
    LEARNERS = "learners"
    SYNC = "sync"
    """The weights moving from the learners to the engines."""


class OwnDevices:
    """Each role on devices of its own: nothing moves at a hand-over."""

    takes_turns = False

    def to_learners(self) -> None:
        """Before the update."""

    def to_sync(self) -> None:
        """Between the update and the weight sync."""

    def after_failed_sync(self) -> None:
        """A generator died in the sync: before its replacement starts."""

    def before_rebuild(self) -> None:
        """Before the weight sync is rebuilt for a replacement generator."""

    def after_replacement(self) -> None:
        """Once the weights reached the replacement."""

    def after_save(self) -> None:
        """After a checkpoint was written."""

    def to_generators(self) -> None:
        """After the weight sync."""


class SharedGpus(OwnDevices):
    """A learner rank and an engine worker on each GPU, taking turns."""

    takes_turns = True

    def __init__(self, generators: GeneratorGroup, learners: LearnerGroup, observe: Callable[[RunPhase], None],
                 keep_engine_weights: bool):
        """`keep_engine_weights`: sleeping engines keep their weights in host memory (a LoRA
        run's syncs send the adapter alone, so base weights dropped would never come back)."""
        self.generators, self.learners, self.observe = generators, learners, observe
        self.keep_engine_weights = keep_engine_weights
        self.turn = Turn.GENERATORS

    def to_learners(self) -> None:
        """The engines sleep (dropping their weights, which the sync after the update
        overwrites), then the learners bring their state back."""
        self.generators.sleep(keep_weights=self.keep_engine_weights)
        self.observe(RunPhase.GENERATE)
        self.learners.onload()
        self.observe(RunPhase.HAND_OVER)
        self.turn = Turn.LEARNERS

    def to_sync(self) -> None:
        """The optimizer state leaves the GPU: the sync needs the parameters alone, and the
        room for the engines' weights."""
        self.learners.offload(parameters=False)
        self.observe(RunPhase.UPDATE)
        self.turn = Turn.SYNC

    def after_failed_sync(self) -> None:
        """A new engine starts awake on its GPU: the learners' state leaves first."""
        self.learners.offload()

    def before_rebuild(self) -> None:
        """The engines sleep for the rebuilt sync: it overwrites every weight."""
        self.generators.sleep(keep_weights=self.keep_engine_weights)
        self.observe(RunPhase.REPLACEMENT)

    def after_replacement(self) -> None:
        """The engines wake again if it was their turn."""
        if self.turn == Turn.GENERATORS:
            self.generators.wake_up()

    def after_save(self) -> None:
        """In the engines' turn: the learners' allocator cache is released after it (DeepSpeed
        gathers each fp32 master on the GPU)."""
        self.learners.offload()

    def to_generators(self) -> None:
        """After the sync (which woke the engines' weights): the learners' parameters leave the
        GPU and the engines take their KV cache back."""
        self.learners.offload()
        self.observe(RunPhase.SYNC)
        self.generators.wake_up()
        self.turn = Turn.GENERATORS
