"""Answers in turns with a tool, part by part: how a chat template frames a tool's output, the
calculator, tools in the sandbox (hostile ones too), the tool mask through the learners'
batch and through every store of the replay buffer, and the turn loop on a real vLLM engine."""

import math
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

from rayrep.buffer.answers import PackedAnswers, QuestionAnswers
from rayrep.buffer.files import read_pool, read_snapshot, write_pool, write_snapshot
from rayrep.buffer.pool import decode_writes, encode_write
from rayrep.buffer.shard import ReplayShard
from rayrep.data.arithmetic import calculate
from rayrep.errors import InputError
from rayrep.generator.turns import current_turn, turns_taken
from rayrep.models.tokenizer import CHAT_TEMPLATE, build_char_tokenizer
from rayrep.models.tool_format import TRUNCATED, ToolFormat
from rayrep.types import Answer, Rollout, TrainBatch, answer_arrays


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


# ---------------------------------------------------------------------- the chat template's framing

def test_the_tiny_template_frames_a_tool_message_after_the_policys_turn(tokenizer):
    format = ToolFormat.of(tokenizer, "<calc>", "</calc>", 8)
    assert (format.head, format.tail) == ("<|endoftext|>\nR: ", "\nA: ")
    assert format.stop_token is None  # ("</calc>" is seven characters: a turn ends at the end of sequence)
    assert format.call("12+3=15, <calc>12+3</calc><|endoftext|>") == "12+3"
    assert format.call("<calc>12+3") is None and format.call("no call") is None
    # After a turn that ended its message, the end of sequence is the policy's own token already.
    assert format.output_text("15", "<|endoftext|>") == "\nR: 15\nA: "
    assert format.output_text("123456789", "<|endoftext|>") == f"\nR: 12345678{TRUNCATED}\nA: "
    # The text the conversation renders: the policy's turn, then the tool's output framed so.
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<calc>1+2</calc>"},
         {"role": "tool", "content": "3"}], tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("A: <calc>1+2</calc><|endoftext|>" + format.output_text("3", "<|endoftext|>"))
    # A one-token closing markup ends the turn itself, and the template's closing follows whole.
    one_token = ToolFormat.of(tokenizer, "\\boxed{", "}", 8)
    assert one_token.stop_token == tokenizer.convert_tokens_to_ids("}")
    assert one_token.output_text("3", "}") == "<|endoftext|>\nR: 3\nA: "


@pytest.mark.parametrize("template, why", [
    (CHAT_TEMPLATE.replace("{% elif message['role'] == 'tool' %}R: {{ message['content'] }}\n", ""), "another role"),
    ("{% for m in messages %}{% if m['role'] != 'tool' %}{{ m['content'] }}\n{% endif %}{% endfor %}", "nothing"),
    ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
     "{{ m['content'] }}{% endfor %}", "no tool role"),
])
def test_a_template_without_a_tool_role_is_refused_in_one_line(tokenizer, template, why):
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = template
    with pytest.raises(InputError, match="chat template") as err:
        ToolFormat.of(tokenizer, "<calc>", "</calc>", 8, name="policy-x")
    assert "policy-x" in str(err.value) and why in str(err.value) and "\n" not in str(err.value)


def test_turns_are_counted_from_the_tool_mask():
    assert turns_taken(None) == 1 and current_turn(None) == 0
    mask = np.array([0, 0, 1, 1, 0, 0, 1, 0], bool)
    assert turns_taken(mask) == 3
    assert current_turn(mask) == 7
    assert turns_taken(np.array([0, 0, 1, 1], bool)) == 2 and current_turn(np.array([0, 0, 1, 1], bool)) == 4


# ---------------------------------------------------------------------- the tools

def test_the_calculator_reads_the_tasks_notation_and_refuses_the_rest():
    assert calculate("12+3-4") == "11" and calculate("2-9*3") == "-21" and calculate(" 7 * 6 ") == "42"
    for bad in ("2**99", "1/2", "", "1+", "__import__('os')", "9" * 13, "+".join(["1"] * 21)):
        with pytest.raises(ValueError):
            calculate(bad)


