"""The run's evaluations of its test split: when they happen (before the first step, every
`run.eval_every` steps, and after the last), the step-0 one taken from another run of the
same start (`run.start_eval`), and every record so far (what `evals.json` holds)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

from rayrep.config import Config, ConfigError, differing_fields
from rayrep.eval.evaluate import evaluate
from rayrep.run.layout import RunFolder
from rayrep.roles.system import Runtime
from rayrep.types import Prompt


class Evaluations:
    def __init__(self, cfg: Config, prompts: Sequence[Prompt], prompt_ids: Sequence[list[int]],
                 records: list[dict] | None = None, known_start: dict | None = None):
        self.cfg, self.prompts, self.prompt_ids = cfg, prompts, prompt_ids
        self.records: list[dict] = list(records or [])
        self.known_start = known_start
        """The step-0 evaluation of another run with this run's start, to reuse rather than repeat."""

    def due(self, step: int) -> bool:
        """Whether training step `step` (1 on) ends with an evaluation; the start's is taken when the run starts (`Training`)."""
        every = self.cfg.run.eval_every
        return bool(every and step % every == 0) or step == self.cfg.run.steps

    def run(self, runtime: Runtime, step: int) -> dict:
        """Evaluate the generators' current weights at `step` (or reuse the known start) and
        keep the record: `test_<metric>` for pass@k, avg@k, maj@k; `eval_generator_*` counts."""
        if step == 0 and self.known_start is not None:  # the same start, evaluated by another run
            record = self.known_start
        else:
            start = time.perf_counter()
            summary = evaluate(runtime, self.cfg, self.prompts, self.prompt_ids)
            record = {"step": step, "time_eval": time.perf_counter() - start}
            record.update({f"test_{k}": v for k, v in summary.items() if "@" in k})
            record.update({f"eval_{k}": v for k, v in summary.items() if k.startswith("generator_")})
        self.records.append(record)
        return record

    def write(self, folder: RunFolder) -> None:
        folder.evals.write_text(json.dumps(self.records, indent=2))


START_SECTIONS = ("model", "data", "generator", "verifier", "tools")
"""What the step-0 evaluation depends on besides `run.seed`: the policy, the test set, the
sampling (and the tool its answers call) and the scoring."""


def known_start_evaluation(cfg: Config) -> dict:
    """The step-0 evaluation of the run folder `run.start_eval`, checked to be this run's
    own start: every field of `START_SECTIONS` and `run.seed` equal, so the policy, the test
    questions, their sampling seeds and the scoring are the same and evaluating again would
    draw the same answers. Refused with the first field that differs, or the file missing."""
    folder = RunFolder(Path(cfg.run.start_eval))
    try:
        other = json.loads(folder.config.read_text(encoding="utf-8"))
        evals = json.loads(folder.evals.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"run.start_eval: {folder.path} is not a finished run's folder ({err})") from None
    if not (isinstance(evals, list) and evals and isinstance(evals[0], dict) and evals[0].get("step") == 0):
        raise ConfigError(f"run.start_eval: {folder.evals} has no step-0 evaluation")
    mine = json.loads(cfg.to_json())  # as the other run saved its own (lists, not tuples)
    differences = differing_fields(
        other, mine, keep=lambda name: name.split(".")[0] in START_SECTIONS or name == "run.seed")
    if differences:
        name, there, here = differences[0]
        raise ConfigError(f"run.start_eval: {folder.path} started otherwise: {name} = {there!r} there, {here!r} here")
    return {**evals[0], "time_eval": 0.0}
