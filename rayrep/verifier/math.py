"""Math answer verification with math-verify, under a hard time limit, from any thread.

`score(completion, ground_truth)` is the reward function: 1.0 when the completion's final
answer is mathematically equivalent to the ground truth, else 0.0 (or -1.0 with
``style="dapo"``). `verify` returns a `Verdict` whose `status` lets callers count
timeouts and errors; `verify_batch` checks many completions in one round trip.

Why a child process: math-verify bounds its own work with SIGALRM, which only works on
the main thread, and no Python signal can interrupt a long computation inside C code (a
huge integer power, a backtracking regex). So parsing and comparison run in a
small long-lived child (the sandbox) that the caller talks to over a pipe; a call that
overruns its limit gets the child killed and replaced by a warm spare. The parent never
imports sympy or math-verify.

The final answer of a completion is the content of its last complete ``\\boxed{...}``;
without one, whatever math-verify extracts from the tail of the text.

Children are spawned (never forked: the caller may be running torch, vLLM or Ray threads),
so, as with any spawn-based multiprocessing, a script that verifies at import time needs
an ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import re
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Sequence

__all__ = [
    "MathSandbox",
    "SandboxError",
    "Verdict",
    "default_sandbox",
    "equivalent",
    "extract_answer",
    "last_boxed_content",
    "score",
    "verify",
    "verify_batch",
]

logger = logging.getLogger(__name__)

Status = Literal["ok", "no_answer", "timeout", "error"]
"""ok: the answer was checked; no_answer: nothing to check; timeout: over the limit;
error: rejected by a guard, a resource limit, or a crash."""

Style = Literal["binary", "dapo"]

DEFAULT_TIMEOUT_S = 1.0

MAX_ANSWER_CHARS = 1000
"""Longer final answers (and ground truths) are rejected before the sandbox: real answers
are short, and parse time grows quickly with length."""

MAX_NESTING_DEPTH = 50
"""Deeper brace nesting is rejected before the sandbox: the LaTeX parser recurses per level."""

TAIL_CHARS = 2000
"""Without a ``\\boxed{}``, only this much of the end of a completion goes to math-verify."""

DEFAULT_MEMORY_LIMIT_BYTES = 4 * 1024**3

_BOXED = "\\boxed"
# A backslash escapes the next character, so `\{` and `\}` (literal braces, as in sets)
# do not open or close a group.
_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.DOTALL)
# C0/C1 control characters never appear in model text, but they do in decoded binary junk.
# Backspace, tab, newlines, vertical tab and form feed are allowed: datasets with broken
# escaping turn `\b`, `\t`, `\n`, `\v`, `\f`, `\r` of LaTeX commands into exactly those.
_CONTROL_CHARS = re.compile(r"[\x00-\x07\x0e-\x1f\x7f-\x9f]")


# ---------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class Verdict:
    """Outcome of checking one completion against one ground truth."""

    correct: bool
    status: Status
    answer: str | None = None
    """The final answer that was checked (box content or math-verify's extraction)."""
    detail: str = ""
    """Why, for statuses other than "ok"; meant for logs."""

    def reward(self, style: Style = "binary") -> float:
        """The reward this verdict earns: 1/0 (``binary``) or +1/-1 (``dapo``)."""
        _check_style(style)
        if self.correct:
            return 1.0
        return -1.0 if style == "dapo" else 0.0


class SandboxError(RuntimeError):
    """The sandbox process could not be started (a broken install, not a bad input)."""


def _check_style(style: str) -> None:
    if style not in ("binary", "dapo"):
        raise ValueError(f"style must be 'binary' or 'dapo', got {style!r}")


def _check_timeout(timeout_s: float) -> float:
    timeout_s = float(timeout_s)
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    return timeout_s


# ---------------------------------------------------------------------------------------
# Answer extraction and guards (parent side, pure Python, linear time)


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


def _last_boxed(text: str, max_chars: int | None) -> _Box | None:
    """The last ``\\boxed{...}`` that closes, scanning at most max_chars of its content."""
    stop = len(text)
    pos = text.rfind(_BOXED)
    while pos != -1:
        open_pos = pos + len(_BOXED)
        while open_pos < stop and text[open_pos] in " \t\n":
            open_pos += 1
        if open_pos < stop and text[open_pos] == "{":
            # +2: room for both braces around max_chars of content; one more means "too long".
            window_end = stop if max_chars is None else min(stop, open_pos + max_chars + 2)
            end = _group_end(text, open_pos, window_end)
            if end is not None:
                close_pos, depth = end
                return _Box(text[open_pos + 1 : close_pos], depth, True)
            if window_end < stop:
                # Either an over-long answer or one cut off by the length limit of the
                # generation: no need to scan a megabyte to find out which.
                content = text[open_pos + 1 : window_end]
                return _Box(content, _nesting_depth(content), False)
            # This group never closes, so an earlier group that contains it cannot close
            # either: earlier candidates only need scanning up to here. That keeps the
            # whole search linear even for text full of unclosed boxes.
            stop = pos
        pos = text.rfind(_BOXED, 0, pos)
    return None


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


# A sandbox work item: (kind, prediction, reference).
#   "answer":  prediction is an extracted final answer, compared with the reference
#   "text":    prediction is free text; math-verify extracts the answer, then compares
#   "extract": prediction is free text; only the extracted answer comes back
_Item = tuple[str, str, str]


def _completion_item(completion: str, kind_for_text: str) -> tuple[str, str] | Verdict:
    """(kind, prediction) to send to the sandbox, or the Verdict when a guard decides."""
    if not isinstance(completion, str):
        raise TypeError(f"completion must be str, got {type(completion).__name__}")
    box = _last_boxed(completion, MAX_ANSWER_CHARS)
    if box is not None:
        if not box.content.strip():
            return Verdict(False, "no_answer", "", "empty \\boxed{}")
        problem = _guard(box.content, box.depth, "boxed answer")
        if problem:
            return Verdict(False, "error", None, problem)
        return "answer", box.content
    tail = completion[-TAIL_CHARS:]
    if not tail.strip():
        return Verdict(False, "no_answer", None, "empty completion")
    # The answer length cap applies to what math-verify extracts from the tail (in the child).
    problem = _guard(tail, _nesting_depth(tail), "completion tail", max_chars=TAIL_CHARS)
    if problem:
        return Verdict(False, "error", None, problem)
    return kind_for_text, tail


def _reference_problem(reference: str, what: str) -> str | None:
    if not isinstance(reference, str):
        raise TypeError(f"{what} must be str, got {type(reference).__name__}")
    if not reference.strip():
        return f"{what} is empty"
    return _guard(reference, _nesting_depth(reference), what)


# ---------------------------------------------------------------------------------------
# The child process. Everything below up to MathSandbox runs only there.


class _SoftDeadline(BaseException):
    """Raised by SIGALRM inside the child. A BaseException, so that the `except Exception`
    blocks all over math-verify and sympy let it through."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise _SoftDeadline()


def _limit_address_space(limit_bytes: int) -> None:
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit_bytes = min(limit_bytes, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, hard))


class _ChildWorker:
    """Parses and compares inside the child; holds the cache of parsed references."""

    CACHE_SIZE = 4096

    def __init__(self) -> None:
        from math_verify import parse, verify

        self._parse = parse
        self._verify = verify
        self._references: OrderedDict[str, list] = OrderedDict()

    def run(self, item: _Item, soft_s: float) -> tuple[bool, str, str | None, str]:
        """(correct, status, answer, detail) for one item, within soft_s seconds."""
        import signal

        try:
            # We are on the child's main thread, so an interval timer works here. math-verify's
            # own timeouts are off: they count whole seconds and would reset this timer.
            signal.setitimer(signal.ITIMER_REAL, soft_s)
            try:
                return self._handle(*item)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _SoftDeadline:
            return False, "timeout", None, f"stopped in the sandbox after {soft_s:.2f}s"
        except MemoryError:
            return False, "error", None, "memory limit of the sandbox reached"
        except RecursionError:
            return False, "error", None, "expression nested too deeply"
        except Exception as exc:  # a bug or an exotic input: report it, keep serving
            return False, "error", None, f"{type(exc).__name__} in math-verify"

    def _handle(self, kind: str, prediction: str, reference: str) -> tuple[bool, str, str | None, str]:
        if kind == "answer":
            predicted = self._parse_reference(prediction)
        else:
            predicted = self._parse_text(prediction)
        if not predicted:
            return False, "no_answer", None, "math-verify found no answer"
        if kind == "answer":
            answer = prediction.strip()
        else:
            # parse() returns [expression, the text it came from]: report and vote on the text.
            answer = next((p for p in reversed(predicted) if isinstance(p, str)), None) or str(predicted[0])
            if len(answer) > MAX_ANSWER_CHARS:
                return False, "error", None, f"extracted answer longer than {MAX_ANSWER_CHARS} characters"
        if kind == "extract":
            return False, "ok", answer, ""
        gold = self._parse_reference(reference)
        if not gold:
            return False, "error", answer, "math-verify could not parse the reference"
        return self._matches(gold, predicted), "ok", answer, ""

    def _parse_text(self, text: str) -> list:
        return self._parse(text, parsing_timeout=None, raise_on_error=True)

    def _parse_reference(self, reference: str) -> list:
        """Parse a bare answer ("1/2", "\\sqrt{8}"): math-verify only reads LaTeX inside
        delimiters, so it is boxed first; plain parsing is the fallback."""
        cached = self._references.get(reference)
        if cached is not None:
            self._references.move_to_end(reference)
            return cached
        parsed = self._parse_text(reference if _BOXED in reference else f"{_BOXED}{{{reference}}}")
        if not parsed and _BOXED not in reference:
            parsed = self._parse_text(reference)
        self._references[reference] = parsed
        if len(self._references) > self.CACHE_SIZE:
            self._references.popitem(last=False)
        return parsed

    def _matches(self, gold: list, predicted: list) -> bool:
        for g in gold:
            for p in predicted:
                try:
                    if self._verify(g, p, timeout_seconds=None, raise_on_error=True):
                        return True
                except (MemoryError, RecursionError):
                    raise
                except Exception:
                    # math-verify's own convention: a comparison that fails is not a match.
                    continue
        return False


def _sandbox_main(conn: Any, memory_limit_bytes: int | None) -> None:
    """Entry point of the child: import, warm up, say ready, then serve batches."""
    import signal

    # Ctrl-C in a terminal reaches the whole process group; the parent decides our fate.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGALRM, _on_alarm)
    try:
        if memory_limit_bytes:
            _limit_address_space(memory_limit_bytes)
        for name in ("math_verify", "latex2sympy2_extended"):
            # Its warnings ("timeout is disabled", parse failures) would flood the job's log.
            logging.getLogger(name).setLevel(logging.CRITICAL)
        worker = _ChildWorker()
        # The first parse compiles regexes and loads the ANTLR grammar: pay for it before
        # any call's clock runs. It doubles as a check of the install (an ANTLR runtime
        # that does not match latex2sympy makes every LaTeX answer silently wrong).
        correct, status, _, detail = worker.run(("answer", "\\frac{1}{2}", "0.5"), 30.0)
        if not correct:
            conn.send(("failed", f"math-verify self-check 1/2 == 0.5 failed ({status} {detail})".rstrip()))
            return
    except BaseException as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    try:
        conn.send(("ready", os.getpid()))
        while True:
            items, soft_s = conn.recv()
            for item in items:
                conn.send(worker.run(item, soft_s))
    except (EOFError, OSError):
        return  # the parent closed the pipe or died: nobody is waiting for answers


# ---------------------------------------------------------------------------------------
# Parent side


class _Child:
    """One sandbox process and the parent's end of its pipe."""

    def __init__(self, ctx: Any, memory_limit_bytes: int | None) -> None:
        parent_end, child_end = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_sandbox_main,
            args=(child_end, memory_limit_bytes),
            name="rayrep-math-sandbox",
            daemon=True,
        )
        self.process.start()
        self.pid: int = self.process.pid
        # Without our copy of the child's end, a dead child shows up as EOF on the pipe.
        child_end.close()
        self.conn = parent_end
        self.ready = False

    def wait_ready(self, timeout_s: float) -> None:
        if self.ready:
            return
        if not self.conn.poll(timeout_s):
            raise SandboxError(f"math sandbox did not start within {timeout_s:.0f}s")
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            self.process.join(1.0)
            raise SandboxError(
                f"math sandbox exited during start-up (exit code {self.process.exitcode}; its "
                "traceback is on stderr). Spawned children import the main module, so a script "
                "that verifies at import time needs an `if __name__ == '__main__':` guard."
            ) from None
        if message[0] != "ready":
            raise SandboxError(f"math sandbox failed to start: {message[1]}")
        self.ready = True

    def kill(self) -> None:
        """SIGKILL, reap (no zombie) and release the pipe and sentinel descriptors."""
        try:
            self.process.kill()
            self.process.join(5.0)
            self.process.close()
        except (OSError, ValueError, AssertionError):
            pass
        self.conn.close()


