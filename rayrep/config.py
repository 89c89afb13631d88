"""Typed configuration: one dataclass per component, validated when it is built.

Every field has a one-line doc (shown by `--help`). A Config comes from a named preset
(`rayrep/presets/<name>.toml`, shipped with the package; `tiny-cpu` by default),
optionally user TOML files, and command-line overrides of any field
(`--learner.lr 1e-6`). A wrong value fails here, before any actor starts, with the
dotted field name and the bad value.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import math
import sys
import tomllib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rayrep.types import TOKEN_SUM_AGGREGATIONS, Aggregation

DEFAULT_PRESET = "tiny-cpu"


class InputError(ValueError):
    """Bad input from the user (a config value, a file, a row in it): jobs report it in one
    line, naming the file, row, field or value, and exit with status 2."""


class ConfigError(InputError):
    """A configuration value is wrong; the message names the field and the value."""


def option(default: Any, doc: str, *, min: float | None = None, max: float | None = None):
    """A config field with its one-line doc and an optional inclusive numeric range."""
    return field(default=default, metadata={"doc": doc, "min": min, "max": max})


@dataclass
class DataConfig:
    train_files: tuple[str, ...] = option((), "prompt sets (jsonl/json/parquet; verl/DAPO rows, or plain prompt/question + answer rows) to train on; empty: the embedded arithmetic task")
    test_files: tuple[str, ...] = option((), "prompt sets to evaluate on; empty: the embedded task's test split")
    arithmetic_levels: tuple[str, ...] = option(("add2", "sub2", "mix3"), "difficulty levels of the embedded arithmetic task")
    arithmetic_train_size: int = option(20000, "train questions of the embedded task", min=1)
    arithmetic_test_size: int = option(500, "test questions of the embedded task", min=1)
    arithmetic_seed: int = option(0, "seed of the embedded task's splits (defines the task itself, not a run: left out of run.seed)")
    arithmetic_test_reserve: int = option(2000, "problems at the start of the embedded task's sequence kept for test splits (the largest test split; the tiny policy is warm-started past them)", min=1)
    max_prompt_tokens: int = option(1024, "prompts longer than this are rejected when the prompt set is loaded", min=1)
    shuffle_seed: int = option(-1, "seed of the order in which training questions are visited; -1: derived from run.seed", min=-1)


@dataclass
class ModelConfig:
    path: str = option("tiny", "Hugging Face checkpoint directory of the base policy; 'tiny': the embedded tiny policy that ships for the recipe of model.tiny_* and data.arithmetic_* (tiny-cpu's, tiny-cpu-hard's)")
    dtype: Literal["float32", "bfloat16"] = option("float32", "compute dtype of rollouts and training; the learner keeps fp32 master weights and optimizer state")
    rope_theta: float = option(0.0, "override the checkpoint's RoPE base (ExGRPO: 40000, with a longer context); 0: keep it", min=0.0)
    max_position_embeddings: int = option(0, "override the checkpoint's positions (ExGRPO: 16384); 0: keep it", min=0)
    tiny_hidden_size: int = option(128, "hidden size of the embedded tiny policy", min=32)
    tiny_layers: int = option(4, "transformer layers of the embedded tiny policy", min=1)
    tiny_warm_start_problems: int = option(20000, "train problems of the embedded task the tiny policy is warm-started on", min=1)
    tiny_warm_start_steps: int = option(1300, "supervised warm-start steps of the embedded tiny policy", min=0)
    tiny_warm_start_slips: float = option(0.4, "share of warm-start solutions with a slip in the last step, late in the warm start", min=0.0, max=1.0)
    tiny_warm_start_slip_steps: int = option(250, "the warm start's last this-many steps are the ones with slips", min=0)


@dataclass
class GeneratorConfig:
    num_workers: int = option(0, "vLLM engines; 0: one per tensor-parallel group of the policy's GPUs, so that every GPU generates", min=0)
    tensor_parallel_size: int = option(1, "GPUs per vLLM engine (1 on CPU)", min=1)
    temperature: float = option(1.0, "sampling temperature of training rollouts", min=0.0)
    top_p: float = option(1.0, "nucleus sampling of training rollouts", min=0.0, max=1.0)
    max_response_tokens: int = option(3072, "longest response a rollout may generate", min=1)
    eval_temperature: float = option(1.0, "sampling temperature of evaluation", min=0.0)
    eval_top_p: float = option(1.0, "nucleus sampling of evaluation (both papers: 1.0)", min=0.0, max=1.0)
    eval_samples: int = option(4, "answers sampled per test question in evaluation (avg@k, pass@k, maj@k)", min=1)
    eval_samples_by_source: tuple[str, ...] = option((), "benchmarks sampled another number of times, as data_source=k entries (ExGRPO: avg@32 on AIME and AMC)")
    gpu_memory_utilization: float = option(0.85, "share of GPU memory vLLM may take (GPU only)", min=0.05, max=1.0)
    cpu_kv_cache_gib: float = option(1.0, "KV-cache size of a CPU vLLM engine in GiB (CPU only)", min=0.1)
    enforce_eager: bool = option(True, "run vLLM without CUDA graphs / compilation (fast start, needed on CPU)")
    seed: int = option(-1, "base seed of the generators' sampling (worker i uses seed + i); -1: derived from run.seed", min=-1)


@dataclass
class VerifierConfig:
    num_workers: int = option(1, "verifier actors scoring completions in parallel", min=0)
    cpus_per_worker: float = option(1.0, "CPUs each verifier's bundle reserves", min=0.01)
    timeout_s: float = option(1.0, "hard wall-clock limit per completion; a slower one scores as wrong and counts as a timeout", min=0.01)
    reward_style: Literal["binary", "dapo"] = option("dapo", "binary: 1 correct / 0 wrong; dapo: +1 / -1")
    overlong_buffer: int = option(512, "DAPO overlong shaping: the penalty ramps over the last this-many tokens", min=0)
    overlong_factor: float = option(1.0, "DAPO overlong shaping: the penalty at the maximum length (0 disables shaping)", min=0.0)


@dataclass
class ReplayConfig:
    num_shards: int = option(2, "replay buffer shard actors; questions are routed by a stable hash of their id (0: in-process)", min=0)
    cpus_per_shard: float = option(0.25, "CPUs each shard's bundle reserves (shards hold memory and answer a few calls per step)", min=0.01)
    max_answers_per_question: int = option(0, "cap on stored answers per question, the oldest evicted beyond it; 0: no cap (the ExGRPO code keeps them all)", min=0)
    snapshot_every: int = option(1, "steps between snapshots of the buffer (<run>/replay/), from which a shard that dies is restored; what it was given since is lost and counted (replay_shard_lost_*): 1 loses nothing; 0: the checkpoints' snapshots only", min=0)


@dataclass
class RLEPConfig:
    pool: str = option("", "experience pool (Parquet) to replay; jobs/rlep.py fills it in from the collect stage")
    replays_per_group: int = option(2, "M: replayed successes added to each question's G fresh rollouts", min=0)
    old_logprobs: Literal["recompute", "recorded"] = option("recompute", "replayed answers' old log-probs: recompute with the current policy (ratio starts at 1) or the recorded behaviour ones")
    collect_samples: int = option(64, "answers sampled per training question when building the pool", min=2)
    collect_temperature: float = option(0.7, "sampling temperature when building the pool", min=0.0)
    collect_top_p: float = option(0.95, "nucleus sampling when building the pool", min=0.0, max=1.0)
    min_successes: int = option(2, "questions with fewer verified successes are left out of the pool", min=1)
    collect_questions: int = option(0, "pool only the first this-many training questions the run's sampler visits (0: all)", min=0)
    replay_if_at_most: int = option(-1, "adaptive replay: a question's stored successes join its group only when at most this many of its G fresh answers are correct (-1: always, the paper)", min=-1)
    grow_pool: bool = option(False, "add each step's verified fresh successes to the pool (deduplicated; replay.max_answers_per_question caps it), so that it keeps up with the policy; off: the paper's fixed pool")


@dataclass
class ExGRPOConfig:
    start_pass_rate: float = option(0.35, "replay starts once a batch's share of correct rollouts first exceeds this", min=0.0, max=1.0)
    replay_ratio: float = option(0.5, "rho: share of each batch's questions drawn from the buffer", min=0.0, max=1.0)
    bucket_sigma: Literal["code", "paper"] = option("code", "bucket weight N(k/K; 0.5, sigma): sigma = 1 in counts (the code) or in accuracy units (the paper)")
    beta: float = option(0.1, "replay shaping f(w) = w / (w + beta)", min=1e-6)
    clip_fresh_in_mixed: bool = option(False, "clip fresh tokens in the mixed phase (paper eq. 4) instead of leaving them unclipped (the code)")


@dataclass
class AlgorithmConfig:
    name: Literal["grpo", "rlep", "exgrpo"] = option("grpo", "grpo: the DAPO baseline; rlep / exgrpo: the replay methods")
    prompts_per_step: int = option(512, "questions per rollout step (B)", min=1)
    group_size: int = option(16, "fresh rollouts per question (G; K in ExGRPO)", min=2)
    std_normalize: bool = option(True, "divide group advantages by the group's std (off: Dr.GRPO / ExGRPO)")
    advantage_eps: float = option(1e-6, "added to the group std", min=0.0)
    dynamic_sampling: bool = option(False, "drop groups whose rewards are all equal and sample more questions (DAPO)")
    rlep: RLEPConfig = field(default_factory=RLEPConfig)
    exgrpo: ExGRPOConfig = field(default_factory=ExGRPOConfig)

    @property
    def uses_replay(self) -> bool:
        """Whether the run keeps a replay buffer (its shards are placed and started with the other roles)."""
        return self.name in ("rlep", "exgrpo")


@dataclass
class LearnerConfig:
    num_workers: int = option(1, "learner actors forming one data-parallel group", min=1)
    strategy: Literal["fsdp2", "deepspeed"] = option("fsdp2", "sharding: torch FSDP2, or DeepSpeed ZeRO-2")
    lr: float = option(1e-6, "peak learning rate", min=0.0)
    lr_schedule: Literal["constant", "cosine"] = option("constant", "after warm-up: constant, or cosine decay to 0 at run.steps")
    warmup_steps: int = option(10, "rollout steps of linear learning-rate warm-up (the scheduler counts rollouts, as the RLEP code does)", min=0)
    weight_decay: float = option(0.1, "AdamW weight decay", min=0.0)
    grad_clip: float = option(1.0, "max global grad norm (0 disables)", min=0.0)
    skip_grad_norm_above: float = option(0.0, "skip an optimizer step whose grad norm exceeds this (0 disables; ExGRPO: 500)", min=0.0)
    mini_batch_prompts: int = option(64, "questions per optimizer step; all their answers (G + M) go in", min=1)
    micro_batch_size: int = option(16, "sequences per forward/backward pass (gradient accumulation); with loss_agg seq-mean-token-sum-norm it also sets the loss scale, as in verl", min=1)
    micro_batch_tokens: int = option(0, "> 0: forward/backward passes of rows of like length, at most this many padded tokens each (rows x the longest), instead of micro_batch_size rows (less padding; the loss is the same); micro_batch_size still sets the seq-mean-token-sum-norm scale", min=0)
    logit_chunk_tokens: int = option(1024, "tokens whose log-probs and entropies are computed at once from the logits, in fp32 (the logits themselves stay in model.dtype): bounds that working memory to about 4 x this x vocab x 4 bytes", min=1)
    epochs: int = option(1, "passes over each rollout batch", min=1)
    gradient_checkpointing: bool = option(False, "keep only each layer's input for backward and recompute the rest (the paper presets: on)")
    clip_low: float = option(0.2, "PPO clip range below 1 (1 - eps_low)", min=0.0, max=0.999)
    clip_high: float = option(0.28, "PPO clip range above 1 (clip-higher, 1 + eps_high)", min=0.0)
    dual_clip: float = option(10.0, "dual-clip bound c for negative advantages (0 disables)", min=0.0)
    loss_agg: Aggregation = option("token-mean", "how per-token losses are aggregated")
    loss_norm_constant: float = option(0.0, "divisor of token sums in the seq-mean-token-sum(-norm) aggregations (Dr.GRPO: max response length; ExGRPO: 8192)", min=0.0)
    entropy_coef: float = option(0.0, "entropy bonus coefficient (ExGRPO: 0.001)", min=0.0)
    behaviour_cap: float = option(0.0, "decoupled PPO (AReaL): the ratio against the policy at the start of the update, each token weighted by min(pi_prox / pi_behaviour, cap), for fresh and replayed answers alike; corrects asynchronous rollouts (run.max_policy_lag) and replay; 0: off (the papers' loss)", min=0.0)


@dataclass
class PlacementConfig:
    device: Literal["cpu", "gpu"] = option("cpu", "cpu: gloo and CPU bundles; gpu: NCCL and {'GPU': 1} bundles")
    mode: Literal["colocated", "disaggregated"] = option("colocated", "generators and learners share bundles, or each role gets its own")
    cpus_per_bundle: int = option(1, "CPUs per learner / generator bundle (Ray's accounting); colocated roles take turns in it", min=1)
    threads: int = option(0, "torch threads of each learner and generator actor; 0: its bundle's CPUs", min=0)
    pin_cores: bool = option(False, "CPU runs: bind each generator's and learner's threads to cores of their own (generators first, then learners, by index, `threads` each), so that roles working at once (asynchronous rollouts, disaggregated) do not share cores; off: vLLM binds its threads to every core")
    cpu_node_resource: str = option("", "a custom resource that CPU nodes advertise: verifiers and replay shards go there (cluster.yaml: rayrep_cpu_node)")
    wait_timeout_s: float = option(600.0, "how long to wait for an autoscaling cluster to grow to the plan before giving up", min=1.0)
    cluster_can_grow: Literal["auto", "yes", "no"] = option("auto", "whether the cluster can add nodes; auto: when an autoscaler runs (v2 publishes its node types; v1's are read from placement.autoscaling_config)")
    autoscaling_config: str = option("~/ray_bootstrap_config.yaml", "the autoscaler's config on the head node, where Ray's cluster launcher writes it: the node types of an autoscaler v1, which publishes none, for the plan's check")
    gpus_per_node: int = option(8, "GPUs per node of the cluster (for the plan's node count)", min=1)
    gpu_memory_gib: float = option(80.0, "memory of one GPU in GiB, for the memory plan checked before a GPU run starts", min=1.0)

    @property
    def takes_turns(self) -> bool:
        """Generators and learners share GPUs and take turns with their memory (vLLM sleep
        mode while the learners update; the learners' state off the GPU while generating)."""
        return self.device == "gpu" and self.mode == "colocated"

    @property
    def collective_backend(self) -> Literal["gloo", "nccl"]:
        """The torch.distributed backend of every group (learners, weight sync): the one place it is chosen."""
        return "nccl" if self.device == "gpu" else "gloo"


@dataclass
class SyncConfig:
    bucket_mb: float = option(64.0, "weights travel in flat buckets of at most this many MiB", min=0.001)


@dataclass
class LoggingConfig:
    out_dir: str = option("runs", "root folder of runs (metrics, checkpoints, plots)")
    run_name: str = option("", "this run's folder under out_dir; empty: algorithm name and time")
    wandb: bool = option(False, "also log metrics to Weights & Biases")
    wandb_mode: Literal["offline", "online"] = option("offline", "offline: a local wandb run folder in the run's folder, never the network (sync it later with `wandb sync`); online: stream to wandb with the user's key")
    wandb_project: str = option("rayrep", "Weights & Biases project")
    plots: bool = option(True, "write learning-curve PNGs to <run>/plots at the end of a run")


@dataclass
class ServeConfig:
    host: str = option("127.0.0.1", "address the HTTP server binds (0.0.0.0 exposes it beyond this machine)")
    port: int = option(8000, "HTTP port of the server", min=1, max=65535)
    min_replicas: int = option(1, "replicas (vLLM engines) kept running", min=1)
    max_replicas: int = option(1, "replicas at most: above min_replicas, Serve adds and removes replicas by load", min=1)
    target_ongoing_requests: float = option(16.0, "autoscaling aims at this many ongoing requests per replica", min=1.0)
    max_ongoing_requests: int = option(64, "requests one replica works on at once; more wait in Serve's queue", min=1)
    cpus_per_replica: float = option(1.0, "CPUs each replica reserves (on GPUs it also takes generator.tensor_parallel_size GPUs)", min=0.01)
    max_model_len: int = option(0, "context (prompt + answer tokens) of the served engine; 0: the checkpoint's positions", min=0)
    max_tokens: int = option(1024, "cap on a request's max_tokens (above it: 400); also the default when a request sets none", min=1)
    max_n: int = option(16, "cap on answers per prompt (n) in one request", min=1)
    max_prompts: int = option(32, "cap on prompts in one /v1/completions request", min=1)
    max_temperature: float = option(2.0, "cap on a request's temperature", min=0.0)
    max_request_bytes: int = option(1_000_000, "larger request bodies get a 413", min=1024)


@dataclass
class RunConfig:
    steps: int = option(400, "rollout steps", min=0)
    eval_every: int = option(20, "evaluate on the test set every this-many steps (0: only at the start and end)", min=0)
    save_every: int = option(0, "save a run checkpoint (policy, optimizer, buffer, sampler, random state) every this-many steps (0: only at the end)", min=0)
    keep_checkpoints: int = option(2, "keep the newest this-many step checkpoints (and the final one); 0: keep all", min=0)
    seed: int = option(0, "the run's seed: every other seed (data order, sampling, replay draws, learner init) derives from it unless set explicitly", min=0)
    start_eval: str = option("", "a run folder whose step-0 evaluation is this run's, not evaluated again: that run started from the same policy with the same model, data, generator, verifier and seed settings (checked), so it drew the same answers (the seeded study's arms share their baseline's)")
    max_policy_lag: int = option(0, "asynchronous rollouts: the generators sample this many steps ahead while the learners update, so answers are up to this many policy versions old (older fresh ones are dropped and counted); 0: synchronous", min=0)


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)

    def __post_init__(self):
        validate(self)

    def eval_samples(self, data_source: str) -> int:
        """Answers sampled per test question of benchmark `data_source` in evaluation."""
        return _samples_by_source(self.generator.eval_samples_by_source).get(data_source, self.generator.eval_samples)

    def seed(self, role: Literal["generator", "data"], index: int = 0) -> int:
        """The seed of one consumer: its explicit field when set (>= 0; plus `index`), else
        derived from `run.seed`, so that one number changes or repeats a whole run."""
        explicit = {"generator": self.generator.seed, "data": self.data.shuffle_seed}[role]
        if explicit >= 0:
            return explicit + index
        return derive_seed(self.run.seed, role, index)

    def sampling_seeds(self, key: str, count: int) -> list[int]:
        """One vLLM seed per prompt of a generate call named `key` ("rollout-<step>-<round>",
        "eval", "collect"): a prompt's answers then depend on the run seed, the call and its
        place in the call only, so a resumed run samples what the uninterrupted one did, on
        any number of engines. Every evaluation uses the same seeds (common random numbers:
        two evaluations differ by the policy, not by the draw)."""
        base = self.seed("generator")
        return [derive_seed(base, key, i) for i in range(count)]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def replace(self, **dotted: Any) -> "Config":
        """A validated copy with dotted fields changed: `cfg.replace(**{"learner.lr": 1e-5})`."""
        data = self.to_dict()
        for key, value in dotted.items():
            _set_dotted(data, key, value)
        return from_dict(data)


