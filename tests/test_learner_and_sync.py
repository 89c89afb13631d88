"""FSDP2 learner group and weight sync on a real local Ray cluster (gloo, real vLLM)."""

import random

import pytest
import ray
import torch

from rayrep.generator.pool import GeneratorPool
from rayrep.learner.group import LearnerGroup
from rayrep.placement import Placement, make_plan
from rayrep.sync.weights import WeightSync
from rayrep.types import LossSpec, TrainBatch


def synthetic_batch(num_prompts=8, answers=4, seed=0):
    """Random prompts and answers of unequal lengths (token ids < 259, the tiny vocab)."""
    rng = random.Random(seed)
    prompts, responses, index = [], [], []
    for q in range(num_prompts):
        prompt_ids = [rng.randrange(3, 259) for _ in range(rng.randint(5, 12))]
        for _ in range(answers):
            prompts.append(prompt_ids)
            responses.append([rng.randrange(3, 259) for _ in range(rng.randint(1, 15))])
            index.append(q)
    return TrainBatch.of_sequences(
        prompts, responses, index, logprobs=[[-5.0] * len(r) for r in responses],
        advantages=[rng.uniform(-1.5, 1.5) for _ in responses], recompute_old=[True] * len(responses),
    )


def full_state(learners: LearnerGroup) -> dict[str, torch.Tensor]:
    """The learners' full weights (rank 0's gather; every rank takes part)."""
    return ray.get([w.full_state_dict.remote() for w in learners.workers])[0]


def model_with(tiny_policy: str, state: dict[str, torch.Tensor]):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_policy).eval()
    model.load_state_dict(state, strict=False)  # the tied head follows the embedding
    return model


def make_learners(cfg, model_path, workers, strategy="fsdp2"):
    cfg = cfg.replace(**{"learner.num_workers": workers, "learner.strategy": strategy, "placement.cpus_per_bundle": 1,
                         "generator.num_workers": 1, "verifier.num_workers": 0})
    placement = Placement(make_plan(cfg))
    return cfg, placement, LearnerGroup(cfg, model_path, placement, total_optimizer_steps=10)


@pytest.mark.parametrize("strategy", ["fsdp2", "deepspeed"])
def test_two_ranks_take_the_same_update_as_one(ray_cluster, tiny_cfg, tiny_policy, strategy):
    # Two mini-batches of 4 questions, micro-batches of 5 rows: rows per rank and micro-batch
    # counts differ, and token counts differ between ranks: token-mean must still be global.
    # The one-rank reference is always FSDP2; the two ranks use `strategy`.
    cfg = tiny_cfg.replace(**{"algorithm.prompts_per_step": 8, "learner.mini_batch_prompts": 4,
                              "learner.micro_batch_size": 5, "learner.lr": 1e-3, "learner.warmup_steps": 2})
    batch = synthetic_batch()
    results = {}
    for workers in (1, 2):
        _, placement, learners = make_learners(cfg, tiny_policy, workers, "fsdp2" if workers == 1 else strategy)
        metrics = learners.update(batch, LossSpec())
        results[workers] = (metrics, full_state(learners))
        learners.shutdown()
        placement.remove()
    (m1, s1), (m2, s2) = results[1], results[2]
    assert m1["optimizer_steps"] == m2["optimizer_steps"] == 2
    assert m1["fresh_tokens"] == m2["fresh_tokens"] == int(batch.response_mask.sum())
    assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-4)  # same gradients
    assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-4, abs=1e-6)
    assert m1["lr"] == pytest.approx(0.75e-3)  # warm-up: 0.5e-3 then 1e-3
    assert m2["lr"] == pytest.approx(m1["lr"])
    for name in s1:
        diff = (s1[name] - s2[name]).abs()
        # Adam divides by |g|: an element whose gradient is ~0 can move by up to 2 lr in either
        # run; everything else must agree to float precision.
        assert diff.max() <= 2 * 2 * 1e-3, name  # two optimizer steps of lr 1e-3
        assert (diff > 1e-5).float().mean() < 1e-3, name
    from safetensors.torch import load_file
    original = load_file(f"{tiny_policy}/model.safetensors")
    moved = max((s1[n] - original[n]).abs().max().item() for n in original)
    assert moved > 1e-4  # the update really changed the weights


def test_weight_sync_makes_the_generators_sample_from_the_learners_weights(ray_cluster, tiny_cfg, tiny_policy):
    """After each sync the behaviour log-probs of fresh samples equal the learner's weights'
    log-probs of those tokens (a transformers forward pass of the gathered state)."""
    from transformers import AutoTokenizer

    from rayrep.data import encode_prompts, load_split

    cfg = tiny_cfg.replace(**{"learner.lr": 1e-3, "learner.warmup_steps": 0, "sync.bucket_mb": 0.5})
    cfg, placement, learners = make_learners(cfg, tiny_policy, 2)
    generators = GeneratorPool.create(cfg, tiny_policy, placement)
    sync = WeightSync(cfg, learners, generators)
    assert len(sync.manifest.buckets) > 1  # several bounded buckets, not one call per tensor
    batch = synthetic_batch(seed=1)
    questions = load_split(cfg.data, "test")[:4]
    prompt_ids = encode_prompts(AutoTokenizer.from_pretrained(tiny_policy), questions, cfg.data.max_prompt_tokens)

    def worst_gap(model) -> float:
        rollouts = [r for per_prompt in generators.gather(generators.generate(
            prompt_ids, n=2, temperature=1.0, top_p=1.0, max_tokens=24)) for r in per_prompt]
        gap = 0.0
        for r in rollouts:
            with torch.no_grad():
                logits = model(torch.tensor([r.prompt_ids + r.response_ids])).logits[0, len(r.prompt_ids) - 1 : -1]
            expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(r.response_ids)[:, None])[:, 0]
            gap = max(gap, float((torch.tensor(r.logprobs) - expected).abs().max()))
        return gap

    try:
        original = model_with(tiny_policy, full_state(learners))
        for version in (1, 2, 3):
            learners.update(batch, LossSpec())
            stats = sync.push()
            assert stats["policy_version"] == version and stats["sync_bytes"] == sync.manifest.total_bytes
            assert ray.get([w.policy_version.remote() for w in generators.workers]) == [version]
            trained = model_with(tiny_policy, full_state(learners))
            assert worst_gap(trained) < 1e-3, version
        # the weights really moved: the original weights no longer explain the samples
        assert worst_gap(original) > 1e-2
    finally:
        for worker in generators.workers:
            ray.kill(worker)
        learners.shutdown()
        placement.remove()
