"""GPU memory: parameter counts against transformers, the presets' plans as timelines, refusals,
the residency of one process (places, idempotent moves, the allocator's cache), and the
device-memory ledger that holds a run's transitions to the plan."""

import pytest
from conftest import job_here

from rayrep.cluster.memory import (ENGINE, RunPhase, ENGINE_RUNTIME, GIB, KNOWN_SHAPES, KV_CACHE, LEARNER, MASTER_GATHERED,
                                   OPTIMIZER, PARAMETERS, RECEIVED, RESERVED_BYTES, SEND_BUFFERS, UPDATE, WEIGHTS,
                                   WHOLE_TENSOR,
                                   DeviceLedger, MemoryLedgerError, ModelShape, check_memory, engine_host_backup,
                                   memory_plan, model_shape)
from rayrep.cluster.residency import ABSENT, ALLOCATOR_CACHE, DEVICE, DROPPED, HOST, Holding, Residency, ResidencyError
from rayrep.config import InputError, load_preset

PRESETS = ("qwen2.5-math-7b-rlep", "qwen2.5-math-7b-exgrpo")


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_matches_a_real_model(tied):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=176, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_config(config)
    assert ModelShape.of(config).parameters == sum(p.numel() for p in model.parameters())
    assert ModelShape.of(config).largest_tensor == max(p.numel() for p in model.parameters())


def test_the_7b_shape_has_7_6_billion_parameters():
    shape = ModelShape.of(KNOWN_SHAPES["Qwen/Qwen2.5-Math-7B"])
    assert 7.6e9 < shape.parameters < 7.7e9  # Qwen2.5-7B: 7.61B
    assert shape.kv_bytes_per_token(2) == 2 * 28 * 4 * 128 * 2


@pytest.mark.parametrize("preset", PRESETS)
def test_the_paper_presets_fit_on_80_gib_gpus_phase_by_phase(preset):
    cfg = load_preset(preset)
    plan = memory_plan(cfg)
    shape = model_shape(cfg)
    assert plan is not None and plan.problems() == [], plan.describe()
    assert [p.name for p in plan.phases] == ["learner set-up", "engine start-up", "resume", "generate", "hand-over",
                                             "update", "sync", "replacement", "save"]
    assert all(plan.per_gpu(phase) < 80 * GIB for phase in plan.phases)
    learner, engine = plan.sizes[LEARNER], plan.sizes[ENGINE]
    # FSDP2 splits the fp32 state over the learners: 16 bytes per parameter in all
    state = learner[PARAMETERS] + learner[OPTIMIZER] + learner["gradients"]
    assert state == pytest.approx(16 * shape.parameters / cfg.learner.num_workers, rel=1e-6)
    # no vocabulary-wide fp32 tensor of the whole micro-batch: the logits stay bf16, fp32 in chunks
    wider = memory_plan(cfg.replace(**{"learner.logit_chunk_tokens": 4096}))
    chunk = learner["fp32 log-prob chunk"]
    assert wider.sizes[LEARNER]["fp32 log-prob chunk"] == 4 * chunk and chunk < learner["logits and their gradient"]
    # The sync, as the runtime takes it: the optimizer state has left and the allocator's
    # cache is released; the embedding (the largest tensor) is gathered whole in bf16 and fills
    # each of the two send buffers; the engine wakes its bf16 weights and keeps a layer's worth
    # of received tensors, twice, beside them.
    sync = plan.phase("sync")
    largest = shape.largest_tensor * 2
    assert set(sync.held[LEARNER]) == {PARAMETERS, WHOLE_TENSOR, SEND_BUFFERS}
    assert sync.held[LEARNER][SEND_BUFFERS] == 2 * largest and sync.held[LEARNER][WHOLE_TENSOR] == largest
    assert sync.held[ENGINE][WEIGHTS] == 2 * shape.parameters and sync.held[ENGINE][RECEIVED] > 2 * largest
    # Colocated turns: the engines sleep while the learners hold their state; awake, the GPU is theirs.
    assert plan.phase("update").held[ENGINE] == {}  # (its runtime pools too: in host memory asleep)
    assert plan.phase("sync").held[ENGINE][ENGINE_RUNTIME] == GIB  # (back with the weights' wake)
    for name in ("engine start-up", "generate", "resume", "replacement", "save"):  # FSDP2 saves from host memory
        assert plan.phase(name).holds(LEARNER) == 0
        assert plan.phase(name).holds(ENGINE) == int(0.85 * 80 * GIB)
    assert plan.transport == "handles"
    described = plan.describe()
    for name in (p.name for p in plan.phases):
        assert f"  {name} " in described
    assert "host memory per node: learner set-up" in described and "training" in described
    assert described.rstrip().endswith("fits")


