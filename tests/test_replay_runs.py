"""RLEP and ExGRPO on a real local Ray cluster: real learners, vLLM generators, buffer shard actors."""

import dataclasses
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from rayrep.algos.exgrpo import ExGRPO
from rayrep.buffer.files import read_pool
from rayrep.buffer.replay import ReplayBuffer
from rayrep.cluster.placement import Placement, make_plan
from rayrep.data import PromptSampler
from rayrep.learner.group import LearnerGroup
from rayrep.machine import describe_path, numeric_path
from rayrep.pipelines.collect import collect_pool
from rayrep.run.checkpoints import read_run_state
from rayrep.run.log import read_metrics
from rayrep.train import train
from rayrep.types import Answer, Group, Rollout, RolloutPart, answer_arrays


RECORDED = Path(__file__).parent / "recorded_metrics"
"""Each short run's metrics as the code before the rollouts' redesign (issue 44) wrote them,
on a 2-core CPU machine (`buffer_bytes` since grown by the 8 bytes each stored answer's row
now holds: its question's number and its advantage; the per-GPU figures of the learners' turn,
`memory_hand_over_gib` and `memory_update_gib`, since down by the 1 GiB of engine runtime that a
sleeping engine keeps in host memory, not on its GPU); answer-level replay's as the code that
brought it wrote them. `RAYREP_RECORD_METRICS=1` writes them again, and the machine and kernels
they were written with (`RECORDED_ON`: written with the RLEP, ExGRPO and RLEP-with-LoRA runs'
figures, which came out the same to the last digit)."""
NOT_RECORDED = re.compile(r"time|seconds|gbps|per_second|^padding_frac$")
"""Wall-clock figures, which no two runs share; and the share of padding, which since the
figures were recorded counts the positions a pass runs (a shared prompt once, each answer's
rest to its micro-batch's longest; `rayrep.learner.forward.Pass`) rather than whole rows."""
NEW_SINCE_RECORDED = re.compile(r"^(exgrpo_replays_from_others|mismatch_|forward_only_frac$)")
"""Metrics the code logs now that it did not when the figures were recorded: at every ExGRPO
step that replays, the replays other runs sampled (0 without a shared pool); at every step,
the engines' log-probs against the learner's (`rayrep.learner.mismatch`), and the share of the
update's answers that passed forward only (`learner.forward_only_idle_questions`)."""


RECORDED_ON = RECORDED / "machine.json"
"""The CPU and kernels the figures were recorded with (`rayrep.machine.numeric_path`): a run
that differs says whether it ran on other kernels."""


def same_as_recorded(name: str, records: list[dict], apart: dict[int, tuple[str, ...]] | None = None) -> None:
    """The run's records hold every recorded metric of every step, equal within round-off
    (counts exactly): a change to how answers travel must not change what a run computes.
    `apart`: {step: key prefixes} of metrics that step logs differently by design, left out
    there on both sides."""
    apart = apart or {}
    kept = [{k: v for k, v in r.items() if not NOT_RECORDED.search(k)} for r in records]
    path = RECORDED / f"{name}.json"
    if os.environ.get("RAYREP_RECORD_METRICS"):
        path.parent.mkdir(exist_ok=True)
        recorded = [{k: v for k, v in r.items() if not NEW_SINCE_RECORDED.match(k)} for r in kept]  # (as compared)
        path.write_text(json.dumps(recorded, indent=0, sort_keys=True) + "\n")
        RECORDED_ON.write_text(json.dumps(numeric_path(), indent=1) + "\n")
        return
    recorded = [{k: v for k, v in r.items() if not NOT_RECORDED.search(k)} for r in json.loads(path.read_text())]
    # Sampled tokens repeat across kernels unless a draw falls within round-off of a boundary:
    # a difference names both machines' kernels.
    kernels = f"recorded on {describe_path(json.loads(RECORDED_ON.read_text()))}; run on {describe_path(numeric_path())}"
    assert len(kept) == len(recorded), name
    for now, then in zip(kept, recorded):
        if now["step"] in apart:
            now, then = ({k: v for k, v in r.items() if not k.startswith(apart[now["step"]])} for r in (now, then))
        assert {k for k in now if not NEW_SINCE_RECORDED.match(k)} == set(then), (name, now["step"], set(now) ^ set(then))
        for key, value in then.items():
            if isinstance(value, float):
                assert now[key] == pytest.approx(value, rel=1e-4, abs=1e-7), (name, now["step"], key, kernels)
            else:
                assert now[key] == value, (name, now["step"], key, kernels)


