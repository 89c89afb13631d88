"""Runs whose answers call a tool, on the embedded tool task (tiny-cpu-tool) and the session's
Ray cluster: a GRPO run whose tool actor is killed mid-call and whose generator is killed
mid-turn, stopped and resumed, ends as the uninterrupted run; ExGRPO stores and replays
trajectories with their tool masks; a call lost twice ends its answer as a counted tool
failure, scored wrong."""

import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from rayrep.run.log import read_metrics

# The calculator as a user's tool (the seam a user's own tool takes), slow enough that a call
# is under way when its actor is killed.
SLOW_CALCULATOR = '''
import time

from rayrep.data.arithmetic import calculate


def run(call):
    time.sleep(0.05)
    return calculate(call)
'''

RUN = {"run.steps": 3, "run.eval_every": 0, "algorithm.prompts_per_step": 16, "learner.mini_batch_prompts": 8,
       "data.arithmetic_test_size": 32, "logging.plots": False, "tools.num_workers": 2,
       "placement.emulate_gpus": True}
# What differs between two runs that took the same steps: the clock, and the recovery.
APART = ("time_", "memory_", "generator_", "tool_replaced", "tool_retried_calls", "tool_seconds", "tokens_per_second",
         "sync_seconds", "sync_gbps", "time")


def comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(APART)}


def logged(run: Path, step: int) -> bool:
    path = run / "metrics.jsonl"
    return path.exists() and any(r["step"] == step for r in read_metrics(path))


def kill_in_turn(run: Path, stop: threading.Event, killed: list) -> None:
    """Once step 0 is logged, SIGKILL a tool actor running a call (step 1); once step 1 is
    logged, the generator in its `generate` call (step 2): its answers are between turns."""
    stages = [(0, "ray::ToolWorker.run"), (1, "ray::GeneratorWorker.generate")]
    for step, title in stages:
        while not stop.is_set() and not logged(run, step):
            time.sleep(0.05)
        while not stop.is_set():
            victims = []
            for process in psutil.process_iter(["cmdline"]):
                cmdline = process.info["cmdline"] or []
                if cmdline[:1] and cmdline[0].startswith(title):
                    victims.append(process)
            if victims:
                victims[0].kill()
                killed.append(title)
                break
            time.sleep(0.005)


@pytest.fixture(scope="module")
def tool_runs(ray_cluster, tmp_path_factory):
    """The uninterrupted run, and the same run with its actors killed in turn, stopped after
    step 2 and resumed for step 3 (both in this process, on the session's cluster)."""
    from rayrep.config import load_preset
    from rayrep.train import train

    out = tmp_path_factory.mktemp("tool-runs")
    (out / "slow_calculator.py").write_text(SLOW_CALCULATOR)
    cfg = load_preset("tiny-cpu-tool").replace(**RUN, **{"logging.out_dir": str(out),
                                                         "tools.name": f"{out / 'slow_calculator.py'}:run"})
    whole = train(cfg.replace(**{"logging.run_name": "whole"}), log=lambda _: None).run_dir
    stopped = cfg.replace(**{"logging.run_name": "killed"})
    stop, killed = threading.Event(), []
    watcher = threading.Thread(target=kill_in_turn, args=(out / "killed", stop, killed))
    watcher.start()
    try:
        train(stopped.replace(**{"run.steps": 2}), log=lambda _: None)
    finally:
        stop.set()
        watcher.join()
    resumed = train(stopped, log=lambda _: None, resume=True).run_dir
    return read_metrics(whole / "metrics.jsonl"), read_metrics(resumed / "metrics.jsonl"), killed


@pytest.mark.slow
def test_a_tool_run_trains_survives_its_deaths_and_resumes_as_the_uninterrupted_one(tool_runs):
    whole, resumed, killed = tool_runs
    assert killed == ["ray::ToolWorker.run", "ray::GeneratorWorker.generate"]
    assert [r["step"] for r in resumed] == [r["step"] for r in whole] == [0, 1, 2, 3]
    # The tool actor's calls were asked again of the other (step 1), and the dead one replaced
    # before the next round (step 2); the generator replaced and its prompts asked again (step 2).
    assert resumed[1]["tool_retried_calls"] >= 1 and resumed[2].get("tool_replaced") == 1
    assert resumed[2].get("generator_replaced") == 1
    assert resumed[1]["tool_failures"] == 0
    for step, (mine, theirs) in enumerate(zip(resumed, whole)):
        if step == 2:  # (the stopped run evaluated at its end)
            mine = {k: v for k, v in mine.items() if not k.startswith("test_")}
        assert comparable(mine) == comparable(theirs), step
    # The policy called the tool and learned: a share of its answers in two turns, the tool's
    # tokens a part of their tokens, out of the learners' counts.
    for record in whole[1:]:
        assert 0.05 < record["tool_call_share"] <= 1 and record["turns_per_answer"] == 1 + record["tool_calls_per_answer"]
        assert 0 < record["tool_token_share"] < 0.5 and record["fresh_tokens"] == record["generated_tokens"]
        assert record["tool_errors"] + record["tool_timeouts"] < record["tool_calls_per_answer"] * 128


