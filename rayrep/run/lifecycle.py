"""A training run's lifecycle, around the loop of `rayrep.train`: its inputs checked and its
folder laid out before anything starts (`Run.open`); then started and supervised (`Run.start`:
the runtime and the algorithm built, the start taken, a learner's death reported, every actor
stopped), which gives the run whole (`Training`) and what follows each step
(`Training.end_step`: buffer snapshots, the evaluation schedule, the step's record,
checkpoints, progress)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoTokenizer

from rayrep.algos.registry import AlgorithmInputs, algorithm_class, check_inputs, make_algorithm
from rayrep.algos.interface import Algorithm
from rayrep.buffer.answers import Origin
from rayrep.buffer.replay import store_kind
from rayrep.config import Config
from rayrep.data import PromptSampler, encode_prompts, load_split
from rayrep.generator.engine import check_engine_batch
from rayrep.heap import long_lived
from rayrep.library_output import LIBRARY_LOG
from rayrep.machine import describe_path, numeric_path
from rayrep.models import config_overrides, resolve_policy
from rayrep.models.adapter import merge_adapter
from rayrep.progress import Progress
from rayrep.run.checkpoints import (BufferSnapshots, RunState, mark_final, restore_run, resume_point,
                                    save_run)
from rayrep.run.evaluation import Evaluations, known_start_evaluation
from rayrep.run.layout import RunFolder
from rayrep.run.log import MetricsLog, keep_metrics_until, step_fields
from rayrep.run.record import StepRecord
from rayrep.run.restarts import learner_death
from rayrep.roles.system import Runtime
from rayrep.verifier.group import check_checkers
from rayrep.verifier.tools import check_tools


@dataclass
class RunResult:
    run_dir: Path
    final_checkpoint: str
    evals: list[dict] = field(default_factory=list)
    """One record per evaluation: {"step", "test_pass@1", ...}."""


class Run:
    def __init__(self, cfg: Config, folder: RunFolder, policy: str, inputs: AlgorithmInputs, sampler: PromptSampler,
                 evaluations: Evaluations, checkpoint: Path | None, state: RunState | None, log=print):
        self.cfg, self.folder, self.policy, self.inputs = cfg, folder, policy, inputs
        self.sampler, self.evaluations, self.log = sampler, evaluations, log
        self.checkpoint, self.state = checkpoint, state
        """The checkpoint resumed from and its state (None: a new run)."""
        self.first_step = state.step + 1 if state else 1

    @staticmethod
    def open(cfg: Config, resume: bool = False, log=print) -> "Run":
        """Everything that can be wrong with the policy, the prompt sets, the algorithm's inputs
        (RLEP's pool, a shared pool to attach to), the checkpoint to resume from or another
        run's start fails here, before any actor starts and before the run's folder is written;
        then the folder gets the config, and a resumed run its sampler position, evaluations
        and log up to its checkpoint."""
        policy = resolve_policy(cfg, log=log)
        check_engine_batch(cfg, policy)  # a step's sequences in one wave of each CPU engine
        with long_lived():  # the prompt sets and their token ids: as long as the run
            tokenizer = AutoTokenizer.from_pretrained(policy)
            train_prompts, test_prompts = load_split(cfg.data, "train"), load_split(cfg.data, "test")
            prompt_ids = dict(zip((p.uid for p in train_prompts),
                                  encode_prompts(tokenizer, train_prompts, cfg.data.max_prompt_tokens)))
            test_ids = encode_prompts(tokenizer, test_prompts, cfg.data.max_prompt_tokens)
        folder = RunFolder.of(cfg)
        # The answers this run stores carry its folder, the checkpoint it started from (its
        # policy versions count the updates since) and its sampling temperature.
        origin = Origin(str(folder.path.resolve()), str(policy), cfg.generator.temperature)
        inputs = check_inputs(cfg, train_prompts, prompt_ids, origin)
        check_checkers(cfg, [*train_prompts, *test_prompts])  # a user's checker: loaded and called once
        check_tools(cfg, tokenizer, str(policy))  # the template's tool role, a turn's budget, a user's tool loaded
        if algorithm_class(cfg).replays:
            store_kind(cfg).check_before_start(cfg, prompt_ids)
        checkpoint, state = resume_point(cfg, folder) if resume else (None, None)
        known_start = known_start_evaluation(cfg) if cfg.run.start_eval and state is None else None

        folder.path.mkdir(parents=True, exist_ok=True)
        folder.config.write_text(cfg.to_json())
        machine = numeric_path()
        folder.note_machine(state.step if state else 0, machine)
        log(f"machine: {describe_path(machine)}")  # what a figure that differs elsewhere depends on
        sampler = PromptSampler.of_run(cfg, train_prompts)
        if state is not None:
            sampler.restore(state.sampler)
            keep_metrics_until(folder.metrics, state.step)
        evaluations = Evaluations(cfg, test_prompts, test_ids, state.evals if state else None, known_start)
        return Run(cfg, folder, policy, inputs, sampler, evaluations, checkpoint, state, log)

    @contextmanager
    def start(self) -> Iterator[Training]:
        """The run, started and fully built (`Training`): its actors (a resumed run's
        generators from its checkpoint's weights, its learners from the base policy, whose
        every weight the learner checkpoint's fp32 masters then replace), its algorithm, its
        log open, and its start taken (step 0's evaluation, or the checkpoint restored); and,
        however the block ends, stopped. A learner that died turns the error into
        `LearnerDied`: the run cannot go on, but its last checkpoint can."""
        runtime = Runtime.start(self.cfg, self.policy, policy_version=self.state.policy_version if self.state else 0,
                                generator_path=str(self.checkpoint) if self.checkpoint else None,
                                log_dir=self.folder.path)
        self.log(f"run folder: {self.folder.path} (libraries' output: {LIBRARY_LOG} there)")
        metrics = MetricsLog(self.folder.path, self.cfg.to_dict(), self.cfg.logging,
                             resumed_at=self.state.step if self.state else None, log=self.log)
        training = None
        try:
            algorithm = make_algorithm(self.cfg, self.inputs, runtime.buffer, runtime.learners, self.sampler)
            training = Training(self, runtime, algorithm, metrics)
            yield training
        except Exception as error:
            in_progress, saved = (self.first_step, self.checkpoint) if training is None else \
                (training.step_in_progress, training.saved)
            death = learner_death(runtime, self.folder, in_progress, saved)
            if death is not None:
                raise death from error
            raise
        finally:
            metrics.close()
            runtime.shutdown()


class Training:
    """A started run, whole: what each step reads (`runtime`, `algorithm`) and what follows
    each step (`end_step`: buffer snapshots, the evaluation schedule, the step's record,
    checkpoints, progress). Built by `Run.start`, with the run's start taken: step 0's
    evaluation for a new run, the checkpoint restored for a resumed one. The buffer's first
    snapshot (RLEP's pool, a resumed buffer) is what a shard that dies comes back with."""

    def __init__(self, run: Run, runtime: Runtime, algorithm: Algorithm, metrics: MetricsLog):
        self.cfg, self.folder, self.sampler, self.log = run.cfg, run.folder, run.sampler, run.log
        self.evaluations = run.evaluations
        self.runtime, self.algorithm, self.metrics = runtime, algorithm, metrics
        self.first_step = run.first_step
        self.last_step = run.first_step - 1
        """The last step ended (`end_step`)."""
        self.saved = run.checkpoint
        """The latest complete checkpoint."""
        self.snapshots = BufferSnapshots(runtime.buffer, self.folder, self.cfg.replay.snapshot_every)
        self.progress = Progress(self.cfg.run.steps, "train", unit="step", log=self.log, done=self.last_step)
        if run.state is None:
            metrics.log(self.evaluations.run(runtime, step=0))
            self.progress.update(0, **step_fields(self.evaluations.records[-1]))  # step 0 is not a step: no ETA
        else:
            restore_run(run.checkpoint, run.state, runtime, algorithm)
            self.log(f"resumed {self.folder.path} at step {run.state.step} (policy version "
                     f"{run.state.policy_version}) from {run.checkpoint.name}")
            self.progress.update(run.state.step)
        self.snapshots.take()

    @property
    def step_in_progress(self) -> int:
        """The step after the last one ended, or the last step while the run finishes (what a
        learner's death reports)."""
        return min(self.last_step + 1, self.cfg.run.steps)

    def steps(self) -> range:
        return range(self.first_step, self.cfg.run.steps + 1)

    def end_step(self, record: StepRecord) -> None:
        """After step `record.step`: the scheduled buffer snapshot, the evaluation when one is
        due, the record in the log (before the checkpoint: a checkpoint's steps are all in the
        log), the checkpoint when one is due, the progress line."""
        step = record.step
        self.snapshots.after_step(step, record)
        if self.evaluations.due(step):
            record.add(self.evaluations.run(self.runtime, step))
        self.metrics.log(record.as_dict())
        if self.cfg.saves_checkpoint(step):
            self.save(step)
        self.progress.update(step, **record.progress_fields())
        for count, message in record.notes.items():
            self.log(f"step {step}: {count} {record.counts.get(count, 0)}, the first: {message}")
        self.last_step = step

    def save(self, step: int) -> None:
        self.saved = save_run(self.cfg, self.folder, step, self.runtime, self.algorithm, self.sampler,
                              self.snapshots, self.evaluations.records)

    def finish(self) -> RunResult:
        """The run's final checkpoint marked (a run with no steps to take saves the policy as
        it is), a LoRA run's also merged into its base if asked (`learner.lora_merge`:
        `checkpoints/final-merged`, in the driver's memory), and its evaluations written."""
        if self.saved is None:
            self.save(self.cfg.run.steps)
        final = mark_final(self.folder.path, self.saved)
        if self.cfg.learner.lora_merge:  # the adapter merged into its base: a whole checkpoint beside `final`
            merge_adapter(final, final.with_name("final-merged"), getattr(torch, self.cfg.model.dtype),
                          config_overrides(self.cfg, str(final)))
        self.evaluations.write(self.folder)
        return RunResult(self.folder.path, str(final), self.evaluations.records)
