"""Final answers of completions, and the guards that keep pathological text away from math-verify.

Pure Python, linear time, run in the caller's process: the final answer of a completion
is the content of its ``\\boxed{...}`` (several boxes are read together, as math-verify
reads them); without one, whatever math-verify extracts from the tail of the text (in the
sandbox, `rayrep.verifier.sandbox`). Answers
that are too long, nested too deeply or hold control characters are rejected here,
before any parser sees them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, NamedTuple

from rayrep.verifier.reward import Style, correctness_reward

Status = Literal["ok", "no_answer", "timeout", "error", "bad_value"]
"""ok: the answer was checked; no_answer: nothing to check; timeout: over the limit;
error: rejected by a guard, a resource limit, or a crash (a user's checker that raised);
bad_value: a user's checker returned something that is not a score."""

MAX_ANSWER_CHARS = 1000
"""Longer final answers (and ground truths) are rejected before the sandbox: real answers
are short, and parse time grows quickly with length."""

MAX_NESTING_DEPTH = 50
"""Deeper brace nesting is rejected before the sandbox: the LaTeX parser recurses per level."""

MAX_BOXES = 32
"""More boxed answers than this in one completion are rejected before the sandbox."""

TAIL_CHARS = 2000
"""Without a ``\\boxed{}``, only this much of the end of a completion goes to math-verify."""

BOXED = "\\boxed"
# A backslash escapes the next character, so `\{` and `\}` (literal braces, as in sets)
# do not open or close a group.
_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.DOTALL)
# C0/C1 control characters never appear in model text, but they do in decoded binary junk.
# Backspace, tab, newlines, vertical tab and form feed are allowed: datasets with broken
# escaping turn `\b`, `\t`, `\n`, `\v`, `\f`, `\r` of LaTeX commands into exactly those.
_CONTROL_CHARS = re.compile(r"[\x00-\x07\x0e-\x1f\x7f-\x9f]")


@dataclass(frozen=True)
class Verdict:
    """Outcome of checking one completion against one ground truth."""

    correct: bool
    status: Status
    answer: str | None = None
    """The final answer that was checked (box content or math-verify's extraction)."""
    detail: str = ""
    """Why, for statuses other than "ok"; meant for logs."""
    score: float | None = None
    """A user's checker's score; None for a checker that only judges (the reward is then
    the verdict's, in the run's style)."""
    components: tuple[tuple[str, float], ...] = ()
    """The named parts of its score, as logged: a user's checker's (`checker_<name>`), the
    format terms' (`format_<term>`)."""

    def reward(self, style: Style = "binary") -> float:
        """The reward this verdict earns: its checker's score, or for a verdict alone 1/0
        (``binary``) or +1/-1 (``dapo``)."""
        return correctness_reward(self.correct, style) if self.score is None else self.score


class _Box(NamedTuple):
    content: str
    depth: int
    """Brace nesting depth inside the box."""
    complete: bool
    """False when the content ran past the length limit before its closing brace."""


def _group_end(text: str, open_pos: int, stop: int) -> tuple[int, int] | None:
    """(index of the `}` closing the `{` at open_pos, max depth inside), or None if the
    group is still open at `stop`."""
    depth = 0
    max_depth = 0
    for token in _BRACE_TOKEN.finditer(text, open_pos, stop):
        brace = token.group()
        if brace == "{":
            depth += 1
            max_depth = max(max_depth, depth)
        elif brace == "}":
            depth -= 1
            if depth == 0:
                return token.start(), max_depth - 1
    return None


def _boxes(text: str, max_chars: int | None, limit: int) -> list[_Box]:
    """The ``\\boxed{...}`` groups of `text` that close, last first, at most `limit` of them,
    each scanned over at most max_chars of its content. An over-long box ends the list
    (as its last entry, `complete` False). Linear in the length of `text`."""
    found: list[_Box] = []
    stop = len(text)
    pos = text.rfind(BOXED)
    while pos != -1 and len(found) < limit:
        open_pos = pos + len(BOXED)
        while open_pos < stop and text[open_pos] in " \t\n":
            open_pos += 1
        if open_pos < stop and text[open_pos] == "{":
            # +2: room for both braces around max_chars of content; one more means "too long".
            window_end = stop if max_chars is None else min(stop, open_pos + max_chars + 2)
            end = _group_end(text, open_pos, window_end)
            if end is not None:
                close_pos, depth = end
                found.append(_Box(text[open_pos + 1 : close_pos], depth, True))
            elif window_end < stop:
                # Either an over-long answer or one cut off by the length limit of the
                # generation: no need to scan a megabyte to find out which.
                content = text[open_pos + 1 : window_end]
                found.append(_Box(content, _nesting_depth(content), False))
                break
        # An earlier box must close before this one starts (a group that never closes here
        # cannot be closed by an earlier one either): earlier candidates only need scanning
        # up to here, which keeps the whole search linear even for text full of boxes.
        stop = pos
        pos = text.rfind(BOXED, 0, pos)
    return found


