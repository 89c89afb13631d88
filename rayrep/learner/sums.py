"""Metric sums the learner ranks add up before anything travels back to the driver."""

from __future__ import annotations

class MetricSums:
    """Accumulates metrics over micro-batches and ranks so that merging stays exact.

    `add(name, total, weight)`: the reported value is sum(total) / sum(weight) (a weighted
    mean: pass a fraction times its token count and the token count). `count(name, n)`:
    reported as a plain sum. `extreme(name, value)`: min or max by the name's suffix.
    """

    def __init__(self, state: dict | None = None):
        state = state or {}
        self.totals: dict[str, float] = dict(state.get("totals", {}))
        self.weights: dict[str, float] = dict(state.get("weights", {}))
        self.counts: dict[str, float] = dict(state.get("counts", {}))
        self.extremes: dict[str, float] = dict(state.get("extremes", {}))

    def add(self, name: str, total: float, weight: float) -> None:
        self.totals[name] = self.totals.get(name, 0.0) + total
        self.weights[name] = self.weights.get(name, 0.0) + weight

    def count(self, name: str, n: float = 1.0) -> None:
        self.counts[name] = self.counts.get(name, 0.0) + n

    def extreme(self, name: str, value: float) -> None:
        pick = min if name.endswith("_min") else max
        self.extremes[name] = pick(self.extremes.get(name, value), value)

    def add_policy_metrics(self, metrics: dict[str, float]) -> None:
        """Fold in one micro-batch's `policy_loss` metrics, weighting by the tokens they cover."""
        fresh, replay = metrics.get("fresh_tokens", 0.0), metrics.get("replay_tokens", 0.0)
        self.count("fresh_tokens", fresh)
        self.count("replay_tokens", replay)
        for name, value in metrics.items():
            if name.endswith("_tokens"):
                continue
            if name.endswith(("_min", "_max")):
                self.extreme(name, value)
                continue
            weight = fresh if name.startswith("fresh_") else replay if name.startswith("replay_") else fresh + replay
            self.add(name, value * weight, weight)

    def merge(self, other: "MetricSums") -> "MetricSums":
        for name, total in other.totals.items():
            self.add(name, total, other.weights[name])
        for name, n in other.counts.items():
            self.count(name, n)
        for name, value in other.extremes.items():
            self.extreme(name, value)
        return self

    def state(self) -> dict:
        return {"totals": self.totals, "weights": self.weights, "counts": self.counts, "extremes": self.extremes}

    def result(self) -> dict[str, float]:
        out = {name: total / self.weights[name] for name, total in self.totals.items() if self.weights[name] > 0}
        out.update(self.counts)
        out.update(self.extremes)
        return out
