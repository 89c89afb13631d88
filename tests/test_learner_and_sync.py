"""FSDP2 learner group and weight sync on a real local Ray cluster (gloo, real vLLM)."""

import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from rayrep.cluster.placement import Placement, make_plan
from rayrep.generator.group import GeneratorGroup
from rayrep.learner.group import LearnerGroup
from rayrep.learner.forward import mini_batches, questions_by_length, rows_per_rank, token_budget_batches
from rayrep.sync.weights import WeightSync
from rayrep.types import LossSpec, MismatchCorrection, TrainBatch


def synthetic_batch(num_prompts=8, answers=4, seed=0, tool_tokens=0):
    """Random prompts and answers of unequal lengths (token ids < 259, the tiny vocab);
    `tool_tokens`: each answer ends with up to this many tokens of a tool's output."""
    rng = random.Random(seed)
    prompts, responses, index = [], [], []
    for q in range(num_prompts):
        prompt_ids = [rng.randrange(3, 259) for _ in range(rng.randint(5, 12))]
        for _ in range(answers):
            prompts.append(prompt_ids)
            responses.append([rng.randrange(3, 259) for _ in range(rng.randint(1, 15))])
            index.append(q)
    advantages = [rng.uniform(-1.5, 1.5) for _ in responses]
    masks = None
    if tool_tokens:  # (drawn from a stream of their own: the answers are the same with them or without)
        tools = random.Random(seed + 1)
        added = [tools.randint(1, tool_tokens) for _ in responses]
        masks = [np.array([False] * len(r) + [True] * k) for r, k in zip(responses, added)]
        responses = [r + [tools.randrange(3, 259) for _ in range(k)] for r, k in zip(responses, added)]
    return TrainBatch.of_sequences(
        prompts, responses, index, logprobs=[[-5.0] * len(r) for r in responses], tool_masks=masks,
        advantages=advantages, recompute_old=[True] * len(responses),
    )


def full_state(learners: LearnerGroup) -> dict[str, torch.Tensor]:
    """The learners' full weights (rank 0's gather; every rank takes part)."""
    return ray.get([w.full_state_dict.remote() for w in learners.workers])[0]


def response_logprobs(model, rollout) -> torch.Tensor:
    """`model`'s log-probs of the rollout's response tokens (a transformers forward pass in
    the model's dtype, the log-softmax in fp32)."""
    with torch.no_grad():
        ids = torch.tensor([rollout.prompt_ids.tolist() + rollout.response_ids.tolist()])
        logits = model(ids).logits[0, len(rollout.prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.from_numpy(rollout.response_ids.astype(np.int64))[:, None])[:, 0]


def logprob_gaps(model, rollouts) -> torch.Tensor:
    """Per token, the gap between the rollouts' behaviour log-probs and `model`'s log-probs of
    the same tokens: near 0 when `model` sampled them."""
    return torch.cat([(torch.from_numpy(r.logprobs.copy()) - response_logprobs(model, r)).abs() for r in rollouts])


def logprob_gap(model, rollouts) -> float:
    """The largest of `logprob_gaps`."""
    return float(logprob_gaps(model, rollouts).max())


def model_with(tiny_policy: str, state: dict[str, torch.Tensor]):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_policy).eval()
    model.load_state_dict(state, strict=False)  # the tied head follows the embedding
    return model


def make_learners(cfg, model_path, workers, strategy="fsdp2"):
    cfg = cfg.replace(**{"learner.num_workers": workers, "learner.strategy": strategy, "placement.cpus_per_bundle": 1, "placement.threads": 1,
                         "generator.num_workers": 1, "verifier.num_workers": 0})
    placement = Placement(make_plan(cfg))
    return cfg, placement, LearnerGroup(cfg, model_path, placement)


# Two mini-batches of 4 questions, micro-batches of 5 rows: rows per rank and micro-batch
# counts differ, and token counts differ between ranks: token-mean must still be global.
TWO_MINI_BATCHES = {"algorithm.prompts_per_step": 8, "learner.mini_batch_prompts": 4, "learner.micro_batch_size": 5,
                    "learner.lr": 1e-3, "learner.warmup_steps": 2}


# A mismatch correction that takes about a third of the fresh tokens out of the loss (the
# band), and the answers with a very unlikely token (the veto), and truncates a third of the
# weights, on `synthetic_batch` rows whose engines' log-probs are -12.2 at every token (about
# the tiny policy's median log-prob of their random tokens): the mini-batch counts then hold
# only what every rank kept. With a KL penalty to the reference policy (the starting one,
# which the second mini-batch has moved away from), as `CORRECTED_SETTINGS`' learners start.
CORRECTED = LossSpec(correction=MismatchCorrection(weights="token", weight_cap=2.0, reject="token",
                                                   reject_upper=5.0, reject_lower=0.2, veto=0.05),
                     kl_coef=0.05, kl_estimator="k3")
CORRECTED_SETTINGS = {**TWO_MINI_BATCHES, "learner.kl.coef": CORRECTED.kl_coef}


def mismatched_batch(tool_tokens=0) -> TrainBatch:
    batch = synthetic_batch(tool_tokens=tool_tokens)
    batch.old_logprobs[batch.response_mask] = -12.2
    return batch


def one_update(cfg, tiny_policy, workers, strategy="fsdp2", loss=LossSpec(), tool_tokens=0, batch=None):
    """(metrics, full state) of `workers` ranks after one update on `batch`, by default
    `synthetic_batch()` (`mismatched_batch()` with a mismatch correction)."""
    _, placement, learners = make_learners(cfg, tiny_policy, workers, strategy)
    try:
        if batch is None:
            batch = synthetic_batch(tool_tokens=tool_tokens) if loss.correction is None else mismatched_batch(tool_tokens)
        return learners.update(batch, loss), full_state(learners)
    finally:
        learners.shutdown()
        placement.remove()


@pytest.fixture(scope="module")
def one_rank_update(ray_cluster, tiny_cfg, tiny_policy):
    """The one-rank FSDP2 reference of `test_two_ranks_take_the_same_update_as_one`, taken once for both
    strategies, with a mismatch correction that rejects tokens (`CORRECTED`)."""
    return one_update(tiny_cfg.replace(**CORRECTED_SETTINGS), tiny_policy, 1, loss=CORRECTED)


