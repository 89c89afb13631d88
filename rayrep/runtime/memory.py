"""The memory plan of a GPU run: what each GPU holds while learning and while generating,
estimated before anything starts, and a plan that cannot fit refused with its numbers.

Estimates, per GPU, in bytes (P parameters, W learner ranks, T tokens of one micro-batch:
`learner.micro_batch_size` rows of the longest sequence, or with `learner.micro_batch_tokens`
at most that many padded tokens, one row at least):

- learner, FSDP2: fp32 master shard 4P/W, AdamW moments 8P/W, fp32 gradient shard 4P/W;
  the compute-dtype copies gathered at once (the root's embedding and head, and two
  layers: the one computing and the one prefetched); activations of one micro-batch:
  each layer's input (with gradient checkpointing) or all of each layer's activations,
  plus one layer's during its backward; the logits in the compute dtype and their
  gradient, and the fp32 working set of the log-prob chunks (`learner.logit_chunk_tokens`
  tokens, four vocabulary-wide fp32 copies of them: rayrep/learner/logprobs.py).
- learner, DeepSpeed ZeRO-2: the whole compute-dtype model on every rank, fp32 master,
  moment and gradient partitions, the same activations.
- generator (vLLM): `generator.gpu_memory_utilization` of the GPU, of which the weights
  (compute dtype, split over the tensor-parallel group) and the rest KV cache.
- sync: the learner's state still on the GPU (master shard, AdamW moments; the gradients
  are freed by the step), the largest tensor gathered whole (FSDP2: in the compute dtype,
  each shard cast before the gather; DeepSpeed: its fp32 master and the cast), the buckets in flight
  (two packed by the sender, two copied by the receiver) and, colocated, the engine's
  weights, woken to receive the new ones.

Colocated GPUs take turns: the learners' phase must fit beside a sleeping engine, the
generators' phase beside offloaded learners, and the sync phase holds a bit of both.
Disaggregated, each role has its own GPUs. These are estimates (allocator fragmentation, CUDA context and NCCL buffers come on top:
`RESERVED_BYTES` per GPU), meant to catch a plan that cannot work before it starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rayrep.cluster.placement import weight_transport
from rayrep.config import Config, InputError

GIB = 2**30
RESERVED_BYTES = 3 * GIB
"""CUDA context, NCCL buffers and the allocator's slack, per GPU."""
SLEEPING_ENGINE_BYTES = 1 * GIB
"""What a vLLM engine keeps on its GPU asleep (its weights and KV cache gone, at level 1 or 2)."""

