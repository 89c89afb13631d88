"""The generation pruner: questions whose groups no longer teach sit out, and come back to be checked.

A group teaches only if its fresh answers disagree (some right, some wrong); a group of
all-right or all-wrong answers has zero advantage everywhere and only costs generation.
After `after` visits in a row whose groups had no signal, a question sits out its next
`skip` visits (the sampler passes it by and draws another in its place), then is generated
for once more: a re-check. A re-check without signal confirms it, and the next pause is
`growth` times longer; a group with signal, at any visit, clears its record.

Pauses count the sampler's visits, not steps: the sampler meets a question once per epoch,
so a pause of fewer steps than an epoch would skip nothing, and a longer one skips a whole
number of visits anyway; counting visits says what happens.

Why: "Learning-Zone Energy" (arXiv 2605.17003) skips prompts the policy already solves and
re-checks them now and then, keeping about 40% of the data per step at equal accuracy;
here the same rule also covers questions every answer gets wrong, which on a weak policy
are most of the zero-signal groups. What it saves on a given task is measured, not assumed
(docs/study.md).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class QuestionRecord:
    quiet: int = 0
    """Visits in a row whose group had no signal."""
    confirmations: int = 0
    """Pauses so far that a re-check confirmed (the next pause is growth ** this x skip)."""
    sitting_out: int = 0
    """Visits still to pass it by."""
    rechecking: bool = False
    """Drawn again after a pause, its verdict not seen yet."""


class GenerationPruner:
    """Which questions the sampler passes by, from what their groups showed; see the module docstring."""

    def __init__(self, after: int, skip: int = 1, growth: float = 2.0):
        if after < 1 or skip < 1 or growth < 1:
            raise ValueError(f"GenerationPruner: after={after} and skip={skip} must be >= 1, growth={growth} >= 1")
        self.after, self.skip, self.growth = after, skip, growth
        self.records: dict[str, QuestionRecord] = {}
        self.counts: Counter = Counter()
        """Visits passed by and re-checks drawn since `take_counts`."""

    def pause(self, confirmations: int) -> int:
        """Visits a question sits out after `confirmations` confirmed pauses."""
        return max(1, round(self.skip * self.growth ** confirmations))

    def passes_by(self, uid: str) -> bool:
        """The sampler visits `uid`: whether to pass it by (counted), else draw it (a re-check
        if it has just sat out a pause)."""
        record = self.records.get(uid)
        if record is None:
            return False
        if record.sitting_out:
            record.sitting_out -= 1
            record.rechecking = record.sitting_out == 0
            self.counts["pruned"] += 1
            return True
        if record.rechecking:
            self.counts["rechecks"] += 1
        return False

    def observe(self, groups: Iterable[tuple[str, Iterable[bool]]]) -> None:
        """The verdicts of a step's fresh answers, per question: (question id, correct flags)."""
        for uid, correct in groups:
            signal = len(set(correct)) > 1
            record = self.records.setdefault(uid, QuestionRecord())
            if signal:
                del self.records[uid]  # it teaches: its record starts over
                continue
            was_recheck, record.rechecking = record.rechecking, False
            record.quiet += 1
            if was_recheck:
                record.confirmations += 1
            if record.quiet >= self.after:
                record.sitting_out = self.pause(record.confirmations)

    def take_counts(self) -> dict[str, float]:
        """Step metrics: visits passed by and re-checks drawn since the last call, and the
        questions sitting out now."""
        taken = {"pruner_skipped": float(self.counts["pruned"]), "pruner_rechecks": float(self.counts["rechecks"]),
                 "pruner_sitting_out": float(sum(r.sitting_out > 0 for r in self.records.values()))}
        self.counts = Counter()
        return taken

    def state(self) -> dict:
        return {"records": {uid: [r.quiet, r.confirmations, r.sitting_out, int(r.rechecking)]
                            for uid, r in sorted(self.records.items())},
                "counts": dict(self.counts)}

    def restore(self, state: dict) -> None:
        self.records = {uid: QuestionRecord(q, c, s, bool(r)) for uid, (q, c, s, r) in state["records"].items()}
        self.counts = Counter(state.get("counts", {}))
