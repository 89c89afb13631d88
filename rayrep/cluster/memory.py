"""The memory plan of a GPU run, as a timeline, and the ledger that holds a run to it.

The plan: what each GPU holds in each phase of the run, per holder (a learner rank, an
engine worker) and part, estimated before anything starts from the config and the policy's
shape; a plan that cannot fit is refused with its numbers (`check_memory`), and `--dry-run`
prints it (`MemoryPlan.describe`), with the host memory each node needs.

Per GPU, in bytes (P parameters, W learner ranks, T tokens of one micro-batch:
`learner.micro_batch_size` rows of the longest sequence, or with `learner.micro_batch_tokens`
at most that many padded tokens, one row at least; `c` the compute dtype's bytes):

- learner, FSDP2: parameters (the fp32 master shard) 4P/W, optimizer state (AdamW's two
  moments) 8P/W; an update adds the fp32 gradient shard 4P/W, the layers gathered in the
  compute dtype (the root's embedding and head, and two layers: the one computing and the
  one prefetched), the activations of one micro-batch (each layer's input with gradient
  checkpointing, else all of each layer's, plus one layer's during its backward), the logits
  and their gradient (2Tc per vocabulary entry) and the fp32 working set of the log-prob
  chunks (four vocabulary-wide fp32 copies of `learner.logit_chunk_tokens` tokens:
  rayrep/learner/logprobs.py). ExGRPO's entropy pass (no graph) holds one layer's
  activations and one copy of the logits instead. A sync gathers each tensor whole in the
  compute dtype and packs the buckets into two send buffers of the largest bucket.
- learner, DeepSpeed ZeRO-2: the whole compute-dtype model and the fp32 master partition,
  moment and gradient partitions, the same activations; its state never leaves the GPU.
- learner with LoRA (`learner.lora_rank`, A adapter parameters): the frozen base in the
  compute dtype (FSDP2: its shard, Pc/W), the adapter's fp32 masters, moments and gradients
  (4A, 8A, 4A over W); a sync gathers and sends the adapter alone, an engine holds a slot for
  one adapter of vLLM's size beside its weights and receives a bucket at a time. The
  activations are counted as without the adapter (its inputs of rank r per projection add
  about r / (16 H + 6 I) of a layer's).
- learner with a KL penalty (`learner.kl.coef`): the reference policy in the compute dtype,
  sharded as the parameters are (FSDP2 Pc/W, DeepSpeed Pc); with LoRA nothing (the base with
  the adapter off). It comes to the GPU with the optimizer state and leaves with it (with
  DeepSpeed too, whose own state stays); its pass
  (no graph, before the update) holds less than the update.
- engine (vLLM): `generator.gpu_memory_utilization` of the GPU awake: its weights (split over
  the tensor-parallel group), its runtime, the KV cache in the rest. Asleep it holds nothing
  the plan counts: every sleep copies its runtime pools to host memory, and any wake (the
  weights' for a sync too) maps them back. Receiving weights it holds a copy of the tensors of a layer (the loader keeps them
  until the layer is whole) and the layer vLLM materialises to load them: about twice the
  largest of a layer and the largest tensor, and a bucket in flight.

Colocated, a learner rank and an engine worker share each GPU and take turns; the timeline
(`timeline`) is the order the runtime takes them in, and each phase says what each holder
may hold then. Disaggregated, each role has GPUs of its own. `RESERVED_BYTES` per GPU come on
top (CUDA contexts, NCCL buffers, fragmentation).

The ledger (`DeviceLedger`): in a running run, the processes' residencies
(`rayrep.cluster.residency`) report what they held at each transition, and the ledger sums
them per GPU: no GPU may go over its size, and no holder beyond its phase's plan (within
`TOLERANCE`). On GPUs the device's measured use at the phase's peak (sampled by each process
that drives a GPU before it releases memory: `Residency.sample_device`) is held to the
phase's plan for that GPU the same way: the model alone could never breach a plan made of
the same figures. A CPU run that emulates GPUs (`placement.emulate_gpus`) stops at the first
breach; a GPU run logs it, once per phase and holder, and records the figures in the step's
record.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from rayrep.cluster.placement import generator_count, weight_transport
from rayrep.cluster.residency import Holding
from rayrep.config import Config, InputError

logger = logging.getLogger(__name__)

GIB = 2**30
RESERVED_BYTES = 3 * GIB
"""CUDA contexts, NCCL buffers and the allocator's fragmentation, per GPU."""
ENGINE_RUNTIME_BYTES = 1 * GIB
"""An awake vLLM engine's runtime beside its weights and KV cache: the pools vLLM 0.32 tags
"runtime" and "cudagraph" (which every sleep, at level 1 or 2, copies to pinned host memory
and any wake maps back, whichever tags it names) and its workspace; an estimate, not measured."""
TOLERANCE = 0.10
"""How far a holder's measured peak may go past its phase's plan before the ledger calls it a breach."""

LEARNER, ENGINE = "learner", "engine"
"""The holders of GPU memory: a learner rank, an engine worker (one per GPU of an engine)."""