HOSTILE_TOOL = '''
import os, time

def run(call):
    if call == "loop":
        while True:
            pass
    if call == "sleep":
        time.sleep(60)
    if call == "memory":
        return str(len(bytearray(64 * 1024**3)))
    if call == "raise":
        raise RuntimeError("no")
    if call == "exit":
        os._exit(3)
    if call == "number":
        return 42
    return call[::-1]
'''


def test_a_users_tool_runs_in_the_sandbox_and_what_goes_wrong_is_an_answer(tmp_path):
    """A hostile tool (it loops, sleeps, allocates 64 GiB, raises, kills its process, gives a
    number) costs each call a counted status and a message the policy reads; the next call is
    answered."""
    from rayrep.verifier.code import CodeLimits
    from rayrep.verifier.tools import ToolSandbox, tool_plugins

    path = tmp_path / "tool.py"
    path.write_text(HOSTILE_TOOL)
    spec = f"{path}:run"
    sandbox = ToolSandbox(spec, 1.0, CodeLimits(), tool_plugins(spec))
    try:
        results = sandbox.run(["abc", "loop", "sleep", "memory", "raise", "exit", "number", "after"])
    finally:
        sandbox.close()
    statuses = [r.status for r in results]
    assert statuses == ["ok", "timeout", "timeout", "error", "error", "error", "error", "ok"]
    assert results[0].output == "cba" and results[-1].output == "retfa"
    assert all(r.output.startswith("error:") for r in results[1:-1])
    assert "RuntimeError: no" in results[4].output and "int, not text" in results[6].output
    assert results[1].seconds < 1.5 and results[2].seconds < 1.5  # the per-call limit holds


def test_the_python_tool_runs_the_call_as_the_code_checker_runs_a_program():
    """Its output is the program's standard output; what goes wrong (an exception, a loop past
    the limit) is a line the policy reads, counted."""
    from rayrep.verifier.code import CodeLimits
    from rayrep.verifier.tools import ToolSandbox

    sandbox = ToolSandbox("python", 2.0, CodeLimits(wall_s=1.0, cpu_s=5))  # (the wall-clock limit first)
    try:
        ok, raised, looped = sandbox.run(["print(6 * 7)", "print(1 / 0)", "while True:\n    pass"])
    finally:
        sandbox.close()
    assert (ok.status, ok.output) == ("ok", "42\n")
    assert raised.status == "error" and "ZeroDivisionError" in raised.output
    assert looped.status == "timeout" and looped.output.startswith("error:") and looped.seconds < 3


def test_a_users_tool_that_cannot_load_is_refused_naming_it(tmp_path):
    from rayrep.verifier.checkers import CheckerError
    from rayrep.verifier.tools import check_tools
    from rayrep.config import load_preset

    cfg = load_preset("tiny-cpu-tool")
    (tmp_path / "two.py").write_text("def run(call, extra):\n    return call\n")
    for spec, message in [(f"{tmp_path}/none.py:run", "no such file"), (f"{tmp_path}/two.py:run", "does not take \\(call\\)")]:
        with pytest.raises(CheckerError, match=message):
            check_tools(cfg.replace(**{"tools.name": spec}), build_char_tokenizer())


def test_a_budget_smaller_than_one_turn_is_refused(tokenizer):
    from rayrep.config import load_preset
    from rayrep.verifier.tools import check_tools

    cfg = load_preset("tiny-cpu-tool")
    assert check_tools(cfg, tokenizer).call_start == "<calc>"
    with pytest.raises(InputError, match="max_response_tokens=8 is smaller than one turn"):
        check_tools(cfg.replace(**{"generator.max_response_tokens": 8, "verifier.overlong_buffer": 0}), tokenizer)
    from rayrep.errors import ConfigError

    with pytest.raises(ConfigError, match="tools.max_turns: 0"):
        cfg.replace(**{"tools.max_turns": 0})


# ---------------------------------------------------------------------- the tool mask in the learners' batch

def trajectory(seed: int, tools: int = 2) -> Rollout:
    """An answer in turns: policy tokens, then for each call a tool's tokens and policy tokens."""
    rng = np.random.default_rng(seed)
    ids, logprobs, mask = [], [], []
    for turn in range(tools + 1):
        n = int(rng.integers(2, 6))
        ids += rng.integers(3, 250, n).tolist()
        logprobs += (-rng.random(n)).tolist()
        mask += [False] * n
        if turn < tools:
            k = int(rng.integers(1, 4))
            ids += rng.integers(3, 250, k).tolist()
            logprobs += [math.nan] * k
            mask += [True] * k
    return Rollout(np.arange(3, 3 + 4), ids, logprobs, "", "stop", tool_mask=np.array(mask))


