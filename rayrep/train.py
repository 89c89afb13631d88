"""The driver: the single controller of a training run, and the loop it runs.

    plan -> generate (vLLM) -> verify (math-verify) -> build (+ replay) -> update -> sync

Each step is written out below in that order, with typed calls on the actor groups. What
surrounds the loop lives elsewhere: a run's folder, resume, checkpoints, evaluations and
restarts after a learner dies in `rayrep.run`; a step's rounds (dynamic-sampling refills, asynchronous
look-ahead, stale drops) in `rayrep.rollouts`; the actors in `rayrep.roles`.
"""

from __future__ import annotations

from rayrep.config import Config
from rayrep.plots import write_plots
from rayrep.rollouts import Rollouts
from rayrep.run.lifecycle import Run, RunResult
from rayrep.run.record import StepRecord
from rayrep.run.restarts import restarting


def train(cfg: Config, log=print, resume: bool = False) -> RunResult:
    """Run `cfg.run.steps` steps; `resume`: continue the run in its folder from its latest
    complete checkpoint (`rayrep.run.checkpoints`), as if it had never stopped."""
    run = Run.open(cfg, resume, log)  # every input checked; nothing started yet
    with run.start() as training:  # the actors and the algorithm; step 0's evaluation, or the checkpoint restored
        runtime, algorithm = training.runtime, training.algorithm
        rollouts = Rollouts(cfg, runtime, algorithm, run.sampler, run.inputs.prompt_ids)
        for step in training.steps():
            record = StepRecord(step)
            with record.timed("step"):
                groups, dropped = rollouts.collect(step, record)  # plan -> generate -> verify
                with record.timed("hand_over"):  # colocated GPUs: the engines sleep, the learners take them
                    runtime.hand_over_to_learners()
                groups, chosen = algorithm.join_replays(groups)  # ExGRPO's entropy choice, on the learners
                record.add(chosen)
                with record.timed("build"):
                    step_batch = algorithm.build(groups, dropped, step=step)
                rollouts.start_ahead(step)  # asynchronous rollouts sample on these weights meanwhile
                version = runtime.version  # the policy the update starts from
                with record.timed("update"):
                    record.add(runtime.learners.update(step_batch.recipe, step_batch.loss, runtime.idle_core_offers()))
                with record.timed("sync"):
                    record.add(runtime.sync_weights())
                    record.add(runtime.hand_over_to_generators())  # (and the step's GPU memory, where it is modelled)
                record.add(algorithm.after_update(step, step_batch))  # what enters and leaves the buffer
                record.add(run.sampler.observe(step_batch.seen))  # the pruner: questions that taught nothing sit out
                record.add(step_batch.metrics)
                record.add(rollouts.stats(step_batch, record, version))
            training.end_step(record)  # evaluate, log, save when due
        result = training.finish()
    if cfg.logging.plots:
        write_plots(result.run_dir, log)
    return result


def train_resuming(cfg: Config, log=print, resume: bool = False, restarts: int = 0) -> RunResult:
    """`train`, started again from the latest checkpoint when a learner dies, up to `restarts` times."""
    return restarting(lambda cfg, resume: train(cfg, log=log, resume=resume), cfg, log, resume, restarts)
