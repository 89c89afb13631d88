"""Answers in turns with a tool: how a policy's turn calls a tool, how the tool's output
joins the answer, and who runs the calls.

A rollout with a tool is one answer written in turns. The policy writes a turn until it
ends its message (its end-of-sequence token, or the call's closing markup where that is one
token); a turn that holds a call (`ToolFormat.call`: the text between the call markup, by
default ``<tool_call>...</tool_call>``) has it run, and the tool's output joins the answer
as the chat template frames a tool message after an assistant one, up to the generation
prompt of the next assistant turn. Those tokens are the tool's (`Rollout.tool_mask`): the
policy reads them and is never trained on them. The answer ends at a turn without a call,
at its last turn (`tools.max_turns`: a call there is not run), or at the response token
budget, which the whole answer shares, the tool's tokens included.

The calls run elsewhere (`ToolRunner`): on the tool group's actors, each in a sandbox, while
the engine goes on decoding the other answers (`rayrep.generator.engine.sample_as_finished`).
A call's output joins its answer a fixed number of engine steps later (`Turns.join_after`),
not when it happens to arrive: answers depend on their seeds and the tools' outputs, never
on how long a tool took (a resumed run, a replaced generator repeat them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

from rayrep.models.tool_format import ToolFormat


class ToolResult(NamedTuple):
    """What one call gave: its output (an error's message, for a call that failed), and how."""

    output: str
    status: str = "ok"
    """'ok', 'error' (the tool raised, or gave no text), 'timeout', or 'lost' (its worker died
    twice: the answer ends, scored wrong)."""
    seconds: float = 0.0
    retried: int = 0
    """1: asked again of another worker, its first having died."""


class ToolRunner(Protocol):
    """Who runs the calls of a generate call while the engine decodes."""

    def submit(self, key: Hashable, call: str) -> None:
        """Start running `call`; its result is asked for under `key` (`collect`)."""

    def collect(self, keys: list[Hashable]) -> dict[Hashable, ToolResult]:
        """The results of these calls, waiting for those not done yet."""


class FunctionTools:
    """Calls run here, one at a time, by a function (`call -> ToolResult`): for sampling in
    one process (the tests of the turn loop), where no tool group runs."""

    def __init__(self, function: Callable[[str], ToolResult]):
        self.function = function
        self.results: dict = {}

    def submit(self, key: Hashable, call: str) -> None:
        start = time.perf_counter()
        result = self.function(call)
        self.results[key] = result._replace(seconds=time.perf_counter() - start)

    def collect(self, keys: list[Hashable]) -> dict[Hashable, ToolResult]:
        return {key: self.results.pop(key) for key in keys}


class ActorTools:
    """Calls run on the tool group's actors (each with a `run(calls) -> [ToolResult]` method),
    taken in turn; a call whose actor died is asked once more of the next live one (its
    result `retried`), and is 'lost' when that one dies too."""

    def __init__(self, workers: list):
        self.workers = list(workers)
        self.next = 0
        self.dead: set[int] = set()
        self.running: dict = {}
        """key -> (call, the worker's index, its ref)."""

    def _send(self, call: str) -> tuple[int, object]:
        live = [i for i in range(len(self.workers)) if i not in self.dead] or list(range(len(self.workers)))
        index = live[self.next % len(live)]
        self.next += 1
        return index, self.workers[index].run.remote([call])

    def submit(self, key: Hashable, call: str) -> None:
        self.running[key] = (call, *self._send(call))

    def collect(self, keys: list[Hashable]) -> dict[Hashable, ToolResult]:
        import ray
        from ray.exceptions import RayActorError

        results = {}
        for key in keys:
            call, index, ref = self.running.pop(key)
            try:
                [results[key]] = ray.get(ref)
                continue
            except RayActorError:
                self.dead.add(index)
            index, ref = self._send(call)
            try:
                [result] = ray.get(ref)
            except RayActorError as err:
                self.dead.add(index)
                result = ToolResult(f"the tool's worker died twice ({type(err).__name__})", "lost")
            results[key] = result._replace(retried=1)
        return results


@dataclass
class Turns:
    """What a generate call needs to sample answers in turns."""

    format: ToolFormat
    runner: ToolRunner
    max_turns: int
    tokenizer: object
    join_after: int = 2
    """A call's output joins its answer this many engine steps after the step that ended the
    call's turn (the engine decodes the other answers meanwhile), waiting for it there if
    the tool is slower: so the engine runs the same steps, and the answers are the same,
    however long each call takes."""

    def output_ids(self, output: str, last_token: int | None) -> list[int]:
        return self.format.output_ids(self.tokenizer, output, last_token)


def turns_taken(tool_mask: np.ndarray | None) -> int:
    """How many turns of the policy an answer's tokens so far began (1 + its tools' outputs)."""
    if tool_mask is None or not len(tool_mask):
        return 1
    starts = np.flatnonzero(tool_mask[1:] & ~tool_mask[:-1])
    return 1 + len(starts) + int(tool_mask[0])


def current_turn(tool_mask: np.ndarray | None) -> int:
    """Where an answer's current turn begins: after its last tool output (0 without one)."""
    if tool_mask is None or not tool_mask.any():
        return 0
    return int(np.flatnonzero(tool_mask)[-1]) + 1
