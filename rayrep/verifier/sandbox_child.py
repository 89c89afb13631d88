"""The verifier sandbox's child process: the checkers behind a pipe, one item at a time.

Started by `rayrep.verifier.sandbox.MathSandbox` as its own interpreter:

    python -m rayrep.verifier.sandbox_child FD MEMORY_LIMIT_BYTES

never through multiprocessing, whose spawn re-imports the caller's main module (a script
that scores at import time, `python -c`, code piped on stdin would all break). FD is
this process's end of a socket pair; messages are pickled by
`multiprocessing.connection.Connection`. The parent's first message names the user's
checkers (`rayrep.verifier.checkers.Plugin`), which are loaded, with math-verify, before the
child says it is ready. Each item runs under a soft deadline (SIGALRM, on this process's
main thread); the parent kills us when even that does not end it.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections import OrderedDict
from multiprocessing.connection import Connection
from typing import Any

from rayrep.verifier import checkers
from rayrep.verifier.final_answer import BOXED, MAX_ANSWER_CHARS, Item

Reply = tuple[bool | None, str, str | None, str, float | None, tuple]
"""(correct, status, answer, detail, score, components): see `rayrep.verifier.final_answer.Verdict`."""

MAX_DETAIL_CHARS = 300
"""A user's checker's error message is cut to this much."""

# An unescaped dollar sign, or \( or \[: text math-verify reads as LaTeX without boxing it.
_MATH_DELIMITER = re.compile(r"(?<!\\)\$|\\\(|\\\[")


class _StartFailed(Exception):
    """The child cannot serve: its message goes to the parent as it is."""


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


def _load(plugin: checkers.Plugin):
    """The user's checker function (a file's source, as read where the job started, imported
    as a module of its own; or a module imported by name), checked to take (completion,
    ground_truth, row). Running it is the point: it is the user's own code, named by them."""
    import importlib
    import importlib.abc
    import importlib.util
    import inspect

    class ShippedSource(importlib.abc.SourceLoader):
        """The file's source as shipped, under the file's own name (in tracebacks too)."""

        def get_filename(self, fullname: str) -> str:
            return plugin.path

        def get_data(self, path: str) -> bytes:
            return plugin.source.encode()

    if plugin.source is not None:
        folder = os.path.dirname(plugin.path)
        if os.path.isdir(folder) and folder not in sys.path:
            sys.path.append(folder)  # (its helpers beside it, where the file exists)
        spec = importlib.util.spec_from_loader(f"rayrep_checker_{len(sys.modules)}", ShippedSource(),
                                               origin=plugin.path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # (dataclasses and pickle look their module up)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(plugin.module)
    function = getattr(module, plugin.function, None)
    if not callable(function):
        raise LookupError(f"{plugin.function!r} is not a function of {plugin.path or plugin.module}")
    try:
        inspect.signature(function).bind(*plugin.takes)
    except TypeError:
        raise TypeError(f"{plugin.function}{inspect.signature(function)} does not take "
                        f"({', '.join(plugin.takes)})") from None
    except ValueError:
        pass  # (a builtin without a signature: its first call will tell)
    return function


class _ChildWorker:
    """Checks inside the child: math-verify (holding the cache of parsed references), the
    text checkers and the user's checkers."""

    CACHE_SIZE = 4096

    def __init__(self, plugins: list[checkers.Plugin], code_limits) -> None:
        from math_verify import parse, verify

        self._parse = parse
        self._verify = verify
        self._references: OrderedDict[str, list] = OrderedDict()
        self._text = {"exact": checkers.exact, "choice": checkers.choice}
        self._code_limits = code_limits
        self._plugins = {}
        for plugin in plugins:
            try:
                self._plugins[plugin.spec] = _load(plugin)
            except BaseException as exc:
                raise _StartFailed(f"{plugin.role} {plugin.spec!r}: {_described(exc)}") from None

    def run(self, item: Item, soft_s: float) -> Reply:
        """The reply for one item, within soft_s seconds."""
        import signal

        try:
            # We are on the child's main thread, so an interval timer works here. math-verify's
            # own timeouts are off: they count whole seconds and would reset this timer.
            signal.setitimer(signal.ITIMER_REAL, soft_s)
            try:
                if item[0] == "check":
                    return self._check(*item[1:])
                if item[0] == "tool":
                    return self._tool(*item[1:])
                return (*self._handle(*item), None, ())
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _SoftDeadline:
            return False, "timeout", None, f"stopped in the sandbox after {soft_s:.2f}s", None, ()
        except MemoryError:
            return False, "error", None, "memory limit of the sandbox reached", None, ()
        except RecursionError:
            return False, "error", None, "expression nested too deeply", None, ()
        except Exception as exc:  # a bug or an exotic input: report it, keep serving
            where = item[1] if item[0] in ("check", "tool") else "math-verify"
            return False, "error", None, f"{type(exc).__name__} in {where}", None, ()

    def _check(self, checker: str, completion: str, truth: str, row: dict) -> Reply:
        """A text checker's or a user's checker's reply; what the user's raises or returns
        amiss is its status (`error`, `bad_value`), never the child's end."""
        if checker == "code":
            from rayrep.verifier.code import check_code

            try:
                correct, score, status, detail = check_code(completion, truth, self._code_limits)
            except ValueError as exc:  # (tests it cannot read)
                return False, "error", None, str(exc)[:MAX_DETAIL_CHARS], None, ()
            return correct, status, None, detail[:MAX_DETAIL_CHARS], score, ()
        text = self._text.get(checker)
        if text is not None:
            try:
                correct, answer, where = text(completion, truth, row)
            except ValueError as exc:
                return False, "error", None, str(exc)[:MAX_DETAIL_CHARS], None, ()
            return correct, "ok" if answer is not None else "no_answer", answer, where, None, ()
        try:
            value = self._plugins[checker](completion, truth, row)
        except _SoftDeadline:
            raise
        except BaseException as exc:  # (SystemExit and KeyboardInterrupt too: the user's code)
            return False, "error", None, _described(exc), None, ()
        try:
            correct, score, components = checkers.score_value(value)
        except ValueError as exc:
            return False, "bad_value", None, str(exc)[:MAX_DETAIL_CHARS], None, ()
        return correct, "ok", None, "", score, tuple((f"checker_{name}", value) for name, value in components)

    def _tool(self, tool: str, call: str) -> Reply:
        """A tool's reply to a call: its output as the answer (status 'ok'), or, for a call that
        fails, a message of what went wrong (status 'error'), which the policy reads instead."""
        if tool == "calculator":
            from rayrep.data.arithmetic import calculate

            try:
                return None, "ok", calculate(call), "", None, ()
            except ValueError as exc:
                return None, "error", f"error: {exc}"[:MAX_DETAIL_CHARS], "", None, ()
        if tool == "python":
            from rayrep.verifier.code import run_program

            outcome = run_program(call, "script", None, self._code_limits)
            if outcome.status == "ok":
                return None, "ok", outcome.output, "", None, ()
            return None, outcome.status, f"error: {outcome.detail}"[:MAX_DETAIL_CHARS], "", None, ()
        try:
            output = self._plugins[tool](call)
        except _SoftDeadline:
            raise
        except BaseException as exc:  # (the user's code: its failure is the call's answer)
            return None, "error", f"error: {_described(exc)}", "", None, ()
        if not isinstance(output, str):
            return None, "error", f"error: the tool gave a {type(output).__name__}, not text", "", None, ()
        return None, "ok", output, "", None, ()

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
        gold = self._parse_gold(reference)
        if not gold:
            return False, "error", answer, "math-verify could not parse the reference"
        return self._matches(gold, predicted), "ok", answer, ""

    def _parse_text(self, text: str) -> list:
        return self._parse(text, parsing_timeout=None, raise_on_error=True)

    def _parse_gold(self, reference: str) -> list:
        """A ground truth: as math-verify reads it when it comes with math delimiters
        (``$...$``, ``\\(...\\)``, ``\\[...\\]``), else as a bare answer."""
        if _MATH_DELIMITER.search(reference):
            return self._parse_text(reference)
        return self._parse_reference(reference)

    def _parse_reference(self, reference: str) -> list:
        """Parse a bare answer ("1/2", "\\sqrt{8}"): math-verify only reads LaTeX inside
        delimiters, so it is boxed first; plain parsing is the fallback."""
        cached = self._references.get(reference)
        if cached is not None:
            self._references.move_to_end(reference)
            return cached
        parsed = self._parse_text(reference if BOXED in reference else f"{BOXED}{{{reference}}}")
        if not parsed and BOXED not in reference:
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


def _described(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:MAX_DETAIL_CHARS]


def _sandbox_main(conn: Any, memory_limit_bytes: int | None) -> None:
    """Entry point of the child: read the user's checkers, import, warm up, say ready, then
    serve batches."""
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
        kind, plugins, code_limits = conn.recv()
        assert kind == "setup", kind
        worker = _ChildWorker(plugins, code_limits)
        # The first parse compiles regexes and loads the ANTLR grammar: pay for it before
        # any call's clock runs. It doubles as a check of the install (an ANTLR runtime
        # that does not match latex2sympy makes every LaTeX answer silently wrong).
        correct, status, _, detail, *_ = worker.run(("answer", "\\frac{1}{2}", "0.5"), 30.0)
        if not correct:
            conn.send(("failed", f"math-verify self-check 1/2 == 0.5 failed ({status} {detail})".rstrip()))
            return
    except _StartFailed as exc:
        conn.send(("failed", str(exc)))
        return
    except BaseException as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    try:
        conn.send(("ready", os.getpid()))
        while True:
            items, softs = conn.recv()
            for item, soft_s in zip(items, softs):
                conn.send(worker.run(item, soft_s))
    except (EOFError, OSError):
        return  # the parent closed the pipe or died: nobody is waiting for answers


if __name__ == "__main__":
    fd, memory_limit = int(sys.argv[1]), int(sys.argv[2])
    _sandbox_main(Connection(fd), memory_limit or None)