def test_each_sharding_strategy_has_its_code_and_says_what_it_can_do():
    """`learner.strategy`'s choices, the code of each (`SHARDINGS`) and what each can do
    (`SHARDING_STRATEGIES`, which the config, the memory plan, resume and the learner ask)
    name the same strategies; DeepSpeed's state stays on the GPU and is not resumable."""
    import typing

    from rayrep.config import LearnerConfig
    from rayrep.config.strategies import SHARDING_STRATEGIES
    from rayrep.learner.sharding import SHARDINGS

    choices = set(typing.get_args(typing.get_type_hints(LearnerConfig)["strategy"]))
    assert choices == set(SHARDINGS) == set(SHARDING_STRATEGIES) == {"fsdp2", "deepspeed"}
    deepspeed = LearnerConfig(strategy="deepspeed").sharding
    assert not (deepspeed.state_moves or deepspeed.resumable or deepspeed.shards_parameters)
    assert LearnerConfig().sharding.resumable


def test_a_tools_tokens_are_context_the_loss_never_trains_on(one_rank_update, tiny_cfg, tiny_policy):
    """The same rows with a tool's output after each answer (tokens the policy reads and that
    predict nothing after them) take the same update as without it: the tool's tokens carry no
    loss term and count in no token mean, entropy, KL, mismatch metric, rejection or weight."""
    (m1, s1) = one_rank_update
    m2, s2 = one_update(tiny_cfg.replace(**CORRECTED_SETTINGS), tiny_policy, 1, loss=CORRECTED, tool_tokens=6)
    with_tools = mismatched_batch(tool_tokens=6)
    assert with_tools.lengths.sum() > synthetic_batch().lengths.sum()  # (the rows do hold the tool's tokens)
    assert m2["fresh_tokens"] == m1["fresh_tokens"]
    for name in sorted(m1):
        if not name.startswith("time_") and name != "padding_frac":
            assert m2[name] == pytest.approx(m1[name], rel=1e-4, abs=1e-6), name
    diff = torch.cat([(s1[name] - s2[name]).abs().flatten() for name in s1])
    assert (diff > 1e-5).float().mean() < 1e-3  # (Adam's ~0 gradients aside, as between ranks)


@pytest.mark.parametrize("strategy", ["fsdp2", "deepspeed"])
def test_two_ranks_take_the_same_update_as_one(one_rank_update, tiny_cfg, tiny_policy, strategy):
    batch = synthetic_batch()
    (m1, s1) = one_rank_update
    m2, s2 = one_update(tiny_cfg.replace(**CORRECTED_SETTINGS), tiny_policy, 2, strategy, CORRECTED)
    assert m1["optimizer_steps"] == m2["optimizer_steps"] == 2
    # What the mismatch correction took out, the same on both: the ranks exchanged their counts.
    for name in ("mismatch_masked_tokens", "mismatch_masked_sequences", "mismatch_truncated_tokens"):
        assert 0.1 < m1[name] < 0.9 and m2[name] == pytest.approx(m1[name]), name
    assert m1["fresh_tokens"] == m2["fresh_tokens"] == \
        pytest.approx(batch.response_mask.sum().item() * (1 - m1["mismatch_masked_tokens"]))
    assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-4)  # same gradients
    assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-4, abs=1e-6)
    # The reference's pass on each rank (FSDP2: its shards; DeepSpeed: whole on each): the same
    # KL as one rank's, which the first optimizer step made more than round-off.
    assert m1["kl_ref"] > 1e-9 and m2["kl_ref"] == pytest.approx(m1["kl_ref"], rel=1e-3)
    assert m1["lr"] == pytest.approx(0.5e-3)  # warm-up over 2 rollouts: this first one at half the rate
    assert m2["lr"] == pytest.approx(m1["lr"])
    for name in s1:
        assert s1[name].dtype == s2[name].dtype == torch.float32  # the masters
        assert (s1[name] - s2[name]).abs().max() <= 2 * 2 * 1e-3, name  # two optimizer steps of lr 1e-3
    # Adam divides by |g|: an element whose gradient is ~0 (a key projection's bias: softmax
    # ignores it) can move by up to 2 lr in either run; everything else must agree to float
    # precision.
    diff = torch.cat([(s1[name] - s2[name]).abs().flatten() for name in s1])
    assert (diff > 1e-5).float().mean() < 1e-3
    from safetensors.torch import load_file
    original = load_file(f"{tiny_policy}/model.safetensors")
    moved = max((s1[n] - original[n]).abs().max().item() for n in original)
    assert moved > 1e-4  # the update really changed the weights


def test_shared_prompts_take_the_same_update_as_whole_rows(one_rank_update, tiny_cfg, tiny_policy):
    """Each prompt computed once per micro-batch, its answers attending to its cached keys
    (the default on one fp32 rank), against every row computed whole: the same loss,
    gradients and weights to float round-off. Two mini-batches, so the old-log-prob pass
    over the second takes shared prompts too."""
    (shared, s1) = one_rank_update
    whole, s2 = one_update(tiny_cfg.replace(**{**CORRECTED_SETTINGS, "learner.shared_prompts": False}), tiny_policy, 1,
                           loss=CORRECTED)
    assert shared["optimizer_steps"] == whole["optimizer_steps"] == 2
    for name in ("loss", "grad_norm", "approx_kl", "fresh_entropy", "kl_ref"):
        assert shared[name] == pytest.approx(whole[name], rel=1e-4, abs=1e-6), name
    diff = torch.cat([(s1[name] - s2[name]).abs().flatten() for name in s1])
    assert diff.max() <= 2 * 2 * 1e-3  # Adam: an element whose gradient is round-off may move either way
    assert (diff > 1e-5).float().mean() < 1e-3


