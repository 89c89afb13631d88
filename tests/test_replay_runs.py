"""RLEP and ExGRPO on a real local Ray cluster: real learners, vLLM generators, buffer shard actors."""

import json

import numpy as np
import pytest
import torch

from rayrep.algos.exgrpo import ExGRPO
from rayrep.algos.rlep import collect_pool
from rayrep.buffer.files import read_pool
from rayrep.buffer.shard import Answer
from rayrep.learner.group import LearnerGroup
from rayrep.metrics import read_metrics
from rayrep.placement import Placement, make_plan
from rayrep.train import train
from rayrep.types import Rollout


def small(cfg, tmp_path, **changes):
    """A few cheap steps of the tiny preset, with 2 buffer shards."""
    defaults = {
        "run.steps": 2, "run.eval_every": 0, "algorithm.prompts_per_step": 16, "learner.mini_batch_prompts": 8,
        "data.arithmetic_test_size": 32, "replay.num_shards": 2, "logging.out_dir": str(tmp_path),
    }
    return cfg.replace(**{**defaults, **changes})


def test_collect_then_rlep_run_replays_the_pool(ray_cluster, tiny_cfg, tiny_policy, tmp_path):
    cfg = small(tiny_cfg, tmp_path, **{"algorithm.rlep.collect_questions": 32, "algorithm.rlep.collect_samples": 8})
    stats = collect_pool(cfg, tiny_policy, tmp_path / "pool.parquet", log=lambda _: None)
    pool = read_pool(stats["pool"])
    assert stats["questions"] == 32 and 0 < stats["kept_questions"] == len(pool) <= 32
    assert all(len(answers) >= 2 for _, answers in pool.values())  # min_successes
    assert sum(len(a) for _, a in pool.values()) == stats["successes"]
    some = next(iter(pool.values()))[1][0]
    assert len(some.response_ids) == len(some.logprobs) and np.isfinite(some.logprobs).all()

    run = train(cfg.replace(**{"algorithm.name": "rlep", "algorithm.rlep.pool": stats["pool"], "logging.run_name": "rlep"}),
                log=lambda _: None)
    records = [r for r in read_metrics(run.run_dir / "metrics.jsonl") if r["step"] > 0]
    assert len(records) == 2
    for record in records:
        assert record["replay_share"] > 0 and record["replay_tokens"] > 0
        assert "replay_ratio_mean" in record and "entropy_replay" in record
        assert record["optimizer_steps"] == 2  # 16 questions / 8 per mini-batch, whatever G'
    # The first questions of the run's order are the pooled ones: the first step replays them.
    assert records[0]["replay_questions_short"] < 16


def test_exgrpo_run_collects_then_replays(ray_cluster, tiny_cfg, tiny_policy, tmp_path):
    # On the DeepSpeed ZeRO-2 learner, so that strategy also runs end to end (weight sync included).
    cfg = small(tiny_cfg, tmp_path, **{
        "algorithm.name": "exgrpo", "algorithm.std_normalize": False, "run.steps": 3, "learner.strategy": "deepspeed",
        "algorithm.exgrpo.start_pass_rate": 0.0, "logging.run_name": "exgrpo",
    })
    run = train(cfg, log=lambda _: None)
    records = [r for r in read_metrics(run.run_dir / "metrics.jsonl") if r["step"] > 0]
    assert records[0]["exgrpo_collecting"] == 1.0 and records[0]["exgrpo_replayed_questions"] == 0
    assert records[0]["buffer_questions"] > 0
    later = records[1:]
    assert all(r["exgrpo_replayed_questions"] > 0 and r["replay_tokens"] > 0 for r in later)
    assert all(r["fresh_clip_frac"] == 0 for r in later)  # fresh tokens unclipped in the mixed phase
    assert all(r["optimizer_steps"] == 2 and r["skipped_steps"] == 0 and r["grad_norm"] > 0 for r in records)
    assert [r["policy_version"] for r in records] == [1, 2, 3]  # each step synced new weights
    assert (run.run_dir / "buffer" / "answers.parquet").exists()


@pytest.fixture(scope="module")
def learners(ray_cluster, tiny_cfg, tiny_policy):
    cfg = tiny_cfg.replace(**{"placement.cpus_per_bundle": 1, "verifier.num_workers": 0})
    placement = Placement(make_plan(cfg))
    group = LearnerGroup(cfg, tiny_policy, placement, total_optimizer_steps=1)
    yield group
    group.shutdown()
    placement.remove()


def test_exgrpo_picks_the_lowest_entropy_answer_every_time(learners, tiny_cfg, tiny_policy):
    """Planted answers whose mean token entropies are computed independently with transformers."""
    from transformers import AutoModelForCausalLM

    from rayrep.data import encode_prompts, load_split

    model = AutoModelForCausalLM.from_pretrained(tiny_policy).eval()
    cfg = tiny_cfg.replace(**{"algorithm.name": "exgrpo", "algorithm.std_normalize": False, "replay.num_shards": 0})
    prompts = load_split(cfg.data, "train")[:12]
    algo = ExGRPO(cfg, prompts)
    algo.attach(type("Runtime", (), {"learners": learners})())
    rng = np.random.default_rng(0)
    expected = {}
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_policy)
    for prompt, ids in zip(prompts, encode_prompts(tokenizer, prompts, 80)):
        answers = []
        # The policy's own greedy answer (low entropy), random tokens (high), and mixtures.
        greedy = model.generate(torch.tensor([ids]), max_new_tokens=30, do_sample=False)[0, len(ids):].tolist()
        for kind in range(4):
            if kind == 0:
                response = greedy
            else:
                response = greedy[: 4 * kind] + rng.integers(3, 259, size=rng.integers(2, 12)).tolist()
            answers.append(Answer(np.array(response, np.int32), np.zeros(len(response), np.float32), 1.0))
        rng.shuffle(answers)
        entropies = []
        for answer in answers:
            full = torch.tensor([ids + answer.response_ids.tolist()])
            with torch.no_grad():
                logp = torch.log_softmax(model(full).logits[0, len(ids) - 1 : -1], -1)
            entropies.append(float(-(logp.exp() * logp).sum(-1).mean()))
        algo.buffer.add([(prompt.uid, np.array(ids, np.int32), answers)])
        expected[prompt.uid] = answers[int(np.argmin(entropies))].response_ids.tolist()
    chosen = algo.lowest_entropy_answers([p.uid for p in prompts])
    assert {uid: a.response_ids.tolist() for uid, a in chosen.items()} == expected
