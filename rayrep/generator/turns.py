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
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

from rayrep.errors import InputError

TRUNCATED = " [output truncated]"
"""What ends a tool's output that was cut at `tools.max_output_chars`."""

_PROBE = ("Q", "X", "\x00tool-output\x00")
"""A user message, an assistant message and a tool output the template is rendered with, to
read how it frames a tool message (`ToolFormat.of`)."""


@dataclass(frozen=True)
class ToolFormat:
    """How a policy's turns call a tool and read its output: the call's markup, and the text
    around a tool's output (read from the policy's chat template)."""

    call_start: str
    call_end: str
    head: str
    """The text between the end of the policy's turn and the tool's output: the rest of the
    template's closing of an assistant message, and its opening of a tool message."""
    tail: str
    """The text after the tool's output: its closing of the tool message and the next
    assistant turn's generation prompt."""
    max_output_chars: int
    stop_token: int | None = None
    """The call's closing markup as one token of the vocabulary, which ends a turn (sampling
    stops there); None: a turn ends where the policy ends its message."""

    @classmethod
    def of(cls, tokenizer, call_start: str, call_end: str, max_output_chars: int, name: str = "the policy") -> "ToolFormat":
        """The format of `tokenizer`'s chat template (an InputError, naming `name`, when the
        template has no tool role, or renders a tool message other than as an addition to
        the conversation before it)."""
        if not call_start or not call_end:
            raise InputError("tools.call_start and tools.call_end must both be set: the markup around a tool call")
        question, answer, output = _PROBE
        conversation = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]

        def render(messages, prompt: bool) -> str:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)

        if getattr(tokenizer, "chat_template", None) is None:
            raise InputError(f"{name}'s tokenizer has no chat template: a tool's output joins an answer as the chat "
                             "template frames a tool message")
        before = render(conversation, False)
        try:
            after = render(conversation + [{"role": "tool", "content": output}], True)
        except Exception as err:  # (a template that raises on a role it does not know)
            raise InputError(f"{name}'s chat template has no tool role ({type(err).__name__}: {err}): a tool's output "
                             "joins an answer as a tool message") from None
        as_other = [render(conversation + [{"role": role, "content": output}], True) for role in ("assistant", "user")]
        if output not in after or after in as_other:
            raise InputError(f"{name}'s chat template has no tool role: it renders a tool message as "
                             f"{'nothing' if output not in after else 'another role'}'s (a tool's output joins an answer "
                             "as a tool message)")
        if not after.startswith(before) or answer not in before:
            raise InputError(f"{name}'s chat template renders a tool message other than after the conversation "
                             "before it: rayrep cannot append a tool's output to an answer with it")
        closing = before[before.rindex(answer) + len(answer):]
        head, tail = after[len(before):].split(output, 1)
        end_ids = tokenizer(call_end, add_special_tokens=False)["input_ids"]
        return cls(call_start, call_end, closing + head, tail, max_output_chars,
                   stop_token=end_ids[0] if len(end_ids) == 1 else None)

    def call(self, turn: str) -> str | None:
        """The first complete call in a turn's text (what is between its markup), or None."""
        start = turn.find(self.call_start)
        if start < 0:
            return None
        end = turn.find(self.call_end, start + len(self.call_start))
        return None if end < 0 else turn[start + len(self.call_start) : end]

    def output_text(self, output: str, turn_end: str) -> str:
        """The text a tool's `output` joins the answer as, after a turn whose last token reads
        `turn_end` (the end-of-sequence token the template's closing starts with is the
        policy's own already)."""
        if len(output) > self.max_output_chars:
            output = output[: self.max_output_chars] + TRUNCATED
        head = self.head[len(turn_end):] if turn_end and self.head.startswith(turn_end) else self.head
        return head + output + self.tail

    def framing_tokens(self, tokenizer) -> int:
        """Tokens of the framing of an empty output: the least a tool's turn adds."""
        return len(tokenizer(self.head + self.tail, add_special_tokens=False)["input_ids"])