def test_questions_with_no_advantage_pass_forward_only_and_the_update_is_the_same(ray_cluster, tiny_cfg,
                                                                                  tiny_policy):
    """Three of eight questions with every answer's advantage 0 (groups all right or all wrong):
    with `learner.forward_only_idle_questions` they pass forward only, without a graph or a
    backward, and the update is the one that trains them (their gradient is exactly 0), to
    float round-off: on one rank, and on two FSDP2 ranks whose shares hold different numbers of
    them (each rank runs as many passes of each kind: the reduce-scatters pair up). Two
    mini-batches, so the second's old log-probs are taken for them too."""
    batch = synthetic_batch()
    idle = torch.isin(batch.prompt_index, torch.tensor([1, 4, 6]))
    batch.advantages[idle] = 0.0
    settings = {**TWO_MINI_BATCHES, "learner.micro_batch_size": 3}

    def update(workers: int, forward_only: bool):
        cfg = tiny_cfg.replace(**settings, **{"learner.forward_only_idle_questions": forward_only})
        return one_update(cfg, tiny_policy, workers, batch=batch)

    (trained, s1), (skipped, s2), (two_ranks, s3) = update(1, False), update(1, True), update(2, True)
    assert "forward_only_frac" not in trained
    assert skipped["forward_only_frac"] == two_ranks["forward_only_frac"] == pytest.approx(idle.float().mean().item())
    for metrics in (skipped, two_ranks):
        assert metrics["optimizer_steps"] == trained["optimizer_steps"] == 2
        for name in ("loss", "grad_norm", "approx_kl", "fresh_entropy", "fresh_tokens", "fresh_clip_frac"):
            assert metrics[name] == pytest.approx(trained[name], rel=1e-4, abs=1e-6), name
    for state in (s2, s3):
        diff = torch.cat([(s1[name] - state[name]).abs().flatten() for name in s1])
        assert diff.max() <= 2 * 2 * 1e-3  # Adam: an element whose gradient is round-off may move either way
        assert (diff > 1e-5).float().mean() < 1e-3


@pytest.mark.slow  # a torch.distributed group in processes of its own
def test_fsdp2_reduce_scatters_every_micro_batch(tmp_path, tiny_cfg, tiny_policy):
    """After a micro-batch that is not a mini-batch's last, every parameter already holds its
    gradient shard: FSDP2 reduce-scattered it, and no rank keeps the model's unsharded fp32
    gradients until the last micro-batch (4 bytes a parameter). The second micro-batch adds
    to the shards: their sum is the gradient of both losses. (A one-rank gloo group in a
    process of its own: this test process must not hold a default group.)"""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import torch, torch.distributed as dist
        from transformers import AutoModelForCausalLM
        from rayrep.config import load_preset
        from rayrep.learner.sharding import FSDP2Sharding
        dist.init_process_group("gloo", store=dist.FileStore({str(tmp_path / "store")!r}, 1), rank=0, world_size=1)
        model = AutoModelForCausalLM.from_pretrained({tiny_policy!r})
        sharding = FSDP2Sharding(model, load_preset("tiny-cpu"), 1, torch.device("cpu"))
        ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
        def loss():
            return sharding.model(input_ids=ids).logits.float().logsumexp(-1).mean()
        sharding.backward(loss(), last_micro_batch=False)
        params = list(sharding.model.parameters())
        missing = [p for p in params if p.grad is None]
        first = [p.grad.to_local().clone() if p.grad is not None else None for p in params]
        sharding.backward(loss(), last_micro_batch=True)
        doubled = all(g is not None and torch.allclose(p.grad.to_local(), 2 * g, rtol=1e-4, atol=1e-7)
                      for p, g in zip(params, first))
        print(len(params), len(missing), doubled)
        dist.destroy_process_group()
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    count, missing, doubled = done.stdout.split()
    assert int(count) > 0 and missing == "0" and doubled == "True", done.stdout


def test_token_budget_chunks_hold_every_row_once_within_the_budget():
    lengths = torch.tensor([30, 7, 12, 30, 45, 9, 9, 20, 3, 60])
    rows = torch.tensor([0, 2, 3, 4, 5, 7, 8, 9])  # one rank's share
    chunks = token_budget_batches(rows, lengths, budget=60)
    assert sorted(torch.cat(chunks).tolist()) == rows.tolist()
    for chunk in chunks:
        padded = len(chunk) * int(lengths[chunk].max())
        assert padded <= 60 or len(chunk) == 1
    # Longest first, like lengths together: [60], [45], [30, 30], [20, 12, 9], [3]
    assert [lengths[c].tolist() for c in chunks] == [[60], [45], [30, 30], [20, 12, 9], [3]]
    assert token_budget_batches(rows[:0], lengths, 60) == []


def test_micro_batches_hold_whole_questions_ordered_by_their_longest_answer():
    lengths = torch.tensor([9, 30, 12, 12, 40, 8, 8, 20, 21, 3, 3, 3])
    index = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3])  # four questions of three answers
    rows = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    # Longest answers by question: 30, 40, 21, 3 -> questions 1, 0, 2, 3; two questions a micro-batch.
    assert [c.tolist() for c in questions_by_length(rows, index, lengths, 2)] == [[3, 4, 5, 0, 1, 2], [6, 7, 8, 9, 10, 11]]
    assert [c.tolist() for c in questions_by_length(rows, index, lengths, 1)] == [[3, 4, 5, 0, 1, 2, 6, 7, 8, 9, 10, 11]]
    # Uneven questions (longest 40, 8, 20, 21: in order 0, 3, 2, 1, of 5, 4, 2 and 1 rows): each
    # cut at the question boundary nearest its share of the rows (4 and 8: after 5 and 9 rows).
    uneven = torch.tensor([0, 0, 0, 0, 0, 1, 2, 2, 3, 3, 3, 3])
    chunks = questions_by_length(rows, uneven, lengths, 3)
    assert [c.tolist() for c in chunks] == [[0, 1, 2, 3, 4], [8, 9, 10, 11], [6, 7, 5]]
    # More micro-batches than questions (another rank's share sets the count): empty ones.
    assert [len(c) for c in questions_by_length(rows[:3], index, lengths, 3)] == [0, 3, 0]


def test_micro_batches_by_length_take_the_update_of_one_pass_and_count_the_padding_it_runs(ray_cluster, tiny_cfg,
                                                                                           tiny_policy):
    """The mini-batch's loss and gradients are a sum over its micro-batches, whichever rows
    each holds: micro-batches of whole questions ordered by length take the update of the whole
    mini-batch in one pass, up to round-off. `padding_frac` counts the positions the passes
    run: each question's prompt once (but its last token), then every answer from its prompt's
    last token on, padded to its micro-batch's longest."""
    cfg = tiny_cfg.replace(**{"algorithm.prompts_per_step": 8, "learner.mini_batch_prompts": 8, "learner.lr": 1e-3,
                              "learner.warmup_steps": 0})
    batch = synthetic_batch(seed=4)
    results = []
    for size in (5, 64):  # micro-batches of whole questions (4 answers each) ordered by length; one pass
        _, placement, learners = make_learners(cfg.replace(**{"learner.micro_batch_size": size}), tiny_policy, 1)
        try:
            results.append(learners.update(batch, LossSpec()))
        finally:
            learners.shutdown()
            placement.remove()
    split, whole = results
    assert split["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5)
    assert split["loss"] == pytest.approx(whole["loss"], rel=1e-5, abs=1e-7)
    starts = batch.response_mask.to(torch.int8).argmax(1)
    prompts = {int(q): int(start) - 1 for q, start in zip(batch.prompt_index, starts)}  # each prompt but its last token
    suffixes = batch.lengths - starts + 1  # each answer with its prompt's last token
    positions = len(prompts) * max(prompts.values()) + len(batch.lengths) * int(suffixes.max())
    tokens = sum(prompts.values()) + int(suffixes.sum())
    assert whole["padding_frac"] == pytest.approx(1 - tokens / positions, rel=1e-9)
    assert split["padding_frac"] < whole["padding_frac"]  # like lengths together


def minor_faults(pid: int) -> int:
    """Pages the process `pid` has faulted in since it started (/proc: field 10 of its stat)."""
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[7])