@pytest.mark.slow
def test_exgrpo_stores_and_replays_tool_trajectories_with_their_masks(ray_cluster, tmp_path):
    """ExGRPO from step 1: answers of step 2 stored, replayed from step 3 (the lowest-entropy
    one of each question, over the policy's tokens); the buffer's trajectories carry masks
    whose spans are the calculator's outputs of the calls before them, as framed."""
    from transformers import AutoTokenizer

    from rayrep.buffer.files import read_snapshot
    from rayrep.config import load_preset
    from rayrep.data.arithmetic import calculate
    from rayrep.models import resolve_policy
    from rayrep.models.tool_format import ToolFormat
    from rayrep.train import train

    cfg = load_preset("tiny-cpu-tool").replace(**{
        **RUN, "logging.out_dir": str(tmp_path), "logging.run_name": "exgrpo", "tools.num_workers": 1,
        "algorithm.name": "exgrpo", "algorithm.std_normalize": False, "algorithm.exgrpo.start_pass_rate": 0.0})
    run = train(cfg, log=lambda _: None).run_dir
    records = read_metrics(run / "metrics.jsonl")
    assert records[3]["replay_share"] > 0  # trajectories replayed in step 3
    tokenizer = AutoTokenizer.from_pretrained(resolve_policy(cfg))
    format = ToolFormat.of(tokenizer, cfg.tools.call_start, cfg.tools.call_end, cfg.tools.max_output_chars)
    snapshot = read_snapshot(run / "replay")  # (after step 3)

    def calculator(call: str) -> str:  # (what the built-in answers, its refusals included)
        try:
            return calculate(call)
        except ValueError as err:
            return f"error: {err}"

    spans = 0
    for _, entry in snapshot.questions:
        for i in range(len(entry)):
            ids = entry.tokens[entry.offsets[i] : entry.offsets[i + 1]]
            mask = entry.tool_mask[entry.offsets[i] : entry.offsets[i + 1]]
            logprobs = entry.logprobs[entry.offsets[i] : entry.offsets[i + 1]]
            assert np.isnan(logprobs[mask]).all() and not np.isnan(logprobs[~mask]).any()
            edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
            for start, end in zip(edges[::2], edges[1::2]):
                spans += 1
                turn = tokenizer.decode(ids[:start].tolist(), skip_special_tokens=False).rpartition("\nA: ")[2]
                output = calculator(format.call(turn))
                assert tokenizer.decode(ids[start:end].tolist(), skip_special_tokens=False) == \
                    format.output_text(output, tokenizer.eos_token)
    assert spans > 0


@pytest.mark.slow
def test_a_call_lost_twice_ends_its_answer_as_a_tool_failure_scored_wrong(ray_cluster, tiny_cfg):
    """Both tool actors dead: each answer that calls ends there, `TOOL_FAILED`, counted in its
    tool use, and the verifier scores it wrong whatever its text says."""
    import ray

    from rayrep.config import load_preset
    from rayrep.data import encode_prompts, load_split
    from rayrep.generator.engine import make_engine, sample_as_finished
    from rayrep.generator.turns import ActorTools, Turns
    from rayrep.models import resolve_policy
    from rayrep.models.tool_format import ToolFormat
    from rayrep.types import TOOL_FAILED
    from rayrep.verifier.code import CodeLimits
    from rayrep.verifier.group import Question, Settings, _check
    from rayrep.verifier.sandbox import MathSandbox
    from rayrep.verifier.tools import RemoteToolWorker

    from conftest import kill_and_wait

    cfg = load_preset("tiny-cpu-tool")
    engine = make_engine(cfg, resolve_policy(cfg))
    workers = [RemoteToolWorker.options(num_cpus=0.25).remote("calculator", 1.0, CodeLimits()) for _ in range(2)]
    ray.get([w.pid.remote() for w in workers])
    for worker in workers:
        kill_and_wait(worker)
    tokenizer = engine.get_tokenizer()
    turns = Turns(ToolFormat.of(tokenizer, cfg.tools.call_start, cfg.tools.call_end, 32), ActorTools(workers),
                  cfg.tools.max_turns, tokenizer)
    prompts = load_split(cfg.data, "test")[:16]
    answers = {}
    for positions, rollouts in sample_as_finished(engine, encode_prompts(tokenizer, prompts, 80), n=4, temperature=1.0,
                                                  top_p=1.0, max_tokens=72, seeds=list(range(16)), turns=turns):
        answers.update(zip(positions, rollouts))
    rollouts = [answers[p] for p in range(16)]
    failed = [r for group in rollouts for r in group if r.finish_reason == TOOL_FAILED]
    assert failed and all(r.tools.failed and r.tools.retried == 1 and r.tools.calls == 1 for r in failed)
    assert all(r.finish_reason != TOOL_FAILED for group in rollouts for r in group if r.tools is None)
    with MathSandbox() as sandbox:
        verdicts = _check(sandbox, rollouts, [Question("math", p.ground_truth, {}) for p in prompts],
                          Settings(1.0), majority=False)
    for group, marks in zip(rollouts, verdicts.correct):
        for rollout, correct in zip(group, marks):
            if rollout.finish_reason == TOOL_FAILED:
                assert correct is False
    assert verdicts.statuses["tool_failed"] == len(failed)