KNOWN_SHAPES: dict[str, dict] = {
    # From the model's published config.json, for dry runs on machines without the weights.
    "Qwen/Qwen2.5-Math-7B": dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False, max_position_embeddings=4096,
    ),
}


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

    @classmethod
    def of(cls, config) -> "ModelShape":
        """From a transformers config or a dict of the same fields."""
        get = config.get if isinstance(config, dict) else lambda name, default=None: getattr(config, name, default)
        return cls(
            vocab_size=get("vocab_size"), hidden_size=get("hidden_size"), intermediate_size=get("intermediate_size"),
            num_hidden_layers=get("num_hidden_layers"), num_attention_heads=get("num_attention_heads"),
            num_key_value_heads=get("num_key_value_heads") or get("num_attention_heads"),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def layer_parameters(self) -> int:
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        attention = h * h + h + 2 * (h * kv + kv) + h * h  # q (bias), k and v (bias), o
        return attention + 3 * h * self.intermediate_size + 2 * h  # gate, up, down; two norms

    @property
    def parameters(self) -> int:
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_hidden_layers * self.layer_parameters + self.hidden_size

    def kv_bytes_per_token(self, itemsize: int) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * itemsize


@dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU byte counts of each phase, and whether they fit."""

    capacity: int
    learner: dict[str, int]
    """What one learner GPU holds during an update, by part."""
    generator: dict[str, int]
    """What one generator GPU holds while generating, by part."""
    colocated: bool
    longest_sequence: int
    kv_cache_tokens: int
    """Tokens the KV cache left to an engine holds."""
    resident: dict[str, int]
    """What colocated learners keep on the GPU while the engines run (DeepSpeed's state;
    FSDP2 moves its own to CPU memory)."""
    sync: dict[str, int] = field(default_factory=dict)
    """What one learner GPU holds while the weights go to the engines, by part."""
    transport: str = ""
    """How the weights travel (`rayrep.cluster.placement.weight_transport`), named in the plan."""
    trains: bool = True
    """A training run (learners and generators), not a sampling job (generators only)."""

    @property
    def learner_phase(self) -> int:
        beside = SLEEPING_ENGINE_BYTES if self.colocated else 0
        return sum(self.learner.values()) + beside + RESERVED_BYTES

    @property
    def generator_phase(self) -> int:
        return sum(self.generator.values()) + sum(self.resident.values()) + RESERVED_BYTES

    @property
    def sync_phase(self) -> int:
        beside = SLEEPING_ENGINE_BYTES if self.colocated else 0
        return sum(self.sync.values()) + beside + RESERVED_BYTES

    def problems(self) -> list[str]:
        found = []
        phases = [("learner", self.learner_phase), ("sync", self.sync_phase)] if self.trains else []
        for phase, used in phases + [("generator", self.generator_phase)]:
            if used > self.capacity:
                found.append(f"the {phase} phase needs {used / GIB:.1f} GiB per GPU, more than the "
                             f"{self.capacity / GIB:.0f} GiB of placement.gpu_memory_gib")
        if self.kv_cache_tokens < self.longest_sequence:
            found.append(f"vLLM's KV cache holds {self.kv_cache_tokens} tokens, less than one sequence of "
                         f"{self.longest_sequence}")
        return found

    def describe(self) -> str:
        def parts(items: dict[str, int]) -> str:
            return ", ".join(f"{name} {value / GIB:.2f}" for name, value in items.items())

        how = ("colocated, taking turns" if self.colocated else "disaggregated") if self.trains else "sampling only"
        lines = [f"memory plan per GPU ({self.capacity / GIB:.0f} GiB; {how}; GiB):"]
        if self.trains:
            sleeping = f", sleeping engine {SLEEPING_ENGINE_BYTES / GIB:.2f}" if self.colocated else ""
            lines += [
                f"  learner phase {self.learner_phase / GIB:.1f}: {parts(self.learner)}{sleeping}, "
                f"reserved {RESERVED_BYTES / GIB:.2f}",
                f"  sync phase {self.sync_phase / GIB:.1f} ({self.transport}): {parts(self.sync)}{sleeping}, "
                f"reserved {RESERVED_BYTES / GIB:.2f}",
            ]
        lines += [
            f"  generator phase {self.generator_phase / GIB:.1f}: {parts({**self.generator, **self.resident})}, "
            f"reserved {RESERVED_BYTES / GIB:.2f}",
            f"  (an engine's KV cache holds {self.kv_cache_tokens:,} tokens: "
            f"{self.kv_cache_tokens // max(1, self.longest_sequence):,} sequences of {self.longest_sequence:,})",
        ]
        problems = self.problems()
        lines.append("  does not fit: " + "; ".join(problems) if problems else "  fits")
        return "\n".join(lines)


def model_shape(cfg: Config, local_only: bool = True) -> ModelShape | None:
    """The policy's shape: the embedded tiny policy's recipe, the table of known models (the
    published shapes of those hub ids: a dry run of a paper preset needs no transformers,
    which takes seconds to import), the checkpoint's config.json from a folder or the local
    cache, or (unless `local_only`) the config.json fetched from the hub; None when none of
    them can tell."""
    if cfg.model.path == "tiny":
        from rayrep.models import tiny_spec
        from rayrep.models.recipe import padded_vocab_size
        from rayrep.models.tokenizer import build_char_tokenizer

        spec = tiny_spec(cfg)
        return ModelShape(padded_vocab_size(build_char_tokenizer()), spec.hidden_size, spec.intermediate_size,
                          spec.num_layers, spec.num_heads, spec.num_kv_heads, True)
    if cfg.model.path in KNOWN_SHAPES:
        return ModelShape.of(KNOWN_SHAPES[cfg.model.path])
    from rayrep.models import read_model_config

    try:
        return ModelShape.of(read_model_config(cfg.model.path, local_only=True))
    except InputError:
        pass
    if local_only:
        return None
    return ModelShape.of(read_model_config(cfg.model.path))


def estimate(cfg: Config, shape: ModelShape, trains: bool = True) -> MemoryPlan:
    learner, gen, place = cfg.learner, cfg.generator, cfg.placement
    itemsize = 2 if cfg.model.dtype == "bfloat16" else 4
    P, W, H, L = shape.parameters, learner.num_workers, shape.hidden_size, shape.num_hidden_layers
    sequence = cfg.data.max_prompt_tokens + gen.max_response_tokens
    tokens = learner.micro_batch_size * sequence
    if learner.micro_batch_tokens:  # passes of rows of like length, at most this many padded tokens (one row at least)
        tokens = min(tokens, max(sequence, learner.micro_batch_tokens))
    per_layer_activations = tokens * (16 * H + 6 * shape.intermediate_size) * itemsize
    activations = (L * tokens * H * itemsize + per_layer_activations if learner.gradient_checkpointing
                   else L * per_layer_activations)
    logits = 2 * tokens * shape.vocab_size * itemsize  # the model's output and, in backward, its gradient
    chunk = 4 * min(tokens, learner.logit_chunk_tokens) * shape.vocab_size * 4
    embeddings = shape.vocab_size * H * (1 if shape.tie_word_embeddings else 2)
    if learner.strategy == "fsdp2":
        learner_parts = {
            "fp32 master shard": 4 * P // W, "AdamW moments": 8 * P // W, "fp32 gradient shard": 4 * P // W,
            "gathered weights": (embeddings + 2 * shape.layer_parameters) * itemsize,
        }
    else:
        learner_parts = {
            "whole model": P * itemsize, "fp32 master partition": 4 * P // W, "AdamW moments": 8 * P // W,
            "fp32 gradient partition": 4 * P // W,
        }
    learner_parts.update({"activations": activations, "logits and their gradient": logits,
                          "fp32 log-prob chunk": chunk})
    budget = int(gen.gpu_memory_utilization * place.gpu_memory_gib * GIB)
    weights = P * itemsize // gen.tensor_parallel_size
    colocated = place.mode == "colocated"
    state = ("fp32 master shard", "AdamW moments", "whole model", "fp32 master partition")
    largest = max(shape.vocab_size * H, shape.intermediate_size * H)
    sync_parts = {name: learner_parts[name] for name in state if name in learner_parts}
    if learner.strategy == "fsdp2":  # each rank's shard cast to the compute dtype, then gathered
        sync_parts[f"largest tensor gathered ({cfg.model.dtype})"] = itemsize * largest
    else:  # DeepSpeed gathers the fp32 master from the optimizer's partitions, then casts it
        sync_parts["largest tensor gathered (fp32) and cast"] = (4 + itemsize) * largest
    sync_parts["buckets in flight"] = 4 * int(cfg.sync.bucket_mb * 2**20)
    if colocated:
        sync_parts["engine weights, woken"] = weights
    kv_cache = budget - weights
    kv_per_token = shape.kv_bytes_per_token(itemsize) // gen.tensor_parallel_size
    stays = colocated and trains and learner.strategy == "deepspeed"
    resident = {f"learner {name}": value for name, value in learner_parts.items()
                if stays and name not in ("activations", "logits and their gradient", "fp32 log-prob chunk")}
    return MemoryPlan(
        capacity=int(place.gpu_memory_gib * GIB),
        learner={name: int(value) for name, value in learner_parts.items()},
        generator={"vLLM weights": weights, "KV cache": max(0, kv_cache)},
        colocated=colocated,
        longest_sequence=sequence,
        kv_cache_tokens=max(0, kv_cache) // max(1, kv_per_token),
        resident={name: int(value) for name, value in resident.items()},
        sync={name: int(value) for name, value in sync_parts.items()},
        transport=weight_transport(cfg),
        trains=trains,
    )


def memory_plan(cfg: Config, trains: bool = True, local_only: bool = True) -> MemoryPlan | None:
    """The plan of a GPU run (None on CPU, or when the policy's shape is unknown)."""
    if cfg.placement.device != "gpu":
        return None
    shape = model_shape(cfg, local_only)
    return estimate(cfg, shape, trains) if shape else None


def check_memory(cfg: Config, trains: bool = True) -> None:
    """Refuse, before anything starts, a GPU plan that cannot fit, with its numbers."""
    plan = memory_plan(cfg, trains, local_only=False)
    if plan is not None and plan.problems():
        raise InputError("the memory plan does not fit: " + "; ".join(plan.problems()) + "\n" + plan.describe())