def test_a_cpu_learner_keeps_its_freed_activations_for_the_next_update(ray_cluster, tiny_cfg, tiny_policy):
    """A step's update allocates and frees activations of a few MB by the hundred; by default
    glibc hands them back to the system and every update faults their pages in again. The
    learner's process keeps them (`rayrep.heap.keep_freed_memory`): once it has run an update,
    the next faults in fewer pages. Each update's count varies with what else the process does
    meanwhile (Ray's own threads, the batch's pages read from the object store), so the median
    of five updates is compared. Measured (2026-12-06): without the setting single updates
    fault 16 to 32,900 pages, medians of five 9,900 and 15,100; with it 4 to 7,000, medians
    of five 14 and 25 (of three, up to 5,000)."""
    cfg = tiny_cfg.replace(**{"algorithm.prompts_per_step": 64, "learner.mini_batch_prompts": 64})
    batch = synthetic_batch(num_prompts=64, answers=8, seed=5)
    _, placement, learners = make_learners(cfg, tiny_policy, 1)
    try:
        pid = ray.get(learners.workers[0].pid.remote())
        learners.update(batch, LossSpec())
        faults = []
        for _ in range(5):
            before = minor_faults(pid)
            learners.update(batch, LossSpec())
            faults.append(minor_faults(pid) - before)
        assert sorted(faults)[2] < 5_000, faults
    finally:
        learners.shutdown()
        placement.remove()


def test_token_budget_micro_batches_take_the_same_update_with_less_padding(ray_cluster, tiny_cfg, tiny_policy):
    """Two mini-batches whose old log-probs are recomputed first (so the recomputed rows must
    land where they belong whatever order the chunks take them in), on one rank with fixed
    micro-batches of 5 rows and on two ranks with chunks of at most 40 padded tokens (the
    ranks' chunk counts differ: the shorter rank runs dummy passes)."""
    cfg = tiny_cfg.replace(**{"algorithm.prompts_per_step": 8, "learner.mini_batch_prompts": 4,
                              "learner.micro_batch_size": 5, "learner.lr": 1e-3, "learner.warmup_steps": 0})
    batch = synthetic_batch(seed=3)
    results = []
    for workers, budget in ((1, 0), (2, 40)):
        _, placement, learners = make_learners(cfg.replace(**{"learner.micro_batch_tokens": budget}), tiny_policy, workers)
        try:
            results.append((learners.update(batch, LossSpec()), full_state(learners)))
        finally:
            learners.shutdown()
            placement.remove()
    (fixed, s1), (budgeted, s2) = results
    assert fixed["optimizer_steps"] == budgeted["optimizer_steps"] == 2
    assert budgeted["grad_norm"] == pytest.approx(fixed["grad_norm"], rel=1e-4)
    assert budgeted["loss"] == pytest.approx(fixed["loss"], rel=1e-4, abs=1e-6)
    assert budgeted["approx_kl"] == pytest.approx(fixed["approx_kl"], rel=1e-5)  # the same old log-probs
    for name in s1:
        assert (s1[name] - s2[name]).abs().max() <= 2 * 2 * 1e-3, name
    # Adam moves an element by about lr whatever its gradient's size: one whose gradient is
    # round-off may move either way. Such elements are rare over the whole model.
    diff = torch.cat([(s1[name] - s2[name]).abs().flatten() for name in s1])
    assert (diff > 1e-5).float().mean() < 1e-3
    assert 0 < budgeted["padding_frac"] < fixed["padding_frac"]


def test_the_learning_rate_schedule_counts_rollouts_not_optimizer_steps(ray_cluster, tiny_cfg, tiny_policy):
    # Two optimizer steps per rollout (8 questions, mini-batches of 4); warm-up over 2 rollouts.
    cfg = tiny_cfg.replace(**{"algorithm.prompts_per_step": 8, "learner.mini_batch_prompts": 4, "learner.lr": 1e-3,
                              "learner.warmup_steps": 2, "learner.lr_schedule": "cosine", "run.steps": 5})
    _, placement, learners = make_learners(cfg, tiny_policy, 1)
    try:
        # On CPU the learners keep their state where it is (the hand-over is for colocated GPUs,
        # and CPU runs that emulate them): nothing moves.
        assert ray.get([w.offload.remote() for w in learners.workers]) == [[]]
        assert ray.get([w.onload.remote() for w in learners.workers]) == [[]]
        rates = [learners.update(synthetic_batch(), LossSpec()) for _ in range(5)]
    finally:
        learners.shutdown()
        placement.remove()
    assert [m["optimizer_steps"] for m in rates] == [2] * 5
    # rollout 0, 1: warm-up 1/2, 2/2; then cosine over the 3 remaining rollouts: 1, 0.75, 0.25
    expected = [0.5, 1.0, 1.0, 0.75, 0.25]
    assert [m["lr"] for m in rates] == pytest.approx([1e-3 * f for f in expected])