MIB = 2**20


def test_the_host_figures_are_the_pinned_blocks_torch_rounds_and_keeps_over_the_7b_shapes():
    """vLLM's level-1 sleep (a LoRA run) backs each weight segment up in pinned host memory, and
    a learner's optimizer offload (`non_blocking`) makes pinned copies of its moments; torch's
    host allocator rounds each block up to a power of two and keeps it. Worked out by hand for
    Qwen2.5-Math-7B (bf16; hidden 3584, kv 512, MLP 18944, vocabulary 152064, 28 layers)."""
    # A sleeping engine's weights, one segment each (>= 10 MiB: rounded up to 2 MiB, then a power of two):
    qkv = 4608 * 3584 * 2  # 31.5 MiB -> 32 MiB
    o = 3584 * 3584 * 2  # 24.5 MiB -> 26 MiB -> 32 MiB
    gate_up = 2 * 18944 * 3584 * 2  # 259 MiB -> 260 MiB -> 512 MiB
    down = 18944 * 3584 * 2  # 129.5 MiB -> 130 MiB -> 256 MiB
    embedding = 152064 * 3584 * 2  # 1039.5 MiB -> 1040 MiB -> 2 GiB, and the head the same
    assert (qkv, o, gate_up, down, embedding) == (31.5 * MIB, 24.5 * MIB, 259 * MIB, 129.5 * MIB, 1039.5 * MIB)
    weights = 28 * (32 + 32 + 512 + 256) * MIB + 2 * 2048 * MIB  # 27.4 GiB, for 14.2 GiB of weights
    small = 28 * (4608 * 2 + 2 * 3584 * 2) + 3584 * 2  # biases and norms: one 2 MiB segment
    # The rank-32 adapter slot vLLM keeps (A: 32 x in, B: out x 32 of each projection), in 1-10 MiB
    # requests packed in 20 MiB segments (32 MiB pinned each) and smaller ones in 2 MiB segments:
    sides = [3584, 3584, 3584, 512, 3584, 512, 3584, 3584, 3584, 18944, 3584, 18944, 18944, 3584]
    slot = [32 * side * 2 for side in sides] * 28
    mid, little = sum(n for n in slot if n >= MIB), sum(n for n in slot if n < MIB)
    engine = (weights + -(-mid // (20 * MIB)) * 32 * MIB + -(-(little + small) // (2 * MIB)) * 2 * MIB
              + GIB)  # and its runtime pools (1 GiB)
    lora_cfg = load_preset("qwen2.5-math-7b-rlep").replace(**{"learner.num_workers": 8, "learner.lora_rank": 32})
    assert engine_host_backup(lora_cfg, model_shape(lora_cfg)) == engine
    lora = memory_plan(lora_cfg)
    learner_lora = lora.host["training"][0] / 8 - engine
    base_shard = 2 * model_shape(lora_cfg).parameters / 8
    assert base_shard < learner_lora < base_shard + 0.2e9  # (and the adapter's fp32 state and moments: small)
    assert 255e9 < lora.host["training"][0] < 258e9  # where unrounded weights would count 8 x 15.2 GB
    # A full run's learner rank (8 on a node): its fp32 shard of each parameter (rows / 8) as two pinned moments.
    ranks = 8
    shards = [152064 * 3584 // ranks] * 2 + [3584 // ranks] + 28 * (
        [3584 * 3584 // ranks, 3584 // ranks, 512 * 3584 // ranks, 512 // ranks, 512 * 3584 // ranks, 512 // ranks,
         3584 * 3584 // ranks, 18944 * 3584 // ranks, 18944 * 3584 // ranks, -(-3584 // ranks) * 18944,
         3584 // ranks, 3584 // ranks])
    moments = sum(2 * (1 << (4 * n - 1).bit_length()) for n in shards)
    parameters = 4 * model_shape(load_preset("qwen2.5-math-7b-exgrpo")).parameters // ranks
    exgrpo = memory_plan(load_preset("qwen2.5-math-7b-exgrpo"))
    assert exgrpo.host["training"][0] == ranks * (parameters + moments + GIB)  # (a sleeping engine: its runtime)
    assert 1.9 < moments / (2 * parameters) < 2.1  # rounded up, about twice the moments' bytes
    assert "pinned: 14.5 GB as torch rounds them" in exgrpo.describe()
    # The set-up: each rank loads the bf16 checkpoint (2P), makes its fp32 shards (4P / 8) a layer at a time.
    P = model_shape(load_preset("qwen2.5-math-7b-exgrpo")).parameters
    layer = model_shape(load_preset("qwen2.5-math-7b-exgrpo")).layer_parameters
    assert exgrpo.host["learner set-up"][0] == ranks * (2 * P + 4 * P // ranks + 4 * layer)
    # A node that has less than a plan needs: refused, naming the knob.
    small_node = memory_plan(load_preset("qwen2.5-math-7b-exgrpo").replace(**{"placement.host_memory_gb": 100}))
    assert any(p.startswith("host memory: learner set-up needs 159.8 GB per node, more than the 100 GB of "
                            "placement.host_memory_gb") for p in small_node.problems()), small_node.problems()


def test_the_adapter_count_matches_peft_and_lora_fits_the_rlep_setting_on_one_gpu(tiny_policy):
    """A LoRA adapter's size, as the plan counts it, is PEFT's own; and the RLEP paper setting
    with a rank-32 adapter on every projection shrinks each learner's state to the bf16 base
    shard and the adapter's fp32 state, each sync to the adapter: it fits on one 80 GiB GPU
    (learner and engine taking turns on it), where full fine-tuning does not."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_policy), LoraConfig(r=8, target_modules=list(targets)))
    counted = model_shape(load_preset("tiny-cpu")).adapter_parameters(8, targets)
    assert counted == sum(p.numel() for p in model.parameters() if p.requires_grad) == 77824

    one_gpu = {"learner.num_workers": 1, "learner.mini_batch_prompts": 64}
    full = memory_plan(load_preset("qwen2.5-math-7b-rlep").replace(**one_gpu))
    lora_cfg = load_preset("qwen2.5-math-7b-rlep").replace(**one_gpu, **{"learner.lora_rank": 32})
    lora = memory_plan(lora_cfg)
    assert full.problems() and lora.problems() == [], lora.describe()
    shape = model_shape(lora_cfg)
    adapter = shape.adapter_parameters(32, targets)
    assert 0.004 < adapter / shape.parameters < 0.02  # about 80M of 7.6B
    learner = lora.sizes[LEARNER]
    assert learner[PARAMETERS] == 2 * shape.parameters + 4 * adapter  # the bf16 base, the adapter's fp32 masters
    assert learner[OPTIMIZER] == 8 * adapter and learner["gradients"] == 4 * adapter
    assert lora.sync_bytes == 2 * adapter and full.sync_bytes == 2 * shape.parameters
    assert lora.per_gpu(lora.phase("update")) < full.per_gpu(full.phase("update")) / 3
    assert lora.phase("sync").holds(LEARNER) < full.phase("sync").holds(LEARNER) / 2
    described = lora.describe()
    assert "weights and adapter slot at sleep level 1" in described and described.rstrip().endswith("fits")
    # On 8 GPUs (one node, as the paper), the state each rank keeps on its GPU between turns shrinks 5x.
    eight = {"learner.num_workers": 8}
    full8 = memory_plan(load_preset("qwen2.5-math-7b-rlep").replace(**eight))
    lora8 = memory_plan(load_preset("qwen2.5-math-7b-rlep").replace(**eight, **{"learner.lora_rank": 32}))
    assert lora8.problems() == [] and lora8.phase("hand-over").holds(LEARNER) < full8.phase("hand-over").holds(LEARNER) / 5


def test_the_kl_reference_is_planned_where_the_policys_weights_are():
    """`learner.kl.coef`: the reference policy in the compute dtype, sharded like the policy
    (FSDP2: its shard, DeepSpeed: whole), nothing with LoRA (the base with the adapter off); on
    the GPU with the optimizer state (hand-over, update), not while the engines hold it."""
    from rayrep.cluster.memory import REFERENCE

    cfg = load_preset("qwen2.5-math-7b-rlep").replace(**{"learner.num_workers": 8})
    P = model_shape(cfg).parameters
    assert memory_plan(cfg).sizes[LEARNER][REFERENCE] == 0  # no KL, no reference
    kl = cfg.replace(**{"learner.kl.coef": 0.001})
    fsdp, without = memory_plan(kl), memory_plan(cfg)
    assert fsdp.sizes[LEARNER][REFERENCE] == 2 * P // 8  # bf16, one eighth
    for phase, held in (("hand-over", True), ("update", True), ("sync", False), ("generate", False)):
        extra = fsdp.phase(phase).holds(LEARNER) - without.phase(phase).holds(LEARNER)
        assert extra == (2 * P // 8 if held else 0), phase
    assert "reference policy" in fsdp.describe() and fsdp.problems() == []
    deepspeed = memory_plan(kl.replace(**{"learner.strategy": "deepspeed"}))
    assert deepspeed.sizes[LEARNER][REFERENCE] == 2 * P
    assert REFERENCE not in deepspeed.phase("generate").held[LEARNER]  # it leaves; DeepSpeed's own state stays
    assert memory_plan(kl.replace(**{"learner.lora_rank": 32})).sizes[LEARNER][REFERENCE] == 0


def test_a_plan_that_cannot_fit_is_refused_with_its_numbers(tiny_policy):
    cfg = load_preset("qwen2.5-math-7b-rlep").replace(**{"placement.gpu_memory_gib": 24})
    plan = memory_plan(cfg)
    assert plan.problems() and "more than the 24 GiB" in plan.problems()[0]
    with pytest.raises(InputError, match="the update phase needs [0-9.]+ GiB per GPU, more than the 24 GiB"):
        check_memory(cfg)
    # DeepSpeed keeps its state on the GPU while the colocated engines run
    deepspeed = memory_plan(load_preset("qwen2.5-math-7b-rlep").replace(**{"learner.strategy": "deepspeed"}))
    fsdp = memory_plan(load_preset("qwen2.5-math-7b-rlep"))
    assert deepspeed.phase("generate").holds(LEARNER) > 0 == fsdp.phase("generate").holds(LEARNER)
    # and its checkpoint gathers each fp32 master whole on the GPU beside the awake engine; its
    # bf16 sync sends the whole bf16 weights it holds, gathering nothing
    assert deepspeed.phase("save").holds(LEARNER) == (deepspeed.phase("generate").holds(LEARNER)
                                                      + deepspeed.sizes[LEARNER][MASTER_GATHERED])
    assert deepspeed.sizes[LEARNER][WHOLE_TENSOR] == 0 < deepspeed.sizes[LEARNER][MASTER_GATHERED]
    # a GPU run refuses before anything starts (the tiny policy on 1 GiB GPUs)
    from rayrep.roles.system import Runtime

    tiny_gpu = load_preset("tiny-cpu").replace(**{"placement.device": "gpu", "placement.gpu_memory_gib": 1.0})
    with pytest.raises(InputError, match="memory plan does not fit"):
        Runtime.start(tiny_gpu, tiny_policy)


@pytest.mark.parametrize(("job", "extra"), [("rlep.py", []), ("exgrpo.py", []), ("grpo.py", []), ("eval.py", []),
                                             ("collect.py", ["--checkpoint", "x", "--out", "y"])])
def test_every_job_takes_a_dry_run(job, extra):
    done = job_here(job, "--dry-run", "--preset", "qwen2.5-math-7b-rlep", *extra)
    assert done.returncode == 0, done.stderr
    assert "placement plan:" in done.stdout and "memory plan per GPU (80 GiB" in done.stdout
    trains = job not in ("eval.py", "collect.py")
    assert ("  update " in done.stdout) == trains and ("host memory per node" in done.stdout) == trains
    assert "vLLM engines: the V1 model runner and synchronous scheduling, as the CPU suite runs them" in done.stdout
    small = job_here(job, "--dry-run", "--preset", "qwen2.5-math-7b-rlep", "--placement.gpu_memory_gib", "16", *extra)
    assert small.returncode == 2 and "does not fit" in small.stdout


# ---------------------------------------------------------------------------- residency


def test_moves_are_idempotent_and_every_operation_names_what_it_lacks():
    learner = Residency("learner rank 0", LEARNER, {PARAMETERS: DEVICE, OPTIMIZER: ABSENT})
    assert learner.move(PARAMETERS, HOST) and not learner.move(PARAMETERS, HOST)  # there already: nothing moves
    with pytest.raises(ResidencyError, match="^learner rank 0: an update needs its parameters on the device, "
                                             "and it is in host memory$"):
        learner.require("an update", PARAMETERS)
    engine = Residency("generator 1", ENGINE, {WEIGHTS: DROPPED, KV_CACHE: DROPPED})
    with pytest.raises(ResidencyError, match=r"generator 1: sampling needs its weights on the device, and it is "
                                             r"dropped \(vLLM sleep level 2\)"):
        engine.require("sampling", WEIGHTS, KV_CACHE)
    learner.move(PARAMETERS, DEVICE)
    learner.require("an update", PARAMETERS)


def test_the_allocator_keeps_what_an_operation_freed_until_its_cache_is_released():
    sizes = {PARAMETERS: 4, OPTIMIZER: 8, **{part: 10 for part in UPDATE}}
    learner = Residency("learner rank 0", LEARNER, {PARAMETERS: DEVICE, OPTIMIZER: DEVICE}, sizes)
    with learner.working_on(UPDATE):
        assert learner.reserved == 12 + 50
    assert learner.reserved == 62  # freed, but torch's caching allocator keeps it
    learner.move(OPTIMIZER, HOST)
    assert learner.reserved == 62
    learner.release_cache()
    assert learner.reserved == 4
    report = learner.report()
    assert (report.reserved, report.peak) == (4, 62) and report.at_peak["gradients"] == 10
    assert learner.report().peak == 4  # the peak starts again from now
    learner.move(PARAMETERS, HOST)
    assert learner.report().at_peak == {PARAMETERS: 4}  # (what it held as the interval began)
    # vLLM maps and unmaps an engine's weights and KV cache itself: asleep, they leave at once
    engine = Residency("generator 0", ENGINE, {WEIGHTS: DEVICE, KV_CACHE: DEVICE, ENGINE_RUNTIME: DEVICE},
                       {WEIGHTS: 14, KV_CACHE: 50, ENGINE_RUNTIME: 1}, engine_mapped=(WEIGHTS, KV_CACHE))
    engine.move(WEIGHTS, DROPPED)
    engine.move(KV_CACHE, DROPPED)
    assert engine.reserved == 1


# ---------------------------------------------------------------------------- the ledger


def holding(owner: str, role: str, parts: dict[str, int]) -> Holding:
    return Holding(owner, role, {p: DEVICE for p in parts}, sum(parts.values()), sum(parts.values()), dict(parts))


def test_the_ledger_refuses_a_holder_beyond_its_phase_and_a_gpu_beyond_its_size():
    plan = memory_plan(load_preset("qwen2.5-math-7b-exgrpo"))
    gpus = {"learner rank 0": (0,), "generator 0": (0,)}
    ledger = DeviceLedger(plan, gpus, strict=True)
    awake = plan.phase("generate").held[ENGINE]
    state = {p: plan.sizes[LEARNER][p] for p in (PARAMETERS, OPTIMIZER)}
    ledger.observe(RunPhase.GENERATE, [holding("generator 0", ENGINE, awake), holding("learner rank 0", LEARNER, {})])
    # A resumed learner that brings its state to the GPU beside an awake engine (it should load into host memory):
    with pytest.raises(MemoryLedgerError, match=r"resume phase: learner rank 0 held 10\.64 GiB \(parameters 3\.55 GiB, "
                                                r"optimizer state 7\.09 GiB\), and the plan gives a learner 0\.00 GiB"):
        ledger.observe(RunPhase.RESUME, [holding("generator 0", ENGINE, awake), holding("learner rank 0", LEARNER, state)])
    # The allocator's cache of an update, kept through the sync beside the engine's woken weights:
    update_peak = {**state, **{p: plan.sizes[LEARNER][p] for p in UPDATE}}
    with pytest.raises(MemoryLedgerError, match="sync phase: learner rank 0 held 39.16 GiB"):
        ledger.observe(RunPhase.SYNC, [holding("learner rank 0", LEARNER, {ALLOCATOR_CACHE: 0, **update_peak}),
                                holding("generator 0", ENGINE, plan.phase("sync").held[ENGINE])])
    # Two awake engines' worth on one GPU: over its 80 GiB (and the second is no holder of its phase either)
    ledger.gpus_of["generator 1"] = (0,)
    with pytest.raises(MemoryLedgerError, match=r"GPU 0 held 139\.00 GiB, more than its 80\.00 GiB"):
        ledger.observe(RunPhase.GENERATE, [holding("generator 0", ENGINE, awake), holding("generator 1", ENGINE, awake)])
    # Not strict (a GPU run): logged once per phase and holder, and the run goes on; its figures per phase
    logged = []
    lenient = DeviceLedger(plan, gpus, strict=False, log=logged.append)
    for _ in range(2):
        lenient.observe(RunPhase.RESUME, [holding("generator 0", ENGINE, awake), holding("learner rank 0", LEARNER, state)])
    # (the learner beyond its plan, and its GPU beyond 80 GiB: two breaches, each logged once)
    assert len(logged) == 2 and "learner rank 0 held 10.64 GiB" in logged[0] and "GPU 0 held 81.64 GiB" in logged[1]
    figures = lenient.take_figures()
    assert figures["memory_resume_gib"] == pytest.approx((68 * GIB + sum(state.values()) + RESERVED_BYTES) / GIB)
    assert figures["memory_resume_learner_gib"] == pytest.approx(sum(state.values()) / GIB)
    assert lenient.take_figures() == {}
    # On GPUs, torch's figures beside the model's: the learner's reserved peak, the device's use
    learner = holding("learner rank 0", LEARNER, state)
    learner.measured_peak, learner.device_used = 12 * GIB, 75 * GIB
    engine = holding("generator 0", ENGINE, awake)
    engine.device_used = 74 * GIB
    lenient.observe(RunPhase.RESUME, [engine, learner])
    figures = lenient.take_figures()
    assert (figures["memory_resume_learner_reserved_gib"], figures["memory_resume_device_gib"]) == (12.0, 75.0)


def test_the_devices_measured_use_over_the_plan_is_a_breach_like_the_models():
    """On GPUs the model's figures are the plan's own, so only the measured use can show an
    engine (or anything the model misses) beyond its phase: held to the GPU's plan the same way."""
    plan = memory_plan(load_preset("qwen2.5-math-7b-exgrpo"))
    gpus = {"learner rank 0": (0,), "generator 0": (0,)}
    generate = plan.phase("generate")
    allowed = generate.holds(ENGINE) + generate.holds(LEARNER) + RESERVED_BYTES  # 71.00 GiB
    engine = holding("generator 0", ENGINE, generate.held[ENGINE])  # the model: just what the plan gives
    learner = holding("learner rank 0", LEARNER, {})
    engine.device_used = int(allowed * 1.05)  # within the tolerance
    DeviceLedger(plan, gpus, strict=True).observe(RunPhase.GENERATE, [engine, learner])
    engine.device_used = 79 * GIB  # the engine took more than its share (a CUDA-graph pool the plan misses)
    with pytest.raises(MemoryLedgerError, match=r"generate phase: GPU 0 measured 79\.00 GiB in use at its peak "
                                                r"\(generator 0, learner rank 0 on it\), and the plan gives it "
                                                r"71\.00 GiB in this phase"):
        DeviceLedger(plan, gpus, strict=True).observe(RunPhase.GENERATE, [engine, learner])
    logged = []
    lenient = DeviceLedger(plan, gpus, strict=False, log=logged.append)
    lenient.observe(RunPhase.GENERATE, [engine, learner])
    lenient.observe(RunPhase.GENERATE, [engine, learner])
    assert len(logged) == 1 and logged[0].startswith("device-memory ledger, generate phase: GPU 0 measured 79.00 GiB")
    figures = lenient.take_figures()  # (the step's record: the measured peak, and the breaches counted)
    assert figures["memory_generate_device_gib"] == 79.0 and figures["memory_generate_breaches"] == 2


class ScriptedDevice:
    """A GPU's use as the driver would report it (`mem_get_info`), which a CPU has not: what the
    process holds, as its residency's parts and cache make it, plus an overhead."""

    def __init__(self, overhead: int):
        self.overhead, self.residency = overhead, None

    def __call__(self) -> int:
        return self.residency.reserved + self.overhead


def test_each_phases_measured_peak_is_sampled_before_its_memory_is_released():
    """The ledger observes `generate` after the engines slept and `update` after the learner
    released its allocator's cache (the model's peaks need that order); the device's use is
    sampled by each process just before it releases, so the phase's report holds its peak."""
    sizes = {PARAMETERS: 4, OPTIMIZER: 8, **{part: 10 for part in UPDATE}}
    device = ScriptedDevice(overhead=3)
    learner = device.residency = Residency("learner rank 0", LEARNER, {PARAMETERS: DEVICE, OPTIMIZER: DEVICE}, sizes,
                                           measure=device)
    with learner.working_on(UPDATE):
        pass
    learner.release_cache()  # the end of an update: its peak leaves the device
    assert learner.reserved == 12
    update = learner.report()
    assert update.device_used == 62 + 3  # the update's peak, not the 12 + 3 of the report's moment
    assert learner.report().device_used == 12 + 3  # (the samples start again from the report)

    engine_device = ScriptedDevice(overhead=2)
    engine = engine_device.residency = Residency(
        "generator 0", ENGINE, {WEIGHTS: DEVICE, KV_CACHE: DEVICE, ENGINE_RUNTIME: DEVICE},
        {WEIGHTS: 14, KV_CACHE: 50, ENGINE_RUNTIME: 1}, engine_mapped=(WEIGHTS, KV_CACHE, ENGINE_RUNTIME),
        measure=engine_device)
    engine.sample_device()  # what GeneratorWorker.sleep does before vLLM's sleep frees the GPU
    for part, place in ((WEIGHTS, DROPPED), (KV_CACHE, DROPPED), (ENGINE_RUNTIME, HOST)):
        engine.move(part, place)
    generate = engine.report()
    assert (generate.reserved, generate.device_used) == (0, 65 + 2)