class _Children:
    """The active child and the warm spare. Kept apart from MathSandbox so that its
    finalizer can close them without keeping the sandbox alive."""

    def __init__(self, ctx: Any, memory_limit_bytes: int | None, keep_spare: bool, startup_timeout_s: float):
        self._ctx = ctx
        self._memory_limit_bytes = memory_limit_bytes
        self._keep_spare = keep_spare
        self._startup_timeout_s = startup_timeout_s
        self._owner_pid = os.getpid()
        self.active: _Child | None = None
        self.spare: _Child | None = None
        self.closed = False

    def get_active(self) -> _Child:
        """The child to send work to, started (and the spare refilled) if needed."""
        if self.closed:
            raise RuntimeError("MathSandbox is closed")
        if os.getpid() != self._owner_pid:
            raise RuntimeError("MathSandbox was inherited through fork(): create a new one in this process")
        if self.active is None:
            candidate = self.spare or _Child(self._ctx, self._memory_limit_bytes)
            self.spare = None
            try:
                candidate.wait_ready(self._startup_timeout_s)
            except SandboxError:
                candidate.kill()
                # One fresh try: a spare can die of something transient while it waits.
                candidate = _Child(self._ctx, self._memory_limit_bytes)
                try:
                    candidate.wait_ready(self._startup_timeout_s)
                except SandboxError:
                    candidate.kill()
                    raise
            self.active = candidate
        if self._keep_spare and self.spare is None:
            # Start the replacement now, so that it has finished importing sympy (~0.5 s)
            # by the time a kill needs it.
            self.spare = _Child(self._ctx, self._memory_limit_bytes)
        return self.active

    def discard_active(self) -> None:
        if self.active is not None:
            self.active.kill()
            self.active = None

    def pids(self) -> list[int]:
        return [c.pid for c in (self.active, self.spare) if c is not None]

    def close(self) -> None:
        self.closed = True
        if os.getpid() != self._owner_pid:
            # An inherited copy after fork(): those children belong to the parent process.
            return
        for child in (self.active, self.spare):
            if child is not None:
                child.kill()
        self.active = self.spare = None