def _samples_by_source(entries: tuple[str, ...]) -> dict[str, int]:
    """`generator.eval_samples_by_source` as {data_source: k}; a bad entry names itself."""
    counts = {}
    for entry in entries:
        source, sep, count = entry.rpartition("=")
        if not sep or not source or not count.strip().isdigit() or int(count) < 1:
            raise ConfigError(f"generator.eval_samples_by_source: {entry!r} is not data_source=k with k >= 1")
        counts[source.strip()] = int(count)
    return counts


def derive_seed(run_seed: int, role: str, index: int = 0) -> int:
    """A 31-bit seed for (`role`, `index`) of the run seeded `run_seed`: stable across
    machines and Python versions, unrelated between roles and indices."""
    import hashlib

    digest = hashlib.blake2b(f"{run_seed}/{role}/{index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


# ---------------------------------------------------------------- building and checking


def from_dict(data: dict, cls: type = Config, prefix: str = "") -> Any:
    """Build a (nested) config dataclass from plain data, checking names and types."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a table of fields, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(
            f"unknown config field {prefix}{unknown[0]!s}; fields of {prefix.rstrip('.') or 'the config'}: "
            f"{', '.join(sorted(known))}"
        )
    values = {}
    for name, value in data.items():
        kind = hints[name]
        if dataclasses.is_dataclass(kind):
            values[name] = from_dict(value, kind, f"{prefix}{name}.")
        else:
            values[name] = _coerce(value, kind, f"{prefix}{name}")
    if cls is Config:
        return Config(**values)
    return cls(**values)


def _coerce(value: Any, kind: Any, name: str) -> Any:
    """Check `value` against the annotated type; accept lossless conversions only."""
    origin = typing.get_origin(kind)
    if origin is Literal:
        choices = typing.get_args(kind)
        if value not in choices:
            raise ConfigError(f"{name}: {value!r} is not one of {', '.join(map(repr, choices))}")
        return value
    if origin is tuple:
        (item,) = {a for a in typing.get_args(kind) if a is not Ellipsis}
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name}: expected a list, got {value!r}")
        return tuple(_coerce(v, item, f"{name}[{i}]") for i, v in enumerate(value))
    if origin in (types.UnionType, typing.Union):
        raise TypeError(f"{name}: union types are not supported in configs")
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            # NaN passes every range check and no knob means anything at infinity (TOML and
            # float() both read "nan" and "inf"); an int beyond float's range is infinite too.
            try:
                number = float(value)
            except OverflowError:
                number = math.inf
            if not math.isfinite(number):
                raise ConfigError(f"{name}: expected a finite number, got {number!r}")
            return number
        raise ConfigError(f"{name}: expected a number, got {value!r}")
    if kind is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{name}: expected a string, got {value!r}")
    raise TypeError(f"{name}: unsupported config type {kind}")


def _parse_text(text: str, kind: Any, name: str) -> Any:
    """Turn a command-line string into a value of the field's type."""
    if kind is bool:
        lowered = text.lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{name}: expected true or false, got {text!r}")
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{name}: expected an integer, got {text!r}") from None
    if kind is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{name}: expected a number, got {text!r}") from None
    return text  # strings, Literal choices and comma-separated tuples are checked by _coerce


def _field_specs(cls: type = Config, prefix: str = ""):
    """(dotted name, type, dataclass field) for every leaf field, in declaration order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            yield from _field_specs(kind, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", kind, f


def _check_ranges(obj: Any, prefix: str = "") -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_ranges(value, name + ".")
            continue
        low, high = f.metadata.get("min"), f.metadata.get("max")
        if low is not None and value < low:
            raise ConfigError(f"{name}: {value!r} is below the minimum {low}")
        if high is not None and value > high:
            raise ConfigError(f"{name}: {value!r} is above the maximum {high}")


def validate(cfg: Config) -> None:
    """Ranges of every field, then the rules that tie fields of different components."""
    for name, kind, _ in _field_specs():
        section, _, leaf = name.rpartition(".")
        holder = cfg
        for part in section.split(".") if section else ():
            holder = getattr(holder, part)
        _coerce(getattr(holder, leaf), kind, name)
    _check_ranges(cfg)
    _samples_by_source(cfg.generator.eval_samples_by_source)
    algo, learner = cfg.algorithm, cfg.learner
    if algo.prompts_per_step % learner.mini_batch_prompts:
        raise ConfigError(
            f"learner.mini_batch_prompts={learner.mini_batch_prompts} must divide "
            f"algorithm.prompts_per_step={algo.prompts_per_step}"
        )
    gen, place = cfg.generator, cfg.placement
    if place.device == "gpu" and place.gpus_per_node % gen.tensor_parallel_size:
        raise ConfigError(f"generator.tensor_parallel_size={gen.tensor_parallel_size} must divide "
                          f"placement.gpus_per_node={place.gpus_per_node}: an engine's GPUs are on one node")
    if place.device == "cpu" and gen.tensor_parallel_size > 1:
        raise ConfigError(f"generator.tensor_parallel_size={gen.tensor_parallel_size}: CPU engines run on one device (1)")
    if place.mode == "disaggregated" and not gen.num_workers:
        raise ConfigError("generator.num_workers must be set (> 0) with placement.mode='disaggregated': "
                          "the generators get GPUs of their own")
    if place.mode == "colocated" and not gen.num_workers and learner.num_workers % gen.tensor_parallel_size:
        raise ConfigError(f"generator.tensor_parallel_size={gen.tensor_parallel_size} must divide "
                          f"learner.num_workers={learner.num_workers} (one engine per group of the learners' GPUs)")
    engine_gpus = (gen.num_workers or learner.num_workers // gen.tensor_parallel_size) * gen.tensor_parallel_size
    if place.mode == "colocated" and place.device == "gpu" and engine_gpus > learner.num_workers:
        # Their GPUs' learner rank would hand them weights, and there is none: a broadcast from
        # rank 0 instead would put rank 0 and engine worker 0 on one GPU in one NCCL group.
        raise ConfigError(f"generator.num_workers={gen.num_workers} x tensor_parallel_size={gen.tensor_parallel_size} "
                          f"engine GPUs exceed learner.num_workers={learner.num_workers}: colocated, each engine GPU "
                          "shares a learner's; use placement.mode='disaggregated' for more engines")
    if learner.mini_batch_prompts % learner.num_workers:
        raise ConfigError(
            f"learner.num_workers={learner.num_workers} must divide "
            f"learner.mini_batch_prompts={learner.mini_batch_prompts} (each rank takes whole groups)"
        )
    if learner.loss_agg in TOKEN_SUM_AGGREGATIONS and learner.loss_norm_constant <= 0:
        raise ConfigError(f"learner.loss_norm_constant must be > 0 when learner.loss_agg is {learner.loss_agg!r}")
    if learner.strategy == "deepspeed" and learner.skip_grad_norm_above:
        raise ConfigError(
            f"learner.skip_grad_norm_above={learner.skip_grad_norm_above} is not supported with "
            "learner.strategy='deepspeed' (DeepSpeed skips only non-finite steps); use fsdp2 or set it to 0"
        )
    if learner.dual_clip and learner.dual_clip <= 1:
        raise ConfigError(f"learner.dual_clip: {learner.dual_clip!r} must be > 1 (or 0 to disable)")
    if cfg.run.max_policy_lag and place.takes_turns:
        raise ConfigError(f"run.max_policy_lag={cfg.run.max_policy_lag} needs generators that keep their GPUs while "
                          "the learners update: placement.mode='disaggregated' (colocated GPUs take turns)")
    if cfg.serve.max_replicas < cfg.serve.min_replicas:
        raise ConfigError(f"serve.max_replicas={cfg.serve.max_replicas} is below serve.min_replicas={cfg.serve.min_replicas}")
    if cfg.verifier.overlong_buffer > cfg.generator.max_response_tokens:
        raise ConfigError(
            f"verifier.overlong_buffer={cfg.verifier.overlong_buffer} exceeds "
            f"generator.max_response_tokens={cfg.generator.max_response_tokens}"
        )
    data = cfg.data
    if not data.test_files and data.arithmetic_test_size > data.arithmetic_test_reserve:
        # Past the reserve, test problems would be among those the tiny policy was warm-started on.
        raise ConfigError(
            f"data.arithmetic_test_size={data.arithmetic_test_size} exceeds data.arithmetic_test_reserve="
            f"{data.arithmetic_test_reserve}: raise the reserve (the train split and the tiny policy's warm start "
            f"then begin after it)"
        )


# ---------------------------------------------------------------- presets and command line


def preset_names() -> list[str]:
    """The presets shipped with the package."""
    folder = importlib.resources.files("rayrep.presets")
    return sorted(entry.name.removesuffix(".toml") for entry in folder.iterdir() if entry.name.endswith(".toml"))


def _preset_text(name: str) -> tuple[str, str]:
    """(where it came from, TOML text) of a named preset, or of a TOML file given by path."""
    if name.endswith(".toml") or "/" in name or "\\" in name:
        return _config_file_text(name)
    entry = importlib.resources.files("rayrep.presets").joinpath(f"{name}.toml")
    if not entry.is_file():
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(preset_names())}")
    return f"preset {name}", entry.read_text(encoding="utf-8")


def _config_file_text(path: str) -> tuple[str, str]:
    """(path, TOML text) of a user config file, or an error that says what is wrong with it."""
    file = Path(path)
    if file.suffix != ".toml":
        raise ConfigError(f"config file {path}: not a TOML file (a config file ends in .toml)")
    if not file.exists():
        raise ConfigError(f"config file {path} does not exist")
    if not file.is_file():
        raise ConfigError(f"config file {path} is not a file")
    try:
        return path, file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {path}: cannot be read ({err})") from None


def _parse_toml(origin: str, text: str) -> dict:
    try:
        return tomllib.loads(text)
    # Besides TOMLDecodeError (a ValueError): a plain ValueError for an integer over Python's
    # digit limit, RecursionError for arrays nested thousands deep.
    except (ValueError, RecursionError) as err:
        raise ConfigError(f"{origin}: {err}") from None


def _merge(base: dict, update: dict) -> dict:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _get_dotted(data: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        data = data[part]
    return data


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    *sections, leaf = dotted.split(".")
    for section in sections:
        data = data.setdefault(section, {})
        if not isinstance(data, dict):
            raise ConfigError(f"unknown config field {dotted}")
    data[leaf] = value


def load_preset(name: str = DEFAULT_PRESET) -> Config:
    """A named preset (or a TOML file given by path) as a validated Config."""
    return from_dict(_parse_toml(*_preset_text(name)))


def help_text(cfg: Config | None = None, origin: str = "") -> str:
    """Every field with its type, value and doc: the values of `cfg` (from `origin`, a preset
    or a run's config), else the schema's defaults."""
    values = cfg.to_dict() if cfg is not None else None
    lines = [f"config fields, as {origin} sets them (override with --<field> VALUE):" if origin
             else "config fields (override with --<field> VALUE):"]
    for name, kind, f in _field_specs():
        type_name = getattr(kind, "__name__", None) or str(kind).replace("typing.", "")
        value = f.default if values is None else _get_dotted(values, name)
        value = tuple(value) if isinstance(value, list) else value
        lines.append(f"  --{name} ({type_name}, default {value!r}): {f.metadata.get('doc', '')}")
    return "\n".join(lines)


def parse_cli(argv: list[str], base: dict | None = None) -> Config:
    """Build a Config from `--preset NAME`, `--config FILE.toml` and `--section.field VALUE` args.

    Later sources override earlier ones: preset < config file < field overrides. `base`: a
    saved config (a run's config.json) in place of the preset.
    """
    preset, user = _cli_sources(argv)
    if base is not None and preset != DEFAULT_PRESET:
        raise ConfigError("--preset does not apply when resuming: the run's own config.json is the base")
    return from_dict(_merge(base if base is not None else _parse_toml(*_preset_text(preset)), user))


def _cli_sources(argv: list[str]) -> tuple[str, dict]:
    """(the preset named, what the user sets on top of it: the `--config` files merged in
    order, then the `--section.field` overrides, as a nested dict)."""
    preset, user = DEFAULT_PRESET, {}
    kinds = {name: kind for name, kind, _ in _field_specs()}
    args = list(argv)
    overrides = []
    while args:
        arg = args.pop(0)
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --learner.lr 1e-6")
        key, has_value, value = arg[2:].partition("=")
        if not has_value:
            if not args:
                raise ConfigError(f"{arg} needs a value")
            value = args.pop(0)
        if key == "preset":
            preset = value
        elif key == "config":
            user = _merge(user, _parse_toml(*_config_file_text(value)))
        elif key in kinds:
            overrides.append((key, value))
        else:
            close = [k for k in kinds if k.endswith("." + key.rpartition(".")[2])]
            hint = f"; did you mean {', '.join('--' + k for k in close)}?" if close else ""
            raise ConfigError(f"unknown config field --{key}{hint}")
    for key, text in overrides:
        _set_dotted(user, key, _parse_text(text, kinds[key], key))
    return preset, user


def resume_base(run_dir: str) -> dict:
    """A stopped run's saved config (`RUN_DIR/config.json`), pointed at that folder."""
    path = Path(run_dir) / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"--resume {run_dir}: {path} is not a run's config ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--resume {run_dir}: {path} is not a run's config")
    folder = Path(run_dir).resolve()
    data.setdefault("logging", {}).update(out_dir=str(folder.parent), run_name=folder.name)
    return data


def differing_fields(
    theirs: dict, ours: dict, keep: Callable[[str], bool] = lambda name: True
) -> list[tuple[str, Any, Any]]:
    """`(section.field, their value, our value)` for every field where two configs as
    `Config.to_json` writes them (a run's `config.json`) differ, by name; only the names
    `keep` accepts. A field one of them lacks counts as None."""

    def flat(data: dict, prefix: str = "") -> dict:
        fields = {}
        for key, value in data.items():
            if isinstance(value, dict):
                fields.update(flat(value, f"{prefix}{key}."))
            elif keep(f"{prefix}{key}"):
                fields[f"{prefix}{key}"] = value
        return fields

    a, b = flat(theirs), flat(ours)
    return [(name, a.get(name), b.get(name)) for name in sorted(set(a) | set(b)) if a.get(name) != b.get(name)]


def job_parser(description: str, trains: bool = True, dry_run: bool = True,
               sets: dict[str, tuple[Any, str]] | None = None):
    """An argparse parser for a job's own flags; config fields go to `parse_job_args`.

    Every job takes `--dry-run`: print the placement plan and, for a GPU run, the memory
    plan, then stop, starting nothing (exit 2 when the plan cannot fit). `trains`: the job
    starts learners (a training run), not only generators and verifiers. `dry_run=False`:
    the job has no such plan and defines its own `--dry-run` (the server). `sets`: config
    fields the job sets itself, each as (its value, how the job sets it); value None: the
    job sets it stage by stage (the pipelines). The user's other value is refused.
    """
    import argparse

    parser = argparse.ArgumentParser(
        description=description,
        epilog=_EPILOG + help_text(load_preset(), f"preset {DEFAULT_PRESET}"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if dry_run:
        parser.add_argument("--dry-run", action="store_true",
                            help="print the placement plan and the per-GPU memory plan, start nothing")
    if trains:
        parser.add_argument("--resume", nargs="?", const="", metavar="RUN_DIR",
                            help="continue a stopped run from its latest complete checkpoint: the run in "
                                 "RUN_DIR (its config.json, then any overrides given here), or without "
                                 "RUN_DIR the one --logging.run_name names")
        parser.add_argument("--auto-resume", nargs="?", type=int, const=3, default=0, metavar="N",
                            help="when a learner dies, continue the run from its latest complete checkpoint "
                                 "on its own, up to N times (default 3); without it the job stops and says "
                                 "how to resume")
    parser.set_defaults(trains=trains, plans=dry_run, sets=sets or {})
    return parser


_EPILOG = "Any config field can be set too, e.g. --preset tiny-cpu --learner.lr 1e-5.\n\n"


def _help_config(argv: list[str]) -> tuple[Config, str]:
    """The config that `--help` describes, and where it comes from: the `--preset` and
    `--config` files of `argv` (the default preset when they do not load)."""
    preset, files, args = DEFAULT_PRESET, [], list(argv)
    while args:
        key, has_value, value = args.pop(0).partition("=")
        if key in ("--preset", "--config"):
            if not has_value:
                value = args.pop(0) if args else ""
            if key == "--preset":
                preset = value
            else:
                files.append(value)
    try:
        return parse_cli(["--preset", preset, *[arg for path in files for arg in ("--config", path)]]), \
            " + ".join([f"preset {preset}", *files])
    except ConfigError:
        return load_preset(), f"preset {DEFAULT_PRESET}"


def _apply_job_sets(parser, cfg: Config, argv: list[str]) -> Config:
    """The fields the job sets itself (`job_parser(sets=...)`), set; a value the user gives
    one of them on the command line or in a `--config` file, other than the job's own, is
    refused rather than silently replaced. (A preset's or a resumed run's value is not the
    user's word: `jobs/grpo.py --preset qwen2.5-math-7b-rlep` is that preset's baseline.)"""
    _, user = _cli_sources(argv)
    for name, (value, how) in parser.get_default("sets").items():
        try:
            given = _get_dotted(user, name)
        except (KeyError, TypeError):
            continue
        if value is None or given != value:
            raise ConfigError(f"{name} = {given!r}: {parser.prog} sets it itself ({how}); leave it out")
    return cfg.replace(**{name: value for name, (value, _) in parser.get_default("sets").items() if value is not None})


def parse_job_args(parser, argv: list[str] | None = None):
    """(job flags, Config): the job's own flags, then the config from everything else.

    A config error exits with status 2 and the message, before anything starts; so does
    `--dry-run`, after printing the plans (status 0 when they fit).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:  # the values the chosen preset (and config files) set
        parser.epilog = _EPILOG + help_text(*_help_config(argv))
    args, rest = parser.parse_known_args(argv)
    try:
        cfg = parse_cli(rest, base=resume_base(args.resume) if getattr(args, "resume", None) else None)
        cfg = _apply_job_sets(parser, cfg, rest)
        if getattr(args, "auto_resume", 0) < 0:
            raise ConfigError(f"--auto-resume {args.auto_resume}: the number of restarts cannot be negative")
        if getattr(args, "resume", None) == "" and not cfg.logging.run_name:
            raise ConfigError("--resume without a RUN_DIR needs --logging.run_name to name the run "
                              "(a pipeline: --resume <its folder>)")
    except ConfigError as err:
        parser.exit(2, f"{parser.prog}: config error: {err}\n")
    if args.plans and args.dry_run:
        from rayrep.memory import memory_plan
        from rayrep.placement import make_plan

        lines = [make_plan(cfg, learners=args.trains).describe()]
        plan = memory_plan(cfg, trains=args.trains)
        if plan is None:
            lines.append("memory plan: only for GPU runs of a known model (CPU run, or config.json not at hand)")
        else:
            lines.append(plan.describe())
        print("\n".join(lines))
        parser.exit(2 if plan is not None and plan.problems() else 0)
    return args, cfg


def run_job(main: Callable[[list[str]], object]) -> None:
    """A job's entry point: `main(sys.argv[1:])`. Bad input (an `InputError`: a config value,
    a prompt file, a pool, one of their rows) ends the job with its one-line message and
    exit status 2, not a traceback; a learner's death (`LearnerDied`) with its message (what
    died, the checkpoint left, how to resume) and status 1."""
    from rayrep.learner import LearnerDied

    try:
        main(sys.argv[1:])
    except InputError as err:
        print(f"{Path(sys.argv[0]).name}: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except LearnerDied as death:  # its message says what happened and what to do
        print(f"{Path(sys.argv[0]).name}: {death}", file=sys.stderr)
        raise SystemExit(1) from None