def test_tool_tokens_leave_the_response_mask_and_carry_no_nan():
    answers = [trajectory(0), trajectory(1, tools=0), trajectory(2, tools=1)]
    arrays = answer_arrays([Answer.of(r) for r in answers])
    batch = TrainBatch.of_sequences([a.prompt_ids for a in arrays], [a.response_ids for a in arrays], [0, 0, 1],
                                    logprobs=[a.logprobs for a in arrays], tool_masks=[a.tool_mask for a in arrays])
    for row, rollout in enumerate(answers):
        start, end = 4, 4 + rollout.response_length
        assert batch.response_mask[row, start:end].numpy().tolist() == (~rollout.tool_tokens()).tolist()
        assert not batch.old_logprobs.isnan().any()
        assert batch.old_logprobs[row, start:end][~batch.response_mask[row, start:end]].eq(0).all()
    assert arrays[1].tool_mask is None and arrays[0].logprobs_known


# ---------------------------------------------------------------------- the tool mask in the replay buffer

def stored(rollouts: list[Rollout], step: int = 1) -> list[Answer]:
    return [Answer.of(r, reward=1.0, correct=True, step=step, source="online") for r in rollouts]


def same_arrays(a, b) -> bool:
    return (np.array_equal(a.response_ids, b.response_ids) and np.array_equal(a.logprobs, b.logprobs, equal_nan=True)
            and np.array_equal(a.tool_mask if a.tool_mask is not None else np.zeros(len(a.response_ids), bool),
                               b.tool_mask if b.tool_mask is not None else np.zeros(len(b.response_ids), bool)))


def test_trajectories_keep_their_masks_through_the_shard_snapshot_pool_and_journal(tmp_path):
    items = [("q0", np.arange(4, dtype=np.int32), stored([trajectory(0), trajectory(1, tools=0)])),
             ("q1", np.arange(4, dtype=np.int32), stored([trajectory(2, tools=1), trajectory(3, tools=3)]))]
    expected = {uid: [a.arrays() for a in answers] for uid, _, answers in items}
    packed = PackedAnswers.pack(items)
    assert packed.tool_mask is not None and packed.tool_mask.sum() == sum(
        r.tool_tokens().sum() for _, _, answers in items for r in (a.at for a in answers))

    def check(drawn: dict) -> None:
        for uid, answers in drawn.items():
            got = [a.arrays() for a in answers]
            assert len(got) == len(expected[uid]) and all(same_arrays(g, e) for g, e in zip(got, expected[uid]))

    shard = ReplayShard(0)
    shard.apply(packed, False, {}, [])
    check(shard.pack(["q0", "q1"], [2, 2], np.concatenate([shard.questions[u].rows for u in ("q0", "q1")])).unpack())
    # A snapshot of the shard, read back; and ExGRPO's entropy pass reads the masks with the tokens.
    write_snapshot([shard.export()], tmp_path / "snap")
    check({uid: entry.packed(uid, {}).unpack()[uid] for uid, entry in read_snapshot(tmp_path / "snap").questions})
    prompts, responses, masks = shard.pack(["q1"], [2], shard.questions["q1"].rows).sequences()
    assert [m is not None for m in masks] == [True, True]
    # An experience pool's rows, written and read.
    rows = [{"uid": uid, "prompt": [{"role": "user", "content": uid}], "ground_truth": "1", "data_source": "t",
             "prompt_ids": prompt, "response_ids": a.response_ids, "logprobs": a.logprobs,
             "tool_mask": a.at.tool_mask, "text": "", "reward": 1.0, "version": 0}
            for uid, prompt, answers in items for a in answers]
    write_pool(rows, tmp_path / "pool.parquet", "x")
    check({uid: answers for uid, (_, answers) in read_pool(tmp_path / "pool.parquet").items()})
    # A shared pool's journal record.
    [(_, decoded)] = decode_writes(encode_write({"writer": "w"}, packed))[0]
    check(decoded.unpack())


# ---------------------------------------------------------------------- the turn loop on a real engine