@pytest.mark.slow
def test_exgrpo_replays_a_trajectory_as_it_was_first_trained(ray_cluster):
    """ExGRPO with a real learner group (its lowest-entropy choice is a pass over the stored
    trajectories, their tools' tokens masked), its buffer in this process: each trajectory
    replayed in step 3 has the tokens and the learners' mask of the row it was first trained
    in, in step 2."""
    from rayrep.algos.exgrpo import ExGRPO
    from rayrep.buffer.replay import ReplayBuffer
    from rayrep.config import load_preset
    from rayrep.data import PromptSampler
    from rayrep.models import resolve_policy
    from rayrep.types import Answer, Group, Prompt

    from test_learner_and_sync import make_learners
    from test_tools import trajectory

    prompts = [Prompt(f"q{i}", ({"role": "user", "content": f"q{i}"},), "7") for i in range(16)]
    cfg = load_preset("tiny-cpu-tool").replace(**{
        "replay.num_shards": 0, "algorithm.name": "exgrpo", "algorithm.std_normalize": False, "algorithm.group_size": 4,
        "algorithm.prompts_per_step": 8, "learner.mini_batch_prompts": 8, "algorithm.exgrpo.start_pass_rate": 0.0})
    cfg, placement, learners = make_learners(cfg, resolve_policy(cfg), 1)
    try:
        algo = ExGRPO(cfg, prompts, {p.uid: trajectory(0).prompt_ids.tolist() for p in prompts},
                      ReplayBuffer(0, 64, seed=0), learners=learners,
                      sampler=PromptSampler(prompts[:8], seed=0, keep_at_least=8))
        first_rows: dict[bytes, np.ndarray] = {}

        def run_step(number: int, sampler) -> tuple:
            plan = algo.plan(sampler, 8)
            fresh = [Group.sampled(p, [Answer.of(trajectory(1000 * number + 10 * int(p.uid[1:]) + j, tools=1 + j % 2))
                                       for j in range(n)], [j < 2 for j in range(n)]) for p, n in plan.requests]
            groups, metrics = algo.join_replays(plan.complete(fresh))
            built = algo.build(groups, step=number)
            batch = built.batch
            rows = []
            for row, record in enumerate(built.recipe.rows):
                arrays = record.answer.arrays()
                start = len(arrays.prompt_ids)
                rows.append((record.answer.replayed, arrays.response_ids.tobytes(),
                             batch.response_mask[row, start : start + len(arrays.response_ids)].numpy()))
            algo.after_update(number, built)
            return plan, rows, metrics

        run_step(1, algo.sampler)  # the switch flips (pass rate 0.5)
        _, rows, _ = run_step(2, algo.sampler)  # collected: each question's two right answers
        first_rows.update({tokens: mask for _, tokens, mask in rows})
        plan, rows, metrics = run_step(3, PromptSampler(prompts[8:], seed=0))
        assert plan.choose and metrics["exgrpo_replays_gone"] == 0
        replayed = [(tokens, mask) for was_replayed, tokens, mask in rows if was_replayed]
        assert len(replayed) == len(plan.choose)
        for tokens, mask in replayed:
            assert np.array_equal(mask, first_rows[tokens]) and not mask.all()  # (tool tokens, out of the loss)
    finally:
        learners.shutdown()
        placement.remove()
