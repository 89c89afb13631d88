"""One GPU, about eight minutes: the figures that decide whether the paper presets' GPU paths work.

    python bench/gpu_check.py                          # the GPU's sizes (CPU: small ones, by itself)
    python bench/gpu_check.py --out results/ --sections order timeline
    python bench/gpu_check.py --soak-syncs 100         # a shorter soak

Needs torch and transformers only, plus rayrep's own modules; Ray (a stand-in takes its
place when it is missing) and vLLM (generation is skipped without it) are optional, and
nothing is downloaded: the policies are Qwen2-shaped with random weights, built from a
config. Each section writes `<out>/<section>.json` as soon as it finishes (a section that
fails writes its error), so a run cut short keeps what it measured. On a GPU the policies
have the 7B presets' widths and vocabulary (3584 / 18944 / 152064), cut to 2 and 4 layers;
on a CPU the same code runs at small sizes (the suite runs it so), the GPUs' memory modelled
by the ledger and the engine's stand-in holding 1/1024 of its bytes.

- order: ExGRPO's order on the real `LearnerWorker`, taking turns as a colocated run does:
  onload, the entropy pass, the update (the residency checks live: the update must find its
  parameters on the device); then offload and onload leave the parameters and AdamW's state
  bit for bit as they were, and each move puts the tensors where the residency says.
- learner_memory: one update of the real learner at the presets' settings (bf16, gradient
  checkpointing, the entropy term on, right-padded rows of mixed length; RLEP's 4 x 4096
  rows, ExGRPO's 18,432-token micro-batches), at 2 and 4 layers: the cost of a layer from the
  difference, scaled to 28 layers, against the memory plan's terms; trained tokens per
  second and MFU (6 x parameters x tokens / time, against the H200's 790 TFLOP/s bf16); the
  attention kernels SDPA runs under the padding mask.
- timeline: the colocated 80 GiB timeline on one GPU. A second process stands in for the
  engine (awake 0.85 x 80 GiB, nothing asleep, 14.2 GiB of weights and its runtime woken to receive) and holds
  the rest of the GPU as ballast, so that the two share 80 GiB as a colocated pair does; the
  learner is capped to the same share. Learner set-up, engine start-up, hand-over, a real
  update, the sync through the real handle transport (every weight compared bit for bit with
  the learner's full bf16 state dict; the sender's memory after it), hand-back, a resumed
  learner's state loaded beside the awake engine, and an engine that dies during a sync,
  replaced: `memory_reserved` and the device's use at every transition against the ledger,
  whose measured peaks (the device's use, sampled before each release) it holds to the plan;
  the pinned host memory the learner's optimizer offload takes, against the plan's.
- host_memory: the pinned copies vLLM's level-1 sleep makes of a LoRA engine's weights (the
  RLEP preset's 7B engine with a rank-32 adapter slot: one `torch.empty(..., pin_memory=True)`
  per CUDA segment, as `cumem.py` makes them), against the plan's rounded figure, and what
  torch's host allocator keeps of them once freed (as a wake frees them).
- soak: 600 syncs of the 7B manifest in 64 MiB buckets through the handles, to a receiver
  that copies them into its weights: time per sync, the sender's memory, every sync's bytes checked.
- handoff: the handle transport against a device copy of the same bytes; whether NCCL
  refuses two ranks on one GPU (why colocated runs hand over by handles), waiting 30 s at most.
- logprobs: peak memory of the chunked log-prob and entropy path (forward and backward) at
  4k and 9k tokens against a plain fp32 `log_softmax` of the same logits.
- generation: output tokens/s of a vLLM engine on the same weights (where vLLM is installed).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # rayrep from this checkout

try:  # the learner worker module makes its Ray actor class at import; a bare GPU machine has no Ray
    import ray  # noqa: F401
except ImportError:
    stand_in = types.ModuleType("ray")
    stand_in.remote = lambda cls: cls
    sys.modules["ray"] = stand_in

from rayrep.cluster.memory import (ENGINE, ENGINE_AWAKE, ENGINE_RUNTIME, GIB, LEARNER, RECEIVED,  # noqa: E402
                                   WEIGHTS, DeviceLedger, ModelShape, RunPhase, engine_weight_segments, estimate,
                                   learner_host_state, model_shape, pinned_block_bytes, timeline)
from rayrep.cluster.placement import free_port  # noqa: E402
from rayrep.cluster.residency import Holding, device_use  # noqa: E402
from rayrep.config import load_preset  # noqa: E402
from rayrep.sync.collective import TensorSpec, WeightManifest  # noqa: E402
from rayrep.sync.transport import TRANSPORTS, PeerDied  # noqa: E402

HANDLES = TRANSPORTS["handles"]

WIDE = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
            num_key_value_heads=4, tie_word_embeddings=False)
"""Qwen2.5-Math-7B's widths and vocabulary (28 layers there)."""
SMALL = dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2,
             tie_word_embeddings=True)
H200_BF16_FLOPS = 790e12
"""The H200's bf16 peak as measured on the lent machine (dense matmul)."""
SECTIONS = ("order", "learner_memory", "timeline", "host_memory", "soak", "handoff", "logprobs", "generation")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gib(num_bytes: float | None) -> float | None:
    return None if num_bytes is None else num_bytes / GIB


