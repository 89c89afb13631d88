"""MathSandbox: the checkers (math-verify, the text checkers, a user's) in a child process,
with a hard wall-clock limit on every item.

Why a child process: math-verify bounds its own work with SIGALRM, which only works on
the main thread, and no Python signal can interrupt a long computation inside C code (a
huge integer power, a backtracking regex). So parsing and comparison run in a small
long-lived child that the caller talks to over a socket pair; a call that overruns its
limit gets the child killed and replaced by a warm spare. This process never imports
sympy or math-verify.

The child is a fresh interpreter running `rayrep.verifier.sandbox_child` (never a fork:
the caller may be running torch, vLLM or Ray threads; never multiprocessing's spawn,
which re-imports the caller's main module), so scoring works from any script, guarded by
``if __name__ == "__main__":`` or not, from ``python -c`` and from code piped on stdin.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import subprocess
import sys
import threading
import weakref
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Sequence

from rayrep.verifier.checkers import Plugin
from rayrep.verifier.code import CodeLimits
from rayrep.verifier.final_answer import Item, Verdict, completion_item, reference_problem

__all__ = ["DEFAULT_MEMORY_LIMIT_BYTES", "DEFAULT_TIMEOUT_S", "MathSandbox", "SandboxError"]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 1.0

DEFAULT_MEMORY_LIMIT_BYTES = 4 * 1024**3

# The folder holding the `rayrep` package: the child imports it from there even when
# rayrep is not installed (a source checkout on sys.path only).
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


class SandboxError(RuntimeError):
    """The sandbox process could not be started (a broken install, not a bad input)."""


def _check_timeout(timeout_s: float) -> float:
    timeout_s = float(timeout_s)
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    return timeout_s


class _Child:
    """One sandbox process and our end of its socket pair."""

    def __init__(self, memory_limit_bytes: int | None, plugins: tuple[Plugin, ...], code_limits: CodeLimits) -> None:
        if not sys.executable:
            raise SandboxError("cannot start the math sandbox: sys.executable is unknown in this interpreter")
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p)
        # -P: the caller's working directory stays off the child's sys.path (a user's
        # `signal.py` there must not shadow the standard library).
        command = [sys.executable, "-P", "-m", "rayrep.verifier.sandbox_child",
                   str(theirs.fileno()), str(memory_limit_bytes or 0)]
        try:
            self.process = subprocess.Popen(
                command, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                env=env, close_fds=True,
            )
        except OSError as err:
            ours.close()
            raise SandboxError(f"cannot start the math sandbox ({sys.executable}): {err}") from None
        finally:
            # Without our copy of the child's end, a dead child shows up as EOF.
            theirs.close()
        self.pid: int = self.process.pid
        self.conn = Connection(ours.detach())
        self.ready = False
        try:
            self.conn.send(("setup", list(plugins), code_limits))
        except OSError:
            pass  # (it died at once: `wait_ready` says so)

    def wait_ready(self, timeout_s: float) -> None:
        if self.ready:
            return
        if not self.conn.poll(timeout_s):
            raise SandboxError(f"math sandbox did not start within {timeout_s:.0f}s")
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            try:
                code = self.process.wait(1.0)
            except subprocess.TimeoutExpired:
                code = None
            raise SandboxError(
                f"math sandbox exited during start-up (exit code {code}; its traceback is on stderr)"
            ) from None
        if message[0] != "ready":
            raise SandboxError(f"the verifier sandbox failed to start: {message[1]}")
        self.ready = True

    def exit_code(self) -> int | None:
        return self.process.poll()

    def kill(self) -> None:
        """SIGKILL, reap (no zombie) and release the socket."""
        try:
            self.process.kill()
            self.process.wait(5.0)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.conn.close()


class _Children:
    """The active child and the warm spare. Kept apart from MathSandbox so that its
    finalizer can close them without keeping the sandbox alive."""

    def __init__(self, memory_limit_bytes: int | None, keep_spare: bool, startup_timeout_s: float,
                 plugins: tuple[Plugin, ...], code_limits: CodeLimits):
        self._memory_limit_bytes = memory_limit_bytes
        self._plugins, self._code_limits = plugins, code_limits
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
            candidate = self.spare or _Child(self._memory_limit_bytes, self._plugins, self._code_limits)
            self.spare = None
            try:
                candidate.wait_ready(self._startup_timeout_s)
            except SandboxError:
                candidate.kill()
                # One fresh try: a spare can die of something transient while it waits.
                candidate = _Child(self._memory_limit_bytes, self._plugins, self._code_limits)
                try:
                    candidate.wait_ready(self._startup_timeout_s)
                except SandboxError:
                    candidate.kill()
                    raise
            self.active = candidate
        if self._keep_spare and self.spare is None:
            # Start the replacement now, so that it has finished importing sympy (~0.5 s)
            # by the time a kill needs it.
            self.spare = _Child(self._memory_limit_bytes, self._plugins, self._code_limits)
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
        memory_limit_bytes: int | None = DEFAULT_MEMORY_LIMIT_BYTES,
        keep_spare: bool = True,
        startup_timeout_s: float = 60.0,
        plugins: tuple[Plugin, ...] = (),
        code_limits: CodeLimits = CodeLimits(),
    ) -> None:
        """`plugins`: the user's checkers its children load as they start (a child that
        cannot load one fails to start, with SandboxError naming it); `code_limits`: the
        `code` checker's limits on each run of a program."""
        self._lock = threading.Lock()
        self.code_limits = code_limits
        self._children = _Children(memory_limit_bytes, keep_spare, startup_timeout_s, tuple(plugins), code_limits)
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
        return self.check_batch([("math", completion, truth, {}) for completion, truth in zip(completions, ground_truths)],
                                timeout_s)

    def check_batch(self, checks: Sequence[tuple[str, str, str, dict]], timeout_s: float = DEFAULT_TIMEOUT_S,
                    success_threshold: float = 1.0) -> list[Verdict]:
        """One Verdict per (checker, completion, ground truth, row), in one round trip:
        `math` as `verify_batch` checks, the others by name (`rayrep.verifier.checkers`). A
        user's checker that gives a score and no verdict has its answer correct when the score
        reaches `success_threshold`."""
        verdicts: list[Verdict | None] = []
        items: list[Item] = []
        limits: list[float] = []
        for checker, completion, truth, row in checks:
            if checker == "math":
                decided = self._math_item(completion, truth)
            elif not isinstance(completion, str):
                raise TypeError(f"completion must be str, got {type(completion).__name__}")
            else:
                decided = ("check", checker, completion, truth, row)
            verdicts.append(decided if isinstance(decided, Verdict) else None)
            if not isinstance(decided, Verdict):
                items.append(decided)
                # A program's check runs it, maybe once per case: its own budget.
                limits.append(max(timeout_s, self.code_limits.budget_s(truth)) if checker == "code" else timeout_s)
        checked = iter(self._run(items, limits))
        verdicts = [v if v is not None else next(checked) for v in verdicts]
        return [dataclasses.replace(v, correct=v.score >= success_threshold) if v.correct is None else v
                for v in verdicts]

    def tool_batch(self, calls: Sequence[tuple[str, str]], timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Verdict]:
        """One Verdict per (tool, call text), in one round trip: the tool's output as its
        `answer` (status 'ok'), or a message of what went wrong (status 'error', 'timeout')
        (`rayrep.verifier.tools`)."""
        if any(not isinstance(call, str) for _, call in calls):
            raise TypeError("a tool call must be str")
        return self._run([("tool", tool, call) for tool, call in calls], timeout_s)

    def _math_item(self, completion: str, truth: str) -> Item | Verdict:
        """The item that checks `completion` against `truth` with math-verify, or the Verdict
        when a guard decides."""
        problem = reference_problem(truth, "ground truth")
        prepared = completion_item(completion, "text")
        if isinstance(prepared, Verdict):
            return prepared
        if problem:
            return Verdict(False, "error", None, problem)
        return prepared[0], prepared[1], truth

    def equivalent(self, a: str, b: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
        """Whether two extracted answers are equivalent (`a` is taken as the reference)."""
        return self.equivalent_batch([(a, b)], timeout_s)[0]

    def equivalent_batch(
        self, pairs: Sequence[tuple[str, str]], timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> list[bool]:
        """`equivalent` for many pairs in one round trip; a timeout or error counts as False."""
        results: list[bool | None] = []
        items: list[Item] = []
        for reference, answer in pairs:
            if reference_problem(reference, "answer a") or reference_problem(answer, "answer b"):
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
        items: list[Item] = []
        for index, completion in enumerate(completions):
            prepared = completion_item(completion, "extract")
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

    def _run(self, items: list[Item], timeout_s: float | list[float]) -> list[Verdict]:
        """Each item's verdict, within its limit (`timeout_s`: one for all, or one each)."""
        limits = [_check_timeout(t) for t in timeout_s] if isinstance(timeout_s, list) else \
            [_check_timeout(timeout_s)] * len(items)
        if not items:
            return []
        # Leave the child time to unwind and reply before the parent's hard limit strikes.
        softs = [limit - min(0.25, limit / 2) for limit in limits]
        results: list[Verdict] = []
        failed_sends = 0
        with self._lock:
            while len(results) < len(items):
                child = self._children.get_active()
                try:
                    child.conn.send((items[len(results) :], softs[len(results) :]))
                except (OSError, ValueError):
                    # The child died while idle (killed from outside?): use another one.
                    self._children.discard_active()
                    failed_sends += 1
                    if failed_sends > 2:
                        raise SandboxError("cannot send work to the math sandbox") from None
                    continue
                while len(results) < len(items):
                    verdict = self._receive(child, limits[len(results)])
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
            reply = child.conn.recv()
        except (EOFError, OSError):
            exit_code = child.exit_code()
            logger.warning("math sandbox %s died (exit code %s); replacing it", child.pid, exit_code)
            self._children.discard_active()
            return Verdict(False, "error", None, f"sandbox process died (exit code {exit_code})")
        return Verdict(*reply)
