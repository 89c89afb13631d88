"""The formulas of evaluation and of seeded studies, pure and cheap to import: avg@k,
unbiased pass@k, the k reported, the standard error, and the per-benchmark summary."""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence

__all__ = ["avg_at_k", "mean_and_se", "pass_at_k", "pass_ks", "standard_error", "summarize", "summarize_by_source"]


def _as_count(name: str, value: object) -> int:
    """`value` as a non-negative int (numpy integers welcome), or an error naming `name`."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        count = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if count < 0:
        raise ValueError(f"{name} must be >= 0, got {count}")
    return count


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from n samples of which c are correct.

    The chance that at least one of k samples drawn without replacement from the n is
    correct: ``1 - C(n-c, k) / C(n, k)`` (Chen et al., 2021).
    """
    n, c, k = _as_count("n", n), _as_count("c", c), _as_count("k", k)
    if k == 0:
        raise ValueError("k must be >= 1, got 0")
    if k > n:
        raise ValueError(f"k must be <= n, got k={k} > n={n}")
    if c > n:
        raise ValueError(f"c must be <= n, got c={c} > n={n}")
    if n - c < k:
        return 1.0  # every draw of k includes a correct sample
    # C(n-c, k) / C(n, k) == prod_{i=n-c+1..n} (1 - k/i): no huge binomials, no overflow.
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def _correctness_rows(correct: Iterable[Iterable[object]]) -> list[list[float]]:
    """Validate a problems x samples matrix of 0/1 (or bools) into lists of floats."""
    rows = []
    for index, row in enumerate(correct):
        try:
            values = [float(v) for v in row]
        except TypeError:
            raise ValueError(
                f"correct[{index}] is not a row of samples: pass one row of 0/1 per problem (2-D)"
            ) from None
        if not values:
            raise ValueError(f"correct[{index}] is empty: every problem needs at least one sample")
        bad = next((v for v in values if v not in (0.0, 1.0)), None)
        if bad is not None:
            raise ValueError(
                f"correct[{index}] holds {bad!r}: expected 0/1 or bools (for rewards, use r > 0)"
            )
        rows.append(values)
    if not rows:
        raise ValueError("correct is empty: need at least one problem")
    return rows


def avg_at_k(correct: Iterable[Iterable[object]]) -> float:
    """Mean correctness over each problem's samples, averaged over problems.

    `correct` holds one row of 0/1 (or bools) per problem: a list of lists or a 2-D array.
    Rows may differ in length; each problem weighs the same.
    """
    rows = _correctness_rows(correct)
    return sum(sum(row) / len(row) for row in rows) / len(rows)


def summarize(correct: Iterable[Iterable[object]], ks: Sequence[int] | None = None) -> dict[str, float]:
    """Metrics of a problems x n-samples correctness matrix, for logs and reports.

    Returns ``{"avg@n": ..., "pass@k": ... for each k in ks, "num_problems": ...,
    "samples_per_problem": n}``, pass@k being the mean over problems of `pass_at_k`.
    `ks` defaults to (1, n). Every problem must have the same number of samples n.
    """
    rows = _correctness_rows(correct)
    n = len(rows[0])
    for index, row in enumerate(rows):
        if len(row) != n:
            raise ValueError(
                f"correct[{index}] has {len(row)} samples but correct[0] has {n}: summarize needs equal rows"
            )
    wanted = sorted({1, n} if ks is None else {_as_count("ks", k) for k in ks})
    for k in wanted:
        if not 1 <= k <= n:
            raise ValueError(f"ks must lie between 1 and the {n} samples per problem, got {k}")
    summary: dict[str, float] = {f"avg@{n}": avg_at_k(rows)}
    for k in wanted:
        summary[f"pass@{k}"] = sum(pass_at_k(n, int(sum(row)), k) for row in rows) / len(rows)
    summary["num_problems"] = len(rows)
    summary["samples_per_problem"] = n
    return summary


def pass_ks(n: int) -> list[int]:
    """The k of pass@k reported for n samples per question: 1, the powers of two up to n, and n."""
    return sorted({1, n} | {2**i for i in range(1, n.bit_length()) if 2**i <= n})


def standard_error(values: Sequence[float]) -> float:
    """The standard error of the mean of `values` (sample standard deviation / sqrt(n)); NaN for
    fewer than two (one value says nothing about the spread)."""
    n = len(values)
    if n < 2:
        return math.nan
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def summarize_by_source(
    sources: Sequence[str], correct: Sequence[Sequence[object]], majority: Sequence[bool | None]
) -> dict[str, float]:
    """Every metric per benchmark (`data_source`), and the aggregates the papers report.

    Per source s with k samples per question: `s/avg@k`, `s/pass@j` for j in `pass_ks(k)`,
    `s/maj@k`, `s/questions`. Aggregates: `pass@1`, pooled over all questions (each
    question weighs the same), with its standard error `pass@1_se`; `mean_pass@1` and
    `mean_maj@k`, the plain mean of the benchmarks' scores (ExGRPO's average, where a
    large benchmark does not dominate). When every question has the same k, the pooled `avg@k`, `pass@j` and `maj@k` too (RLEP
    reports its benchmarks one by one: the per-source entries). A question whose majority is
    None (its checker reads no answer to vote on) has no maj@k: nor has its source, nor the
    pooled figure.
    """
    if not (len(sources) == len(correct) == len(majority)):
        raise ValueError(f"sources, correct and majority differ in length: {len(sources)}, {len(correct)}, {len(majority)}")
    by_source: dict[str, list[int]] = {}
    for index, source in enumerate(sources):
        by_source.setdefault(source, []).append(index)
    out: dict[str, float] = {}
    pass1, votes = [], []
    for source, rows in sorted(by_source.items()):
        matrix = [correct[i] for i in rows]
        k = len(matrix[0])
        part = summarize(matrix, ks=pass_ks(k))
        out.update({f"{source}/{name}": value for name, value in part.items() if "@" in name})
        if all(majority[i] is not None for i in rows):
            out[f"{source}/maj@{k}"] = sum(bool(majority[i]) for i in rows) / len(rows)
            votes.append(out[f"{source}/maj@{k}"])
        out[f"{source}/questions"] = len(rows)
        pass1.append(part["pass@1"])
    per_question = [sum(map(float, row)) / len(row) for row in correct]
    out["pass@1"] = sum(per_question) / len(per_question)
    # The standard error of pass@1 as an estimate of the policy's accuracy on questions of
    # this kind: the spread of per-question scores (question difficulty and sampling noise
    # together) over the square root of the number of questions.
    out["pass@1_se"] = standard_error(per_question)
    out["mean_pass@1"] = sum(pass1) / len(pass1)
    if votes:
        out["mean_maj@k"] = sum(votes) / len(votes)
    widths = {len(row) for row in correct}
    if len(widths) == 1:
        (k,) = widths
        out.update({name: value for name, value in summarize(correct, ks=pass_ks(k)).items() if "@" in name})
        if None not in majority:
            out[f"maj@{k}"] = sum(map(bool, majority)) / len(majority)
    out["questions"] = len(correct)
    return out


def mean_and_se(values: Sequence[float]) -> tuple[float, float]:
    """The mean and its standard error (`standard_error`: NaN for one value)."""
    if not values:
        raise ValueError("mean_and_se of no values")
    return sum(values) / len(values), standard_error(values)
