"""The embedded tiny policy: tokenizer, build, caching, and loading in transformers and vLLM."""

import json
import os

import pytest
import torch

from rayrep.models.tiny import TinyPolicySpec, ensure_tiny_policy
from rayrep.models.tokenizer import build_char_tokenizer


@pytest.mark.parametrize(
    "text",
    ["Q: 12+7-5=? Answer in \\boxed{}.\nA: ", "  two  spaces\tand\nnewlines\n\n", "ünïcödé → ∑ 😀", ""],
)
def test_tokenizer_round_trips_any_text(text):
    tokenizer = build_char_tokenizer()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte


def test_tokenizer_reloads_identically_through_auto_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from rayrep.models.tiny import qwen2_config

    built = build_char_tokenizer()
    qwen2_config(TinyPolicySpec(), 264, built).save_pretrained(tmp_path)
    built.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "Q: 7-9+7=? Answer in \\boxed{}.\nA: 7-9=-2, -2+7=5. \\boxed{5}"
    assert loaded(text)["input_ids"] == built(text)["input_ids"]
    messages = [{"role": "user", "content": "1+2=?"}]
    kwargs = dict(add_generation_prompt=True, tokenize=True, return_dict=False)
    assert loaded.apply_chat_template(messages, **kwargs) == built.apply_chat_template(messages, **kwargs)
    assert (loaded.eos_token_id, loaded.pad_token_id) == (built.eos_token_id, built.pad_token_id)


@pytest.fixture(scope="module")
def small_build(tmp_path_factory):
    spec = TinyPolicySpec(num_train=300, warm_start_steps=3, warm_start_batch=8)
    cache = tmp_path_factory.mktemp("cache")
    return spec, cache, ensure_tiny_policy(spec, cache, log=lambda _: None)


def test_build_writes_a_complete_checkpoint_and_is_cached(small_build):
    spec, cache, path = small_build
    files = set(os.listdir(path))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "rayrep_build.json"} <= files
    assert json.loads((path / "rayrep_build.json").read_text())["cache_key"] == spec.cache_key()
    assert [p.name for p in cache.iterdir()] == [path.name]  # no staging folders left
    before = (path / "model.safetensors").stat().st_mtime_ns
    calls = []
    assert ensure_tiny_policy(spec, cache, log=calls.append) == path
    assert calls == [] and (path / "model.safetensors").stat().st_mtime_ns == before


def test_the_build_file_records_the_weights_hash(small_build, tmp_path):
    """The hash covers every tensor's bytes: it matches a recomputation, changes with one
    weight, and is added to the build file of a policy built before builds recorded it."""
    from safetensors.torch import load_file, save_file

    from rayrep.models.tiny import build_info, weights_sha256

    _, _, path = small_build
    recorded = json.loads((path / "rayrep_build.json").read_text())["weights_sha256"]
    assert len(recorded) == 64 and recorded == weights_sha256(path)
    changed = tmp_path / "changed"
    changed.mkdir()
    tensors = load_file(path / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = torch.nextafter(tensors[name].view(-1)[0], torch.tensor(1e9))  # one ulp
    save_file(tensors, changed / "model.safetensors")
    assert weights_sha256(changed) != recorded
    older = {k: v for k, v in json.loads((path / "rayrep_build.json").read_text()).items() if k != "weights_sha256"}
    (changed / "rayrep_build.json").write_text(json.dumps(older))
    assert build_info(changed)["weights_sha256"] == weights_sha256(changed)
    assert json.loads((changed / "rayrep_build.json").read_text())["weights_sha256"] == weights_sha256(changed)


def cpu_has_avx2() -> bool:
    with open("/proc/cpuinfo") as info:
        return " avx2" in info.read()


@pytest.mark.skipif(not cpu_has_avx2(), reason="the portable kernels are AVX2 ones")
def test_the_build_pins_its_kernels_so_that_cpu_models_agree(small_build, tmp_path):
    """The build runs with AVX2 kernels whatever the CPU offers; MKL told to use only AVX2
    instructions (what a CPU without AVX-512 gives it) builds the very same weights."""
    from rayrep.models.tiny import build_with_portable_kernels

    spec, _, path = small_build
    recorded = json.loads((path / "rayrep_build.json").read_text())
    assert recorded["cpu_capability"] == "AVX2" and recorded["torch"] == torch.__version__
    other = tmp_path / "avx2-only"
    other.mkdir()
    stats = build_with_portable_kernels(spec, other, log=lambda _: None, env={"MKL_ENABLE_INSTRUCTIONS": "AVX2"})
    assert stats["weights_sha256"] == recorded["weights_sha256"]


def test_cache_key_tracks_every_field():
    base = TinyPolicySpec()
    assert base.cache_key() == TinyPolicySpec().cache_key()
    assert base.cache_key() != TinyPolicySpec(warm_start_steps=1301).cache_key()
    assert base.cache_key() != TinyPolicySpec(levels=("add2",)).cache_key()
    assert base.cache_key() != TinyPolicySpec(test_reserve=3000).cache_key()


def test_transformers_loads_and_generates(tiny_policy):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_policy)
    model = AutoModelForCausalLM.from_pretrained(tiny_policy)
    assert model.config.model_type == "qwen2" and model.config.tie_word_embeddings
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 2e6
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "12+30=? Answer in \\boxed{}."}], add_generation_prompt=True,
        tokenize=True, return_dict=False,
    )
    out = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)
    answer = tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True)
    # The warm start teaches the answer format; 12+30 is an easy one.
    assert answer.startswith("12+30=") and "\\boxed{" in answer, answer
    assert out[0, -1].item() == tokenizer.eos_token_id