# The parts, as the plan and the holders (rayrep.learner.worker, rayrep.generator.worker,
# rayrep.sync.transport) name them.
PARAMETERS = "parameters"
OPTIMIZER = "optimizer state"
REFERENCE = "reference policy"
GRADIENTS = "gradients"
GATHERED = "gathered layers"
ACTIVATIONS = "activations"
LOGITS = "logits and their gradient"
LOGPROB_CHUNK = "fp32 log-prob chunk"
PASS_ACTIVATIONS = "activations of a pass without a graph"
PASS_LOGITS = "logits of a pass without a graph"
WHOLE_TENSOR = "tensor gathered whole"
MASTER_GATHERED = "fp32 master gathered whole"
SEND_BUFFERS = "send buffers"
WEIGHTS = "weights"
KV_CACHE = "KV cache"
ENGINE_RUNTIME = "engine runtime"
RECEIVED = "received tensors"

LEARNER_STATE = (PARAMETERS, REFERENCE, OPTIMIZER)
UPDATE = (GRADIENTS, GATHERED, ACTIVATIONS, LOGITS, LOGPROB_CHUNK)
"""What an update allocates for itself (the old log-prob pass inside it holds less)."""
FORWARD_PASS = (GATHERED, PASS_ACTIVATIONS, PASS_LOGITS, LOGPROB_CHUNK)
"""What a pass without a graph allocates (ExGRPO's entropy pass)."""
ENGINE_AWAKE = (WEIGHTS, KV_CACHE, ENGINE_RUNTIME)

KNOWN_SHAPES: dict[str, dict] = {
    # From the model's published config.json, for dry runs on machines without the weights.
    "Qwen/Qwen2.5-Math-7B": dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False, max_position_embeddings=4096,
        torch_dtype="bfloat16",
    ),
}


STORED_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per weight of a checkpoint's `torch_dtype`."""


@dataclass(frozen=True)
class ModelShape:
    """What the estimates need of a decoder-only (Qwen2 / Llama-shaped) policy."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    tie_word_embeddings: bool
    checkpoint_bytes: int = 4
    """Bytes of one weight as the checkpoint stores them (its `torch_dtype`): what the learners load."""

    @classmethod
    def of(cls, config) -> "ModelShape":
        """From a transformers config or a dict of the same fields."""
        get = config.get if isinstance(config, dict) else lambda name, default=None: getattr(config, name, default)
        return cls(
            vocab_size=get("vocab_size"), hidden_size=get("hidden_size"), intermediate_size=get("intermediate_size"),
            num_hidden_layers=get("num_hidden_layers"), num_attention_heads=get("num_attention_heads"),
            num_key_value_heads=get("num_key_value_heads") or get("num_attention_heads"),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            checkpoint_bytes=STORED_BYTES.get(str(get("torch_dtype") or get("dtype") or "float32").removeprefix("torch."), 4),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def layer_parameters(self) -> int:
        return sum(math.prod(shape) for shape in self.layer_tensors())

    def layer_tensors(self) -> list[tuple[int, ...]]:
        """The shapes of one decoder layer's parameters as transformers holds them: q (and its
        bias), k and v (and theirs), o, gate, up, down, two norms."""
        h, kv, inter = self.hidden_size, self.num_key_value_heads * self.head_dim, self.intermediate_size
        return [(h, h), (h,), (kv, h), (kv,), (kv, h), (kv,), (h, h), (inter, h), (inter, h), (h, inter), (h,), (h,)]

    def projections(self) -> dict[str, tuple[int, int]]:
        """Each projection of a layer that a LoRA adapter may target: (in, out) features."""
        h, kv, inter = self.hidden_size, self.num_key_value_heads * self.head_dim, self.intermediate_size
        return {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
                "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}

    @property
    def parameters(self) -> int:
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_hidden_layers * self.layer_parameters + self.hidden_size

    @property
    def largest_tensor(self) -> int:
        """Elements of the largest weight: the embedding (or the head) or an MLP projection."""
        return max(self.vocab_size * self.hidden_size, self.intermediate_size * self.hidden_size)

    def adapter_parameters(self, rank: int, targets: Iterable[str]) -> int:
        """Elements of a LoRA adapter of `rank` on the `targets` projections of every layer
        (A: rank x in, B: out x rank); a name no layer has adds nothing."""
        return sum(self.adapter_tensors(rank, targets))

    def largest_adapter_tensor(self, rank: int) -> int:
        """Elements of a LoRA adapter's largest tensor (an MLP projection's A or B)."""
        return rank * max(self.hidden_size, self.intermediate_size)

    def learner_tensors(self) -> list[tuple[int, ...]]:
        """The shapes of the parameters as transformers holds them (q, k, v, o, gate, up and down
        apart), the tied head once."""
        h = self.hidden_size
        head = [] if self.tie_word_embeddings else [(self.vocab_size, h)]
        return [(self.vocab_size, h), *self.layer_tensors() * self.num_hidden_layers, (h,), *head]

    def engine_tensors(self, tensor_parallel: int) -> list[int]:
        """Elements of each weight of one tensor-parallel rank of a vLLM engine (q, k and v fused,
        gate and up fused, the vocabulary split over the ranks)."""
        h, kv, inter, tp = self.hidden_size, self.num_key_value_heads * self.head_dim, self.intermediate_size, tensor_parallel
        layer = [(h + 2 * kv) // tp * h, (h + 2 * kv) // tp, h * h // tp, 2 * inter // tp * h, h * inter // tp, h, h]
        vocab = -(-self.vocab_size // tp) * h
        return [vocab, *layer * self.num_hidden_layers, h, *([] if self.tie_word_embeddings else [vocab])]

    def adapter_tensors(self, rank: int, targets: Iterable[str]) -> list[int]:
        """Elements of each tensor of a LoRA adapter of `rank` on the `targets` projections (A and B
        of each, in every layer)."""
        shapes = self.projections()
        return [rank * side for t in sorted(set(targets)) if t in shapes for side in shapes[t]] * self.num_hidden_layers

    def kv_bytes_per_token(self, itemsize: int) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * itemsize


# ---------------------------------------------------------------------------- the plan


class RunPhase(StrEnum):
    """The phases of a run, one name each for the memory plan's timeline, the transitions the
    runtime reports to the ledger (`rayrep.roles.system`) and the metrics named after them
    (`metric`)."""

    LEARNER_SET_UP = "learner set-up"
    ENGINE_START_UP = "engine start-up"
    RESUME = "resume"
    GENERATE = "generate"
    HAND_OVER = "hand-over"
    UPDATE = "update"
    SYNC = "sync"
    REPLACEMENT = "replacement"
    SAVE = "save"

    @property
    def metric(self) -> str:
        """The prefix of the phase's memory figures: `memory_hand_over` and so on."""
        return "memory_" + self.value.replace(" ", "_").replace("-", "_")