def bracketed(delay_s: float = 0.0):
    """A tool that answers a call with its text in brackets, after `delay_s` seconds."""
    import time

    from rayrep.generator.turns import FunctionTools, ToolResult

    def answer(call: str) -> ToolResult:
        time.sleep(delay_s)
        return ToolResult(f"[{call}]")

    return FunctionTools(answer)


@pytest.fixture(scope="module")
def tiny_engine(tiny_cfg, tiny_policy):
    from rayrep.generator.engine import make_engine

    return make_engine(tiny_cfg, tiny_policy)


def sample_turns(engine, cfg, runner, count=6, n=4, max_turns=3, max_tokens=96, **options):
    """Answers in turns of the tiny policy, whose boxed answer is its "call" (a policy that
    calls no tool by itself still ends each answer with one), to `count` prompts."""
    from rayrep.data import encode_prompts, load_split
    from rayrep.generator.engine import sample_as_finished
    from rayrep.generator.turns import Turns

    tokenizer = engine.get_tokenizer()
    turns = Turns(ToolFormat.of(tokenizer, "\\boxed{", "}", 16), runner, max_turns, tokenizer)
    prompts = encode_prompts(tokenizer, load_split(cfg.data, "train")[:count], cfg.data.max_prompt_tokens)
    seeds = options.pop("seeds", list(range(100, 100 + count + len(options.get("carried", ())))))
    answers = {}
    for positions, rollouts in sample_as_finished(engine, prompts, n=n, temperature=1.0, top_p=1.0, max_tokens=max_tokens,
                                                  seeds=seeds, turns=turns, **options):
        answers.update(zip(positions, rollouts))
    return [answers[p] for p in sorted(answers)], turns


def check_trajectory(rollout: Rollout, turns, max_tokens: int) -> None:
    """The tool's tokens are its outputs as framed, without log-probs; the policy's have theirs."""
    tool = rollout.tool_tokens()
    assert np.isnan(rollout.logprobs[tool]).all() and not np.isnan(rollout.logprobs[~tool]).any()
    assert rollout.response_length <= max_tokens and turns_taken(rollout.tool_mask) <= turns.max_turns
    calls = rollout.tools.calls if rollout.tools else 0
    assert turns_taken(rollout.tool_mask) == 1 + calls and (rollout.tools is None) == (rollout.tool_mask is None)
    if rollout.tools:
        assert rollout.tools.tokens == tool.sum()
    # Each span of tool tokens reads as the framed output of the call that ends the turn before it.
    ids, starts = rollout.response_ids, np.flatnonzero(np.diff(np.concatenate([[0], tool.astype(int)])) == 1)
    for start in starts:
        end = start + np.argmin(tool[start:]) if not tool[start:].all() else len(tool)
        text = turns.tokenizer.decode(ids[start:end].tolist(), skip_special_tokens=False)
        turn = turns.tokenizer.decode(ids[current_turn(tool[:start]):start].tolist(), skip_special_tokens=False)
        call = turns.format.call(turn)
        assert call is not None and text.startswith(turns.format.output_text(f"[{call}]", "}")[: len(text)])


@pytest.mark.slow
def test_answers_go_on_in_turns_while_the_tool_runs(tiny_engine, tiny_cfg):
    """Each answer's calls run while the engine decodes the others; the tool's outputs join
    the answers as framed, masked, without log-probs; the same seeds give the same answers,
    whatever the tool's time."""
    answers, turns = sample_turns(tiny_engine, tiny_cfg, bracketed())
    flat = [r for group in answers for r in group]
    assert sum(r.tools is not None for r in flat) >= len(flat) // 2  # (the policy boxes most answers)
    assert any(turns_taken(r.tool_mask) == 3 for r in flat)  # some reach the last turn, whose call is not run
    for rollout in flat:
        check_trajectory(rollout, turns, 96)
        assert rollout.finish_reason in ("stop", "length")
    # However long the tool took (its output joins a fixed number of steps later). The log-probs
    # within float noise: the engine's prefix cache holds the first sampling's blocks.
    again, _ = sample_turns(tiny_engine, tiny_cfg, bracketed(delay_s=0.01))
    for first, second in zip([r for g in again for r in g], flat):
        assert np.array_equal(first.response_ids, second.response_ids) and first.finish_reason == second.finish_reason
        assert np.array_equal(first.tool_tokens(), second.tool_tokens())
        assert (first.tools and first.tools.counts()) == (second.tools and second.tools.counts())
        assert np.allclose(first.logprobs, second.logprobs, atol=1e-5, equal_nan=True)