@pytest.mark.parametrize(("algorithm", "epochs"), [("grpo", 2), ("rlep", 1), ("exgrpo", 1)])
def test_the_first_mini_batch_takes_its_old_logprobs_from_its_own_forward_pass(ray_cluster, tiny_cfg, tiny_policy,
                                                                              algorithm, epochs):
    """The update skips the old-log-prob pass over its first mini-batch (its weights have not
    moved yet) and takes the same update as when every row's old log-probs come from a
    separate pass first: GRPO over two epochs (the first mini-batch's own log-probs serve
    the second epoch), RLEP's replays recomputed with the fresh answers, ExGRPO's replays
    keeping their recorded log-probs under the shaped loss."""
    cfg = tiny_cfg.replace(**{**TWO_MINI_BATCHES, "model.dtype": "float32", "learner.epochs": epochs,
                              "learner.warmup_steps": 0})
    batch = synthetic_batch(seed=5)
    replayed = torch.arange(len(batch.replay_mask)) % 4 == 3  # one answer in four
    loss = LossSpec()
    if algorithm != "grpo":
        batch.replay_mask = replayed
    if algorithm == "exgrpo":
        batch.recompute_old = ~replayed
        loss = LossSpec(replay_loss="shaped", clip_fresh=False)

    def old_logprobs_before_any_update(worker, batch: TrainBatch) -> torch.Tensor:
        """The batch's old log-probs as a separate pass takes them, mini-batch by mini-batch
        (run inside the learner actor): recomputed rows replaced, recorded rows kept."""
        old = batch.old_logprobs.clone()
        for prompts in mini_batches(batch.num_prompts, worker.cfg.learner.mini_batch_prompts):
            rows, recomputed = worker.forward.old_logprobs(batch, rows_per_rank(batch.prompt_index, prompts, worker.world_size))
            keep = batch.recompute_old[rows]
            old[rows[keep]] = recomputed[keep]
        return old

    results = []
    for separate_pass in (False, True):
        _, placement, learners = make_learners(cfg, tiny_policy, 1)
        try:
            trained = batch
            if separate_pass:  # the reference: every old log-prob given, none recomputed
                old = ray.get(learners.workers[0].__ray_call__.remote(old_logprobs_before_any_update, batch))
                trained = TrainBatch(**{**vars(batch), "old_logprobs": old,
                                        "recompute_old": torch.zeros_like(batch.recompute_old)})
            results.append((learners.update(trained, loss), full_state(learners)))
        finally:
            learners.shutdown()
            placement.remove()
    (own, own_state), (separate, separate_state) = results
    assert own["optimizer_steps"] == separate["optimizer_steps"] == 2 * epochs
    for name in ("loss", "grad_norm", "approx_kl"):
        assert own[name] == pytest.approx(separate[name], rel=1e-5, abs=1e-7), name
    assert all(torch.allclose(own_state[n], separate_state[n], atol=1e-6) for n in own_state)


# One mini-batch of 8 questions, lr 1e-3 from the first step.
ONE_MINI_BATCH = {"algorithm.prompts_per_step": 8, "learner.mini_batch_prompts": 8, "learner.lr": 1e-3,
                  "learner.warmup_steps": 0}


@pytest.fixture(scope="module")
def fp32_updates(ray_cluster, tiny_cfg, tiny_policy):
    """One fp32 rank, three updates on `synthetic_batch()`: (metrics of each, the full state
    after the first, after the third): the reference of gradient checkpointing and of bf16."""
    # Rows whole, as gradient checkpointing and bf16 (FSDP2) compute them: the same
    # arithmetic, so that the comparisons below are of one change at a time.
    _, placement, learners = make_learners(tiny_cfg.replace(**ONE_MINI_BATCH, **{"model.dtype": "float32",
                                                                                 "learner.shared_prompts": False}),
                                           tiny_policy, 1)
    try:
        metrics = [learners.update(synthetic_batch(), LossSpec())]
        first = full_state(learners)
        metrics += [learners.update(synthetic_batch(), LossSpec()) for _ in range(2)]
        return metrics, first, full_state(learners)
    finally:
        learners.shutdown()
        placement.remove()


def test_gradient_checkpointing_takes_the_same_update(fp32_updates, tiny_cfg, tiny_policy):
    metrics, state, _ = fp32_updates
    cfg = tiny_cfg.replace(**ONE_MINI_BATCH, **{"model.dtype": "float32", "learner.gradient_checkpointing": True})
    checkpointed, checkpointed_state = one_update(cfg, tiny_policy, 1)
    assert checkpointed["grad_norm"] == pytest.approx(metrics[0]["grad_norm"], rel=1e-5)
    assert all(torch.allclose(state[n], checkpointed_state[n], atol=1e-6) for n in state)


def optimizer_state_dtypes(learners: LearnerGroup) -> set[str]:
    """The dtypes of AdamW's moment tensors on every rank (read inside the actors)."""
    def dtypes(worker) -> set[str]:
        optimizer = worker.sharding.optimizer
        optimizer = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed wraps the torch optimizer
        return {str(v.dtype) for state in optimizer.state.values() for k, v in state.items() if k != "step"}

    return set().union(*ray.get([w.__ray_call__.remote(dtypes) for w in learners.workers]))


@pytest.mark.parametrize("strategy", ["fsdp2", "deepspeed"])
def test_bf16_compute_keeps_fp32_masters_that_move_at_a_paper_learning_rate(ray_cluster, tiny_cfg, tiny_policy, strategy):
    """At lr 1e-6 (the papers'), a bf16 parameter would round nearly every update away; the
    fp32 masters take them all. Gradients are reduced and accumulated in fp32 by both
    strategies (DeepSpeed would use bf16 unless told), and a DeepSpeed sync sends its whole
    bf16 weights, which are the masters rounded, without gathering the masters."""
    from safetensors.torch import load_file

    cfg = tiny_cfg.replace(**{"model.dtype": "bfloat16", "learner.lr": 1e-6, "learner.warmup_steps": 0,
                              "learner.weight_decay": 0.1, "algorithm.prompts_per_step": 8,
                              "learner.mini_batch_prompts": 4})
    _, placement, learners = make_learners(cfg, tiny_policy, 2, strategy)
    try:
        for _ in range(2):
            learners.update(synthetic_batch(), LossSpec())
        state = full_state(learners)
        dtypes = optimizer_state_dtypes(learners)
        manifest = learners.weight_manifest(1 << 20)
        # What a sync sends: each tensor gathered in bf16 (FSDP2: each rank's shard cast first).
        synced = ray.get([w.__ray_call__.remote(
            lambda worker: {name: (tensor.dtype, tensor.float().cpu())
                            for name, tensor in worker.sharding.full_tensors(torch.bfloat16)})
            for w in learners.workers])
        if strategy == "deepspeed":
            engine_dtypes = ray.get(learners.workers[0].__ray_call__.remote(
                lambda worker: (worker.sharding.model.communication_data_type,
                                worker.sharding.model.get_data_types())))
            assert engine_dtypes == (torch.float32, (torch.bfloat16, torch.float32))
    finally:
        learners.shutdown()
        placement.remove()
    original = load_file(f"{tiny_policy}/model.safetensors")
    changed = sum(int((state[n] != original[n]).sum()) for n in original)
    total = sum(t.numel() for t in original.values())
    assert changed / total > 0.99, changed / total
    assert dtypes == {"torch.float32"}
    assert {s.dtype for s in manifest.tensors} == {torch.bfloat16}  # the generators get bf16
    for rank_tensors in synced:  # every rank holds the full tensors: the masters rounded to bf16
        assert set(rank_tensors) == set(state)
        for name, (dtype, tensor) in rank_tensors.items():
            assert dtype == torch.bfloat16
            assert torch.equal(tensor, state[name].to(torch.bfloat16).float()), name