class MathSandbox:
    """math-verify in a child process, with a hard wall-clock limit on every item.

    Thread-safe: concurrent callers are served one at a time (the limit bounds each
    item's computation, not time spent queueing); for parallelism use `verify_batch`, or
    one sandbox per worker. A call that overruns gets the child killed and replaced by a
    warm spare, so the next call does not wait for a start-up. Inside the child, a soft
    deadline (slightly below the limit) ends most slow comparisons without a kill, and
    an address-space limit turns memory blow-ups into errors.
    """

    def __init__(
        self,
        *,
        start_method: Literal["spawn", "forkserver"] = "spawn",
        memory_limit_bytes: int | None = DEFAULT_MEMORY_LIMIT_BYTES,
        keep_spare: bool = True,
        startup_timeout_s: float = 60.0,
    ) -> None:
        # Never plain fork: the parent may be running torch, vLLM or Ray threads.
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}")
        self._lock = threading.Lock()
        self._children = _Children(
            multiprocessing.get_context(start_method), memory_limit_bytes, keep_spare, startup_timeout_s
        )
        # Runs on close(), on garbage collection, and at interpreter exit.
        self._finalizer = weakref.finalize(self, self._children.close)

    # -- lifecycle

    def start(self) -> MathSandbox:
        """Start the child (and spare) now instead of on the first call."""
        with self._lock:
            self._children.get_active()
        return self

    def close(self) -> None:
        """Kill and reap the child processes. Idempotent."""
        with self._lock:
            self._finalizer()

    @property
    def closed(self) -> bool:
        return self._children.closed

    def child_pids(self) -> list[int]:
        """Process ids: [active child, spare], either absent when not started (yet)."""
        return self._children.pids()

    def __enter__(self) -> MathSandbox:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- checks

    def verify(self, completion: str, ground_truth: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Verdict:
        """Check one completion's final answer against the ground truth."""
        return self.verify_batch([completion], [ground_truth], timeout_s)[0]

    def verify_batch(
        self, completions: Sequence[str], ground_truths: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> list[Verdict]:
        """One Verdict per (completion, ground truth) pair, in one round trip to the child.

        `timeout_s` bounds each item; after a kill the remaining items go to the spare.
        """
        if len(completions) != len(ground_truths):
            raise ValueError(
                f"completions and ground_truths differ in length: {len(completions)} != {len(ground_truths)}"
            )
        verdicts: list[Verdict | None] = []
        items: list[_Item] = []
        for completion, truth in zip(completions, ground_truths):
            problem = _reference_problem(truth, "ground truth")
            prepared = _completion_item(completion, "text")
            if isinstance(prepared, Verdict):
                verdicts.append(prepared)
            elif problem:
                verdicts.append(Verdict(False, "error", None, problem))
            else:
                verdicts.append(None)
                items.append((prepared[0], prepared[1], truth))
        checked = iter(self._run(items, timeout_s))
        return [v if v is not None else next(checked) for v in verdicts]

    def equivalent(self, a: str, b: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
        """Whether two extracted answers are equivalent (`a` is taken as the reference)."""
        return self.equivalent_batch([(a, b)], timeout_s)[0]

    def equivalent_batch(
        self, pairs: Sequence[tuple[str, str]], timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> list[bool]:
        """`equivalent` for many pairs in one round trip; a timeout or error counts as False."""
        results: list[bool | None] = []
        items: list[_Item] = []
        for reference, answer in pairs:
            if _reference_problem(reference, "answer a") or _reference_problem(answer, "answer b"):
                results.append(False)
            else:
                results.append(None)
                items.append(("answer", answer, reference))
        checked = iter(self._run(items, timeout_s))
        return [r if r is not None else next(checked).correct for r in results]

    def extract_answers(
        self, completions: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> list[str | None]:
        """The final answer of each completion, or None where there is none (or it could
        not be extracted in time). Boxed answers never need the child."""
        answers: list[str | None] = []
        pending: list[int] = []
        items: list[_Item] = []
        for index, completion in enumerate(completions):
            prepared = _completion_item(completion, "extract")
            if isinstance(prepared, Verdict):
                answers.append(None)
            elif prepared[0] == "answer":
                answers.append(prepared[1].strip())
            else:
                answers.append(None)
                pending.append(index)
                items.append((prepared[0], prepared[1], ""))
        for index, verdict in zip(pending, self._run(items, timeout_s)):
            answers[index] = verdict.answer if verdict.status == "ok" else None
        return answers

    # -- the round trip

    def _run(self, items: list[_Item], timeout_s: float) -> list[Verdict]:
        timeout_s = _check_timeout(timeout_s)
        if not items:
            return []
        # Leave the child time to unwind and reply before the parent's hard limit strikes.
        soft_s = timeout_s - min(0.25, timeout_s / 2)
        results: list[Verdict] = []
        failed_sends = 0
        with self._lock:
            while len(results) < len(items):
                child = self._children.get_active()
                try:
                    child.conn.send((items[len(results) :], soft_s))
                except (OSError, ValueError):
                    # The child died while idle (killed from outside?): use another one.
                    self._children.discard_active()
                    failed_sends += 1
                    if failed_sends > 2:
                        raise SandboxError("cannot send work to the math sandbox") from None
                    continue
                while len(results) < len(items):
                    verdict = self._receive(child, timeout_s)
                    results.append(verdict)
                    if self._children.active is not child:
                        break  # it was killed: the rest go to the next child
        return results

    def _receive(self, child: _Child, timeout_s: float) -> Verdict:
        """The child's reply for its current item, or a timeout/error after killing it."""
        if not child.conn.poll(timeout_s):
            logger.debug("math sandbox %s killed after %.2fs", child.pid, timeout_s)
            self._children.discard_active()
            return Verdict(False, "timeout", None, f"sandbox killed after {timeout_s:.2f}s")
        try:
            correct, status, answer, detail = child.conn.recv()
        except (EOFError, OSError):
            exit_code = child.process.exitcode
            logger.warning("math sandbox %s died (exit code %s); replacing it", child.pid, exit_code)
            self._children.discard_active()
            return Verdict(False, "error", None, f"sandbox process died (exit code {exit_code})")
        return Verdict(correct, status, answer, detail)


# ---------------------------------------------------------------------------------------
# Module-level API on a per-process default sandbox

_default_lock = threading.Lock()
_default: MathSandbox | None = None


def default_sandbox() -> MathSandbox:
    """The sandbox shared by the module-level functions, created on first use."""
    global _default
    with _default_lock:
        if _default is None or _default.closed:
            _default = MathSandbox()
        return _default


def _forget_default_after_fork() -> None:
    # A forked process must not talk to its parent's child over the inherited pipe.
    global _default, _default_lock
    _default = None
    _default_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_default_after_fork)


def verify(completion: str, ground_truth: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Verdict:
    """Check a completion's final answer against the ground truth (see `Verdict`)."""
    return default_sandbox().verify(completion, ground_truth, timeout_s)


def verify_batch(
    completions: Sequence[str], ground_truths: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[Verdict]:
    """`verify` for many pairs in one round trip; `timeout_s` bounds each item."""
    return default_sandbox().verify_batch(completions, ground_truths, timeout_s)


def score(
    completion: str, ground_truth: str, *, style: Style = "binary", timeout_s: float = DEFAULT_TIMEOUT_S
) -> float:
    """Reward of a completion: 1.0 if its final answer equals the ground truth, else 0.0
    (``style="dapo"``: +1.0 / -1.0). Timeouts and errors score as wrong."""
    _check_style(style)
    return verify(completion, ground_truth, timeout_s).reward(style)


def equivalent(a: str, b: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Whether two extracted answers are mathematically equivalent (`a` is the reference:
    math-verify is not symmetric for equations such as ``x=3`` vs ``3``)."""
    return default_sandbox().equivalent(a, b, timeout_s)


def extract_answer(completion: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> str | None:
    """The final answer of a completion, or None."""
    return default_sandbox().extract_answers([completion], timeout_s)[0]