def test_vllm_logprobs_match_transformers(tiny_policy, tiny_cfg):
    """The same checkpoint in vLLM: sampled tokens' log-probs equal a transformers forward pass."""
    from transformers import AutoModelForCausalLM

    from rayrep.data import encode_prompts, load_split
    from rayrep.generator.engine import make_engine, sample

    llm = make_engine(tiny_cfg, tiny_policy)
    prompts = load_split(tiny_cfg.data, "test")[:8]
    prompt_ids = encode_prompts(llm.get_tokenizer(), prompts, tiny_cfg.data.max_prompt_tokens)
    groups = sample(llm, prompt_ids, n=2, temperature=1.0, top_p=1.0, max_tokens=48)
    model = AutoModelForCausalLM.from_pretrained(tiny_policy).eval()
    for group in groups:
        for rollout in group:
            assert len(rollout.logprobs) == len(rollout.response_ids) > 0
            ids = torch.tensor([rollout.prompt_ids + rollout.response_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(rollout.prompt_ids) - 1 : -1]
            expected = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(rollout.response_ids)[:, None])[:, 0]
            assert torch.allclose(torch.tensor(rollout.logprobs), expected, atol=1e-3), (rollout.text,)


def test_tiny_policy_lands_in_the_target_band(tiny_policy, tiny_cfg):
    """pass@1 at T=1.0 between 15% and 60%: useful, with room for RL to improve."""
    from rayrep.eval import evaluate_checkpoint

    metrics = evaluate_checkpoint(tiny_cfg, tiny_policy)  # on a local Ray cluster of its own
    assert metrics["questions"] == tiny_cfg.data.arithmetic_test_size
    assert 0 < metrics["maj@4"] <= metrics["pass@4"]
    assert 0.15 <= metrics["pass@1"] <= 0.60, metrics
    assert metrics["pass@4"] > metrics["pass@1"]
    assert metrics["verifier_timeouts"] == 0


def test_the_hard_preset_builds_on_its_own_levels_past_its_test_reserve(tmp_path):
    """tiny-cpu-hard: its levels and reserve reach the build recipe; no warm-start problem is
    among its 4,000 possible test questions; every worked solution fits the response
    budget before the overlong penalty; and the build runs (a few steps here)."""
    import dataclasses

    from transformers import AutoConfig

    from rayrep.config import load_preset
    from rayrep.data.arithmetic import make_splits
    from rayrep.models import tiny_spec

    cfg = load_preset("tiny-cpu-hard")
    spec = tiny_spec(cfg)
    assert (spec.levels, spec.test_reserve) == (("add3", "sub3", "mix4"), 4000)
    assert spec.cache_key() != tiny_spec(load_preset("tiny-cpu")).cache_key()
    warm_start, _ = make_splits(spec.num_train, 0, spec.task_seed, spec.levels, spec.test_reserve)
    _, test = make_splits(0, 4000, spec.task_seed, spec.levels, spec.test_reserve)
    assert len(warm_start) == spec.num_train and not {p.expression for p in warm_start} & {p.expression for p in test}
    budget = cfg.generator.max_response_tokens - cfg.verifier.overlong_buffer
    tokenizer = build_char_tokenizer()
    longest = max(len(tokenizer(p.solution(2), add_special_tokens=False)["input_ids"]) + 1 for p in warm_start[:3000])
    assert longest <= budget, (longest, budget)
    small = dataclasses.replace(spec, num_train=200, warm_start_steps=3, warm_start_batch=8)
    path = ensure_tiny_policy(small, tmp_path, log=lambda _: None)
    assert AutoConfig.from_pretrained(path).model_type == "qwen2"
    assert json.loads((path / "rayrep_build.json").read_text())["spec"]["levels"] == ["add3", "sub3", "mix4"]


def test_an_interrupted_build_leaves_no_build_process_behind(tmp_path):
    """A build whose caller stops (a test's time limit, Ctrl-C) kills its build process."""
    import psutil

    from rayrep.models.tiny import build_with_portable_kernels

    class Stop(Exception):
        pass

    def stop(line):
        raise Stop(line)

    spec = TinyPolicySpec(num_train=300, warm_start_steps=500, warm_start_batch=8)
    with pytest.raises(Stop, match="tiny policy warm start: step 1/500"):
        build_with_portable_kernels(spec, tmp_path, log=stop)
    builds = [p for p in psutil.Process().children(recursive=True) if "rayrep.models.tiny" in " ".join(p.cmdline())]
    assert builds == []
    assert not (tmp_path / "rayrep_build.json").exists()
