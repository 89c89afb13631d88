"""The evaluation's report: the table `jobs/eval.py` prints and the JSON file it writes."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from rayrep.config import Config
from rayrep.errors import InputError
from rayrep.types import Prompt


POOLED, MEAN = "all (pooled)", "mean of benchmarks"
"""The table's aggregate rows: every question weighs the same; every benchmark weighs the same."""


def format_table(metrics: Mapping[str, float]) -> str:
    """The evaluation's table, in percent: one row per benchmark (`data_source`) with its
    questions, k, avg@k, pass@1, pass@j for j in `pass_ks(k)` and maj@k; then the aggregates
    of `summarize_by_source`: pooled over all questions (avg@k, pass@j and maj@k only when
    every benchmark has the same k) and the plain mean over benchmarks (pass@1 and maj@k).
    "-" where a row has no such number. Pure: `metrics` as `evaluate` returns them."""
    per_source: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        source, slash, name = key.rpartition("/")
        if slash:
            per_source.setdefault(source, {})[name] = value

    def k_of(values: Mapping[str, float]) -> int | None:
        return next((int(name[4:]) for name in values if name.startswith("avg@")), None)

    extra_ks = sorted({int(name[5:]) for values in per_source.values() for name in values
                       if name.startswith("pass@")} - {1})
    header = ["benchmark", "questions", "k", "avg@k", "pass@1", *(f"pass@{j}" for j in extra_ks), "maj@k"]

    def percent(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.1f}"

    def row(label: str, questions: object, k: int | None, values: Mapping[str, float], maj: float | None) -> list[str]:
        return [label, "-" if questions is None else str(questions), "-" if k is None else str(k),
                percent(values.get(f"avg@{k}")), *(percent(values.get(f"pass@{j}")) for j in [1, *extra_ks]),
                percent(maj)]

    rows = [header]
    for source, values in sorted(per_source.items()):
        k = k_of(values)
        rows.append(row(source, int(values["questions"]), k, values, values.get(f"maj@{k}")))
    pooled = {name: value for name, value in metrics.items() if "/" not in name}
    k = k_of(pooled)
    rows.append(row(POOLED, int(pooled["questions"]), k, pooled, pooled.get(f"maj@{k}")))
    rows.append(row(MEAN, None, None, {"pass@1": metrics["mean_pass@1"]}, metrics.get("mean_maj@k")))
    widths = [max(len(r[column]) for r in rows) for column in range(len(header))]
    lines = ["  ".join([r[0].ljust(widths[0]), *(cell.rjust(width) for cell, width in zip(r[1:], widths[1:]))])
             for r in rows]
    lines.insert(len(per_source) + 1, "-" * len(lines[0]))
    return "\n".join(lines)


def eval_report(
    cfg: Config, checkpoint: str, prompts: Sequence[Prompt], metrics: Mapping[str, float], seconds: float
) -> dict:
    """Everything an evaluation produced, as `jobs/eval.py` writes it to JSON: the checkpoint,
    the prompt files (none: the embedded task's test split), the sampling settings (k per
    benchmark), every metric, the time taken, and the whole config."""
    gen = cfg.generator
    return {
        "checkpoint": checkpoint,
        "prompt_files": list(cfg.data.test_files),
        "questions": len(prompts),
        "sampling": {
            "temperature": gen.eval_temperature,
            "top_p": gen.eval_top_p,
            "max_tokens": gen.max_response_tokens,
            "k": {source: cfg.eval_samples(source) for source in sorted({p.data_source for p in prompts})},
            "seed": cfg.seed("generator"),
        },
        "metrics": dict(metrics),
        "eval_seconds": round(seconds, 1),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": cfg.to_dict(),
    }


def default_report_path(out_dir: str | Path, checkpoint: str, when: float | None = None) -> Path:
    """`<out_dir>/eval/<checkpoint name>-<YYYYmmdd-HHMMSS>.json`: a run's checkpoint
    (`<run>/checkpoints/<name>`) is named `<run>-<name>`, a hub id by its last part."""
    path = Path(checkpoint)
    name = path.name or "checkpoint"
    if path.parent.name == "checkpoints" and path.parent.parent.name:
        name = f"{path.parent.parent.name}-{name}"
    return Path(out_dir) / "eval" / f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(when))}.json"


def check_report_path(path: str | Path) -> None:
    """Refuse, before any sampling, a report path that cannot be written (a folder, or under a
    folder that cannot be created or written), with an `InputError` naming it."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"report {path}: is a folder; give a file name")
    existing = path.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"report {path}: cannot be written ({existing} is not a writable folder)")


def write_report(path: str | Path, report: Mapping) -> Path:
    """Write `report` as JSON to `path` atomically: a temporary file beside it, then a rename,
    so that no reader sees half a file and a failed write leaves none behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            json.dump(report, file, indent=2)
            file.write("\n")
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path