class ToolResult(NamedTuple):
    """What one call gave: its output (an error's message, for a call that failed), and how."""

    output: str
    status: str = "ok"
    """'ok', 'error' (the tool raised, or gave no text), 'timeout', or 'lost' (its worker died
    twice: the answer ends, scored wrong)."""
    seconds: float = 0.0


class ToolRunner(Protocol):
    """Who runs the calls of a generate call, without holding up the engine."""

    def submit(self, key: Hashable, call: str) -> None:
        """Run `call`; its result comes back under `key` (`finished`)."""

    def finished(self, wait: bool) -> list[tuple[Hashable, ToolResult]]:
        """The calls finished since the last time; with `wait`, at least one (if any runs)."""

    def running(self) -> int:
        """Calls submitted and not yet returned by `finished`."""


class FunctionTools:
    """Calls run here, one at a time, by a function (`call -> ToolResult`): for sampling in
    one process (the tests of the turn loop), where no tool group runs."""

    def __init__(self, function: Callable[[str], ToolResult]):
        self.function = function
        self.done: deque = deque()

    def submit(self, key: Hashable, call: str) -> None:
        start = time.perf_counter()
        result = self.function(call)
        self.done.append((key, result._replace(seconds=time.perf_counter() - start)))

    def finished(self, wait: bool) -> list[tuple[Hashable, ToolResult]]:
        done, self.done = list(self.done), deque()
        return done

    def running(self) -> int:
        return len(self.done)


class ActorTools:
    """Calls run on the tool group's actors (each with a `run(calls) -> [ToolResult]` method),
    taken in turn; a call whose actor died is asked once more of the next one, and is
    'lost' when that one dies too. Results are gathered as they arrive (`ray.wait`)."""

    def __init__(self, workers: list):
        self.workers = list(workers)
        self.next = 0
        self.waiting: dict = {}
        """ref -> (key, call, tries so far)."""
        self.lost_workers: set[int] = set()

    def submit(self, key: Hashable, call: str, tries: int = 0) -> None:
        worker = self.workers[self.next % len(self.workers)]
        self.next += 1
        self.waiting[worker.run.remote([call])] = (key, call, tries)

    def finished(self, wait: bool) -> list[tuple[Hashable, ToolResult]]:
        import ray
        from ray.exceptions import RayActorError

        if not self.waiting:
            return []
        ready, _ = ray.wait(list(self.waiting), num_returns=1 if wait else len(self.waiting), timeout=None if wait else 0)
        results = []
        for ref in ready:
            key, call, tries = self.waiting.pop(ref)
            try:
                [result] = ray.get(ref)
            except RayActorError as err:
                if tries == 0:
                    self.submit(key, call, tries=1)
                    continue
                result = ToolResult(f"the tool's worker died twice ({type(err).__name__})", "lost")
            results.append((key, result))
        return results

    def running(self) -> int:
        return len(self.waiting)


@dataclass
class Turns:
    """What a generate call needs to sample answers in turns."""

    format: ToolFormat
    runner: ToolRunner
    max_turns: int
    tokenizer: object

    def turn_end_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def output_ids(self, output: str, last_token: int | None) -> list[int]:
        text = self.format.output_text(output, self.turn_end_text(last_token) if last_token is not None else "")
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def turns_taken(tool_mask: np.ndarray | None) -> int:
    """How many turns of the policy an answer's tokens so far began (1 + its tools' outputs)."""
    if tool_mask is None or not len(tool_mask):
        return 1
    starts = np.flatnonzero(tool_mask[1:] & ~tool_mask[:-1]) if len(tool_mask) > 1 else np.empty(0)
    return 1 + len(starts) + int(tool_mask[0])


def current_turn(tool_mask: np.ndarray | None, length: int) -> int:
    """Where an answer's current turn begins: after its last tool output (0 without one)."""
    if tool_mask is None or not tool_mask.any():
        return 0
    return int(np.flatnonzero(tool_mask)[-1]) + 1 if length else 0
