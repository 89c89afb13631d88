"""The embedded task: seeded integer arithmetic problems with verifiable answers.

Difficulty comes from the number of operands and their digits. The default mix is chosen
so that the embedded tiny policy, after its short supervised warm start, solves a useful
share of test problems but far from all of them: RL has room to improve.

Splits are disjoint by expression and fully determined by the seed, so every run, every
machine and every Ray worker sees the same train and test questions.
"""

from __future__ import annotations

import functools
import itertools
import random
import re
from dataclasses import dataclass

from rayrep.types import Prompt

DATA_SOURCE = "rayrep/arithmetic"
INSTRUCTION = "Answer in \\boxed{}."


@dataclass(frozen=True)
class Level:
    """One difficulty level: `operands` integers of `min_digits`..`max_digits` digits."""

    name: str
    operands: int
    min_digits: int
    max_digits: int
    ops: str = "+"

    def __post_init__(self):
        if self.operands < 2:
            raise ValueError(f"Level {self.name!r}: operands must be >= 2, got {self.operands}")
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(
                f"Level {self.name!r}: need 1 <= min_digits <= max_digits, "
                f"got {self.min_digits}..{self.max_digits}"
            )
        if not self.ops or set(self.ops) - set("+-*"):
            raise ValueError(f"Level {self.name!r}: ops must be made of '+', '-', '*', got {self.ops!r}")


LEVELS: dict[str, Level] = {
    level.name: level
    for level in (
        Level("add1", operands=2, min_digits=1, max_digits=1, ops="+"),
        Level("add2", operands=2, min_digits=1, max_digits=2, ops="+"),
        Level("sub2", operands=2, min_digits=1, max_digits=2, ops="-"),
        Level("mix3", operands=3, min_digits=1, max_digits=1, ops="+-"),
        Level("add3", operands=2, min_digits=2, max_digits=3, ops="+"),
        Level("mul1", operands=2, min_digits=1, max_digits=1, ops="*"),
        Level("mix4", operands=4, min_digits=1, max_digits=2, ops="+-"),
        # Harder levels (the tiny-cpu-hard preset): more digits, so more carries and borrows.
        Level("sub3", operands=2, min_digits=2, max_digits=3, ops="-"),
        Level("add4", operands=2, min_digits=3, max_digits=4, ops="+"),
        Level("mix5", operands=5, min_digits=1, max_digits=2, ops="+-"),
        # Beyond what the tiny policy computes by itself (the tiny-cpu-tool preset): with the
        # calculator, a matter of copying the expression and reading the result.
        Level("mul2", operands=2, min_digits=2, max_digits=2, ops="*"),
        Level("add5", operands=2, min_digits=4, max_digits=5, ops="+"),
    )
}
DEFAULT_LEVELS = ("add2", "sub2", "mix3")


@dataclass(frozen=True)
class Problem:
    expression: str
    answer: int
    level: str

    @property
    def question(self) -> str:
        return f"{self.expression}=? {INSTRUCTION}"

    def solution(self, slip: int = 0) -> str:
        """A worked answer, left to right, ending in the boxed result (the warm-start target).

        `slip` adds an arithmetic mistake of that size to the last step (and so to the boxed
        result), as a careless solver would make.
        """
        tokens = _split_expression(self.expression)
        steps, value = [], int(tokens[0])
        pairs = list(zip(tokens[1::2], tokens[2::2]))
        for index, (op, operand) in enumerate(pairs):
            new_value = _apply(value, op, int(operand)) + (slip if index == len(pairs) - 1 else 0)
            steps.append(f"{value}{op}{operand}={new_value}")
            value = new_value
        return f"{', '.join(steps)}. \\boxed{{{value}}}"

    def to_prompt(self, split: str, index: int) -> Prompt:
        return Prompt(
            uid=f"arith-{split}-{index}",
            messages=({"role": "user", "content": self.question},),
            ground_truth=str(self.answer),
            data_source=DATA_SOURCE,
            extra={"level": self.level},
        )


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def _random_operand(rng: random.Random, level: Level) -> int:
    digits = rng.randint(level.min_digits, level.max_digits)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def _random_problem(rng: random.Random, level: Level) -> Problem:
    # Evaluated left to right, as written in the worked solution (no operator precedence),
    # so multiplication levels use a single operator.
    operands = [_random_operand(rng, level) for _ in range(level.operands)]
    ops = [rng.choice(level.ops) for _ in range(level.operands - 1)]
    value, expression = operands[0], str(operands[0])
    for op, operand in zip(ops, operands[1:]):
        value = _apply(value, op, operand)
        expression += f"{op}{operand}"
    return Problem(expression, value, level.name)