ROLLOUT_CLASSES = {("rayrep.types", "Rollout"), ("rayrep.types", "RolloutPart"), ("rayrep.types", "TrainBatch"),
                   ("rayrep.buffer.answers", "PackedAnswers")}
"""What holds answers' token arrays: what the driver must never read in a step."""
_unpickled: list | None = None


def _note_unpickled(event: str, args: tuple) -> None:
    if event == "pickle.find_class" and _unpickled is not None:
        _unpickled.append(tuple(args))


def trained_without_reading_rollouts(cfg):
    """`train(cfg)`, its driver (this process) watched: every object Ray deserializes here is
    unpickled, and the unpickler names each class it loads to Python's audit hooks
    (`pickle.find_class`). A run whose driver `ray.get`s rollouts, answer arrays or a
    collated batch fails here. (A hook cannot be removed: one, installed once, that a flag
    turns on; a put-and-get of a rollout first shows that it sees what Ray reads.)"""
    global _unpickled
    if not getattr(trained_without_reading_rollouts, "hooked", False):
        sys.addaudithook(_note_unpickled)
        trained_without_reading_rollouts.hooked = True
    _unpickled = []
    try:
        ray.get(ray.put(RolloutPart([[Rollout([1], [2], [-0.5], "2", "stop")]])))
        assert ("rayrep.types", "RolloutPart") in _unpickled, "the audit hook does not see Ray's reads"
        _unpickled.clear()
        result = train(cfg, log=lambda _: None)
        read = ROLLOUT_CLASSES & set(_unpickled)
    finally:
        _unpickled = None
    assert not read, f"the driver read {sorted(read)} during the run"
    return result


def small(cfg, tmp_path, **changes):
    """A few cheap steps of the tiny preset, with 2 buffer shards, taking turns as colocated GPUs
    do (`placement.emulate_gpus`: residency checks and the device-memory ledger live)."""
    defaults = {
        "run.steps": 2, "run.eval_every": 0, "algorithm.prompts_per_step": 16, "learner.mini_batch_prompts": 8,
        "data.arithmetic_test_size": 32, "replay.num_shards": 2, "logging.out_dir": str(tmp_path),
        "placement.emulate_gpus": True,
    }
    return cfg.replace(**{**defaults, **changes})


@pytest.fixture(scope="module")
def pool_stats(ray_cluster, tiny_cfg, tiny_policy, tmp_path_factory):
    """An experience pool of the base policy over the first 32 questions a run visits."""
    folder = tmp_path_factory.mktemp("pool")
    cfg = small(tiny_cfg, folder, **{"algorithm.rlep.collect_questions": 32, "algorithm.rlep.collect_samples": 8})
    return collect_pool(cfg, tiny_policy, folder / "pool.parquet", log=lambda _: None)


def test_collect_then_rlep_run_replays_the_pool(ray_cluster, tiny_cfg, tiny_policy, tmp_path, pool_stats):
    cfg = small(tiny_cfg, tmp_path)
    stats = pool_stats
    pool = read_pool(stats["pool"])
    assert stats["questions"] == 32 and 0 < stats["kept_questions"] == len(pool) <= 32
    assert all(len(answers) >= 2 for _, answers in pool.values())  # min_successes
    assert sum(len(a) for _, a in pool.values()) == stats["successes"]
    some = next(iter(pool.values()))[1][0]
    assert len(some.response_ids) == len(some.logprobs) and np.isfinite(some.logprobs).all()

    run = trained_without_reading_rollouts(
        cfg.replace(**{"algorithm.name": "rlep", "algorithm.rlep.pool": stats["pool"], "logging.run_name": "rlep"}))
    records = [r for r in read_metrics(run.run_dir / "metrics.jsonl") if r["step"] > 0]
    same_as_recorded("rlep", records)
    assert len(records) == 2
    for record in records:
        assert record["replay_share"] > 0 and record["replay_tokens"] > 0
        # The engines (vLLM, fp32 on CPU) and the learner agree on the fresh answers' log-probs.
        assert abs(record["mismatch_kl"]) < 1e-5 and record["mismatch_ppl_ratio"] == pytest.approx(1, abs=1e-5)
        assert record["mismatch_learner_ppl"] > 1 and record["mismatch_chi2_token"] < 1e-4
        assert "replay_ratio_mean" in record and "replay_entropy" in record
        assert record["optimizer_steps"] == 2  # 16 questions / 8 per mini-batch, whatever G'
    # The first questions of the run's order are the pooled ones: the first step replays them.
    assert records[0]["replay_questions_short"] < 16