@pytest.mark.parametrize("strategy", ["fsdp2", "deepspeed"])
def test_lora_trains_only_its_adapter_in_fp32_on_a_frozen_base_in_bf16(ray_cluster, tiny_cfg, tiny_policy, strategy):
    """With `learner.lora_rank`, two ranks of either strategy hold the base frozen in bf16 (no
    gradients, no optimizer state, no fp32 masters: it stays the checkpoint's weights to the
    bit) and train the adapter alone, in fp32; a sync's manifest lists the adapter's tensors
    alone, in bf16, named as in PEFT's files."""
    from safetensors.torch import load_file

    cfg = tiny_cfg.replace(**{"model.dtype": "bfloat16", "learner.lr": 1e-3, "learner.warmup_steps": 0,
                              "algorithm.prompts_per_step": 8, "learner.mini_batch_prompts": 4,
                              "learner.lora_rank": 8})
    _, placement, learners = make_learners(cfg, tiny_policy, 2, strategy)
    try:
        for _ in range(2):
            learners.update(synthetic_batch(), LossSpec())
        state = ray.get([w.full_state_dict.remote(torch.bfloat16) for w in learners.workers])[0]
        held = ray.get(learners.workers[1].__ray_call__.remote(lambda worker: (
            {str(p.dtype) for p in worker.sharding.module.parameters() if not p.requires_grad},
            {str(p.dtype) for p in worker.sharding.module.parameters() if p.requires_grad})))
        dtypes = optimizer_state_dtypes(learners)
        moments = ray.get(learners.workers[0].__ray_call__.remote(lambda worker: len(
            getattr(worker.sharding.optimizer, "optimizer", worker.sharding.optimizer).state)))
        manifest = learners.weight_manifest(1 << 20)
    finally:
        learners.shutdown()
        placement.remove()
    # The frozen base; the adapter's masters (DeepSpeed: in its optimizer, the module's copies bf16).
    assert held == ({"torch.bfloat16"}, {"torch.float32" if strategy == "fsdp2" else "torch.bfloat16"})
    assert dtypes == {"torch.float32"}
    adapter = {name: t for name, t in state.items() if ".lora_" in name}
    assert len(adapter) == 56 and all(t.abs().max() > 0 for t in adapter.values())  # A and B both moved from 0 / init
    # DeepSpeed's optimizer holds its partitions as flat groups; torch's AdamW (FSDP2) one state per adapter tensor.
    assert moments == (56 if strategy == "fsdp2" else moments) and moments > 0
    original = load_file(f"{tiny_policy}/model.safetensors")
    for name, tensor in original.items():
        frozen = name.replace(".weight", ".base_layer.weight").replace(".bias", ".base_layer.bias")
        assert torch.equal(state.get(frozen, state.get(name)), tensor.to(torch.bfloat16)), name
    assert [s.name for s in manifest.tensors] == [f"base_model.model.{name.replace('.default', '')}" for name in adapter]
    assert {s.dtype for s in manifest.tensors} == {torch.bfloat16} and manifest.adapter.r == 8


def test_three_bf16_steps_agree_with_fp32_within_bf16_tolerance(fp32_updates, tiny_cfg, tiny_policy):
    from safetensors.torch import load_file

    m32, _, s32 = fp32_updates
    _, placement, learners = make_learners(tiny_cfg.replace(**ONE_MINI_BATCH, **{"model.dtype": "bfloat16"}),
                                           tiny_policy, 1)
    try:
        m16 = [learners.update(synthetic_batch(), LossSpec()) for _ in range(3)]
        s16 = full_state(learners)
    finally:
        learners.shutdown()
        placement.remove()
    original = load_file(f"{tiny_policy}/model.safetensors")
    # Step 1 starts from the same weights, so only the arithmetic differs: bf16 keeps 8 bits
    # of significand (each operation rounds by up to 2^-9 of its result), and a few dozen
    # roundings in sequence through four layers and back move the gradient's norm by about a
    # percent (0.6% with AVX-512 kernels, 0.9% with AVX2), where a wrong scale (a lost mean,
    # a dropped micro-batch) moves it by tens of percent.
    assert m16[0]["grad_norm"] == pytest.approx(m32[0]["grad_norm"], rel=0.05)
    # After it the two runs hold different weights (Adam divides each entry's step by the
    # entry's own size, so the rounding of small gradients changes their steps by up to lr):
    # the next gradients are of two models, checked for their scale only (5-6% apart).
    for a, b in zip(m32[1:], m16[1:]):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=0.25)
    # The three steps' update is the same update: it points the same way (the difference
    # under a fifth of its length) and is as large, entry by entry, within a tenth.
    moved32 = torch.cat([(s32[n] - original[n]).flatten() for n in original])
    moved16 = torch.cat([(s16[n] - original[n]).flatten() for n in original])
    assert (moved16 - moved32).norm() < 0.2 * moved32.norm()
    assert (moved32 - moved16).abs().mean() < 0.1 * moved32.abs().mean()


def adapted(tiny_policy: str, learners: LearnerGroup, folder):
    """The base policy with the learners' LoRA adapter, as PEFT itself applies it: the adapter
    gathered at rank 0 and written in PEFT's format, then loaded by `peft` (not merged)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rayrep.models.adapter import file_key, write_adapter

    state = ray.get([w.full_state_dict.remote(torch.float32, True) for w in learners.workers])[0]
    config = ray.get(learners.workers[0].adapter_config.remote())
    write_adapter(folder, {file_key(name): t for name, t in state.items()}, config)
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_policy), str(folder)).eval()


def bf16_noise(model, rollouts) -> torch.Tensor:
    """Per token, how far transformers' own bf16 forward pass of `model`'s weights lands from
    its fp32 forward pass of them: what computing in bf16 alone costs on this CPU's kernels."""
    import copy

    in_bf16 = copy.deepcopy(model).to(torch.bfloat16)
    return torch.cat([(response_logprobs(in_bf16, r) - response_logprobs(model, r)).abs() for r in rollouts])


