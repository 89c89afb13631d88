"""Checkpoints and resume, with real failures, in one job as a long run meets them: its
generator, a replay shard and its learner are killed in turn (`--auto-resume` restarts it
from step 2 after the learner's death), then the driver is SIGKILLed while it saves step 4.
The job leaves the checkpoint before current, ends as the uninterrupted run ends once
resumed, with each death counted. One uninterrupted run and this one serve every test; both
train a LoRA adapter. The run takes partial rollouts: every step stops its slowest answers,
so each death meets answers paused. (A run resumed on another number of learners:
tests/test_replay_runs.py's answer-level run.)"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow.parquet as pq
import pytest

from safetensors import safe_open

from rayrep.models.adapter import is_adapter
from rayrep.run.checkpoints import read_run_state, step_checkpoints
from rayrep.run.log import read_metrics

REPO = Path(__file__).resolve().parent.parent
# ExGRPO, so that the buffer, its random draws and the algorithm's switch are all in play.
RUN = ["--algorithm.name", "exgrpo", "--algorithm.std_normalize", "false", "--algorithm.exgrpo.start_pass_rate", "0",
       "--run.steps", "4", "--run.eval_every", "2", "--run.save_every", "2", "--run.keep_checkpoints", "0",
       "--algorithm.prompts_per_step", "16", "--learner.mini_batch_prompts", "8", "--data.arithmetic_test_size", "32",
       "--data.arithmetic_train_size", "40",  # step 3 starts a second epoch, without the questions retired in the first
       "--logging.plots", "false",
       # Partial rollouts: each step stops its slowest groups and the next finishes them, so
       # the learner dies (step 3) with answers paused; the step-4 checkpoint asks them again.
       "--run.partial_rollouts", "0.5",
       # The generation pruner: from step 3 (the second epoch) it passes by questions whose
       # groups taught nothing; its records resume with the sampler.
       "--algorithm.prune.after", "1",
       "--placement.emulate_gpus", "true",  # turns taken as on colocated GPUs, the device-memory ledger live
       # LoRA: the learners train an adapter, the syncs send it alone, checkpoints hold it in
       # PEFT's format (the run resumes from it), and the engines keep their base weights
       # while they sleep. (Full-weight resume: test_replay_runs' stopped and resumed run.)
       "--learner.lora_rank", "8", "--learner.lr", "1e-3",
       # A KL penalty to the reference policy: with LoRA the base with the adapter off, which a
       # resume finds where it was (the base checkpoint), restoring nothing of its own.
       "--learner.kl.coef", "0.01"]
# What differs between two runs that took the same steps: the clock.
CLOCK = ("time", "tokens_per_second", "sync_seconds", "sync_gbps")


def job(out: Path, name: str, *extra: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "jobs/train.py", *RUN, "--logging.out_dir", str(out),
                             "--logging.run_name", name, *extra], cwd=REPO, start_new_session=True, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def comparable(record: dict) -> dict:
    """What a step shares with the same step of another run: not the clock, nor the GPU
    memory the ledger saw (a restarted run's first step has its start-up's figures too)."""
    return {k: v for k, v in record.items() if not k.startswith(("time_", "memory_")) and k not in CLOCK}


def without_recovery(record: dict) -> dict:
    """`comparable`, less the counts of replaced actors (the killed run's steps 1 and 2)."""
    return {k: v for k, v in comparable(record).items() if not k.startswith(("generator_", "replay_shard_"))}


@pytest.fixture(scope="module")
def runs(ray_cluster, tiny_policy, tmp_path_factory):
    """An uninterrupted run, and the same run with its actors killed in turn (`kill_in_turn`)
    and then SIGKILLed while it saves its step-4 checkpoint (the driver kills itself with the
    checkpoint written but not yet renamed into place; then the rest of the job, its local Ray
    cluster and every actor), then resumed. What the killed run left is noted before the resume.
    The killed run is a job of its own (its driver dies); the uninterrupted run and the resume
    train in this process, on the session's cluster (the same seeds, the same run)."""
    from rayrep.cli import resume_base
    from rayrep.config import parse_cli
    from rayrep.train import train

    out = tmp_path_factory.mktemp("runs")
    train(parse_cli([*RUN, "--logging.out_dir", str(out), "--logging.run_name", "whole"]), log=lambda _: None)

    run = out / "killed"
    killed = job(out, "killed", "--auto-resume", env=dict(os.environ, RAYREP_FAILPOINT="save-4"))
    stop, deaths = threading.Event(), []
    watcher = threading.Thread(target=kill_in_turn, args=(killed, run, stop, deaths))
    watcher.start()
    try:
        output, _ = killed.communicate(timeout=900)
    finally:
        stop.set()
        watcher.join()
    assert killed.returncode == -signal.SIGKILL, output[-3000:]
    try:
        os.killpg(killed.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    (out / "killed.log").write_text(output)
    left = {"checkpoints": [step for step, _ in step_checkpoints(run)],
            "partial": (run / "checkpoints" / ".step-4.partial" / "run_state.json").exists(),
            "logged": [r["step"] for r in read_metrics(run / "metrics.jsonl")]}
    resumed_lines = []
    train(parse_cli([], base=resume_base(str(run))), log=resumed_lines.append, resume=True)
    return out, left, "\n".join(resumed_lines), (deaths, output)


def test_a_job_killed_while_saving_leaves_the_checkpoint_before_it_current(runs):
    _, left, _, _ = runs
    # Steps 3 and 4 were logged (a record goes to the log before its checkpoint); the step-4
    # checkpoint is complete but not current.
    assert left == {"checkpoints": [2], "partial": True, "logged": [0, 1, 2, 3, 4]}


def test_a_killed_run_resumes_and_repeats_the_uninterrupted_one(runs):
    out, _, output, _ = runs
    assert "resumed" in output and "at step 2" in output
    whole = read_metrics(out / "whole" / "metrics.jsonl")
    resumed = read_metrics(out / "killed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]  # what the killed run logged after step 2 is gone
    # Partial rollouts: every step stopped answers (the driver died saving step 4 with its
    # answers paused; the learner in step 3, with step 3's); step 2 finished step 1's, and the
    # steps that saved a checkpoint kept none of the groups they stopped: each was asked again
    # (a question of the prompt set) or dropped (one of ExGRPO's replayed questions), both seen.
    assert all(resumed[step]["partial_answers_paused"] > 0 for step in (1, 2, 3, 4))
    for step in (2, 4):
        given_back = [resumed[step].get(name, 0) for name in ("partial_groups_asked_again",
                                                              "partial_replayed_groups_dropped")]
        assert sum(given_back) == resumed[step]["partial_groups_carried"] > 0, (step, given_back)
    assert all(sum(resumed[step].get(name, 0) for step in (2, 4)) > 0
               for name in ("partial_groups_asked_again", "partial_replayed_groups_dropped"))
    # The resumed run repeats the uninterrupted one step for step: one run.seed repeats a run.
    for mine, theirs in zip(resumed, whole):
        assert without_recovery(mine) == without_recovery(theirs), mine["step"]
    assert resumed[-1]["buffer_answers"] > 0 and resumed[-1]["exgrpo_collecting"] == 1.0
    assert sum(r.get("pruner_skipped", 0) for r in resumed) > 0  # the pruner passed questions by, after the resume too
    assert "memory_resume_gib" in resumed[3]  # the ledger saw the learners' state loaded (into host memory)
    assert all(r["kl_ref"] > 0 for r in resumed[2:])  # the adapter, trained, is away from the base
    # Each start noted its machine and kernels: the new run's at step 0, each resume's at its step.
    starts = [start["step"] for start in json.loads((out / "killed" / "machine.json").read_text())]
    assert starts[0] == 0 and starts[-1] == 2 and len(starts) >= 2, starts
    assert [start["step"] for start in json.loads((out / "whole" / "machine.json").read_text())] == [0]

    # The last checkpoints hold the same buffer, sampler position and policy version.
    a, b = read_run_state(out / "whole" / "checkpoints" / "final"), read_run_state(out / "killed" / "checkpoints" / "final")
    assert (a.step, a.policy_version, a.sampler, a.buffer_rng, a.algorithm) == \
           (b.step, b.policy_version, b.sampler, b.buffer_rng, b.algorithm) == (a.step, 4, a.sampler, a.buffer_rng, a.algorithm)
    for name in ("answers.parquet", "questions.parquet"):
        # Each answer names the run that sampled it: its folder, which differs between the two.
        whole_table, killed_table = (pq.read_table(out / run / "checkpoints" / "final" / "buffer" / name)
                                     for run in ("whole", "killed"))
        if "run" in whole_table.column_names:
            assert set(whole_table["run"].to_pylist()) == {str((out / "whole").resolve())}
            assert set(killed_table["run"].to_pylist()) == {str((out / "killed").resolve())}
            whole_table, killed_table = whole_table.drop_columns(["run"]), killed_table.drop_columns(["run"])
        if "advantage" in whole_table.column_names:  # NaN (unknown: ExGRPO keeps none), which equals nothing
            assert np.array_equal(whole_table["advantage"].to_numpy(), killed_table["advantage"].to_numpy(), equal_nan=True)
            whole_table, killed_table = whole_table.drop_columns(["advantage"]), killed_table.drop_columns(["advantage"])
        assert whole_table.equals(killed_table)
    assert [step for step, _ in step_checkpoints(out / "killed")] == [2, 4]
    # LoRA: the policy checkpoint is the adapter (in PEFT's format), each sync sent it alone.
    final = out / "killed" / "checkpoints" / "final"
    assert is_adapter(final) and not (final / "model.safetensors").exists()
    with safe_open(str(final / "adapter_model.safetensors"), "pt") as adapter:
        assert {r["sync_bytes"] for r in resumed[1:]} == {sum(adapter.get_tensor(k).nbytes for k in adapter.keys())}
    assert not list((out / "killed" / "checkpoints").glob(".step-*"))  # nothing half-written left


def kill_in_turn(job: subprocess.Popen, run: Path, stop: threading.Event, killed: list) -> None:
    """In the job's process tree: once step 0 is logged, SIGKILL its generator in a `generate`
    call (step 1's rollouts); once step 1 is logged, a replay shard; once the step-2 checkpoint
    is complete, its learner in an `update` call (step 3)."""
    def logged(step: int) -> bool:
        path = run / "metrics.jsonl"
        return path.exists() and any(json.loads(line)["step"] == step for line in path.read_text().splitlines() if line.strip())

    stages = [(lambda: logged(0), "ray::GeneratorWorker.generate"), (lambda: logged(1), "ray::ReplayShard"),
              (lambda: (run / "checkpoints" / "step-2" / "run_state.json").exists(), "ray::LearnerWorker.update")]
    for ready, title in stages:
        while not stop.is_set() and not ready():
            time.sleep(0.05)
        while not stop.is_set():
            try:
                victims = [p for p in psutil.Process(job.pid).children(recursive=True)
                           if p.cmdline()[:1] and p.cmdline()[0].startswith(title)]
            except psutil.Error:
                victims = []
            if victims:
                victims[0].send_signal(signal.SIGKILL)
                killed.append(title)
                break
            time.sleep(0.005)


def test_a_run_whose_actors_die_in_turn_ends_as_the_uninterrupted_one(runs):
    out, _, _, (killed, output) = runs
    assert killed == ["ray::GeneratorWorker.generate", "ray::ReplayShard", "ray::LearnerWorker.update"]
    # The learner's death stopped the run in step 3, said so, and the job went on from step 2.
    assert "learner rank 0 died" in output and "the run stopped in step 3" in output, output[-3000:]
    assert "restart 1 of 3: from step-2" in output and "at step 2" in output

    records = read_metrics(out / "killed" / "metrics.jsonl")  # after the resume
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    # Step 1: the generator was replaced and the prompts whose answers had not arrived (all 24
    # in flight, unless a first part came before the kill) sampled again, stopped where the
    # undisturbed engine stopped; step 2: the shard was restored from step 1's snapshot,
    # losing nothing.
    assert records[1].get("generator_replaced") == 1 and 0 < records[1].get("generator_retried_prompts", 0) <= 24
    assert {k: v for k, v in records[2].items() if k.startswith("replay_shard_")} == \
           {"replay_shard_replaced": 1, "replay_shard_lost_answers": 0, "replay_shard_lost_question_updates": 0}
    assert not any(k.startswith(("generator_", "replay_shard_")) for r in records[3:] for k in r)
    whole = read_metrics(out / "whole" / "metrics.jsonl")
    for mine, theirs in zip(records, whole):
        assert without_recovery(mine) == without_recovery(theirs), mine["step"]