@pytest.mark.slow
def test_a_stopped_call_ends_its_turn_and_the_paused_answer_resumes(tiny_engine, tiny_cfg):
    """Partial rollouts: the engine stops the groups past the quota, a call under way keeps its
    output; continued in a later call, each answer finishes with consistent turns and masks."""
    answers, turns = sample_turns(tiny_engine, tiny_cfg, bracketed(), count=8, quota=2)
    paused = [group for group in answers if any(r.finish_reason == "paused" for r in group)]
    assert paused and any(r.tool_mask is not None for g in paused for r in g)
    for group in paused:
        for rollout in group:
            check_trajectory(rollout, turns, 96)
    done, _ = sample_turns(tiny_engine, tiny_cfg, bracketed(), count=0,
                           carried=paused, seeds=list(range(len(paused))))
    for before, after in zip(paused, done):
        for b, a in zip(before, after):
            assert a.finish_reason in ("stop", "length")
            assert np.array_equal(a.response_ids[: b.response_length], b.response_ids)
            assert np.array_equal(a.tool_tokens()[: b.response_length], b.tool_tokens())
            check_trajectory(a, turns, 96)


def test_rlep_replays_a_pools_trajectories_with_their_masks(tmp_path):
    """A pool of answers that called a tool (as jobs/collect.py writes one from such a run):
    RLEP's replayed rows are the pooled trajectories, token for token, their tools' tokens
    out of the learners' response mask as in the rows they were first trained in."""
    from rayrep.algos.rlep import RLEP, load_pool
    from rayrep.buffer.replay import ReplayBuffer
    from rayrep.config import load_preset
    from rayrep.data import PromptSampler
    from rayrep.types import Group, Prompt

    prompt_ids = [10, 11, 12]
    pooled = {f"q{i}": [trajectory(10 * i + j, tools=j % 3) for j in range(3)] for i in range(2)}
    rows = [{"uid": uid, "prompt": [{"role": "user", "content": uid}], "ground_truth": "7", "data_source": "t",
             "prompt_ids": prompt_ids, "response_ids": r.response_ids, "logprobs": r.logprobs, "tool_mask": r.tool_mask,
             "text": "", "reward": 1.0, "version": 0} for uid, answers in pooled.items() for r in answers]
    write_pool(rows, tmp_path / "pool.parquet", "ckpt")
    cfg = load_preset("tiny-cpu-tool").replace(**{
        "replay.num_shards": 0, "algorithm.group_size": 2, "algorithm.name": "rlep", "algorithm.prompts_per_step": 2,
        "learner.mini_batch_prompts": 2, "algorithm.rlep.pool": str(tmp_path / "pool.parquet"),
        "algorithm.rlep.replays_per_group": 3})
    ids = {uid: prompt_ids for uid in pooled}
    algo = RLEP(cfg, ids, load_pool(cfg, ids), ReplayBuffer(0, 64, seed=0))
    prompts = [Prompt(uid, ({"role": "user", "content": uid},), "7") for uid in pooled]
    plan = algo.plan(PromptSampler(prompts, seed=0), 2)
    fresh = [Group.sampled(p, [Answer.of(trajectory(99 + a, tools=1)) for a in range(n)], [False] * n)
             for p, n in plan.requests]
    step = algo.build(plan.complete(fresh), step=1)
    batch = step.batch
    replayed = 0
    for row, record in enumerate(step.recipe.rows):
        arrays = record.answer.arrays()
        start = len(arrays.prompt_ids)
        trained = batch.response_mask[row, start : start + len(arrays.response_ids)].numpy()
        if record.answer.replayed:
            replayed += 1
            uid = step.groups[record.question].prompt.uid
            [first] = [r for r in pooled[uid] if np.array_equal(r.response_ids, arrays.response_ids)]
            assert np.array_equal(trained, ~first.tool_tokens())  # as the row it was first trained in
        assert np.array_equal(trained, ~(arrays.tool_mask if arrays.tool_mask is not None else np.zeros(len(trained), bool)))
    assert replayed == 6
