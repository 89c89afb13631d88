"""The embedded tiny policy: tokenizer, the build command, the shipped policies and their
checks, and loading in transformers (in vLLM: tests/test_vllm_internals.py)."""

import json
import os

import pytest
import torch

from rayrep.config import InputError, load_preset, parse_cli
from rayrep.models import resolve_policy, shipped_policy, tiny_spec
from rayrep.models.recipe import SHIPPED, TinyPolicySpec, read_record, weights_sha256
from rayrep.models.tiny import build_policy, main
from rayrep.models.tokenizer import CHAT_TEMPLATE, build_char_tokenizer


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
    out = tmp_path_factory.mktemp("build") / "policy"
    return spec, out, build_policy(spec, out, log=lambda _: None, record={"preset": "test"})


@pytest.mark.slow  # builds (trains) a policy
def test_build_writes_a_complete_checkpoint_and_replaces_one_whole(small_build):
    spec, path, record = small_build
    files = set(os.listdir(path))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "rayrep_build.json"} <= files
    assert read_record(path) == record
    assert (record["cache_key"], record["preset"]) == (spec.cache_key(), "test")
    assert record["machine"] and record["torch"] == torch.__version__
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no staging folders left
    # Built again into the same folder (a shipped policy rebuilt): replaced by the same weights.
    again = build_policy(spec, path, log=lambda _: None, record={"preset": "test"})
    assert again["weights_sha256"] == record["weights_sha256"] == weights_sha256(path)
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    # A folder that holds something else is never overwritten.
    other = path.parent / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty and not a tiny policy"):
        build_policy(spec, other, log=lambda _: None)
    assert (other / "notes.txt").read_text() == "mine"
    (other / "notes.txt").unlink()
    other.rmdir()


