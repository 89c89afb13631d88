"""The driver's timed phases of a step, and one step's wall time split into them: what the
step-time plot stacks (`rayrep.plots.step_times`) and what the run exports as each phase's
share (`rayrep.run.sinks.RayMetricsSink`)."""

from __future__ import annotations

PHASES = ("plan", "generate", "verify", "hand_over", "select", "kl_reward", "build", "old_logprobs", "ref_logprobs",
          "update", "sync")
"""The driver's timed phases of a step, in the order they run."""

NESTED_PHASES = {"old_logprobs": "update", "ref_logprobs": "update", "kl_reward": "build"}
"""Phases timed inside another one: the learners take the old log-probs, and the KL's reference
log-probs, within the update call; the KL in the reward is taken within the algorithm's build."""


def phase_seconds(record: dict, phases: list[str] | tuple[str, ...]) -> dict[str, float]:
    """A step record's seconds in each of `phases`, nested phases split out of their parent
    (`update` is then the update call without its old log-probs), plus `other`: what the
    step spent outside the timed phases (the algorithm's `after_update`, the buffer writes),
    so that they add up to `time_step`."""
    seconds = {p: record.get(f"time_{p}") or 0.0 for p in phases}
    for child, parent in NESTED_PHASES.items():
        if child in seconds and parent in seconds:
            seconds[parent] = max(0.0, seconds[parent] - seconds[child])
    step = record.get("time_step") or 0.0
    return {**seconds, "other": max(0.0, step - sum(seconds.values())) if step else 0.0}
