"""Metrics: weighted sums that merge across ranks, a JSONL log, optional wandb, progress lines."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path


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


class MetricsLog:
    """One JSON object per line in `<run_dir>/metrics.jsonl`, mirrored to wandb when asked."""

    def __init__(self, run_dir: Path, config_dict: dict, use_wandb: bool = False, project: str = "rayrep"):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a", buffering=1)
        self.wandb = None
        if use_wandb:
            import wandb

            self.wandb = wandb.init(project=project, name=Path(run_dir).name, config=config_dict, dir=str(run_dir))

    def log(self, record: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        clean.setdefault("time", round(time.time(), 3))
        self.file.write(json.dumps(clean) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in clean.items() if isinstance(v, (int, float))}, step=record.get("step"))

    def close(self) -> None:
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def progress_line(record: dict) -> str:
    """A one-line summary of a training step for the console."""
    parts = [f"step {record['step']:>4}"]
    for key, label, fmt in (
        ("reward_mean", "reward", "{:+.3f}"),
        ("accuracy", "acc", "{:.3f}"),
        ("response_length", "len", "{:.1f}"),
        ("fresh_entropy", "ent", "{:.3f}"),
        ("grad_norm", "gnorm", "{:.2f}"),
        ("test_pass@1", "test pass@1", "{:.3f}"),
        ("time_step", "s", "{:.1f}"),
    ):
        if record.get(key) is not None:
            parts.append(f"{label} {fmt.format(record[key])}")
    return " | ".join(parts)


def compare_runs(baseline: list[dict], other: list[dict], metric: str = "test_pass@1") -> dict:
    """Peak and final of both eval curves, and the first step where `other` reaches the baseline's peak."""
    def curve(evals):
        return [(e["step"], e[metric]) for e in evals if metric in e]

    base, mine = curve(baseline), curve(other)
    base_peak_step, base_peak = max(base, key=lambda p: (p[1], -p[0]))
    mine_peak_step, mine_peak = max(mine, key=lambda p: (p[1], -p[0]))
    reached = next((step for step, value in mine if value >= base_peak), None)
    return {
        "metric": metric,
        "baseline": {"peak": base_peak, "peak_step": base_peak_step, "final": base[-1][1], "final_step": base[-1][0]},
        "other": {"peak": mine_peak, "peak_step": mine_peak_step, "final": mine[-1][1], "final_step": mine[-1][0]},
        "other_reaches_baseline_peak_at": reached,
    }


def plot_curves(curves: dict[str, list[dict]], path: str | Path, metric: str = "test_pass@1", title: str = "") -> Path:
    """A PNG of `metric` against step, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for name, evals in curves.items():
        points = [(e["step"], e[metric]) for e in evals if metric in e]
        ax.plot([s for s, _ in points], [100 * v for _, v in points], marker="o", label=name)
    ax.set_xlabel("training step")
    ax.set_ylabel(f"{metric.removeprefix('test_')} on the test set (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def comparison_table(names: tuple[str, str], comparison: dict) -> str:
    base, other = names
    b, o = comparison["baseline"], comparison["other"]
    reached = comparison["other_reaches_baseline_peak_at"]
    lines = [
        f"{'run':<12}{'peak ' + comparison['metric']:>22}{'at step':>9}{'final':>9}",
        f"{base:<12}{100 * b['peak']:>21.1f}%{b['peak_step']:>9}{100 * b['final']:>8.1f}%",
        f"{other:<12}{100 * o['peak']:>21.1f}%{o['peak_step']:>9}{100 * o['final']:>8.1f}%",
    ]
    if reached is None:
        lines.append(f"{other} did not reach the {base} peak ({100 * b['peak']:.1f}%) within {o['final_step']} steps")
    else:
        lines.append(f"{other} first reached the {base} peak ({100 * b['peak']:.1f}%, step {b['peak_step']}) "
                     f"at step {reached}")
    return "\n".join(lines)
