"""The memory plan: parameter counts against transformers, the presets' plans, refusals."""

import subprocess
import sys
from pathlib import Path

import pytest

from rayrep.config import InputError, load_preset
from rayrep.runtime.memory import GIB, KNOWN_SHAPES, ModelShape, check_memory, memory_plan, model_shape

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_matches_a_real_model(tied):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=176, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_config(config)
    assert ModelShape.of(config).parameters == sum(p.numel() for p in model.parameters())


def test_the_7b_shape_has_7_6_billion_parameters():
    shape = ModelShape.of(KNOWN_SHAPES["Qwen/Qwen2.5-Math-7B"])
    assert 7.6e9 < shape.parameters < 7.7e9  # Qwen2.5-7B: 7.61B
    assert shape.kv_bytes_per_token(2) == 2 * 28 * 4 * 128 * 2


def test_the_paper_presets_fit_on_80_gib_gpus():
    for preset in ("qwen2.5-math-7b-rlep", "qwen2.5-math-7b-exgrpo"):
        plan = memory_plan(load_preset(preset))
        assert plan is not None and plan.problems() == [], plan.describe()
        assert plan.learner_phase < 80 * GIB and plan.generator_phase < 80 * GIB and plan.sync_phase < 80 * GIB
        # the sync holds the learner's state and the woken engine weights (bf16, 2 bytes a parameter)
        assert plan.sync["engine weights, woken"] == 2 * model_shape(load_preset(preset)).parameters
        assert plan.transport == "handles" and "sync phase" in plan.describe() and "(handles)" in plan.describe()
        # no vocabulary-wide fp32 tensor of the whole micro-batch: the logits stay bf16, fp32 in chunks
        chunked = plan.learner["fp32 log-prob chunk"]
        wider = memory_plan(load_preset(preset).replace(**{"learner.logit_chunk_tokens": 4096}))
        assert wider.learner["fp32 log-prob chunk"] == 4 * chunked and chunked < plan.learner["logits and their gradient"]
        # FSDP2 splits the fp32 state over the learners: 16 bytes per parameter in all
        cfg = load_preset(preset)
        state = plan.learner["fp32 master shard"] + plan.learner["AdamW moments"] + plan.learner["fp32 gradient shard"]
        assert state == pytest.approx(16 * model_shape(cfg).parameters / cfg.learner.num_workers, rel=1e-6)


def test_a_plan_that_cannot_fit_is_refused_with_its_numbers(tiny_policy):
    cfg = load_preset("qwen2.5-math-7b-rlep").replace(**{"placement.gpu_memory_gib": 24})
    plan = memory_plan(cfg)
    assert plan.problems() and "more than the 24 GiB" in plan.problems()[0]
    with pytest.raises(InputError, match="the learner phase needs [0-9.]+ GiB per GPU, more than the 24 GiB"):
        check_memory(cfg)
    # DeepSpeed keeps its state on the GPU while the colocated engines run
    deepspeed = memory_plan(load_preset("qwen2.5-math-7b-rlep").replace(**{"learner.strategy": "deepspeed"}))
    assert deepspeed.resident and deepspeed.generator_phase > memory_plan(load_preset("qwen2.5-math-7b-rlep")).generator_phase
    # a GPU run refuses before anything starts (the tiny policy on 1 GiB GPUs)
    from rayrep.runtime.system import Runtime

    tiny_gpu = load_preset("tiny-cpu").replace(**{"placement.device": "gpu", "placement.gpu_memory_gib": 1.0})
    with pytest.raises(InputError, match="memory plan does not fit"):
        Runtime.start(tiny_gpu, tiny_policy)


@pytest.mark.parametrize(("job", "extra"), [("rlep.py", []), ("exgrpo.py", []), ("grpo.py", []), ("eval.py", []),
                                             ("collect.py", ["--checkpoint", "x", "--out", "y"])])
def test_every_job_takes_a_dry_run(job, extra):
    done = subprocess.run([sys.executable, str(ROOT / "jobs" / job), "--dry-run", "--preset", "qwen2.5-math-7b-rlep",
                           *extra], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "placement plan:" in done.stdout and "memory plan per GPU (80 GiB" in done.stdout
    assert ("learner phase" in done.stdout) == (job not in ("eval.py", "collect.py"))
    small = subprocess.run([sys.executable, str(ROOT / "jobs" / job), "--dry-run", "--preset", "qwen2.5-math-7b-rlep",
                            "--placement.gpu_memory_gib", "16", *extra], capture_output=True, text=True, timeout=120)
    assert small.returncode == 2 and "does not fit" in small.stdout