# The broadcast's full-weight sync is checked the same way across two nodes (test_two_nodes:
# the same log-prob gap, under 1e-3); here it carries a LoRA adapter.
@pytest.mark.parametrize(("dtype", "mode", "lora_rank"), [
    ("float32", "colocated", 0), ("bfloat16", "colocated", 0), ("float32", "disaggregated", 8)])
def test_weight_sync_makes_the_generators_sample_from_the_learners_weights(ray_cluster, tiny_cfg, tiny_policy, tmp_path,
                                                                         dtype, mode, lora_rank):
    """After each sync the behaviour log-probs of fresh samples are those of the learner's
    weights (a transformers forward pass of the gathered state), not of the weights the sync
    replaced. In bf16 the generators get the fp32 masters rounded to bf16, and compute in
    bf16. Colocated, the learner rank beside the engine hands it each bucket (shared-memory
    handles); disaggregated, rank 0 broadcasts (gloo). With LoRA (two FSDP2 ranks training an
    adapter on the frozen base), only the adapter's tensors travel, and the engines sample the
    base with the adapter as PEFT applies it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rayrep.data import encode_prompts, load_split

    # lr 3e-3: each step moves the weights well clear of bf16's computing noise.
    cfg = tiny_cfg.replace(**{"learner.lr": 3e-3, "learner.warmup_steps": 0, "sync.bucket_mb": 0.5 if not lora_rank else 0.1,
                              "model.dtype": dtype, "placement.mode": mode, "learner.lora_rank": lora_rank})
    cfg, placement, learners = make_learners(cfg, tiny_policy, 2)
    assert placement.plan.transport == {"colocated": "handles", "disaggregated": "broadcast"}[mode]
    generators = GeneratorGroup.create(cfg, tiny_policy, placement)
    sync = WeightSync(cfg, learners, generators)
    assert len(sync.manifest.buckets) > 1  # several bounded buckets, not one call per tensor
    batch = synthetic_batch(seed=1)
    questions = load_split(cfg.data, "test")[:4]
    prompt_ids = encode_prompts(AutoTokenizer.from_pretrained(tiny_policy), questions, cfg.data.max_prompt_tokens)

    def sampled() -> list:  # about 350 tokens: a mean over many tokens, not one token's worst case
        answers = generators.gather(generators.generate(prompt_ids, n=4, temperature=1.0, top_p=1.0, max_tokens=24))
        return [r for per_prompt in answers for r in per_prompt]

    def as_sent(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: t.to(getattr(torch, dtype)).float() for name, t in state.items()}

    def learners_policy(version: int):
        if lora_rank:
            return adapted(tiny_policy, learners, tmp_path / f"adapter-{version}")
        return model_with(tiny_policy, as_sent(full_state(learners)))

    if lora_rank:  # the adapter's tensors alone: 4 layers x 7 projections x (A, B)
        assert len(sync.manifest.tensors) == 56 and all(".lora_" in t.name for t in sync.manifest.tensors)
        assert sync.manifest.total_bytes < 0.1 * sum(t.numel() for t in AutoModelForCausalLM.from_pretrained(
            tiny_policy).parameters()) * 4
    try:
        replaced = learners_policy(0)
        for version in (1, 2, 3):
            learners.update(batch, LossSpec())
            stats = sync.push()
            assert stats["policy_version"] == version and stats["sync_bytes"] == sync.manifest.total_bytes
            assert ray.get([w.policy_version.remote() for w in generators.workers]) == [version]
            trained, rollouts = learners_policy(version), sampled()
            to_trained = logprob_gaps(trained, rollouts)
            # The sync took: the new weights explain the samples, and the weights it replaced
            # do not (a stale engine, or a stale part of one, reverses the two). Each step moves
            # the mean gap by 0.1-0.8 nats; bf16's computing noise is about 0.01.
            assert to_trained.mean() < 0.1 * logprob_gaps(replaced, rollouts).mean(), version
            if dtype == "float32":
                # The engine and transformers differ by fp32 round-off (about 1e-5): which tensors
                # travel is checked here, exactly (a tied head left stale fails at 0.17).
                assert to_trained.max() < 1e-3, version
            else:
                # As close as computing in bf16 gets: transformers' own bf16 pass of the same
                # weights lands as far from its fp32 pass (the engine's mean gap is 0.6-0.9 of
                # it, with AVX-512 and AVX2 kernels). bf16's noise hides a stale head; fp32 does not.
                assert to_trained.mean() < 3 * bf16_noise(trained, rollouts).mean(), version
            replaced = trained
    finally:
        ray.get([worker.drop_adapters.remote() for worker in generators.workers])  # (a LoRA run's folders)
        for worker in generators.workers:
            ray.kill(worker)
        learners.shutdown()
        placement.remove()


def test_model_config_overrides_reach_learners_generators_and_checkpoints(ray_cluster, tiny_cfg, tiny_policy, tmp_path):
    """The ExGRPO preset's longer context: a raised RoPE base and more positions, applied the
    same way by transformers (learners), vLLM (generators) and every saved checkpoint."""
    import json

    from transformers import AutoModelForCausalLM

    from rayrep.config import InputError
    from rayrep.roles.system import Runtime

    long = {"data.max_prompt_tokens": 200, "generator.max_response_tokens": 100}  # 300 > the tiny policy's 256
    with pytest.raises(InputError, match="= 300 exceeds the 256 positions"):
        Runtime.start(tiny_cfg.replace(**long), tiny_policy)  # refused before any actor starts
    cfg = tiny_cfg.replace(**{**long, "model.rope_theta": 40000.0, "model.max_position_embeddings": 512})
    cfg, placement, learners = make_learners(cfg, tiny_policy, 1)
    generators = GeneratorGroup.create(cfg, tiny_policy, placement)
    try:
        checkpoint = learners.save(str(tmp_path / "ckpt"))
        (per_prompt,) = generators.gather(generators.generate([[5, 6, 7, 8, 9, 10, 11, 12]], n=2, temperature=1.0,
                                                              top_p=1.0, max_tokens=24))
    finally:
        for worker in generators.workers:
            ray.kill(worker)
        learners.shutdown()
        placement.remove()
    saved = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert saved["max_position_embeddings"] == 512 and saved["rope_parameters"]["rope_theta"] == 40000.0
    extended = AutoModelForCausalLM.from_pretrained(checkpoint).eval()  # reads the overrides back
    base = AutoModelForCausalLM.from_pretrained(tiny_policy).eval()

    # the generators ran the extended model, not the base one
    assert logprob_gap(extended, per_prompt) < 1e-3 < logprob_gap(base, per_prompt)


def test_deepspeeds_state_stays_on_the_gpu_and_the_kl_reference_takes_turns(ray_cluster, tiny_cfg, tiny_policy):
    """Colocated (emulated GPUs), a DeepSpeed rank keeps its parameters and state on its GPU
    while the engines hold it, and its KL reference, rayrep's own module, leaves and comes back
    with the optimizer's turn; an update finds it on the device."""
    from rayrep.cluster.memory import PARAMETERS, REFERENCE
    from rayrep.cluster.residency import DEVICE, HOST

    cfg = tiny_cfg.replace(**{**TWO_MINI_BATCHES, "placement.emulate_gpus": True, "learner.kl.coef": 0.05})
    _, placement, learners = make_learners(cfg, tiny_policy, 1, "deepspeed")
    try:
        def where() -> dict[str, str]:
            return ray.get(learners.memory_reports()[0]).where

        assert (where()[PARAMETERS], where()[REFERENCE]) == (DEVICE, HOST)  # set up, then the engines' turn
        learners.onload()
        assert where()[REFERENCE] == DEVICE
        metrics = learners.update(synthetic_batch(), LossSpec(kl_coef=0.05))
        assert metrics["kl_ref"] > 0
        learners.offload(parameters=False)  # the sync's turn: the parameters stay for it
        assert (where()[PARAMETERS], where()[REFERENCE]) == (DEVICE, HOST)
    finally:
        learners.shutdown()
        placement.remove()