@dataclass(frozen=True)
class Phase:
    """One phase of the run's timeline: what each holder may hold on one GPU then, by part."""

    name: RunPhase
    what: str
    held: dict[str, dict[str, int]]
    """Holder (`LEARNER`, `ENGINE`) -> part -> bytes on one GPU."""

    def holds(self, holder: str) -> int:
        return sum(self.held.get(holder, {}).values())


@dataclass(frozen=True)
class MemoryPlan:
    """The run's GPUs through its phases, and whether they fit."""

    capacity: int
    sizes: dict[str, dict[str, int]]
    """Holder -> each part's bytes on one GPU."""
    phases: tuple[Phase, ...]
    gpus: tuple[tuple[str, ...], ...]
    """The kinds of GPU, each as the holders that share one: colocated, a learner rank and an
    engine worker; disaggregated, a learner's GPUs and an engine's; sampling, an engine's."""
    colocated: bool
    trains: bool
    transport: str
    longest_sequence: int
    kv_cache_tokens: int
    host: dict[str, tuple[int, str]] = field(default_factory=dict)
    """Host memory per node at the moments that need most of it: bytes and what holds them."""
    host_capacity: int = 0
    """Host memory of one node (`placement.host_memory_gb`), in bytes; 0: not checked."""
    sync_bytes: int = 0
    """What one weight sync sends: the policy in the compute dtype, or a LoRA run's adapter."""

    def phase(self, name: RunPhase) -> Phase:
        for phase in self.phases:
            if phase.name == name:
                return phase
        raise KeyError(f"the memory plan has no phase {name!r}: {[p.name for p in self.phases]}")

    def per_gpu(self, phase: Phase) -> int:
        """The phase's bytes on its fullest GPU, `RESERVED_BYTES` included."""
        return max(sum(phase.holds(h) for h in kind) for kind in self.gpus) + RESERVED_BYTES

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=self.per_gpu)

    def problems(self) -> list[str]:
        found = [f"the {phase.name} phase needs {self.per_gpu(phase) / GIB:.1f} GiB per GPU, more than the "
                 f"{self.capacity / GIB:.0f} GiB of placement.gpu_memory_gib"
                 for phase in self.phases if self.per_gpu(phase) > self.capacity]
        if self.kv_cache_tokens < self.longest_sequence:
            found.append(f"vLLM's KV cache holds {self.kv_cache_tokens} tokens, less than one sequence of "
                         f"{self.longest_sequence}")
        found += [f"host memory: {moment} needs {value / 1e9:.1f} GB per node, more than the "
                  f"{self.host_capacity / 1e9:.0f} GB of placement.host_memory_gb (set it to the nodes' own; else "
                  f"fewer learner ranks per node, placement.gpus_per_node, or LoRA, learner.lora_rank)"
                  for moment, (value, _) in self.host.items() if self.host_capacity and value > self.host_capacity]
        return found

    def describe(self) -> str:
        if not self.trains:
            how = "sampling only: each GPU an engine's"
        elif self.colocated:
            how = "colocated: a learner rank and an engine worker on each GPU, taking turns"
        else:
            how = "disaggregated: learners and engines on GPUs of their own"
        lines = [f"memory plan per GPU ({self.capacity / GIB:.0f} GiB; {how}; GiB), phase by phase:"]
        width = max(len(p.name) for p in self.phases)
        for phase in self.phases:
            holders = []
            for kind in self.gpus:
                for holder in kind:
                    parts = phase.held.get(holder, {})
                    inside = ", ".join(f"{name} {value / GIB:.2f}" for name, value in parts.items() if value)
                    label = holder if len(self.gpus) == 1 else f"{holder} GPU"
                    holders.append(f"{label} {phase.holds(holder) / GIB:.2f}" + (f" ({inside})" if inside else ""))
            lines.append(f"  {phase.name:<{width}} {self.per_gpu(phase) / GIB:5.1f}  {'; '.join(holders)}")
            lines.append(f"  {'':<{width}}        {phase.what}")
        travel = (f"a sync sends {self.sync_bytes / 1e9:.3g} GB by {self.transport}; " if self.transport else "")
        lines.append(f"  (each GPU also keeps {RESERVED_BYTES / GIB:.2f} for CUDA contexts, NCCL and fragmentation; "
                     f"{travel}an engine's KV cache holds {self.kv_cache_tokens:,} tokens: "
                     f"{self.kv_cache_tokens // max(1, self.longest_sequence):,} sequences of {self.longest_sequence:,})")
        if self.host:
            lines.append("host memory per node: " + "; ".join(
                f"{moment} {value / 1e9:.1f} GB ({what})" for moment, (value, what) in self.host.items()))
        problems = self.problems()
        lines.append(f"  peak {self.per_gpu(self.peak) / GIB:.1f} GiB per GPU ({self.peak.name}): "
                     + ("does not fit: " + "; ".join(problems) if problems else "fits"))
        return "\n".join(lines)