def _last_boxed(text: str, max_chars: int | None) -> _Box | None:
    """The last ``\\boxed{...}`` that closes, scanning at most max_chars of its content."""
    boxes = _boxes(text, max_chars, limit=1)
    return boxes[0] if boxes else None


def last_boxed_content(text: str, max_chars: int | None = None) -> str | None:
    """Content of the last ``\\boxed{...}`` in `text` whose braces close (``\\{`` and
    ``\\}`` do not count), or None. With max_chars, a box whose content is longer than
    that counts as not found."""
    box = _last_boxed(text, max_chars)
    return box.content if box is not None and box.complete else None


def _nesting_depth(text: str) -> int:
    depth = 0
    max_depth = 0
    for token in _BRACE_TOKEN.finditer(text):
        brace = token.group()
        if brace == "{":
            depth += 1
            max_depth = max(max_depth, depth)
        elif brace == "}":
            depth = max(depth - 1, 0)
    return max_depth


def _guard(text: str, depth: int, what: str, max_chars: int = MAX_ANSWER_CHARS) -> str | None:
    """Why `text` must not reach the sandbox, or None if it may."""
    if len(text) > max_chars:
        return f"{what} longer than {max_chars} characters"
    if depth > MAX_NESTING_DEPTH:
        return f"{what} nested deeper than {MAX_NESTING_DEPTH} braces"
    if _CONTROL_CHARS.search(text):
        return f"{what} contains control characters"
    return None


# A sandbox work item: (kind, prediction, reference) for math-verify, or
# ("check", checker, completion, ground truth, row) for the other checkers.
#   "answer":  prediction is an extracted final answer, compared with the reference
#   "text":    prediction is free text; math-verify extracts the answer, then compares
#   "extract": prediction is free text; only the extracted answer comes back
#   "check":   the checker named (`rayrep.verifier.checkers`) judges the completion
Item = tuple


def completion_item(completion: str, kind_for_text: str) -> tuple[str, str] | Verdict:
    """(kind, prediction) to send to the sandbox, or the Verdict when a guard decides.

    One boxed answer is compared as it is. Several are read together, as math-verify reads
    them: a completion that boxes the two roots, or each element of a set, answers with
    all of its boxes (and one that boxes every candidate answers with the whole set, which
    equals no single ground truth).
    """
    if not isinstance(completion, str):
        raise TypeError(f"completion must be str, got {type(completion).__name__}")
    boxes = _boxes(completion, MAX_ANSWER_CHARS, limit=MAX_BOXES + 1)
    if boxes:
        if len(boxes) > MAX_BOXES:
            return Verdict(False, "error", None, f"more than {MAX_BOXES} boxed answers")
        for box in boxes:
            problem = _guard(box.content, box.depth, "boxed answer")
            if problem:
                return Verdict(False, "error", None, problem)
        if not any(box.content.strip() for box in boxes):
            return Verdict(False, "no_answer", "", "empty \\boxed{}")
        if len(boxes) == 1:
            return "answer", boxes[0].content
        return kind_for_text, " ".join(f"{BOXED}{{{box.content}}}" for box in reversed(boxes))
    tail = completion[-TAIL_CHARS:]
    if not tail.strip():
        return Verdict(False, "no_answer", None, "empty completion")
    # The answer length cap applies to what math-verify extracts from the tail (in the child).
    problem = _guard(tail, _nesting_depth(tail), "completion tail", max_chars=TAIL_CHARS)
    if problem:
        return Verdict(False, "error", None, problem)
    return kind_for_text, tail


def reference_problem(reference: str, what: str) -> str | None:
    if not isinstance(reference, str):
        raise TypeError(f"{what} must be str, got {type(reference).__name__}")
    if not reference.strip():
        return f"{what} is empty"
    return _guard(reference, _nesting_depth(reference), what)