def best_seconds(run, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def device_used(device: torch.device) -> int | None:
    """Bytes in use on the device, every process's (None on CPU)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


# ---------------------------------------------------------------------------- policies and learners


def build_policy(folder: Path, shape: dict, layers: int, device: torch.device) -> tuple[str, object]:
    """A Qwen2-shaped policy with random weights in `folder` (fp32, as the learners load it)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**shape, num_hidden_layers=layers, max_position_embeddings=16384)
    torch.manual_seed(0)
    with torch.device(device):  # built where it is fast to initialise; written in host memory
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return str(folder), config


def learner_config(model_dir: str, preset: str, gpu: bool, **changes):
    """The preset's learner settings on one rank, colocated (taking turns): on a CPU, with the
    GPUs emulated so that the residency checks and sizes are live."""
    cfg = load_preset(preset).replace(**{
        "model.path": model_dir, "learner.num_workers": 1, "generator.num_workers": 1,
        "learner.mini_batch_prompts": 1, "algorithm.prompts_per_step": 1, "learner.warmup_steps": 0,
        "placement.device": "gpu" if gpu else "cpu", "placement.mode": "colocated",
        "placement.emulate_gpus": not gpu, "verifier.overlong_buffer": 0, **changes})
    return cfg


def start_learner(cfg, model_dir: str):
    from rayrep.learner.worker import LearnerWorker

    worker = LearnerWorker(cfg, rank=0, world_size=1, threads=os.cpu_count() or 1)
    worker.setup(model_dir, "127.0.0.1", free_port())
    return worker


def mixed_batch(vocab: int, rows: int, prompt: int, longest: int, seed: int = 0):
    """`rows` answers to one `prompt`-token question, right-padded: lengths spread evenly up to `longest`."""
    from rayrep.types import TrainBatch

    generator = torch.Generator().manual_seed(seed)
    question = torch.randint(3, vocab, (prompt,), generator=generator).tolist()
    lengths = [max(1, int((longest - prompt) * (i + 1) / rows)) for i in range(rows)]
    responses = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]
    return TrainBatch.of_sequences([question] * rows, responses, [0] * rows,
                                   advantages=torch.randn(rows, generator=generator).tolist(),
                                   recompute_old=[True] * rows)


def local_tensors(worker) -> dict[str, torch.Tensor]:
    """This rank's parameters and AdamW moments, copied to host memory."""
    def local(t):
        return (t.to_local() if hasattr(t, "to_local") else t).detach().to("cpu", copy=True)

    found = {f"param/{n}": local(p) for n, p in worker.sharding.model.named_parameters()}
    for n, p in worker.sharding.model.named_parameters():
        for key, value in worker.sharding.optimizer.state.get(p, {}).items():
            if torch.is_tensor(value) and value.dim() > 0:
                found[f"{key}/{n}"] = local(value)
    return found


def devices_of(worker) -> list[str]:
    """Where this rank's parameter shards and AdamW moments really are."""
    places = {(p.to_local() if hasattr(p, "to_local") else p).device.type for p in worker.sharding.model.parameters()}
    moments = {v.device.type for s in worker.sharding.optimizer.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0}
    return [",".join(sorted(places)), ",".join(sorted(moments)) or "none"]


# ---------------------------------------------------------------------------- order


def order_check(model_dir: str, config, device: torch.device) -> dict:
    """ExGRPO's order on the real learner, and offload / onload bit for bit (defect 1)."""
    import numpy as np

    from rayrep.buffer.answers import PackedAnswers
    from rayrep.types import Answer
    from rayrep.cluster.memory import OPTIMIZER, PARAMETERS
    from rayrep.types import LossSpec

    gpu = device.type == "cuda"
    cfg = learner_config(model_dir, "qwen2.5-math-7b-exgrpo", gpu, **{
        "learner.micro_batch_tokens": 0, "learner.micro_batch_size": 4, "generator.max_response_tokens": 512,
        "data.max_prompt_tokens": 64, "learner.lr": 1e-6})
    worker = start_learner(cfg, model_dir)
    figures: dict = {"after_setup": [worker.residency.at(PARAMETERS), *devices_of(worker)]}
    try:
        batch = mixed_batch(config.vocab_size, 8, 64, 256)
        generator = torch.Generator().manual_seed(1)
        answers = [Answer.of_arrays(np.array(torch.randint(3, config.vocab_size, (n,), generator=generator), np.int32),
                          np.zeros(n, np.float32), 1.0) for n in (40, 90, 150)]
        packed = PackedAnswers.pack([("q", np.array(batch.input_ids[0, :64], np.int32), answers)])
        loss = LossSpec(entropy_coef=cfg.learner.entropy_coef)
        for step in range(2):  # the second step has AdamW's state to move too
            moved_on = worker.onload()
            rows, entropies = worker.mean_entropies(packed)
            figures[f"step{step}_after_entropy_pass"] = [worker.residency.at(PARAMETERS), *devices_of(worker)]
            worker.update(batch, loss)  # refuses parameters anywhere but on the device
            figures[f"step{step}"] = {"onload_moved": moved_on, "entropies": [float(e) for e in entropies],
                                      "after_update": [worker.residency.at(PARAMETERS), worker.residency.at(OPTIMIZER),
                                                       *devices_of(worker)]}
            before = local_tensors(worker)
            figures[f"step{step}"]["offload_moved"] = worker.offload()
            figures[f"step{step}"]["after_offload"] = devices_of(worker)
            worker.onload()
            after = local_tensors(worker)
            figures[f"step{step}"]["bit_identical_after_offload_onload"] = (
                before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before))
            figures[f"step{step}"]["tensors_compared"] = len(before)
            worker.offload()
        figures["entropy_pass_then_update_ok"] = True
    finally:
        worker.shutdown()
    return figures