def compute_bytes(cfg: Config) -> int:
    """Bytes of one value in the compute dtype (`model.dtype`): weights, KV cache, activations."""
    return 2 if cfg.model.dtype == "bfloat16" else 4


def trained_parameters(cfg: Config, shape: ModelShape) -> int:
    """The parameters that train (fp32 masters, AdamW moments, gradients) and that a weight
    sync sends: every one, or a LoRA run's adapter's (`learner.lora_rank`)."""
    learner = cfg.learner
    return shape.adapter_parameters(learner.lora_rank, learner.lora_target_modules) if learner.lora_rank \
        else shape.parameters


def part_sizes(cfg: Config, shape: ModelShape) -> dict[str, dict[str, int]]:
    """Each holder's parts, in bytes on one GPU (see the module's docstring)."""
    from rayrep.models.adapter import vllm_max_lora_rank

    learner, gen, place = cfg.learner, cfg.generator, cfg.placement
    c = compute_bytes(cfg)
    P, W, H, L, V = shape.parameters, learner.num_workers, shape.hidden_size, shape.num_hidden_layers, shape.vocab_size
    lora, T = learner.lora_rank, trained_parameters(cfg, shape)
    frozen = P * c if lora else 0  # a LoRA run's base, frozen in the compute dtype
    sequence = cfg.data.max_prompt_tokens + gen.max_response_tokens
    tokens = learner.micro_batch_size * sequence
    if learner.micro_batch_tokens:  # passes of rows of like length, at most this many padded tokens (one row at least)
        tokens = min(tokens, max(sequence, learner.micro_batch_tokens))
    per_layer = tokens * (16 * H + 6 * shape.intermediate_size) * c
    embeddings = V * H * (1 if shape.tie_word_embeddings else 2)
    bucket = int(cfg.sync.bucket_mb * 2**20)
    largest = shape.largest_adapter_tensor(lora) if lora else shape.largest_tensor  # of what a sync sends
    # Buckets of at most `bucket` bytes, a bigger tensor alone; an adapter smaller than one bucket fills one.
    largest_bucket = min(bucket, T * c) if lora else max(bucket, largest * c)
    fsdp = learner.sharding.shards_parameters
    learner_parts = {
        PARAMETERS: (frozen // W if fsdp else P * c) + 4 * T // W,  # DeepSpeed: the whole compute-dtype model too
        OPTIMIZER: 8 * T // W,
        # The KL's reference policy in the compute dtype, sharded as the parameters are (LoRA:
        # the base with the adapter off, nothing more).
        REFERENCE: (P * c // W if fsdp else P * c) if learner.kl.coef and not lora else 0,
        GRADIENTS: 4 * T // W,
        GATHERED: (embeddings + 2 * shape.layer_parameters) * c if fsdp else 0,
        ACTIVATIONS: L * tokens * H * c + per_layer if learner.gradient_checkpointing else L * per_layer,
        LOGITS: 2 * tokens * V * c,  # the model's output and, in backward, its gradient
        LOGPROB_CHUNK: 4 * min(tokens, learner.logit_chunk_tokens) * V * 4,
        PASS_ACTIVATIONS: per_layer,
        PASS_LOGITS: tokens * V * c,
        # A sync: FSDP2 casts each rank's shard to the compute dtype, then gathers it; DeepSpeed
        # sends its whole bf16 weights as they are, or in fp32 gathers the master.
        WHOLE_TENSOR: largest * c if fsdp or c == 4 else 0,
        SEND_BUFFERS: 2 * largest_bucket,
        # A checkpoint: DeepSpeed gathers each fp32 master whole on the GPU (then casts it);
        # FSDP2 casts its shards in host memory.
        MASTER_GATHERED: 0 if fsdp else largest * (4 + c),
    }
    budget = int(gen.gpu_memory_utilization * place.gpu_memory_gib * GIB)
    # With LoRA, vLLM's slot for one adapter of its rank size on every projection (max_loras 1), beside the base.
    slot = shape.adapter_parameters(vllm_max_lora_rank(lora), learner.lora_target_modules) * c if lora else 0
    weights = (P * c + slot) // gen.tensor_parallel_size
    engine_parts = {
        WEIGHTS: weights,
        ENGINE_RUNTIME: ENGINE_RUNTIME_BYTES,
        KV_CACHE: max(0, budget - weights - ENGINE_RUNTIME_BYTES),
        # Full weights: a layer's tensors held by the loader and the layer it materialises, and a
        # bucket in flight; an adapter: a bucket at a time (the worker copies each to host memory).
        RECEIVED: largest_bucket if lora else 2 * max(shape.largest_tensor, shape.layer_parameters) * c + bucket,
    }
    return {LEARNER: learner_parts, ENGINE: engine_parts}


def timeline(cfg: Config, sizes: dict[str, dict[str, int]], trains: bool = True) -> tuple[Phase, ...]:
    """The run's phases in the order the runtime takes them (`rayrep.roles.system`), each
    with what each holder may hold on one GPU then."""
    learner, engine = sizes[LEARNER], sizes[ENGINE]

    def of(holder: dict[str, int], *parts: str) -> dict[str, int]:
        return {part: holder[part] for part in parts}

    awake = of(engine, *ENGINE_AWAKE)
    if not trains:
        return (Phase(RunPhase.ENGINE_START_UP, "the engines load the policy and take their share of the GPU",
                      {ENGINE: awake}),
                Phase(RunPhase.GENERATE, "the engines sample", {ENGINE: awake}))
    state = of(learner, *LEARNER_STATE)
    update = {**state, **of(learner, *UPDATE)}
    send = of(learner, WHOLE_TENSOR, SEND_BUFFERS)
    receiving = {**of(engine, WEIGHTS, ENGINE_RUNTIME, RECEIVED)}
    # DeepSpeed's state never leaves the GPU (the KL's reference policy, our own module, does).
    resident = {} if cfg.learner.sharding.state_moves else of(learner, PARAMETERS, OPTIMIZER)
    saving = {**resident, **of(learner, MASTER_GATHERED)} if resident else {}
    set_up = {**(resident or of(learner, PARAMETERS)), **of(learner, REFERENCE)}
    if cfg.placement.mode != "colocated":
        # A learner's GPU is its own: its allocator keeps the update's peak from one update to the next.
        kept = max(update, {**state, **send}, key=lambda parts: sum(parts.values()))
        return (
            Phase(RunPhase.LEARNER_SET_UP, "the learners load the policy and keep their shards on their GPUs",
                  {LEARNER: set_up}),
            Phase(RunPhase.ENGINE_START_UP, "the engines load the policy on GPUs of their own",
                  {LEARNER: state, ENGINE: awake}),
            Phase(RunPhase.RESUME, "a resumed run's learners load their checkpoint", {LEARNER: state, ENGINE: awake}),
            Phase(RunPhase.UPDATE, "the learners train (ExGRPO's entropy pass and the KL's reference pass first); the engines may sample ahead",
                  {LEARNER: update, ENGINE: awake}),
            Phase(RunPhase.SYNC, "each tensor gathered whole and broadcast (in the room the update's peak left in the "
                  "learner's allocator); the engines load it beside their KV cache",
                  {LEARNER: kept, ENGINE: {**awake, RECEIVED: engine[RECEIVED]}}),
            Phase(RunPhase.REPLACEMENT, "a generator that died starts again, then a sync reaches it",
                  {LEARNER: kept, ENGINE: awake}),
            Phase(RunPhase.SAVE, "a checkpoint: the policy gathered (DeepSpeed: each fp32 master whole, on the GPU), "
                  "the learners' shards written", {LEARNER: kept, ENGINE: awake}),
        )
    asleep: dict[str, int] = {}  # (a sleeping engine's pools are all in host memory or dropped: see ENGINE_RUNTIME_BYTES)
    return (
        Phase(RunPhase.LEARNER_SET_UP, "each learner rank loads the policy in host memory and keeps its shard on its GPU, "
              "then moves it to host memory; the engines start after", {LEARNER: set_up}),
        Phase(RunPhase.ENGINE_START_UP, "the engines load the policy and take their share of the GPU "
              "(generator.gpu_memory_utilization)", {LEARNER: resident, ENGINE: awake}),
        Phase(RunPhase.RESUME, "a resumed run's learners load their checkpoint into host memory beside the awake engines",
              {LEARNER: resident, ENGINE: awake}),
        Phase(RunPhase.GENERATE, "the engines sample (rollouts, evaluations); the learners' state is in host memory",
              {LEARNER: resident, ENGINE: awake}),
        Phase(RunPhase.HAND_OVER, "the engines sleep (level 2: weights and KV cache dropped; with LoRA level 1, the "
              "weights kept in host memory); the learners' state comes back", {LEARNER: state, ENGINE: asleep}),
        Phase(RunPhase.UPDATE, "the learners train (ExGRPO's entropy pass and the KL's reference pass first), then release the allocator's cache",
              {LEARNER: update, ENGINE: asleep}),
        Phase(RunPhase.SYNC, "the optimizer state leaves; each tensor is gathered whole and handed over in buckets; the "
              "engines wake their weights and load them; then the parameters leave and the KV cache wakes",
              {LEARNER: {**(resident or of(learner, PARAMETERS)), **send}, ENGINE: receiving}),
        Phase(RunPhase.REPLACEMENT, "a generator that died starts again (awake) while the learners' state is in host "
              "memory; it sleeps, and a sync reaches it", {LEARNER: resident, ENGINE: awake}),
        Phase(RunPhase.SAVE, "a checkpoint, beside the awake engines: FSDP2 casts its shards in host memory; DeepSpeed "
              "gathers each fp32 master whole on the GPU", {LEARNER: saving, ENGINE: awake}),
    )


MIB = 2**20


def cuda_segments(requests: Iterable[int]) -> list[int]:
    """The segments torch's CUDA caching allocator maps for `requests` (bytes; expandable
    segments off, as vLLM's sleep mode has them): a request of 10 MiB or more gets a segment of
    its own rounded up to 2 MiB; those of 1 to 10 MiB share 20 MiB segments, smaller ones 2 MiB
    segments (counted as packed full)."""
    requests = list(requests)
    mid = sum(n for n in requests if MIB <= n < 10 * MIB)
    small = sum(n for n in requests if n < MIB)
    return ([-(-n // (2 * MIB)) * 2 * MIB for n in requests if n >= 10 * MIB]
            + [20 * MIB] * -(-mid // (20 * MIB)) + [2 * MIB] * -(-small // (2 * MIB)))


def pinned_block_bytes(nbytes: int) -> int:
    """What torch's caching host allocator takes for a pinned request of `nbytes`: the next power
    of two (`ATen/core/CachingHostAllocator.h`; `pinned_max_round_threshold_mb` of
    `PYTORCH_ALLOC_CONF` unset, as rayrep leaves it), a block it keeps for reuse once freed."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def engine_host_backup(cfg: Config, shape: ModelShape) -> int:
    """The pinned host memory one sleeping engine worker copies its GPU memory to, as torch's host
    allocator rounds it (vLLM's `cumem.py`: one `torch.empty(..., pin_memory=True)` per segment), and
    keeps once the engine wakes: its runtime pools at either sleep level (an estimate:
    `ENGINE_RUNTIME_BYTES`) and, at level 1 (a LoRA run), each segment of its weights and of
    its adapter slot."""
    weights = engine_weight_segments(cfg, shape) if cfg.learner.lora_rank else []
    return pinned_block_bytes(ENGINE_RUNTIME_BYTES) + sum(pinned_block_bytes(segment) for segment in weights)


def engine_weight_segments(cfg: Config, shape: ModelShape) -> list[int]:
    """The CUDA segments (bytes) of one engine worker's weights and, in a LoRA run, its adapter
    slot: what vLLM's level-1 sleep copies to host memory, one pinned block each."""
    from rayrep.models.adapter import vllm_max_lora_rank

    c, tp, lora = compute_bytes(cfg), cfg.generator.tensor_parallel_size, cfg.learner.lora_rank
    slot = shape.adapter_tensors(vllm_max_lora_rank(lora), cfg.learner.lora_target_modules) if lora else []
    return cuda_segments([n * c for n in shape.engine_tensors(tp)] + [n * c // tp for n in slot])


def learner_host_state(cfg: Config, shape: ModelShape) -> tuple[int, int]:
    """(pageable, pinned) host bytes of one learner rank's state while the engines have the GPU
    (FSDP2): its parameter shards (and the reference's), moved with `.to()`, and its AdamW
    moments, moved with `non_blocking=True`, which makes them pinned blocks of torch's host
    allocator (one per moment of each shard, rounded, and kept)."""
    learner, W, c, P = cfg.learner, cfg.learner.num_workers, compute_bytes(cfg), shape.parameters
    if learner.lora_rank:
        trained = [(n,) for n in shape.adapter_tensors(learner.lora_rank, learner.lora_target_modules)]
        pageable = (P * c + 4 * trained_parameters(cfg, shape)) // W
    else:
        trained = shape.learner_tensors()
        pageable = 4 * P // W + (P * c // W if learner.kl.coef else 0)
    # FSDP2 shards each tensor's first dimension in W chunks of ceil(rows / W) rows.
    shards = [-(-rows // W) * math.prod(rest) for rows, *rest in trained]
    return pageable, sum(2 * pinned_block_bytes(4 * n) for n in shards)


def host_memory(cfg: Config, shape: ModelShape, trains: bool) -> dict[str, tuple[int, str]]:
    """Host memory per node at the moments that need most of it (learner set-up, training),
    pinned blocks as torch's host allocator rounds and keeps them."""
    if not trains:
        return {}
    place, W = cfg.placement, cfg.learner.num_workers
    ranks = min(W, place.gpus_per_node) if place.device == "gpu" else W
    P, lora, c = shape.parameters, cfg.learner.lora_rank, compute_bytes(cfg)
    # The KL's reference policy (not with LoRA): loaded whole in the compute dtype, then sharded.
    reference = P * c if cfg.learner.kl.coef and not lora else 0
    if lora:  # the frozen base, loaded in the compute dtype, and this rank's shard of it
        loading, how = P * c * (W + 1) // W, f"in {cfg.model.dtype}"
    elif cfg.learner.sharding.shards_parameters:
        # The policy in the checkpoint's dtype, this rank's fp32 shards, and the one layer being upcast.
        stored = shape.checkpoint_bytes
        loading = P * stored + 4 * P // W + (4 * shape.layer_parameters if stored != 4 else 0)
        how = f"in its checkpoint's {8 * stored}-bit weights, its fp32 shards made a layer at a time"
    else:  # DeepSpeed: the whole policy upcast, and its fp32 partition
        loading, how = 4 * P * (W + 1) // W, "upcast to fp32 whole"
    loading += reference * (W + 1) // W
    host = {RunPhase.LEARNER_SET_UP: (ranks * loading, f"{ranks} learner rank(s), each loading the policy {how}"
                                                       f"{' and its reference' if reference else ''}: "
                                                       f"{loading / 1e9:.1f} GB")}
    if not place.takes_turns:
        return host
    engines = engine_host_backup(cfg, shape)
    pageable = pinned = 0
    if cfg.learner.sharding.state_moves:
        pageable, pinned = learner_host_state(cfg, shape)
    elif reference:  # DeepSpeed's state stays on the GPU; the reference leaves it
        pageable = reference
    each = pageable + pinned + engines
    host["training"] = (ranks * each, f"the engines' turn, {ranks} GPU(s): each learner rank's state "
                                      f"{(pageable + pinned) / 1e9:.1f} GB (its optimizer's moments pinned: "
                                      f"{pinned / 1e9:.1f} GB as torch rounds them) and each sleeping engine's "
                                      f"pinned backup, which torch keeps once it wakes ({engines / 1e9:.1f} GB: its "
                                      f"runtime{', its weights and adapter slot at sleep level 1' if lora else ''})")
    return host


def estimate(cfg: Config, shape: ModelShape, trains: bool = True, sequence: int | None = None) -> MemoryPlan:
    """The plan of `cfg` for a policy of `shape`; `sequence`: the longest sequence an engine
    must hold (default: the longest prompt and answer; a server: its context)."""
    gen, place = cfg.generator, cfg.placement
    c = compute_bytes(cfg)
    sizes = part_sizes(cfg, shape)
    colocated = place.mode == "colocated"
    if not trains:
        gpus: tuple[tuple[str, ...], ...] = ((ENGINE,),)
    elif colocated:
        gpus = ((LEARNER, ENGINE),)
    else:
        gpus = ((LEARNER,), (ENGINE,))
    kv_per_token = shape.kv_bytes_per_token(c) // gen.tensor_parallel_size
    return MemoryPlan(
        capacity=int(place.gpu_memory_gib * GIB),
        sizes=sizes,
        phases=timeline(cfg, sizes, trains),
        gpus=gpus,
        colocated=colocated,
        trains=trains,
        transport=weight_transport(cfg) if trains else "",
        longest_sequence=sequence or cfg.data.max_prompt_tokens + gen.max_response_tokens,
        kv_cache_tokens=sizes[ENGINE][KV_CACHE] // max(1, kv_per_token),
        host=host_memory(cfg, shape, trains),
        host_capacity=int(place.host_memory_gb * 1e9),
        sync_bytes=trained_parameters(cfg, shape) * c,
    )


def model_shape(cfg: Config, local_only: bool = True, path: str | None = None) -> ModelShape | None:
    """The shape of the policy at `path` (default: `model.path`): the embedded tiny policy's
    recipe, the table of known models (the published shapes of those hub ids: a dry run of a
    paper preset needs no transformers, which takes seconds to import), the checkpoint's
    config.json from a folder or the local cache, or (unless `local_only`) the config.json
    fetched from the hub; None when none of them can tell."""
    path = path or cfg.model.path
    if path == "tiny":
        from rayrep.models import tiny_spec
        from rayrep.models.recipe import padded_vocab_size
        from rayrep.models.tokenizer import build_char_tokenizer

        spec = tiny_spec(cfg)
        return ModelShape(padded_vocab_size(build_char_tokenizer()), spec.hidden_size, spec.intermediate_size,
                          spec.num_layers, spec.num_heads, spec.num_kv_heads, True)
    if path in KNOWN_SHAPES:
        return ModelShape.of(KNOWN_SHAPES[path])
    from rayrep.models import read_model_config

    try:
        return ModelShape.of(read_model_config(path, local_only=True))
    except InputError:
        pass
    if local_only:
        return None
    return ModelShape.of(read_model_config(path))


def memory_plan(cfg: Config, trains: bool = True, local_only: bool = True, sequence: int | None = None,
                model_path: str | None = None) -> MemoryPlan | None:
    """The plan of a run that models its GPUs (a GPU run, or a CPU run emulating one);
    None for other CPU runs, or when the policy's shape is unknown. `model_path`: the
    policy's folder when it is not `model.path` (a served checkpoint); `sequence`: see `estimate`."""
    if not cfg.placement.models_gpus:
        return None
    shape = model_shape(cfg, local_only, model_path)
    return estimate(cfg, shape, trains, sequence) if shape else None


def check_memory(cfg: Config, trains: bool = True) -> None:
    """Refuse, before anything starts, a GPU plan that cannot fit, with its numbers."""
    plan = memory_plan(cfg, trains, local_only=False)
    if plan is not None and plan.problems():
        raise InputError("the memory plan does not fit: " + "; ".join(plan.problems()) + "\n" + plan.describe())


# ---------------------------------------------------------------------------- the ledger


class MemoryLedgerError(RuntimeError):
    """A run's sequence put more on a GPU than it has, or more than its plan says, at a transition."""


@dataclass
class Observation:
    """One transition of the run as the ledger saw it."""

    phase: RunPhase
    gpus: dict[int, int]
    """GPU index -> the most its holders held together since the last transition (reserved included)."""
    measured: dict[int, int]
    """GPU index -> the most the device held at its processes' samples since the last
    transition (`mem_get_info`, taken before each release; GPU runs only)."""


def gib(value: float) -> str:
    """Bytes in GiB, as the plan counts them; below a hundredth of one, in MiB or KiB (a small
    policy's parts, which the emulated GPUs of the CPU tests hold)."""
    if value >= GIB / 100 or value == 0:
        return f"{value / GIB:.2f} GiB"
    return f"{value / 2**20:.2f} MiB" if value >= 2**20 / 100 else f"{value / 2**10:.2f} KiB"


class DeviceLedger:
    """Each GPU of the run as the real call sequence fills it: at every transition the runtime
    hands over what each process reported (`Holding`), and the ledger sums the processes that
    share a GPU, checks the sums against the GPU's size and each holder against its phase of
    the plan, and keeps the timeline (`observations`) and the step's figures."""

    def __init__(self, plan: MemoryPlan, gpus_of: dict[str, tuple[int, ...]], strict: bool, log=logger.warning):
        """`gpus_of`: each holder (a `Holding.owner`) -> the GPUs it holds memory on (an engine
        worker's holding is the same on each GPU of its engine). `strict`: a breach stops the
        run (`MemoryLedgerError`); else it is logged once per phase and holder."""
        self.plan, self.gpus_of, self.strict, self.log = plan, gpus_of, strict, log
        self.observations: list[Observation] = []
        self.figures: dict[str, float] = {}
        self._logged: set[tuple[str, str]] = set()

    def observe(self, phase: RunPhase, holdings: Iterable[Holding]) -> None:
        """The transition that ends `phase`: each holder's peak since the last one."""
        planned = self.plan.phase(phase)
        on_gpu: dict[int, list[Holding]] = defaultdict(list)
        breaches = []
        for holding in holdings:
            for gpu in self.gpus_of[holding.owner]:
                on_gpu[gpu].append(holding)
            allowed = planned.holds(holding.role)
            if holding.peak > allowed * (1 + TOLERANCE):
                article = "an" if holding.role[0] in "aeiou" else "a"
                plan_parts = _parts(planned.held.get(holding.role, {}))
                breaches.append((holding.owner, (
                    f"{holding.owner} held {gib(holding.peak)} ({_parts(holding.at_peak)}), and the plan gives "
                    f"{article} {holding.role} {gib(allowed)} in this phase ({plan_parts})")))
        totals = {gpu: sum(h.peak for h in held) + RESERVED_BYTES for gpu, held in on_gpu.items()}
        for gpu, total in totals.items():
            if total > self.plan.capacity:
                held = "; ".join(f"{h.owner}: {_parts(h.at_peak)}" for h in on_gpu[gpu])
                breaches.append((f"gpu {gpu}", f"GPU {gpu} held {gib(total)}, more than its {gib(self.plan.capacity)} "
                                               f"({held})"))
        # Each process that drives a GPU samples the whole device's use before it releases
        # memory: the phase's peak, measured, held to the same plan as the model's.
        measured = {gpu: max(used) for gpu, held in on_gpu.items()
                    if (used := [h.device_used for h in held if h.device_used is not None])}
        for gpu, used in measured.items():
            allowed = sum(planned.holds(role) for role in {h.role for h in on_gpu[gpu]}) + RESERVED_BYTES
            if used > allowed * (1 + TOLERANCE):
                breaches.append((f"gpu {gpu} measured", (
                    f"GPU {gpu} measured {gib(used)} in use at its peak ({', '.join(sorted(h.owner for h in on_gpu[gpu]))} "
                    f"on it), and the plan gives it {gib(allowed)} in this phase ({gib(RESERVED_BYTES)} reserved included)")))
        self.observations.append(Observation(phase, totals, measured))
        learners = [h for h in holdings if h.role == LEARNER]
        name = phase.metric
        self._keep(f"{name}_gib", max(totals.values(), default=None))
        self._keep(f"{name}_learner_gib", max((h.peak for h in learners), default=None))
        # On GPUs, the measured figures beside the model's: the learner process's reserved
        # peak (torch's), and the whole device's use at its peak.
        self._keep(f"{name}_learner_reserved_gib",
                   max((h.measured_peak for h in learners if h.measured_peak is not None), default=None))
        self._keep(f"{name}_device_gib", max(measured.values(), default=None))
        if breaches:
            message = f"device-memory ledger, {phase} phase: " + "; ".join(text for _, text in breaches)
            if self.strict:
                raise MemoryLedgerError(message)
            self.figures[f"{name}_breaches"] = self.figures.get(f"{name}_breaches", 0) + len(breaches)
            for who, text in breaches:
                if (phase, who) not in self._logged:
                    self._logged.add((phase, who))
                    self.log(f"device-memory ledger, {phase} phase: {text}")

    def _keep(self, key: str, value: int | None) -> None:
        if value is not None:
            self.figures[key] = max(self.figures.get(key, 0.0), value / GIB)

    def take_figures(self) -> dict[str, float]:
        """The most each phase held on a GPU and in a learner rank since the last call (GiB;
        GPU runs: the measured figures beside them), and the breaches logged (a count)."""
        figures, self.figures = self.figures, {}
        return figures


def _parts(parts: dict[str, int]) -> str:
    shown = [f"{name} {gib(value)}" for name, value in parts.items() if value]
    return ", ".join(shown) if shown else "nothing"


def engine_gpus(cfg: Config, engine: int) -> tuple[int, ...]:
    """The GPUs engine `engine` holds memory on, numbered as the ledger numbers them: colocated,
    the policy's bundles (learner rank j's GPU is j); disaggregated, after the learners' GPUs."""
    tp = cfg.generator.tensor_parallel_size
    first = engine * tp if cfg.placement.mode == "colocated" else cfg.learner.num_workers + engine * tp
    return tuple(range(first, first + tp))


def ledger_gpus(cfg: Config, trains: bool = True) -> dict[str, tuple[int, ...]]:
    """Each holder's GPUs (see `engine_gpus`); holders are named as their residencies name them."""
    gpus = {f"generator {e}": engine_gpus(cfg, e) for e in range(generator_count(cfg))}
    if trains:
        gpus.update({f"learner rank {r}": (r,) for r in range(cfg.learner.num_workers)})
    return gpus

