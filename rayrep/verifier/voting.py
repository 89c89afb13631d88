"""Majority voting over a question's answers (maj@k): answers grouped by math-verify
equivalence, the largest group's answer checked against the ground truth."""

from __future__ import annotations

from collections.abc import Sequence

from rayrep.verifier import math as math_verifier
from rayrep.verifier.sandbox import MathSandbox


def maj_at_k(
    answers: Sequence[str],
    ground_truth: str,
    k: int | None = None,
    *,
    timeout_s: float = 1.0,
    sandbox: MathSandbox | None = None,
) -> float:
    """1.0 if the majority final answer of the first k completions equals the ground truth.

    Final answers are extracted as the verifier does (the last ``\\boxed{}``, else what
    math-verify finds at the end of the text); completions without one do not vote.
    Answers join the first group whose first answer they are math-verify-equivalent to
    (equivalence is checked against that representative only, so it need not be
    transitive). The largest group wins; a tie goes to the group whose first answer came
    earliest. 0.0 when no completion has an answer. `k` defaults to all completions;
    `sandbox` defaults to the process-wide one of `rayrep.verifier.math`.
    """
    if isinstance(answers, str):
        raise TypeError("answers must be a sequence of completions, not one string")
    answers = list(answers)
    k = len(answers) if k is None else k
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an integer, got {k!r}")
    if not 1 <= k <= len(answers):
        raise ValueError(f"k must lie between 1 and len(answers)={len(answers)}, got {k}")

    checker = sandbox if sandbox is not None else math_verifier.default_sandbox()
    representatives: list[str] = []
    votes: list[int] = []
    group_of: dict[str, int] = {}  # identical strings skip the sandbox
    for answer in checker.extract_answers(answers[:k], timeout_s):
        if answer is None:
            continue
        group = group_of.get(answer)
        if group is None:
            same = checker.equivalent_batch([(rep, answer) for rep in representatives], timeout_s)
            group = next((i for i, match in enumerate(same) if match), None)
            if group is None:
                representatives.append(answer)
                votes.append(0)
                group = len(representatives) - 1
            group_of[answer] = group
        votes[group] += 1
    if not votes:
        return 0.0
    # Groups were created in order of first occurrence, so the lowest index wins a tie.
    winner = max(range(len(votes)), key=lambda i: (votes[i], -i))
    return 1.0 if checker.equivalent(ground_truth, representatives[winner], timeout_s) else 0.0
