"""Metric sums the learner ranks add up before anything travels back to the driver."""

from __future__ import annotations

from rayrep.learner.loss import LossMetrics


class MetricSums:
    """Accumulates metrics over micro-batches and ranks so that merging stays exact.

    `add(name, total, weight)`: the reported value is sum(total) / sum(weight) (a weighted
    mean: pass a fraction times its token count and the token count). `count(name, n)`:
    reported as a plain sum. `smallest(name, value)`, `largest(name, value)`: the extremes.
    """

    def __init__(self, state: dict | None = None):
        state = state or {}
        self.totals: dict[str, float] = dict(state.get("totals", {}))
        self.weights: dict[str, float] = dict(state.get("weights", {}))
        self.counts: dict[str, float] = dict(state.get("counts", {}))
        self.minima: dict[str, float] = dict(state.get("minima", {}))
        self.maxima: dict[str, float] = dict(state.get("maxima", {}))

    def add(self, name: str, total: float, weight: float) -> None:
        self.totals[name] = self.totals.get(name, 0.0) + total
        self.weights[name] = self.weights.get(name, 0.0) + weight

    def count(self, name: str, n: float = 1.0) -> None:
        self.counts[name] = self.counts.get(name, 0.0) + n

    def smallest(self, name: str, value: float) -> None:
        self.minima[name] = min(self.minima.get(name, value), value)

    def largest(self, name: str, value: float) -> None:
        self.maxima[name] = max(self.maxima.get(name, value), value)

    def add_loss_metrics(self, metrics: LossMetrics) -> None:
        """Fold in one micro-batch's `policy_loss` metrics: each mean with the count of the
        tokens it is a mean over."""
        for name, (total, count) in metrics.means.items():
            self.add(name, total, count)
        for name, n in metrics.counts.items():
            self.count(name, n)
        for name, value in metrics.smallest.items():
            self.smallest(name, value)
        for name, value in metrics.largest.items():
            self.largest(name, value)

    def merge(self, other: "MetricSums") -> "MetricSums":
        for name, total in other.totals.items():
            self.add(name, total, other.weights[name])
        for name, n in other.counts.items():
            self.count(name, n)
        for name, value in other.minima.items():
            self.smallest(name, value)
        for name, value in other.maxima.items():
            self.largest(name, value)
        return self

    def state(self) -> dict:
        return {"totals": self.totals, "weights": self.weights, "counts": self.counts, "minima": self.minima,
                "maxima": self.maxima}

    def result(self) -> dict[str, float]:
        out = {name: total / self.weights[name] for name, total in self.totals.items() if self.weights[name] > 0}
        out.update(self.counts)
        out.update(self.minima)
        out.update(self.maxima)
        return out