# ---------------------------------------------------------------------------- learner memory


def sdpa_kernels(worker, batch, rows: int) -> list[str]:
    """The CUDA kernels one forward pass runs for attention under the padding mask."""
    from torch.profiler import ProfilerActivity, profile

    width = int(batch.lengths[:rows].max())
    ids = batch.input_ids[:rows, :width].to(worker.device)
    mask = (torch.arange(width)[None, :] < batch.lengths[:rows, None]).long().to(worker.device)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        worker.sharding.model(input_ids=ids, attention_mask=mask)
        torch.cuda.synchronize()
    names = {event.key for event in prof.key_averages()}
    return sorted(n for n in names if any(k in n.lower() for k in ("attention", "fmha", "flash", "efficient", "sdpa",
                                                                       "cutlass", "softmax")))


def learner_memory_check(dirs: dict[int, str], configs: dict[int, object], device: torch.device, scale: dict) -> dict:
    """The learner's peak at the presets' micro-batches, at 2 and 4 layers (see the docstring)."""
    from rayrep.cluster.memory import LEARNER, UPDATE, part_sizes
    from rayrep.types import LossSpec

    gpu = device.type == "cuda"
    settings = {
        "rlep": ("qwen2.5-math-7b-rlep", {"learner.micro_batch_size": 4, "learner.micro_batch_tokens": 0},
                 scale["rlep_prompt"], scale["rlep_longest"], 8),
        "exgrpo": ("qwen2.5-math-7b-exgrpo", {"learner.micro_batch_tokens": scale["exgrpo_tokens"],
                                              "learner.micro_batch_size": 64},
                   scale["exgrpo_prompt"], scale["exgrpo_longest"], 8),
    }
    figures: dict = {}
    for name, (preset, changes, prompt, longest, rows) in settings.items():
        per_depth = {}
        for layers, model_dir in dirs.items():
            cfg = learner_config(model_dir, preset, gpu, **changes, **{
                "generator.max_response_tokens": longest - prompt, "data.max_prompt_tokens": prompt})
            worker = start_learner(cfg, model_dir)
            try:
                batch = mixed_batch(configs[layers].vocab_size, rows, prompt, longest)
                loss = LossSpec(entropy_coef=cfg.learner.entropy_coef)
                worker.onload()
                worker.update(batch, loss)  # the first makes AdamW's state: measured from the second
                worker.onload()
                synchronize(device)
                state = torch.cuda.memory_allocated(device) if gpu else None
                if gpu:
                    torch.cuda.reset_peak_memory_stats(device)
                start = time.perf_counter()
                worker.update(batch, loss)
                synchronize(device)
                seconds = time.perf_counter() - start
                tokens = int(batch.lengths.sum())
                parameters = sum(p.numel() for p in worker.sharding.module.parameters())
                row = {"parameters": parameters, "tokens": tokens, "padded_tokens": int(batch.lengths.max()) * rows,
                       "seconds": seconds, "tokens_per_second": tokens / seconds}
                if gpu:
                    peak = torch.cuda.max_memory_allocated(device)
                    row.update(state_gib=gib(state), peak_allocated_gib=gib(peak),
                               peak_reserved_gib=gib(torch.cuda.max_memory_reserved(device)),
                               transient_gib=gib(peak - state),
                               mfu=6 * parameters * tokens / seconds / H200_BF16_FLOPS)
                    if layers == min(dirs):
                        row["attention_kernels"] = sdpa_kernels(worker, batch, rows=min(rows, 4))
                        row["attention_implementation"] = worker.sharding.module.config._attn_implementation
                per_depth[layers] = row
                worker.offload()
            finally:
                worker.shutdown()
        low, high = min(per_depth), max(per_depth)
        section = {"by_layers": per_depth}
        shape28 = ModelShape.of({**configs[high].to_dict(), "num_hidden_layers": 28})
        plan_cfg = learner_config(dirs[high], preset, gpu, **changes, **{
            "generator.max_response_tokens": longest - prompt, "data.max_prompt_tokens": prompt})
        sizes28 = part_sizes(plan_cfg, shape28)[LEARNER]
        section["plan_update_parts_28_layers_gib"] = {p: gib(sizes28[p]) for p in UPDATE}
        section["plan_transient_28_layers_gib"] = gib(sum(sizes28[p] for p in UPDATE))
        if gpu:
            per_layer = (per_depth[high]["transient_gib"] - per_depth[low]["transient_gib"]) / (high - low)
            section["transient_per_layer_gib"] = per_layer
            section["transient_28_layers_gib"] = per_depth[low]["transient_gib"] + (28 - low) * per_layer
            section["measured_over_plan_28_layers"] = (section["transient_28_layers_gib"]
                                                       / section["plan_transient_28_layers_gib"])
        figures[name] = section
    return figures


# ---------------------------------------------------------------------------- the engine's stand-in


