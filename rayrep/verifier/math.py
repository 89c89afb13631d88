"""Math answer verification with math-verify, under a hard time limit, from any script or thread.

`score(completion, ground_truth)` is the reward function: 1.0 when the completion's final
answer is mathematically equivalent to the ground truth, else 0.0 (or -1.0 with
``style="dapo"``). `verify` returns a `Verdict` whose `status` lets callers count
timeouts and errors; `verify_batch` checks many completions in one round trip.

The final answer is the content of the ``\\boxed{...}`` (several boxes answer together, as
math-verify reads them), or without one, what math-verify extracts from the end of the
text (`rayrep.verifier.final_answer`). Every
check runs in a sandbox process with a hard wall-clock limit (`rayrep.verifier.sandbox`);
the module-level functions share one sandbox per process, started on first use. Nothing
here needs an ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import os
import threading
from typing import Sequence

from rayrep.verifier.final_answer import MAX_ANSWER_CHARS, Verdict, last_boxed_content
from rayrep.verifier.reward import Style, correctness_reward
from rayrep.verifier.sandbox import DEFAULT_TIMEOUT_S, MathSandbox, SandboxError

__all__ = [
    "MAX_ANSWER_CHARS",
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
    # A forked process must not talk to its parent's child over the inherited socket.
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
    correctness_reward(False, style)  # a bad style fails before any work
    return verify(completion, ground_truth, timeout_s).reward(style)


def equivalent(a: str, b: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Whether two extracted answers are mathematically equivalent (`a` is the reference:
    math-verify is not symmetric for equations such as ``x=3`` vs ``3``)."""
    return default_sandbox().equivalent(a, b, timeout_s)


def extract_answer(completion: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> str | None:
    """The final answer of a completion, or None."""
    return default_sandbox().extract_answers([completion], timeout_s)[0]