def test_exgrpo_run_collects_then_replays(ray_cluster, tiny_cfg, tiny_policy, tmp_path):
    """On the DeepSpeed ZeRO-2 learner, so that strategy also runs end to end (weight sync
    included), and with dynamic sampling: every refill round's groups keep their replays."""
    cfg = small(tiny_cfg, tmp_path, **{
        "algorithm.name": "exgrpo", "algorithm.std_normalize": False, "run.steps": 3, "learner.strategy": "deepspeed",
        "algorithm.exgrpo.start_pass_rate": 0.0, "algorithm.dynamic_sampling": True, "logging.run_name": "exgrpo",
    })
    run = trained_without_reading_rollouts(cfg)
    records = [r for r in read_metrics(run.run_dir / "metrics.jsonl") if r["step"] > 0]
    same_as_recorded("exgrpo-deepspeed-dynamic", records)
    # As the public code: step 1 flips the switch and stores nothing, step 2 collects, step 3 replays.
    assert records[0]["exgrpo_collecting"] == 1.0 and records[0]["buffer_questions"] == 0
    assert records[1]["buffer_questions"] > 0 and records[0]["replayed_questions"] == records[1]["replayed_questions"] == 0
    later = records[2:]
    assert all(r["replayed_questions"] > 0 and r["replay_tokens"] > 0 for r in later)
    assert all(r["time_select"] > 0 and r["exgrpo_selected_entropy"] > 0 for r in later)  # its own phase
    assert all(r["fresh_clip_frac"] == 0 for r in records[1:])  # fresh tokens unclipped in the mixed phase
    assert all(r["optimizer_steps"] == 2 and r["skipped_steps"] == 0 and r["grad_norm"] > 0 for r in records)
    assert [r["policy_version"] for r in records] == [1, 2, 3]  # each step synced new weights
    assert (run.run_dir / "checkpoints" / "final" / "buffer" / "answers.parquet").exists()
    # Dynamic sampling: refills happened, every trained group carries a signal, and every
    # replayed question trains with K - 1 fresh rollouts and its stored answer.
    K = cfg.algorithm.group_size
    assert sum(r["dynamic_sampling_rounds"] for r in records) > 0
    assert all(r["groups_all_equal"] == 0 for r in records)
    assert all(r["group_size_min"] == r["group_size_max"] == K for r in records)