def stand_in_engine(commands, answers, device_name: str, ballast: int, sizes: dict[str, int], scale: float) -> None:
    """A process that holds what an engine worker holds on its GPU, as told (`ENGINE_AWAKE`
    parts awake, its runtime asleep, weights woken to receive), `scale` of the plan's bytes;
    it receives weights through the real handle transport and answers each tensor's digest."""
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    keep = torch.empty(ballast, dtype=torch.uint8, device=device) if ballast else None  # noqa: F841 - held
    held: dict[str, torch.Tensor] = {}
    channel = None

    def hold(parts: tuple[str, ...]) -> None:
        for part in list(held):
            if part not in parts:
                del held[part]
        if device.type == "cuda":
            torch.cuda.empty_cache()  # vLLM unmaps a sleeping tag's memory: it goes back to the device
        for part in parts:
            if part not in held:
                held[part] = torch.empty(max(1, int(sizes[part] * scale)), dtype=torch.uint8, device=device)

    while True:
        command, *args = commands.get()
        try:
            if command == "hold":
                hold(tuple(args[0]))
                answers.put(("held", device_used(device)))
            elif command == "join":
                channel = HANDLES.join_as_engine_worker("127.0.0.1", args[0], 2, 1, "gloo", device)
                answers.put(("joined", None))
            elif command == "receive":
                manifest, die_after = args
                hold((ENGINE_RUNTIME, WEIGHTS))
                digests, received, peak = {}, 0, 0
                for count, (name, tensor) in enumerate(channel.receive(manifest)):
                    digests[name] = digest(tensor)
                    received += tensor.numel() * tensor.element_size()
                    peak = max(peak, device_used(device) or 0)
                    if die_after is not None and count + 1 == die_after:
                        os._exit(1)  # as a killed engine does, mid-sync
                channel.close()
                answers.put(("received", {"digests": digests, "bytes": received, "peak_device_used": peak}))
            elif command == "stop":
                return
        except Exception as error:  # noqa: BLE001 - the driver reports it
            answers.put(("error", f"{type(error).__name__}: {error}"))


class Engine:
    """The driver's handle on the stand-in engine process."""

    def __init__(self, device: torch.device, ballast: int, sizes: dict[str, int], scale: float):
        context = multiprocessing.get_context("spawn")
        self.commands, self.answers = context.Queue(), context.Queue()
        self.process = context.Process(target=stand_in_engine, daemon=True,
                                       args=(self.commands, self.answers, str(device), ballast, sizes, scale))
        self.process.start()

    def ask(self, *command, timeout: float = 300):
        self.commands.put(command)
        kind, value = self.answers.get(timeout=timeout)
        if kind == "error":
            raise RuntimeError(f"the engine's stand-in: {value}")
        return value

    def send(self, *command) -> None:
        self.commands.put(command)

    def answer(self, timeout: float = 300):
        kind, value = self.answers.get(timeout=timeout)
        if kind == "error":
            raise RuntimeError(f"the engine's stand-in: {value}")
        return value

    def stop(self) -> None:
        if self.process.is_alive():
            self.commands.put(("stop",))
            self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()


ASLEEP: tuple[str, ...] = ()
"""What a sleeping engine holds on its GPU: nothing the plan counts (vLLM copies its runtime
pools to host memory at every sleep)."""


def engine_holding(parts: tuple[str, ...], sizes: dict[str, int], extra: dict[str, int] | None = None) -> Holding:
    """The stand-in's holding as the ledger models it (the plan's bytes)."""
    held = {p: sizes[p] for p in parts}
    held.update(extra or {})
    total = sum(held.values())
    return Holding("generator 0", ENGINE, {p: "device" for p in held}, total, total, held)


# ---------------------------------------------------------------------------- timeline