def _split_expression(expression: str) -> list[str]:
    """'12+3-4' -> ['12', '+', '3', '-', '4'] (operands are non-negative)."""
    return re.findall(r"\d+|[-+*]", expression)


CALCULATOR_LIMITS = (12, 20)
"""The calculator's largest operand (digits) and most operands: it computes what the task
asks, not what a hostile call would make it."""


def calculate(expression: str) -> str:
    """The value of `expression` in the task's own notation (non-negative integers joined by
    +, - and *, spaces allowed, evaluated left to right as the task's solutions are), as
    text: the embedded tool task's calculator. A ValueError says what it cannot read."""
    text = expression.replace(" ", "")
    if not re.fullmatch(r"\d+([-+*]\d+)*", text):
        raise ValueError(f"not an expression of integers and + - *: {expression[:40]!r}")
    tokens = _split_expression(text)
    digits, operands = CALCULATOR_LIMITS
    if len(tokens) > 2 * operands - 1 or any(len(t) > digits for t in tokens[::2]):
        raise ValueError(f"at most {operands} operands of {digits} digits")
    value = int(tokens[0])
    for op, operand in zip(tokens[1::2], tokens[2::2]):
        value = _apply(value, op, int(operand))
    return str(value)


def resolve_levels(names) -> list[Level]:
    unknown = [n for n in names if n not in LEVELS]
    if unknown:
        raise ValueError(f"unknown arithmetic level(s) {unknown}; known: {sorted(LEVELS)}")
    if not names:
        raise ValueError("at least one arithmetic level is needed")
    return [LEVELS[n] for n in names]


TEST_RESERVE = 2000
"""By default, the first this-many problems of the stream are kept for test splits: a train
split never includes them, so the train split does not depend on the test size (up to
this many). `data.arithmetic_test_reserve` changes it (a larger test set needs a larger
reserve, and the tiny policy is then warm-started past it)."""


def problem_stream(seed: int = 0, levels=DEFAULT_LEVELS):
    """Distinct problems in a fixed seeded order, levels taking turns.

    A level whose distinct problems run out (1-digit addition has only 100) drops out of
    the rotation instead of repeating questions; the stream ends when every level has.
    """
    active = list(resolve_levels(levels))
    rng = random.Random(f"rayrep-arithmetic-{seed}")
    seen: set[str] = set()
    turn = 0
    while active:
        level = active[turn % len(active)]
        for _ in range(200):
            problem = _random_problem(rng, level)
            if problem.expression not in seen:
                seen.add(problem.expression)
                turn += 1
                yield problem
                break
        else:
            active.remove(level)


@functools.lru_cache(maxsize=4)
def stream_prefix(seed: int, levels: tuple[str, ...], count: int) -> tuple[Problem, ...]:
    """The first `count` problems of `problem_stream(seed, levels)` (fewer if it ends first),
    kept for the process: every run of a test session, or of a pipeline, loads the same
    splits, and drawing 22,000 problems takes about 0.9 s here."""
    return tuple(itertools.islice(problem_stream(seed, levels), count))


def make_splits(
    num_train: int, num_test: int, seed: int = 0, levels=DEFAULT_LEVELS, reserve: int = TEST_RESERVE
) -> tuple[list[Problem], list[Problem]]:
    """Deterministic, disjoint train and test problems, levels mixed evenly.

    Both are prefixes of fixed sequences: the test split is the start of the problem
    stream, the train split the part after `reserve` problems (or after the test split, if
    larger). So a smaller split is part of a larger one, growing either never changes the
    other, and the embedded tiny policy (warm-started on a train split of the same
    reserve) never saw a test problem of any test split up to `reserve` problems.
    """
    train_start = max(num_test, reserve)
    problems = stream_prefix(seed, tuple(levels), train_start + num_train)
    if len(problems) < train_start + num_train:
        raise ValueError(
            f"arithmetic levels {list(levels)} have too few distinct problems for {num_train} train "
            f"questions after {train_start} reserved for test"
        )
    return list(problems[train_start:]), list(problems[:num_test])


def arithmetic_prompts(
    split: str, num_train: int, num_test: int, seed: int = 0, levels=DEFAULT_LEVELS, reserve: int = TEST_RESERVE
) -> list[Prompt]:
    if split == "test":
        # The start of the stream: no need to draw the train split behind it (0.5 s at 20,000).
        problems = stream_prefix(seed, tuple(levels), num_test)
        if len(problems) < num_test:
            raise ValueError(f"arithmetic levels {list(levels)} have only {len(problems)} distinct problems, "
                             f"fewer than the {num_test} test questions asked for")
    else:
        problems, _ = make_splits(num_train, num_test, seed, levels, reserve)
    return [p.to_prompt(split, i) for i, p in enumerate(problems)]