@pytest.mark.parametrize("name", ["prioritized", "rlep"])
def test_dynamic_sampling_keeps_every_algorithms_replays(ray_cluster, tiny_cfg, tiny_policy, tmp_path, pool_stats, name):
    """Refill rounds are planned as values of their own: no round's replays are lost, and the
    filter sees every group whole (fresh and replayed rollouts). ExGRPO's: in the test above.
    Answer-level replay runs with the generation pruner, on a training set small enough that
    questions come back (an epoch is two steps of 16), and is stopped after step 2 and resumed
    for step 3 on two learners instead of one: its records are an uninterrupted run's (the
    buffer's advantages and ages, and the pruner's records, came back with the checkpoint;
    the two ranks' update agrees with one rank's within round-off)."""
    changes = {"algorithm.name": name, "algorithm.dynamic_sampling": True, "run.steps": 3, "logging.run_name": name}
    if name == "rlep":
        # G = 4: fresh groups that all fail (kept only through their replays) are common
        # enough that three steps surely hold some (about 1 in 5 groups). The learners train a
        # LoRA adapter (RLEP with LoRA; the full-weight RLEP run is the test above).
        changes.update({"algorithm.rlep.pool": pool_stats["pool"], "algorithm.group_size": 4,
                        "learner.lora_rank": 8, "learner.lr": 1e-3})
    else:
        changes.update({"algorithm.prune.after": 1, "data.arithmetic_train_size": 32})
    cfg = small(tiny_cfg, tmp_path, **changes)
    if name == "prioritized":
        trained_without_reading_rollouts(cfg.replace(**{"run.steps": 2}))
        run_dir = train(cfg.replace(**{"learner.num_workers": 2}), log=lambda _: None, resume=True).run_dir
        assert read_run_state(run_dir / "checkpoints" / "final").learner["world_size"] == 2
    else:
        run_dir = trained_without_reading_rollouts(cfg).run_dir
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] > 0]
    if name == "prioritized":
        # What the uninterrupted run did not do then: the stopped run evaluated at its end
        # (step 2), and the resumed one's ledger saw it start up and load the checkpoint (step 3),
        # its learners' share of the memory smaller; each of the two ranks pads its own
        # micro-batches. The rest of step 3, the update's figures too, is the uninterrupted run's.
        assert "test_pass@1" in records[1] and "memory_resume_gib" in records[2]
        records[1] = {k: v for k, v in records[1].items() if not k.startswith("test_")}
        assert records[2]["memory_update_learner_gib"] < records[1]["memory_update_learner_gib"]
    same_as_recorded(f"{name}-lora-dynamic" if cfg.learner.lora_rank else f"{name}-dynamic", records,
                     apart={3: ("memory_", "padding_frac")} if name == "prioritized" else None)
    K = cfg.algorithm.group_size
    assert sum(r["dynamic_sampling_rounds"] for r in records) > 0  # refills did happen
    for r in records:
        assert r["groups_all_equal"] == 0  # every trained group carries a signal
        assert r["optimizer_steps"] == 2  # the replayed answers ride in the fresh groups' mini-batches
    if name == "prioritized":
        # Every fresh group whole; from step 2 on, stored answers of other questions join, up
        # to a quarter of the batch's answers (as many as the buffer holds outside the step's
        # questions), right and wrong ones, none older than the bound; the pruner passes by
        # questions whose groups taught nothing.
        assert all(r["group_size_min"] == r["group_size_max"] == K for r in records)
        assert records[0]["prioritized_replayed"] == 0 and records[0]["buffer_answers"] > 0
        for r in records[1:]:
            assert 0.1 < r["replay_share"] <= 0.25 and r["replay_tokens"] > 0
            assert 0 < r["prioritized_wrong_share"] < 1 and r["prioritized_age_mean"] <= cfg.algorithm.prioritized.max_age
        assert sum(r["pruner_skipped"] for r in records) > 0
    if name == "rlep":
        # LoRA: each sync sent the adapter alone (rank 8 on 7 projections of 4 layers, fp32).
        assert {r["sync_bytes"] for r in records} == {4 * 4 * 8 * (2 * (128 + 128) + 2 * (128 + 64) + 3 * (128 + 384))}
        # Groups whose fresh rollouts all failed are kept when a pooled success gives them a signal.
        assert any(r["groups_signal_from_replay"] > 0 for r in records)
        assert all(r["group_size_max"] <= K + cfg.algorithm.rlep.replays_per_group for r in records)


@pytest.fixture(scope="module")
def learners(ray_cluster, tiny_cfg, tiny_policy):
    cfg = tiny_cfg.replace(**{"placement.cpus_per_bundle": 1, "placement.threads": 1, "verifier.num_workers": 0})
    placement = Placement(make_plan(cfg))
    group = LearnerGroup(cfg, tiny_policy, placement)
    yield group
    group.shutdown()
    placement.remove()


def test_exgrpo_picks_the_lowest_entropy_answer_every_time(learners, tiny_cfg, tiny_policy):
    """Planted answers whose mean token entropies are computed independently with transformers."""
    from transformers import AutoModelForCausalLM

    from rayrep.data import encode_prompts, load_split

    model = AutoModelForCausalLM.from_pretrained(tiny_policy).eval()
    cfg = tiny_cfg.replace(**{"algorithm.name": "exgrpo", "algorithm.std_normalize": False})
    prompts = load_split(cfg.data, "train")[:12]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_policy)
    encoded = encode_prompts(tokenizer, prompts, 80)
    # two shard actors: the answers travel by ref
    algo = ExGRPO(cfg, prompts, {p.uid: ids for p, ids in zip(prompts, encoded)}, ReplayBuffer(2, 64), learners,
                  PromptSampler(prompts))
    rng = np.random.default_rng(0)
    expected, lowest = {}, []
    for prompt, ids in zip(prompts, encoded):
        answers = []
        # The policy's own greedy answer (low entropy), random tokens (high), and mixtures.
        greedy = model.generate(torch.tensor([ids]), max_new_tokens=30, do_sample=False)[0, len(ids):].tolist()
        for kind in range(4):
            if kind == 0:
                response = greedy
            else:
                response = greedy[: 4 * kind] + rng.integers(3, 259, size=rng.integers(2, 12)).tolist()
            answers.append(Answer.of_arrays(np.array(response, np.int32), np.zeros(len(response), np.float32), 1.0))
        rng.shuffle(answers)
        entropies = []
        for answer in answers:
            full = torch.tensor([ids + answer.response_ids.tolist()])
            with torch.no_grad():
                logp = torch.log_softmax(model(full).logits[0, len(ids) - 1 : -1], -1)
            entropies.append(float(-(logp.exp() * logp).sum(-1).mean()))
        algo.buffer.add([(prompt.uid, np.array(ids, np.int32), answers)])
        expected[prompt.uid] = answers[int(np.argmin(entropies))].response_ids.tolist()
        lowest.append(min(entropies))
    chosen, mean_entropy = algo.lowest_entropy_answers([p.uid for p in prompts])
    # Chosen by reference (`Answer.at`): the learners read them where the shards left them.
    assert {uid: response.tolist() for uid, (_, response, _, _) in zip(chosen, answer_arrays(list(chosen.values())))} \
        == expected
    assert mean_entropy == pytest.approx(sum(lowest) / len(lowest), rel=1e-4)
    algo.buffer.shutdown()