def timeline_check(model_dir: str, config, device: torch.device, scale: float) -> dict:
    """The colocated timeline on one GPU shared with the engine's stand-in (see the docstring)."""
    from rayrep.types import LossSpec

    gpu = device.type == "cuda"
    capacity_gib = 80.0
    cfg = learner_config(model_dir, "qwen2.5-math-7b-rlep", gpu, **{
        "learner.micro_batch_size": 4, "placement.gpu_memory_gib": capacity_gib, "learner.lr": 1e-6,
        "sync.bucket_mb": 64 if gpu else 0.01,  # (many buckets either way: the engine dies between two)
        "generator.max_response_tokens": 3072 if gpu else 112, "data.max_prompt_tokens": 1024 if gpu else 16})
    seven_b = estimate(load_preset("qwen2.5-math-7b-rlep"), ModelShape.of({**WIDE, "num_hidden_layers": 28}))
    sizes = seven_b.sizes[ENGINE]  # the engine's stand-in holds a 7B engine's parts
    ballast = 0
    if gpu:
        total = torch.cuda.get_device_properties(device).total_memory
        ballast = max(0, total - int(capacity_gib * GIB))
        torch.cuda.set_per_process_memory_fraction(capacity_gib * GIB / total, device)
    # The plan of this learner (this policy, one rank) beside a 7B engine, as the stand-in holds.
    mixed = {LEARNER: estimate(cfg, ModelShape.of(config)).sizes[LEARNER], ENGINE: sizes}
    own = dataclasses.replace(seven_b, sizes=mixed, phases=timeline(cfg, mixed), host={})
    breaches: list[str] = []
    ledger = DeviceLedger(own, {"learner rank 0": (0,), "generator 0": (0,)}, strict=False, log=breaches.append)
    rows: list[dict] = []
    figures: dict = {"capacity_gib": capacity_gib, "ballast_gib": gib(ballast), "transitions": rows,
                     "ledger_breaches": breaches}
    engine_now: list = [(), None]  # the stand-in's parts (none before it starts), and its transients since the last transition

    def transition(phase: RunPhase, worker) -> None:
        learner = worker.memory_report()
        extra = engine_now[1] or {}
        ledger.observe(phase, [learner, engine_holding(engine_now[0], sizes, extra)])
        engine_now[1] = None
        used = device_used(device)
        rows.append({
            "phase": phase, "ledger_gpu_gib": gib(ledger.observations[-1].gpus.get(0)),
            "ledger_learner_gib": gib(learner.peak), "learner_parts": {k: gib(v) for k, v in learner.at_peak.items()},
            "learner_reserved_gib": gib(learner.measured_reserved), "learner_peak_reserved_gib": gib(learner.measured_peak),
            "device_used_gib": gib(None if used is None else used - ballast),
            "ledger_measured_gib": gib(ledger.observations[-1].measured.get(0)),
            "plan_gib": gib(own.per_gpu(own.phase(phase))),
        })

    engine = None
    worker = start_learner(cfg, model_dir)
    if gpu:  # the device as the 80 GiB GPU the plan has: the stand-in's ballast is not the run's
        worker.residency.measure = lambda: device_use(device) - ballast
    try:
        transition(RunPhase.LEARNER_SET_UP, worker)
        engine = Engine(device, ballast, sizes, scale)
        engine.ask("hold", ENGINE_AWAKE)
        engine_now[0] = ENGINE_AWAKE
        transition(RunPhase.ENGINE_START_UP, worker)
        batch = mixed_batch(config.vocab_size, 8, cfg.data.max_prompt_tokens,
                            cfg.data.max_prompt_tokens + cfg.generator.max_response_tokens)
        loss = LossSpec()
        manifest = WeightManifest.build([TensorSpec(n, s, getattr(torch, d)) for n, s, d in worker.weight_specs()],
                                        int(cfg.sync.bucket_mb * 2**20), tied_embedding=worker.tied_embedding_name())

        def sync(die_after: int | None = None) -> dict | None:
            port = free_port()
            engine.send("join", port)
            worker.join_weight_group("127.0.0.1", port, 2)
            engine.answer()
            engine_now[0] = (ENGINE_RUNTIME, WEIGHTS)
            engine_now[1] = {RECEIVED: sizes[RECEIVED]}
            engine.send("receive", manifest, die_after)
            try:
                worker.broadcast_weights(manifest)
            except PeerDied as died:
                figures["engine_died_during_sync"] = str(died)
                return None
            received = engine.answer()
            worker.leave_weight_group()
            return received

        for cycle in range(2):
            worker.residency.sample_device()  # the generate phase's peak, as an engine samples it before it sleeps
            engine.ask("hold", ASLEEP)  # hand-over: the engine sleeps first
            engine_now[0] = ASLEEP
            transition(RunPhase.GENERATE, worker)
            worker.onload()
            transition(RunPhase.HAND_OVER, worker)
            worker.update(batch, loss)
            transition(RunPhase.UPDATE, worker)
            worker.offload(parameters=False)
            if gpu and cycle == 0:  # AdamW's moments, moved with non_blocking: pinned blocks of torch's host allocator
                figures["host_pinned_after_offload_gb"] = pinned_host_bytes() / 1e9
                figures["host_pinned_planned_gb"] = learner_host_state(cfg, ModelShape.of(config))[1] / 1e9
            transition(RunPhase.UPDATE, worker)
            if cycle == 0:
                received = sync()
                sent = worker.full_state_dict(torch.bfloat16)
                figures["sync_bit_for_bit"] = {
                    "tensors": len(sent), "received": len(received["digests"]),
                    "equal": sorted(received["digests"]) == sorted(sent)
                    and all(received["digests"][n] == digest(t) for n, t in sent.items()),
                    "bytes": received["bytes"], "engine_peak_device_used_gib": gib(received["peak_device_used"])}
                figures["sender_reserved_after_sync_gib"] = gib(torch.cuda.memory_reserved(device)) if gpu else None
                transition(RunPhase.SYNC, worker)
                worker.offload()
                figures["sender_reserved_after_offload_gib"] = gib(torch.cuda.memory_reserved(device)) if gpu else None
                transition(RunPhase.SYNC, worker)
                engine.ask("hold", ENGINE_AWAKE)
                engine_now[0] = ENGINE_AWAKE
                # A resumed run: the learner's checkpoint loaded beside the awake engine (defect 2).
                with tempfile.TemporaryDirectory() as folder:
                    shared = worker.save_state(folder)
                    worker.load_state(folder, shared)
                transition(RunPhase.RESUME, worker)
            else:  # the engine dies during this sync; a new one starts awake once the learner has left the GPU
                assert sync(die_after=3) is None, "the stand-in should have died mid-sync"
                engine.process.join(timeout=60)
                worker.leave_weight_group()
                worker.offload()
                transition(RunPhase.SYNC, worker)
                engine = Engine(device, ballast, sizes, scale)
                engine.ask("hold", ENGINE_AWAKE)  # (out of memory here if the learner had kept the GPU)
                engine_now[0] = ENGINE_AWAKE
                transition(RunPhase.REPLACEMENT, worker)
                engine.ask("hold", ASLEEP)
                engine_now[0] = ASLEEP
                transition(RunPhase.REPLACEMENT, worker)
                worker.onload(optimizer=False)
                received = sync()
                figures["replacement_received_tensors"] = len(received["digests"])
                worker.offload()
                transition(RunPhase.SYNC, worker)
        figures["plan_per_phase_gib"] = {p.name: gib(own.per_gpu(p)) for p in own.phases}
    finally:
        worker.shutdown()
        if engine is not None:
            engine.stop()
        if gpu:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    return figures