def test_the_kl_in_the_reward_is_each_answers_summed_estimate_and_lowers_its_reward(ray_cluster, tiny_cfg, tiny_policy):
    """`learner.kl.in_reward`: two ranks give each row the sum over its response tokens of k1
    between the weights the update starts from and the starting policy, as the two models
    compute it here; nothing before any update; the algorithm takes coef x that off each
    answer's reward before its group's advantages."""
    from transformers import AutoModelForCausalLM

    from rayrep.algos.grpo import GRPO
    from rayrep.types import Answer, Group, Prompt, Rollout

    cfg = tiny_cfg.replace(**{**TWO_MINI_BATCHES, "learner.kl.coef": 0.1, "learner.kl.in_reward": True,
                              "learner.kl.estimator": "k1"})
    assert cfg.learner.loss_spec().kl_coef == 0  # not in the loss too
    _, placement, learners = make_learners(cfg, tiny_policy, 2)
    try:
        batch = synthetic_batch()
        before, tokens = learners.kl_to_reference(batch, "k1")
        assert torch.equal(tokens, batch.response_mask.sum(-1).float()) and before.abs().max() < 1e-9
        learners.update(batch, LossSpec())
        after, _ = learners.kl_to_reference(batch, "k1")
        policy, base = model_with(tiny_policy, full_state(learners)), AutoModelForCausalLM.from_pretrained(tiny_policy)
        with torch.no_grad():
            for row in range(len(batch.lengths)):
                ids = batch.input_ids[row : row + 1, : int(batch.lengths[row])]
                mask = batch.response_mask[row, 1 : ids.shape[1]]
                logp = [torch.log_softmax(m(ids).logits[0, :-1].double(), -1).gather(1, ids[0, 1:, None])[:, 0][mask]
                        for m in (policy, base)]
                # The learners' log-probs are fp32 (up to about 20 nats, each within a few 1e-6).
                assert after[row].item() == pytest.approx(float((logp[0] - logp[1]).sum()), rel=1e-5,
                                                          abs=4e-6 * len(logp[0])), row
        assert after.abs().sum() > 1e-4
        # The algorithm's side: each answer's reward less 0.1 x its sum, then the advantages.
        algorithm = GRPO(cfg, learners=learners)
        groups = []
        for question in range(2):
            rows = torch.nonzero(batch.prompt_index == question).flatten().tolist()
            prompt = Prompt(uid=f"q{question}", messages=({"role": "user", "content": "?"},), ground_truth="1")
            answers = [Answer.of(Rollout(batch.input_ids[r, : int(batch.response_mask[r].int().argmax())],
                                         batch.input_ids[r, batch.response_mask[r]], [-1.0] * int(batch.response_mask[r].sum()),
                                         "", "stop")) for r in rows]
            groups.append(Group.sampled(prompt, answers, [True, False] * (len(rows) // 2)))
        step = algorithm.build(groups, step=0)
        plain = [GRPO(cfg).score(g).rewards for g in step.groups]
        sums, _ = learners.kl_to_reference(step.recipe, "k1")
        penalised = [r for g in step.groups for r in g.rewards]
        assert penalised == pytest.approx([r - 0.1 * s for r, s in zip([r for g in plain for r in g], sums.tolist())])
        assert step.metrics["kl_reward_penalty"] == pytest.approx(0.1 * sums.mean().item())
    finally:
        learners.shutdown()
        placement.remove()


def test_a_bf16_checkpoint_loads_in_bf16_and_its_fp32_masters_are_the_fp32_loads(ray_cluster, tiny_cfg, tiny_policy,
                                                                                 tmp_path):
    """Each rank loads the policy in the checkpoint's dtype (a 7B bf16 policy: 15 GB a rank, not
    the 30.9 GB of an fp32 load) and upcasts each layer as it shards it: the masters are those
    an fp32 load of the same checkpoint makes, bit for bit, for FSDP2 over two bf16 ranks."""
    from transformers import AutoModelForCausalLM

    stored = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_policy, dtype=torch.float32).to(torch.bfloat16).save_pretrained(stored)
    for file in Path(tiny_policy).iterdir():  # (its tokenizer and template)
        if not (stored / file.name).exists():
            shutil.copy(file, stored / file.name)
    expected = AutoModelForCausalLM.from_pretrained(stored, dtype=torch.float32).state_dict()
    _, placement, learners = make_learners(tiny_cfg.replace(**{"model.dtype": "bfloat16"}), str(stored), 2)
    try:
        masters = full_state(learners)
    finally:
        learners.shutdown()
        placement.remove()
    assert masters.keys() <= expected.keys() and len(masters) > 10
    for name, tensor in masters.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, expected[name]), name