def test_exgrpo_draws_only_the_fresh_questions_it_trains_on(learners, tiny_cfg, tiny_policy):
    """rho x B questions come from the buffer and B minus those from the sampler: none is
    drawn only to be thrown away (the sampler's position moves by exactly that many)."""
    from transformers import AutoTokenizer

    from rayrep.data import encode_prompts, load_split

    cfg = tiny_cfg.replace(**{"algorithm.name": "exgrpo", "algorithm.std_normalize": False})
    K = cfg.algorithm.group_size
    prompts = load_split(cfg.data, "train")[:40]
    encoded = encode_prompts(AutoTokenizer.from_pretrained(tiny_policy), prompts, 80)
    sampler = PromptSampler(prompts[10:], seed=0)
    algo = ExGRPO(cfg, prompts, {p.uid: ids for p, ids in zip(prompts, encoded)}, ReplayBuffer(0, 0), learners, sampler)
    stored = prompts[:10]
    algo.buffer.apply([(p.uid, np.array(ids, np.int32), [Answer.of_arrays(np.array([5, 6, 1], np.int32), np.zeros(3, np.float32), 1.0)])
                       for p, ids in zip(stored, encoded)], buckets={p.uid: 3 for p in stored})
    algo.collecting = True  # the switch, as after_update flips it
    plan = algo.plan(sampler, 8)
    replayed = [p.uid for p, n in plan.requests if n == K - 1]
    assert len(replayed) == 4 and set(replayed) <= {p.uid for p in stored}
    assert len(plan.requests) == 8 and sampler.position == 8 - 4
    # The stored answer of each is chosen after generation, when the learners hold the GPUs:
    # meanwhile a group counts it as a success (all-wrong fresh rollouts plus it: informative).
    assert set(plan.choose) == set(replayed) and not plan.replays
    fresh = [Group.sampled(p, (Answer.of(Rollout(algo.prompt_ids[p.uid], [7] * 3, [-1.0] * 3, "", "stop")),) * n,
                           (False,) * n)
             for p, n in plan.requests]
    groups = plan.complete(fresh)
    assert [g.pending_replays for g in groups] == [int(p.uid in replayed) for p, _ in plan.requests]
    assert [g.informative for g in groups] == [p.uid in replayed for p, _ in plan.requests]
    joined, metrics = algo.join_replays(groups)
    assert [sum(g.replayed) for g in joined] == [int(p.uid in replayed) for p, _ in plan.requests]
    assert all(g.size == K and not g.pending_replays for g in joined)
    assert metrics["exgrpo_replays_gone"] == 0 and metrics["exgrpo_selected_entropy"] > 0
    # How often the same questions come back: none before the first replaying step; here the
    # next step replays two of these four again and two others (a checkpoint keeps the last set).
    assert metrics["exgrpo_replayed_again"] == 0
    others = [q for q in stored if q.uid not in replayed][:2]
    again = [g for g in groups if g.pending_replays][:2] + [
        dataclasses.replace(Group.sampled(q, fresh[0].answers[:K - 1], (False,) * (K - 1)), pending_replays=1)
        for q in others]
    algo.after_update(1, algo.build(joined, step=1))  # (it keeps the step's replayed questions)
    restored = ExGRPO(cfg, prompts, algo.prompt_ids, algo.buffer, learners, sampler)
    restored.load_state(algo.state())
    assert restored.join_replays(again)[1]["exgrpo_replayed_again"] == 0.5