# ---------------------------------------------------------------------------- host memory


def host_memory_check(gpu: bool) -> dict:
    """Pinned host memory as torch's host allocator takes it, against the plan (see the docstring)."""
    cfg = load_preset("qwen2.5-math-7b-rlep").replace(**{"learner.lora_rank": 32})
    segments = engine_weight_segments(cfg, model_shape(cfg))
    figures = {"segments": len(segments), "unrounded_gb": sum(segments) / 1e9,
               "planned_gb": sum(pinned_block_bytes(n) for n in segments) / 1e9}
    if not gpu:
        return {**figures, "measured": "no CUDA: nothing is pinned on a CPU"}
    before = pinned_host_bytes()
    start = time.perf_counter()
    backups = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in segments]
    figures["pin_seconds"] = time.perf_counter() - start
    figures["measured_gb"] = (pinned_host_bytes() - before) / 1e9
    figures["host_memory_stats"] = {k: v for k, v in torch.cuda.host_memory_stats().items() if "bytes" in k}
    del backups
    figures["kept_after_free_gb"] = (pinned_host_bytes() - before) / 1e9
    figures["measured_over_planned"] = figures["measured_gb"] / figures["planned_gb"]
    return figures


def pinned_host_bytes() -> int:
    """The bytes of pinned blocks torch's host allocator owns (in use and cached), as it rounds them."""
    stats = torch.cuda.host_memory_stats()
    return stats.get("allocated_bytes.current", stats.get("reserved_bytes.current", 0))


# ---------------------------------------------------------------------------- soak


def seven_b_manifest(shape: dict, layers: int, bucket_mb: float) -> WeightManifest:
    """The names, shapes and order of a Qwen2 policy's weights (as a sync sends them), in bf16."""
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    specs = [("model.embed_tokens.weight", (v, h))]
    for n in range(layers):
        layer = f"model.layers.{n}."
        specs += [(layer + "self_attn.q_proj.weight", (h, h)), (layer + "self_attn.q_proj.bias", (h,)),
                  (layer + "self_attn.k_proj.weight", (kv, h)), (layer + "self_attn.k_proj.bias", (kv,)),
                  (layer + "self_attn.v_proj.weight", (kv, h)), (layer + "self_attn.v_proj.bias", (kv,)),
                  (layer + "self_attn.o_proj.weight", (h, h)), (layer + "mlp.gate_proj.weight", (i, h)),
                  (layer + "mlp.up_proj.weight", (i, h)), (layer + "mlp.down_proj.weight", (h, i)),
                  (layer + "input_layernorm.weight", (h,)), (layer + "post_attention_layernorm.weight", (h,))]
    specs += [("model.norm.weight", (h,))]
    if not shape["tie_word_embeddings"]:
        specs += [("lm_head.weight", (v, h))]
    return WeightManifest.build([TensorSpec(n, s, torch.bfloat16) for n, s in specs], int(bucket_mb * 2**20))