@pytest.mark.slow  # builds (trains) a policy
def test_the_build_file_records_the_weights_hash(small_build, tmp_path):
    """The hash covers every tensor's bytes: it matches a recomputation and changes with one weight."""
    from safetensors.torch import load_file, save_file

    _, path, record = small_build
    assert len(record["weights_sha256"]) == 64 and record["weights_sha256"] == weights_sha256(path)
    changed = tmp_path / "changed"
    changed.mkdir()
    tensors = load_file(path / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = torch.nextafter(tensors[name].view(-1)[0], torch.tensor(1e9))  # one ulp
    save_file(tensors, changed / "model.safetensors")
    assert weights_sha256(changed) != record["weights_sha256"]


def cpu_has_avx2() -> bool:
    with open("/proc/cpuinfo") as info:
        return " avx2" in info.read()


@pytest.mark.slow  # builds (trains) a policy
@pytest.mark.skipif(not cpu_has_avx2(), reason="the portable kernels are AVX2 ones")
def test_the_build_pins_its_kernels_so_that_cpu_models_agree(small_build, tmp_path):
    """The build runs with AVX2 kernels whatever the CPU offers; MKL told to use only AVX2
    instructions (what a CPU without AVX-512 gives it) builds the very same weights."""
    from rayrep.models.tiny import build_with_portable_kernels

    spec, path, recorded = small_build
    assert recorded["cpu_capability"] == "AVX2" and recorded["torch"] == torch.__version__
    other = tmp_path / "avx2-only"
    other.mkdir()
    stats = build_with_portable_kernels(spec, other, log=lambda _: None, env={"MKL_ENABLE_INSTRUCTIONS": "AVX2"})
    assert stats["weights_sha256"] == recorded["weights_sha256"]


def test_every_shipped_policy_is_whole_and_matches_its_preset():
    """Each shipped policy: a loadable checkpoint whose weights hash to its build record, and
    whose recipe is the one its preset describes today (a preset changed without a rebuild
    fails here)."""
    from transformers import AutoTokenizer

    names = sorted(entry.name for entry in SHIPPED.iterdir())
    assert names == ["tiny-cpu", "tiny-cpu-hard", "tiny-cpu-tool"]
    for name in names:
        record = read_record(SHIPPED / name)
        assert weights_sha256(SHIPPED / name) == record["weights_sha256"], name
        assert record["preset"] == name and record["cache_key"] == tiny_spec(load_preset(name)).cache_key()
        assert {"torch", "cpu_capability", "machine", "parameters", "recipe_version"} <= set(record)
        assert shipped_policy(tiny_spec(load_preset(name))) == SHIPPED / name
        tokenizer = AutoTokenizer.from_pretrained(SHIPPED / name)
        # One tokenizer and template for all (a tool's output framed as the warm start framed it).
        assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.chat_template == CHAT_TEMPLATE


def test_resolving_the_tiny_policy_uses_the_shipped_one_and_names_its_hash():
    lines = []
    path = resolve_policy(load_preset("tiny-cpu-hard"), log=lines.append)
    assert path == str(SHIPPED / "tiny-cpu-hard")
    assert f"weights sha256 {read_record(path)['weights_sha256'][:16]}" in lines[0] and "shipped" in lines[0]


def test_a_changed_shipped_policy_is_refused(tmp_path):
    import shutil

    root = tmp_path / "policies"
    shutil.copytree(SHIPPED / "tiny-cpu", root / "tiny-cpu")
    weights = root / "tiny-cpu" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of the last tensor
    weights.write_bytes(bytes(data))
    with pytest.raises(InputError, match=r"tiny-cpu: its weights hash to \w{16}, not to the \w{16} of its build "
                                         r"record: the files were changed"):
        shipped_policy(tiny_spec(load_preset("tiny-cpu")), root)


def test_a_recipe_without_a_shipped_policy_is_refused_with_how_to_build_it(tmp_path):
    """Nothing is built on first use: a config whose recipe no shipped policy has (a changed
    warm start, a new build recipe) fails, naming what differs and the build command."""
    import json
    import shutil

    cfg = parse_cli(["--model.tiny_warm_start_steps", "10"])
    with pytest.raises(InputError) as refused:
        resolve_policy(cfg)
    message = str(refused.value)
    assert "the closest, tiny-cpu, differs: model.tiny_warm_start_steps = 1300 there, 10 here." in message
    assert "`python -m rayrep.models.tiny build --preset tiny-cpu ... --out DIR`" in message
    assert f"--out {SHIPPED / 'tiny-cpu'}" in message
    # A shipped policy of an older recipe version: refused, the version named.
    root = tmp_path / "policies"
    shutil.copytree(SHIPPED / "tiny-cpu", root / "tiny-cpu")
    record = json.loads((root / "tiny-cpu" / "rayrep_build.json").read_text())
    record.update(recipe_version=record["recipe_version"] - 1, cache_key="0" * 16)
    (root / "tiny-cpu" / "rayrep_build.json").write_text(json.dumps(record))
    with pytest.raises(InputError, match=r"differs: build recipe version \d+ there, \d+ here"):
        shipped_policy(tiny_spec(load_preset("tiny-cpu")), root)


@pytest.mark.slow  # builds (trains) a policy
def test_the_build_command_builds_what_a_preset_describes(tmp_path, capsys):
    """`python -m rayrep.models.tiny build` (a few steps here): the recipe of the preset with
    the overrides given, recorded with the preset's name; the folder then serves as
    `model.path`."""
    import subprocess
    import sys

    from transformers import AutoConfig

    out = tmp_path / "mine"
    overrides = ["--model.tiny_warm_start_steps", "3", "--model.tiny_warm_start_problems", "300"]
    done = subprocess.run([sys.executable, "-m", "rayrep.models.tiny", "build", "--preset", "tiny-cpu-hard",
                           *overrides, "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "tiny policy ready: " in done.stdout and "weights sha256 " in done.stdout
    record = read_record(out)
    cfg = parse_cli(["--preset", "tiny-cpu-hard", *overrides])
    assert (record["preset"], record["cache_key"]) == ("tiny-cpu-hard", tiny_spec(cfg).cache_key())
    assert AutoConfig.from_pretrained(out).model_type == "qwen2"
    assert resolve_policy(cfg.replace(**{"model.path": str(out)})) == str(out)
    # A bad field: refused in one line before anything is built (the command's `main`, here).
    with pytest.raises(SystemExit) as refused:
        main(["build", "--model.tiny_layers", "0", "--out", str(tmp_path / "bad")])
    assert refused.value.code == 2 and "model.tiny_layers: 0 is below the minimum 1" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


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


def test_tiny_policy_lands_in_the_target_band(ray_cluster, tiny_policy, tiny_cfg):
    """pass@1 at T=1.0 between 15% and 60%: useful, with room for RL to improve."""
    from rayrep.eval.evaluate import evaluate_checkpoint

    metrics = evaluate_checkpoint(tiny_cfg, tiny_policy)
    assert metrics["questions"] == tiny_cfg.data.arithmetic_test_size
    assert 0 < metrics["maj@4"] <= metrics["pass@4"]
    assert 0.15 <= metrics["pass@1"] <= 0.60, metrics
    assert metrics["pass@4"] > metrics["pass@1"]
    assert metrics["verifier_timeouts"] == 0


@pytest.mark.slow  # builds (trains) a policy
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
    path = tmp_path / "policy"
    build_policy(small, path, log=lambda _: None)
    assert AutoConfig.from_pretrained(path).model_type == "qwen2"
    assert json.loads((path / "rayrep_build.json").read_text())["spec"]["levels"] == ["add3", "sub3", "mix4"]


@pytest.mark.slow  # builds (trains) a policy
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