def soak_receiver(port: int, device_name: str, manifest: WeightManifest, syncs: int, expected, results) -> None:
    """Receives `syncs` syncs into one weights buffer; after each, its checksum against the
    one expected of that sync (the sender alternates between two sources)."""
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    channel = HANDLES.join_as_engine_worker("127.0.0.1", port, 2, 1, "gloo", device)
    weights = torch.empty(manifest.total_bytes // 2, dtype=torch.bfloat16, device=device)
    offsets, at = {}, 0
    for spec in manifest.tensors:
        offsets[spec.name] = (at, spec.numel)
        at += spec.numel
    wrong = 0
    for sync in range(syncs):
        for name, tensor in channel.receive(manifest):
            start, numel = offsets[name]
            weights[start : start + numel].copy_(tensor.reshape(-1))
        if int(weights.view(torch.int16).sum(dtype=torch.int64)) != expected[sync % 2]:
            wrong += 1
    results.put({"wrong_syncs": wrong, "peak_reserved_gib": gib(torch.cuda.max_memory_reserved(device))
                 if device.type == "cuda" else None})


def soak_check(device: torch.device, manifest: WeightManifest, syncs: int) -> dict:
    gpu = device.type == "cuda"
    generator = torch.Generator(device="cpu").manual_seed(0)
    elements = manifest.total_bytes // 2
    sources = []
    for flip in range(2):  # two sources of different bytes: a stale sync cannot pass the check
        source = torch.empty(elements, dtype=torch.bfloat16, device=device)
        chunk = 2**26
        for start in range(0, elements, chunk):
            part = torch.randn(min(chunk, elements - start), generator=generator).to(torch.bfloat16)
            source[start : start + len(part)].copy_(part)
        if flip:
            source.neg_()
        sources.append(source)
    expected = [int(s.view(torch.int16).sum(dtype=torch.int64)) for s in sources]
    views = []
    for source in sources:
        at, tensors = 0, []
        for spec in manifest.tensors:
            tensors.append(source[at : at + spec.numel].view(spec.shape))
            at += spec.numel
        views.append(tensors)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    receiver = context.Process(target=soak_receiver, args=(port, str(device), manifest, syncs, expected, results),
                               daemon=True)
    receiver.start()
    channel = HANDLES.join_as_learner("127.0.0.1", port, 2, 0, "gloo", device)
    seconds, reserved = [], []
    try:
        for sync in range(syncs):
            synchronize(device)
            start = time.perf_counter()
            channel.send(manifest, iter(views[sync % 2]))
            synchronize(device)
            seconds.append(time.perf_counter() - start)
            reserved.append(torch.cuda.memory_reserved(device) if gpu else 0)
        outcome = results.get(timeout=600)
    finally:
        channel.close()
        receiver.join(timeout=60)
    ordered = sorted(seconds)
    return {"syncs": syncs, "bytes_per_sync": manifest.total_bytes, "buckets": len(manifest.buckets),
            "largest_bucket_bytes": manifest.largest_bucket_bytes,
            "seconds_first": seconds[0], "seconds_median": ordered[len(ordered) // 2], "seconds_max": ordered[-1],
            "seconds_last_tenth_mean": sum(seconds[-max(1, syncs // 10):]) / max(1, syncs // 10),
            "gbps_median": manifest.total_bytes / ordered[len(ordered) // 2] / 1e9,
            "sender_reserved_gib_first_last_max": [gib(reserved[0]), gib(reserved[-1]), gib(max(reserved))] if gpu
            else None, **outcome}


# ---------------------------------------------------------------------------- handoff


def bucket_manifest(total_bytes: int, bucket_bytes: int) -> WeightManifest:
    """bf16 tensors of `bucket_bytes` each, `total_bytes` in all: a sync's manifest."""
    count = max(1, total_bytes // bucket_bytes)
    specs = [TensorSpec(f"weight{i}", (bucket_bytes // 2,), torch.bfloat16) for i in range(count)]
    return WeightManifest.build(specs, bucket_bytes)


def receive_handoffs(port: int, device_name: str, manifest: WeightManifest, syncs: int, results) -> None:
    """The engine worker's end, in a process of its own: receive `syncs` syncs, report the
    last value of each (the bytes arrived)."""
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    channel = HANDLES.join_as_engine_worker("127.0.0.1", port, 2, 1, "gloo", device)
    for _ in range(syncs):
        last = None
        for _, tensor in channel.receive(manifest):
            last = tensor
        results.put(float(last[-1]))


def duplicate_nccl_rank(port: int, rank: int, results) -> None:
    """One of two NCCL ranks on GPU 0: the first collective fails ("Duplicate GPU detected")."""
    try:
        torch.cuda.set_device(0)
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
        group = dist.ProcessGroupNCCL(store, rank, 2)
        probe = torch.ones(1, device="cuda")
        options = dist.BroadcastOptions()
        options.rootRank = 0
        group.broadcast([probe], options).wait()
        torch.cuda.synchronize()
        results.put((rank, "ok", ""))
    except Exception as error:  # noqa: BLE001 - the error is the figure
        results.put((rank, type(error).__name__, str(error)[:400]))


def handoff_check(device: torch.device, total_bytes: int, bucket_bytes: int, repeats: int) -> dict:
    context = multiprocessing.get_context("spawn")
    manifest = bucket_manifest(total_bytes, bucket_bytes)
    sent = [torch.full(spec.shape, float(i % 7 + 1), dtype=spec.dtype, device=device)
            for i, spec in enumerate(manifest.tensors)]
    port = free_port()
    results = context.Queue()
    receiver = context.Process(target=receive_handoffs, args=(port, str(device), manifest, repeats + 1, results),
                               daemon=True)
    receiver.start()
    channel = HANDLES.join_as_learner("127.0.0.1", port, 2, 0, "gloo", device)
    times = []
    try:
        for _ in range(repeats + 1):  # the first opens the handles: not timed
            synchronize(device)
            start = time.perf_counter()
            channel.send(manifest, iter(sent))
            synchronize(device)
            times.append(time.perf_counter() - start)
            assert results.get(timeout=120) == float((len(sent) - 1) % 7 + 1)
    finally:
        channel.close()
        receiver.join(timeout=60)
    seconds = min(times[1:])
    source = torch.empty(manifest.total_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    copy_seconds = best_seconds(lambda: target.copy_(source), repeats, device)
    figures = {
        "transport": "CUDA IPC handles" if device.type == "cuda" else "shared-memory handles",
        "bytes": manifest.total_bytes, "buckets": len(manifest.buckets),
        "handoff_gbps": manifest.total_bytes / seconds / 1e9, "device_copy_gbps": manifest.total_bytes / copy_seconds / 1e9,
    }
    figures["ratio"] = figures["handoff_gbps"] / figures["device_copy_gbps"]
    if device.type == "cuda":
        port, results = free_port(), context.Queue()
        ranks = [context.Process(target=duplicate_nccl_rank, args=(port, r, results), daemon=True) for r in (0, 1)]
        for process in ranks:
            process.start()
        outcomes, deadline = [], time.monotonic() + 30  # a hang is a finding too, after 30 s
        for _ in ranks:
            try:
                outcomes.append(results.get(timeout=max(0.1, deadline - time.monotonic())))
            except Exception:  # noqa: BLE001
                outcomes.append((None, "no answer within 30 s", ""))
        for process in ranks:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
        figures["nccl_two_ranks_one_gpu"] = [{"rank": r, "outcome": kind, "message": text} for r, kind, text in outcomes]
        figures["nccl_refused"] = all(kind != "ok" for _, kind, _ in outcomes)
    else:
        figures["nccl_two_ranks_one_gpu"] = "no GPU: not run"
    return figures


# ---------------------------------------------------------------------------- logprobs and generation


def logprob_check(device: torch.device, vocab: int, token_counts: list[int], chunk_tokens: int) -> dict:
    from rayrep.learner.logprobs import token_logprobs

    gpu = device.type == "cuda"
    rows = []
    for tokens in token_counts:
        row: dict = {"tokens": tokens, "vocab": vocab, "fp32_full_tensor_gib": tokens * vocab * 4 / GIB}
        for way in ("chunked", "plain"):
            logits = torch.randn(1, tokens, vocab, device=device, dtype=torch.bfloat16).requires_grad_()
            ids = torch.randint(0, vocab, (1, tokens), device=device)
            synchronize(device)
            base = torch.cuda.memory_allocated(device) if gpu else None
            if gpu:
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            if way == "chunked":
                logp, entropy = token_logprobs(logits, ids, 0.7, "grad", chunk_tokens)
            else:  # the whole [1, L, V] in fp32, several times
                log_probs = torch.log_softmax(logits[:, :-1].float() / 0.7, -1)
                logp = log_probs.gather(-1, ids[:, 1:, None]).squeeze(-1)
                entropy = -(log_probs.exp() * log_probs).sum(-1)
            (logp.sum() + entropy.sum()).backward()
            synchronize(device)
            row[f"{way}_seconds"] = time.perf_counter() - start
            if gpu:
                row[f"{way}_peak_above_logits_gib"] = (torch.cuda.max_memory_allocated(device) - base) / GIB
            del logits, logp, entropy
            if way == "plain":
                del log_probs
        row["plan_gradient_and_chunk_gib"] = (tokens * vocab * 2 + 4 * min(tokens, chunk_tokens) * vocab * 4) / GIB
        rows.append(row)
    return {"chunk_tokens": chunk_tokens, "rows": rows}


def generation_check(model_dir: str, dtype: str, prompts: int, new_tokens: int) -> dict:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return {"skipped": "vLLM is not installed here"}
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype=dtype, enforce_eager=not torch.cuda.is_available(),
              max_model_len=64 + new_tokens, seed=0)
    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=1.0, detokenize=False)
    requests = [TokensPrompt(prompt_token_ids=list(range(10 + i, 42 + i))) for i in range(prompts)]
    llm.generate(requests[:2], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"tokens_per_second": produced / seconds, "tokens": produced, "seconds": seconds}


# ---------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--soak-syncs", type=int, help="syncs of the soak (default: 600 on a GPU, 20 on a CPU)")
    parser.add_argument("--out", default="gpu_check_results", help="folder for one JSON file per section")
    args = parser.parse_args()

    gpu = torch.cuda.is_available()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = WIDE if gpu else SMALL
    environment = {"device": torch.cuda.get_device_name(0) if gpu else "CPU", "torch": torch.__version__,
                   "cuda": torch.version.cuda, "shape": shape, "sections": args.sections,
                   # 2.29.7 or later: an engine with generator.batch_invariant can unpin its NCCL settings for
                   # the weight group (rayrep.generator.vllm_internals.shared_nccl_environment)
                   "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpu else None}
    (out / "environment.json").write_text(json.dumps(environment, indent=2))
    print(f"device: {environment['device']}; torch {torch.__version__}; out {out}/", flush=True)
    scale = ({"rlep_prompt": 1024, "rlep_longest": 4096, "exgrpo_prompt": 1024, "exgrpo_longest": 9216,
              "exgrpo_tokens": 18432} if gpu else
             {"rlep_prompt": 16, "rlep_longest": 64, "exgrpo_prompt": 16, "exgrpo_longest": 96, "exgrpo_tokens": 192})
    needs_policies = {"order", "learner_memory", "timeline", "generation"} & set(args.sections)
    with tempfile.TemporaryDirectory() as folder:
        dirs, configs = {}, {}
        if needs_policies:
            for layers in (2, 4):
                start = time.perf_counter()
                dirs[layers], configs[layers] = build_policy(Path(folder) / f"layers-{layers}", shape, layers, device)
                print(f"policy: Qwen2-shaped, {layers} layers, random weights ({time.perf_counter() - start:.0f} s)",
                      flush=True)
        runs = {
            "order": lambda: order_check(dirs[2], configs[2], device),
            "learner_memory": lambda: learner_memory_check(dirs, configs, device, scale),
            "timeline": lambda: timeline_check(dirs[2], configs[2], device, 1.0 if gpu else 2**-10),
            "host_memory": lambda: host_memory_check(gpu),
            "soak": lambda: soak_check(device, seven_b_manifest(shape, 28 if gpu else 2, 64 if gpu else 0.01),
                                       args.soak_syncs or (600 if gpu else 20)),
            "handoff": lambda: handoff_check(device, (2 * GIB) if gpu else 8 * 2**20, (256 if gpu else 1) * 2**20,
                                             repeats=3),
            "logprobs": lambda: logprob_check(device, shape["vocab_size"], [4096, 9216] if gpu else [64, 256],
                                              chunk_tokens=1024 if gpu else 32),
            "generation": lambda: generation_check(dirs[2], "bfloat16", 256 if gpu else 4, 512 if gpu else 16),
        }
        for name in args.sections:
            start = time.perf_counter()
            try:
                figures = runs[name]()
            except Exception as error:  # noqa: BLE001 - a failed section is recorded; the next ones still run
                figures = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-4000:]}
            figures["section_seconds"] = time.perf_counter() - start
            (out / f"{name}.json").write_text(json.dumps(figures, indent=2, default=str))
            shown = {k: v for k, v in figures.items() if k not in ("traceback", "transitions")}
            print(f"{name}: {json.dumps(shown, default=str)[:3000]}", flush=True)
            synchronize(device)
            if gpu:
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
