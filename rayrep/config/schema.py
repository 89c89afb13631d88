"""The configuration schema: one dataclass per component, every field with its one-line
doc (shown by `--help`) and, where it has one, its range. A Config checks itself when it
is built (`validate`): a wrong value fails before any actor starts, naming the field."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from rayrep.config.fields import build, check_fields, get_dotted, option, set_dotted
from rayrep.config.strategies import SHARDING_STRATEGIES, ShardingStrategy
from rayrep.errors import ConfigError
from rayrep.types import (TOKEN_SUM_AGGREGATIONS, Aggregation, KLEstimator, LossSpec, MismatchCorrection, Objective,
                          SpecError, parse_rejections)


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

    def check(self, cfg: Config) -> None:
        if not self.test_files and self.arithmetic_test_size > self.arithmetic_test_reserve:
            # Past the reserve, test problems would be among those the tiny policy was warm-started on.
            raise ConfigError(
                f"data.arithmetic_test_size={self.arithmetic_test_size} exceeds data.arithmetic_test_reserve="
                f"{self.arithmetic_test_reserve}: raise the reserve (the train split and the tiny policy's warm start "
                f"then begin after it)")


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
    tiny_warm_start_tool_calls: float = option(0.0, "share of the tiny policy's warm-start answers that call the calculator (with tools.call_start and tools.call_end) instead of working by hand: a policy that can learn to use the tool", min=0.0, max=1.0, added=True)


@dataclass
class GeneratorConfig:
    num_workers: int = option(0, "vLLM engines; 0: one per tensor-parallel group of the policy's GPUs, so that every GPU generates", min=0)
    tensor_parallel_size: int = option(1, "GPUs per vLLM engine (1 on CPU)", min=1)
    temperature: float = option(1.0, "sampling temperature of training rollouts", min=0.0)
    top_p: float = option(1.0, "nucleus sampling of training rollouts", min=0.0, max=1.0)
    max_response_tokens: int = option(3072, "longest response a rollout may generate", min=1)
    min_response_tokens: int = option(0, "shortest response: the end-of-answer token is not sampled before this many tokens (vLLM's min_tokens; for benchmarks of long answers)", min=0)
    answer_parts: int = option(8, "parts a generator's share of a generate call arrives in, each scored by the verifiers while the rest is sampled (1: the whole share at once)", min=1)
    eval_temperature: float = option(1.0, "sampling temperature of evaluation", min=0.0)
    eval_top_p: float = option(1.0, "nucleus sampling of evaluation (both papers: 1.0)", min=0.0, max=1.0)
    eval_samples: int = option(4, "answers sampled per test question in evaluation (avg@k, pass@k, maj@k)", min=1)
    eval_samples_by_source: tuple[str, ...] = option((), "benchmarks sampled another number of times, as data_source=k entries (ExGRPO: avg@32 on AIME and AMC)")
    gpu_memory_utilization: float = option(0.85, "share of GPU memory vLLM may take (GPU only)", min=0.05, max=1.0)
    cpu_kv_cache_gib: float = option(1.0, "KV-cache size of a CPU vLLM engine in GiB (CPU only; the engine zeroes all of it at start)", min=0.01)
    enforce_eager: bool = option(True, "run vLLM without CUDA graphs / compilation (fast start, needed on CPU)")
    vllm_gpu_defaults: bool = option(False, "GPU engines run as vLLM 0.32 picks on GPUs: its Model Runner V2 where Triton is installed, and asynchronous scheduling, neither of which any CPU test runs; off: the V1 model runner and synchronous scheduling, as the CPU suite runs them", added=True)
    batch_invariant: bool = option(False, "GPU engines use vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT), so that an answer depends on its seed alone, not on what else the engine batched with it: a resumed run and a replaced generator then repeat on GPUs what they repeat on CPUs; its cost has not been measured here", added=True)
    seed: int = option(-1, "base seed of the generators' sampling (worker i uses seed + i); -1: derived from run.seed", min=-1)

    def check(self, cfg: Config) -> None:
        _samples_by_source(self.eval_samples_by_source)
        place, learners = cfg.placement, cfg.learner.num_workers
        if place.device == "gpu" and place.gpus_per_node % self.tensor_parallel_size:
            raise ConfigError(f"generator.tensor_parallel_size={self.tensor_parallel_size} must divide "
                              f"placement.gpus_per_node={place.gpus_per_node}: an engine's GPUs are on one node")
        if place.device == "cpu" and self.tensor_parallel_size > 1:
            raise ConfigError(f"generator.tensor_parallel_size={self.tensor_parallel_size}: CPU engines run on one "
                              "device (1)")
        if place.mode == "disaggregated" and not self.num_workers:
            raise ConfigError("generator.num_workers must be set (> 0) with placement.mode='disaggregated': "
                              "the generators get GPUs of their own")
        if place.mode == "colocated" and not self.num_workers and learners % self.tensor_parallel_size:
            raise ConfigError(f"generator.tensor_parallel_size={self.tensor_parallel_size} must divide "
                              f"learner.num_workers={learners} (one engine per group of the learners' GPUs)")
        engine_gpus = (self.num_workers or learners // self.tensor_parallel_size) * self.tensor_parallel_size
        if place.mode == "colocated" and place.device == "gpu" and engine_gpus > learners:
            # Their GPUs' learner rank would hand them weights, and there is none: a broadcast from
            # rank 0 instead would put rank 0 and engine worker 0 on one GPU in one NCCL group.
            raise ConfigError(f"generator.num_workers={self.num_workers} x tensor_parallel_size="
                              f"{self.tensor_parallel_size} engine GPUs exceed learner.num_workers={learners}: "
                              "colocated, each engine GPU shares a learner's; use placement.mode='disaggregated' "
                              "for more engines")
        if self.batch_invariant and place.device != "gpu":
            raise ConfigError("generator.batch_invariant is for GPU engines: a CPU engine gives each answer from its "
                              "seed alone already (placement.device='cpu')")


@dataclass
class VerifierConfig:
    num_workers: int = option(1, "verifier actors scoring completions in parallel", min=0)
    cpus_per_worker: float = option(1.0, "CPUs each verifier's bundle reserves", min=0.01)
    timeout_s: float = option(1.0, "hard wall-clock limit per completion; a slower one scores as wrong and counts as a timeout", min=0.01)
    reward_style: Literal["binary", "dapo"] = option("dapo", "binary: 1 correct / 0 wrong; dapo: +1 / -1")
    overlong_buffer: int = option(512, "DAPO overlong shaping: the penalty ramps over the last this-many tokens", min=0)
    overlong_factor: float = option(1.0, "DAPO overlong shaping: the penalty at the maximum length (0 disables shaping)", min=0.0)
    reward: str = option("math", "the checker of every row verifier.by_source does not route: math, exact, choice, or your own function, path/to/file.py:function or package.module:function (docs/your-own-task.md)", added=True)
    by_source: tuple[str, ...] = option((), "rows routed to checkers by their data_source, as data_source=checker entries (on the command line comma-separated: gsm8k=math,my_task=rewards/my_task.py:score)", added=True)
    success_threshold: float = option(1.0, "a checker that gives a score and no verdict: an answer scoring at least this is a success (accuracy, replay)", added=True)
    format_terms: tuple[str, ...] = option((), "terms added to every answer's reward, as term=weight entries (comma-separated on the command line): think (a <think>...</think> block, then an answer), boxed (a \\boxed{} answer), chars:MIN-MAX (a length in characters within the band); each logged as format_<term>", added=True)
    code_timeout_s: float = option(5.0, "the code checker: wall-clock limit of one run of the program (each stdin/stdout case is a run of its own)", min=0.1, added=True)
    code_cpu_s: int = option(5, "the code checker: CPU-time limit of one run of the program, seconds", min=1, added=True)
    code_memory_mib: int = option(512, "the code checker: address-space limit of the program's process, MiB", min=64, added=True)
    code_processes: int = option(16, "the code checker: processes the program may have at once (root only: it runs as a user of its own)", min=1, added=True)
    code_file_mib: int = option(16, "the code checker: the largest file the program may write (its output included), MiB", min=1, added=True)
    code_partial_credit: bool = option(False, "the code checker: score the share of tests passed (the reward) instead of 1 only when all pass", added=True)
    code_whole_text: bool = option(False, "the code checker: run the whole completion as the program, not its last fenced Python block", added=True)

    def check(self, cfg: Config) -> None:
        if self.overlong_buffer > cfg.generator.max_response_tokens:
            raise ConfigError(f"verifier.overlong_buffer={self.overlong_buffer} exceeds "
                              f"generator.max_response_tokens={cfg.generator.max_response_tokens}")
        self.routes, self.terms  # (a malformed entry, checker name or term fails here)

    @property
    def routes(self) -> dict[str, str]:
        """`by_source` as {data_source: checker}, each checker's name checked (`checker_name`)."""
        routes = {}
        for entry in self.by_source:
            source, sep, checker = entry.partition("=")
            if not sep or not source.strip() or not checker.strip():
                raise ConfigError(f"verifier.by_source: {entry!r} is not data_source=checker")
            if source.strip() in routes:
                raise ConfigError(f"verifier.by_source: data_source {source.strip()!r} is routed twice")
            routes[source.strip()] = checker_name(checker.strip(), "verifier.by_source")
        checker_name(self.reward, "verifier.reward")
        return routes

    @property
    def terms(self) -> tuple[tuple[str, float], ...]:
        """`format_terms` as (term, weight) pairs, each checked."""
        terms = []
        for entry in self.format_terms:
            term, sep, weight = entry.rpartition("=")
            band = re.fullmatch(r"chars:(\d+)-(\d+)", term)
            try:
                value = float(weight)
            except ValueError:
                value = math.nan
            if not sep or not (term in FORMAT_TERMS or band and int(band[1]) <= int(band[2])) or not math.isfinite(value):
                raise ConfigError(f"verifier.format_terms: {entry!r} is not term=weight with a term of "
                                  f"{', '.join(FORMAT_TERMS)} or chars:MIN-MAX (MIN <= MAX) and a finite weight")
            terms.append((term, value))
        return tuple(terms)


CHECKERS = ("math", "exact", "choice", "code")
"""The checkers rayrep ships (`rayrep.verifier.checkers`, `rayrep.verifier.code`), by name."""
FORMAT_TERMS = ("think", "boxed")
"""The format terms by name (`rayrep.verifier.checkers.format_values`); besides them, chars:MIN-MAX."""


def checker_name(name: str, field: str, builtins: tuple[str, ...] = CHECKERS, what: str = "a checker") -> str:
    """`name` if it names a checker (or `what` else, of `builtins`): a built-in one, or a
    user's function as path/to/file.py:function or package.module:function (ConfigError
    naming `field`)."""
    where, sep, function = name.rpartition(":")
    if name not in builtins and not (sep and where and function.isidentifier()
                                     and (where.endswith(".py") or "/" in where
                                          or all(p.isidentifier() for p in where.split(".")))):
        raise ConfigError(f"{field}: {name!r} is not {what}: {', '.join(builtins)}, "
                          f"path/to/file.py:function or package.module:function")
    return name


TOOLS = ("calculator", "python")
"""The tools rayrep ships, by name (`rayrep.verifier.tools`): the arithmetic task's
calculator, and Python run as the code checker runs a program."""


@dataclass
class ToolsConfig:
    name: str = option("", "the tool the policy calls in its answers (docs/tools.md): calculator, python, or your own function, path/to/file.py:function or package.module:function (call text -> output text); empty: answers in one turn, no tool", added=True)
    call_start: str = option("<tool_call>", "the markup that opens a call in the policy's text", added=True)
    call_end: str = option("</tool_call>", "the markup that closes a call (a turn also ends there when it is one token)", added=True)
    max_turns: int = option(4, "the most turns of the policy in one answer; a call in its last turn is not run (the response token budget, generator.max_response_tokens, is the whole answer's, tool output included)", min=1, added=True)
    max_output_chars: int = option(512, "a tool's output is cut to this many characters, marked as cut", min=1, added=True)
    timeout_s: float = option(5.0, "wall-clock limit of one call; a slower one answers as timed out", min=0.01, added=True)
    num_workers: int = option(1, "tool actors running calls in parallel, each in its own sandbox", min=1, added=True)
    cpus_per_worker: float = option(0.25, "CPUs each tool actor's bundle reserves", min=0.01, added=True)

    @property
    def enabled(self) -> bool:
        return bool(self.name)

    def check(self, cfg: Config) -> None:
        if self.enabled:
            checker_name(self.name, "tools.name", TOOLS, "a tool")
            if not self.call_start or not self.call_end:
                raise ConfigError(f"tools.call_start={self.call_start!r}, tools.call_end={self.call_end!r}: a tool "
                                  "call needs markup on both sides")


@dataclass
class ReplayConfig:
    num_shards: int = option(2, "replay buffer shard actors; questions are routed by a stable hash of their id (0: in-process)", min=0)
    cpus_per_shard: float = option(0.25, "CPUs each shard's bundle reserves (shards hold memory and answer a few calls per step)", min=0.01)
    max_answers_per_question: int = option(0, "cap on stored answers per question, the oldest evicted beyond it; 0: no cap (the ExGRPO code keeps them all)", min=0)
    snapshot_every: int = option(1, "steps between snapshots of the buffer (<run>/replay/), from which a shard that dies is restored; what it was given since is lost and counted (replay_shard_lost_*): 1 loses nothing; 0: the checkpoints' snapshots only", min=0)
    pool: str = option("", "a named pool (jobs/pool.py start) to attach to instead of starting this run's own shards; it outlives the run and other runs may share it", added=True)
    max_version_lag: int = option(-1, "draw only stored answers sampled at most this many policy versions before the drawing run's (-1: any age); those left out are counted (replay_held_back)", min=-1, added=True)
    others_only: bool = option(False, "draw only answers other runs stored (a shared pool), never this run's own; those left out are counted (replay_held_back)", added=True)
    retire_scope: Literal["pool", "run"] = option("pool", "ExGRPO on a shared pool: a question one run retires is retired for every run (pool) or only never drawn again by that run (run)", added=True)

    def check(self, cfg: Config) -> None:
        if not self.pool and (self.others_only or self.retire_scope == "run"):
            raise ConfigError(f"replay.others_only={self.others_only}, replay.retire_scope={self.retire_scope!r}: "
                              "these are for a shared pool (replay.pool); a run's own buffer holds only its answers")


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
    retire_from: Literal["training-set", "buffer"] = option("training-set", "where a question whose K answers were all right goes: out of the buffer and, from the next epoch, out of the training set, at every step (the code); or out of the buffer only, once collecting")


@dataclass
class PruneConfig:
    after: int = option(0, "the generation pruner: a question whose groups had no signal (all answers right, or all wrong) at this many visits in a row sits out its next visits, the sampler drawing others in its place (0: off; any algorithm)", min=0, added=True)
    skip: int = option(1, "visits a question sits out the first time; then it is generated for again (a re-check)", min=1, added=True)
    growth: float = option(2.0, "each re-check without signal makes the next pause this many times longer", min=1.0, added=True)


@dataclass
class PrioritizedConfig:
    replay_share: float = option(0.25, "share of each batch's answers that are replayed: its fresh answers stay, and stored answers join up to this share", min=0.0, max=0.95, added=True)
    decay_versions: float = option(4.0, "tau: an answer's priority is |A| x exp(-age / tau), its age in policy versions since it was sampled (0: no decay)", min=0.0, added=True)
    max_age: int = option(8, "answers sampled more than this many policy versions ago are evicted and never drawn (-1: kept until the per-question cap evicts them)", min=-1, added=True)
    correction: Literal["decoupled", "shaped"] = option("decoupled", "replayed tokens: decoupled PPO, weighted by min(pi_prox / pi_behaviour, learner.behaviour_cap or 2); or ExGRPO's shaping f(w) = w / (w + beta) against their recorded log-probs", added=True)
    beta: float = option(0.1, "the shaping's beta, with correction = shaped", min=1e-6, added=True)


@dataclass
class AlgorithmConfig:
    # The choices are the registry's (`rayrep.algos.registry.ALGORITHMS`; a test holds them equal).
    name: Literal["grpo", "rlep", "exgrpo", "prioritized"] = option("grpo", "grpo: the DAPO baseline; rlep / exgrpo: the papers' replay methods; prioritized: answer-level replay by |advantage| and freshness")
    prompts_per_step: int = option(512, "questions per rollout step (B)", min=1)
    group_size: int = option(16, "fresh rollouts per question (G; K in ExGRPO)", min=2)
    std_normalize: bool = option(True, "divide group advantages by the group's std (off: Dr.GRPO / ExGRPO)")
    advantage_eps: float = option(1e-6, "added to the group std", min=0.0)
    dynamic_sampling: bool = option(False, "drop groups whose rewards are all equal and sample more questions (DAPO)")
    rlep: RLEPConfig = field(default_factory=RLEPConfig)
    exgrpo: ExGRPOConfig = field(default_factory=ExGRPOConfig)
    prioritized: PrioritizedConfig = field(default_factory=PrioritizedConfig)
    prune: PruneConfig = field(default_factory=PruneConfig)


@dataclass
class CorrectionConfig:
    weights: Literal["none", "token", "sequence"] = option("none", "truncated importance weights of fresh answers, pi_learner / pi_engine at the update's start, per token or per answer (verl rollout_is); with token, what learner.behaviour_cap does for fresh answers: set one", added=True)
    weight_cap: float = option(2.0, "upper truncation of those weights (verl rollout_is_threshold)", min=1e-6, added=True)
    weight_lower: float = option(0.0, "> 0: IcePop's weights instead, 0 outside [weight_lower, weight_cap] (verl rollout_is_threshold \"lower_upper\")", min=0.0, added=True)
    reject: Literal["none", "token", "sequence", "geometric"] = option("none", "take fresh tokens whose ratio (per token; the answer's product; its geometric mean) leaves [reject_lower, reject_upper] out of the loss and its counts (verl rollout_rs token_k1, seq_sum_k1, seq_mean_k1 with the band inverted: docs/mismatch.md)", added=True)
    reject_upper: float = option(2.0, "upper end of the rejection band on the ratio", min=1.0, added=True)
    reject_lower: float = option(0.0, "lower end of the rejection band on the ratio; 0: 1 / reject_upper", min=0.0, added=True)
    rollout_rs: str = option("", "verl 0.9's rejection options by its names, comma-separated, each must keep a token: token_k1, seq_sum_k1, seq_mean_k1 (a band on the inverse ratio), token_k2/k3, seq_sum_k2/k3, seq_mean_k2/k3, seq_max_k2/k3 (a bound on a divergence)", added=True)
    rollout_rs_threshold: str = option("", "their thresholds as verl writes them: one for all or one each, comma-separated; k1: \"lower_upper\" or one number u (lower 1/u); k2/k3: one number", added=True)
    veto: float = option(0.0, "take a fresh answer out of the loss whole if any token's ratio is below this (verl 0.6's rollout_token_veto_threshold, e.g. 1e-4; verl 0.9 has none); 0: off", min=0.0, max=0.999999, added=True)

    def correction(self) -> MismatchCorrection | None:
        """The loss's mismatch correction this section asks for; None: none."""
        try:
            rules = parse_rejections(self.rollout_rs, self.rollout_rs_threshold)
        except ValueError as error:
            raise ConfigError(f"learner.correction.rollout_rs={self.rollout_rs!r} with learner.correction.rollout_rs_threshold="
                              f"{self.rollout_rs_threshold!r}: {error}") from None
        if self.weight_lower and self.weights == "none":
            raise ConfigError(f"learner.correction.weight_lower={self.weight_lower} bounds importance weights: set "
                              "learner.correction.weights (token or sequence) too, or leave it 0")
        if self.weights == "none" and self.reject == "none" and not rules and not self.veto:
            return None
        return MismatchCorrection(weights=self.weights, weight_cap=self.weight_cap, weight_lower=self.weight_lower or None,
                                  reject=self.reject, reject_upper=self.reject_upper,
                                  reject_lower=self.reject_lower or 1.0 / self.reject_upper, rs=rules,
                                  veto=self.veto or None)


@dataclass
class KLConfig:
    coef: float = option(0.0, "weight of a KL penalty to the reference policy (the run's starting policy, model.path) in the loss (verl use_kl_loss + kl_loss_coef; TRL beta); 0: none, and no reference pass", min=0.0, added=True)
    estimator: KLEstimator = option("k3", "its per-token estimator: k1 (kl), abs, k2 (mse), k3 (low_var_kl); a trailing + gives the named value with k2's gradient (verl kl_loss_type)", added=True)
    in_reward: bool = option(False, "the penalty in the reward instead of the loss (verl use_kl_in_reward with a fixed coefficient): each answer's reward less coef x the sum over its tokens of the estimate between the policy the update starts from and the reference, before its group's advantages (verl's in-reward estimator is k1, kl)", added=True)


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
    shared_prompts: bool = option(True, "forward passes compute each prompt of a micro-batch once, its answers attending to it (a question's G answers share their prompt; the same log-probs, fewer positions); where ranks hold whole parameters (one fp32 rank, DeepSpeed), without gradient checkpointing; else every row whole")
    forward_only_idle_questions: bool = option(True, "questions whose every answer has advantage 0 (a group all right or all wrong) pass forward only, without a graph or a backward, for the metrics alone, where the loss has no KL or entropy term: their gradient is exactly 0, so the update is the same up to float round-off")
    objective: Objective = option("ppo", "the policy-gradient objective (docs/objectives.md): ppo (the clipped token ratio), gspo (the clipped sequence ratio), cispo (the clipped ratio as a constant weight on the log-prob), sapo (a soft gate instead of a clip)", added=True)
    clip_low: float = option(0.2, "clip range below 1 (1 - eps_low) of ppo's and gspo's ratio and cispo's weight", min=0.0, max=0.999)
    clip_high: float = option(0.28, "clip range above 1 (clip-higher, 1 + eps_high) of ppo's and gspo's ratio and cispo's weight", min=0.0)
    dual_clip: float = option(10.0, "dual-clip bound c for negative advantages, objective ppo only (0 disables)", min=0.0)
    sapo_tau_pos: float = option(1.0, "objective sapo: the gate's temperature for tokens of positive advantage (verl tau_pos)", min=1e-6, added=True)
    sapo_tau_neg: float = option(1.05, "objective sapo: the gate's temperature for the others (verl tau_neg)", min=1e-6, added=True)
    kl: KLConfig = field(default_factory=KLConfig)
    loss_agg: Aggregation = option("token-mean", "how per-token losses are aggregated")
    loss_norm_constant: float = option(0.0, "divisor of token sums in the seq-mean-token-sum(-norm) aggregations (Dr.GRPO: max response length; ExGRPO: 8192)", min=0.0)
    entropy_coef: float = option(0.0, "entropy bonus coefficient (ExGRPO: 0.001)", min=0.0)
    behaviour_cap: float = option(0.0, "decoupled PPO (AReaL): the ratio against the policy at the start of the update, each token weighted by min(pi_prox / pi_behaviour, cap), for fresh and replayed answers alike; corrects asynchronous rollouts (run.max_policy_lag) and replay; 0: off (the papers' loss)", min=0.0)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    lora_rank: int = option(0, "> 0: train a LoRA adapter of this rank (PEFT) on the frozen base instead of every weight: only the adapter carries gradients, optimizer state and fp32 masters, and a weight sync sends only the adapter (docs/lora.md); 0: full fine-tuning", min=0, max=512, added=True)
    lora_alpha: float = option(32.0, "LoRA scale numerator: the adapter's update is scaled by lora_alpha / lora_rank (a fixed alpha keeps the best learning rate about the same across ranks)", min=0.0, added=True)
    lora_dropout: float = option(0.0, "dropout on the adapter's input in training (the engines sample without it)", min=0.0, max=0.999, added=True)
    lora_target_modules: tuple[str, ...] = option(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), "the linear layers that get an adapter (PEFT target_modules; attention and MLP alike: RL with an MLP-less adapter learns less)", added=True)
    lora_merge: bool = option(False, "at the end of a LoRA run, also write the final policy merged into the base as a Hugging Face checkpoint (final-merged/ beside final/)", added=True)

    def loss_spec(self) -> LossSpec:
        """The loss these settings ask for (an algorithm may change its replay terms)."""
        return LossSpec(
            objective=self.objective,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            # The dual clip bounds PPO's token ratio: the other objectives have none.
            dual_clip=(self.dual_clip or None) if self.objective == "ppo" else None,
            sapo_tau_pos=self.sapo_tau_pos,
            sapo_tau_neg=self.sapo_tau_neg,
            kl_coef=0.0 if self.kl.in_reward else self.kl.coef,  # (in the reward: the algorithm's)
            kl_estimator=self.kl.estimator,
            agg=self.loss_agg,
            norm_constant=self.loss_norm_constant if self.loss_agg in TOKEN_SUM_AGGREGATIONS else None,
            entropy_coef=self.entropy_coef,
            behaviour_cap=self.behaviour_cap or None,
            correction=self.correction.correction(),
        )

    @property
    def sharding(self) -> ShardingStrategy:
        """What the sharding strategy can do (`rayrep.config.strategies`)."""
        return SHARDING_STRATEGIES[self.strategy]

    def check(self, cfg: Config) -> None:
        if cfg.algorithm.prompts_per_step % self.mini_batch_prompts:
            raise ConfigError(f"learner.mini_batch_prompts={self.mini_batch_prompts} must divide "
                              f"algorithm.prompts_per_step={cfg.algorithm.prompts_per_step}")
        if self.mini_batch_prompts % self.num_workers:
            raise ConfigError(f"learner.num_workers={self.num_workers} must divide "
                              f"learner.mini_batch_prompts={self.mini_batch_prompts} (each rank takes whole groups)")
        _check_loss(cfg)
        if self.skip_grad_norm_above and not self.sharding.skips_large_gradients:
            raise ConfigError(
                f"learner.skip_grad_norm_above={self.skip_grad_norm_above} is not supported with "
                f"learner.strategy={self.strategy!r} (it skips only non-finite steps); use fsdp2 or set it to 0")
        if self.kl.in_reward and not self.kl.coef:
            raise ConfigError("learner.kl.in_reward puts the KL penalty in the reward: set learner.kl.coef (> 0) too")
        if not self.lora_rank and self.lora_merge:
            raise ConfigError("learner.lora_merge merges a LoRA adapter into its base: set learner.lora_rank (> 0) too")
        if self.lora_rank and not self.lora_target_modules:
            raise ConfigError(f"learner.lora_rank={self.lora_rank} needs learner.lora_target_modules "
                              "(the layers that get an adapter)")


@dataclass
class PlacementConfig:
    device: Literal["cpu", "gpu"] = option("cpu", "cpu: gloo and CPU bundles; gpu: NCCL and {'GPU': 1} bundles")
    mode: Literal["colocated", "disaggregated"] = option("colocated", "generators and learners share bundles, or each role gets its own")
    cpus_per_bundle: int = option(1, "CPUs per learner / generator bundle (Ray's accounting); colocated roles take turns in it", min=1)
    threads: int = option(0, "torch threads of each learner and generator actor; 0: its bundle's CPUs", min=0)
    pin_cores: bool = option(False, "CPU runs: bind each generator's and learner's threads to cores of their own (generators first, then learners, by index, `threads` each), so that roles working at once (asynchronous rollouts, disaggregated) do not share cores; off: vLLM binds its threads to every core")
    lend_idle_cores: bool = option(False, "CPU runs with pin_cores, asynchronous rollouts and one learner rank: the learner also runs on its node's generators' cores once their round is sampled, until its update ends (the update's numbers then depend on when, at the level of float round-off: rayrep.cluster.cores)", added=True)
    cpu_node_resource: str = option("", "a custom resource that CPU nodes advertise: verifiers and replay shards go there (cluster.yaml: rayrep_cpu_node)")
    wait_timeout_s: float = option(600.0, "how long to wait for an autoscaling cluster to grow to the plan before giving up", min=1.0)
    cluster_can_grow: Literal["auto", "yes", "no"] = option("auto", "whether the cluster can add nodes; auto: when an autoscaler runs (v2 publishes its node types; v1's are read from placement.autoscaling_config)")
    autoscaling_config: str = option("~/ray_bootstrap_config.yaml", "the autoscaler's config on the head node, where Ray's cluster launcher writes it: the node types of an autoscaler v1, which publishes none, for the plan's check")
    gpus_per_node: int = option(8, "GPUs per node of the cluster (for the plan's node count)", min=1)
    gpu_memory_gib: float = option(80.0, "memory of one GPU in GiB, for the memory plan checked before a GPU run starts (and the GPUs that placement.emulate_gpus models)", min=1.0)
    host_memory_gb: float = option(1000.0, "host memory of one node in GB that a GPU run may use, for the memory plan's host figures (pinned blocks as torch's host allocator rounds and keeps them included), checked with the GPUs' before a GPU run starts; 1000 GB is below the 1.8-2 TB of common 8-GPU nodes", min=1.0, added=True)
    emulate_gpus: bool = option(False, "CPU runs act as a GPU run of placement.gpu_memory_gib GPUs would, for tests and for debugging a GPU run's sequence on a CPU: colocated roles take turns (vLLM's sleep and wake calls, the learners' state on and off), every operation checks where the memory it needs is, and a device-memory ledger models each GPU from the memory plan, stopping the run where a GPU would overflow or outgrow its plan; the compute stays on the CPU", added=True)

    @property
    def takes_turns(self) -> bool:
        """Generators and learners share GPUs and take turns with their memory (vLLM sleep
        mode while the learners update; the learners' state off the GPU while generating):
        colocated on GPUs, or on CPUs that emulate them."""
        return self.mode == "colocated" and self.models_gpus

    @property
    def models_gpus(self) -> bool:
        """The run's GPU memory is planned and kept in a ledger (`rayrep.cluster.memory`): GPU
        runs, and CPU runs that emulate GPUs."""
        return self.device == "gpu" or self.emulate_gpus

    @property
    def collective_backend(self) -> Literal["gloo", "nccl"]:
        """The torch.distributed backend of every group (learners, weight sync): the one place it is chosen."""
        return "nccl" if self.device == "gpu" else "gloo"

    def check(self, cfg: Config) -> None:
        if self.emulate_gpus and self.device != "cpu":
            raise ConfigError("placement.emulate_gpus is for CPU runs (placement.device='cpu'); a GPU run has its GPUs")
        if self.lend_idle_cores:
            missing = [need for need, holds in (("placement.device='cpu'", self.device == "cpu"),
                                                ("placement.pin_cores=true", self.pin_cores),
                                                ("run.max_policy_lag > 0", cfg.run.max_policy_lag > 0),
                                                ("learner.num_workers=1", cfg.learner.num_workers == 1)) if not holds]
            if missing:
                raise ConfigError("placement.lend_idle_cores lends the cores of generators done sampling ahead to "
                                  f"the one learner rank: it needs {', '.join(missing)}")


@dataclass
class SyncConfig:
    bucket_mb: float = option(64.0, "weights travel in flat buckets of at most this many MiB", min=0.001)
    timeout_s: float = option(600.0, "how long a member of the weight transport waits for the others (joining, each bucket) before the sync fails", min=0.1, added=True)


@dataclass
class LoggingConfig:
    out_dir: str = option("runs", "root folder of runs (metrics, checkpoints, plots)")
    run_name: str = option("", "this run's folder under out_dir; empty: algorithm name and time")
    wandb: bool = option(False, "also log metrics to Weights & Biases")
    wandb_mode: Literal["offline", "online"] = option("offline", "offline: a local wandb run folder in the run's folder, never the network (sync it later with `wandb sync`); online: stream to wandb with the user's key")
    wandb_project: str = option("rayrep", "Weights & Biases project")
    plots: bool = option(True, "write learning-curve PNGs to <run>/plots at the end of a run")
    tensorboard: bool = option(False, "also write each step's metrics and the config to TensorBoard event files in <run>/tensorboard", added=True)
    ray_metrics: bool = option(True, "also export each step's metrics through Ray's metrics (the node's Prometheus endpoint, Ray's Grafana), labelled with the run", added=True)


@dataclass
class ServeConfig:
    host: str = option("127.0.0.1", "address the HTTP server binds (0.0.0.0 exposes it beyond this machine)")
    port: int = option(8000, "HTTP port of the server", min=1, max=65535)
    api_keys_file: str = option("", "file of API keys, one per line: every route but /health then needs 'Authorization: Bearer <key>' (RAYREP_SERVE_API_KEY adds one more)")
    allow_unauthenticated: bool = option(False, "serve on an address other machines reach without an API key (refused otherwise)")
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
    follow_every_s: float = option(5.0, "with jobs/serve.py --follow: how often each replica looks for a newer checkpoint of the run", min=0.1)

    def check(self, cfg: Config) -> None:
        if self.max_replicas < self.min_replicas:
            raise ConfigError(f"serve.max_replicas={self.max_replicas} is below serve.min_replicas={self.min_replicas}")


@dataclass
class RunConfig:
    steps: int = option(400, "rollout steps", min=0)
    eval_every: int = option(20, "evaluate on the test set every this-many steps (0: only at the start and end)", min=0)
    save_every: int = option(0, "save a run checkpoint (policy, optimizer, buffer, sampler, random state) every this-many steps (0: only at the end)", min=0)
    keep_checkpoints: int = option(2, "keep the newest this-many step checkpoints (and the final one); 0: keep all", min=0)
    seed: int = option(0, "the run's seed: every other seed (data order, sampling, replay draws, learner init) derives from it unless set explicitly", min=0)
    start_eval: str = option("", "a run folder whose step-0 evaluation is this run's, not evaluated again: that run started from the same policy with the same model, data, generator, verifier and seed settings (checked), so it drew the same answers (the seeded study's arms share their baseline's)")
    max_policy_lag: int = option(0, "asynchronous rollouts: the generators sample this many steps ahead while the learners update, so answers are up to this many policy versions old (older fresh ones are dropped and counted); 0: synchronous", min=0)
    partial_rollouts: float = option(0.0, "partial rollouts: each step samples this share more groups than it trains on (algorithm.prompts_per_step) and trains on the first done; the others stop, keep their tokens so far (each token its policy version and log-prob) and finish in the next step's round, under the newer weights; a step that saves a checkpoint asks its stopped questions again later instead; a group whose oldest token is more than max(1, 2 x run.max_policy_lag) versions old is dropped, counted (stopped N steps ahead, it continues N steps later); dynamic sampling not with it; 0: off", min=0.0, added=True)

    def check(self, cfg: Config) -> None:
        if self.max_policy_lag and cfg.placement.takes_turns:
            raise ConfigError(f"run.max_policy_lag={self.max_policy_lag} needs generators that keep their GPUs while "
                              "the learners update: placement.mode='disaggregated' (colocated GPUs take turns)")
        if self.partial_rollouts and cfg.algorithm.dynamic_sampling:
            raise ConfigError("run.partial_rollouts with algorithm.dynamic_sampling: not built (a refill round would "
                              "stop answers of its own); use one or the other")


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
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

    def saves_checkpoint(self, step: int) -> bool:
        """Whether step `step` ends with a run checkpoint (`run.save_every`, and the last step)."""
        return step == self.run.steps or bool(self.run.save_every and step % self.run.save_every == 0)

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
            set_dotted(data, key, value)
        return build(data, Config)


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
    digest = hashlib.blake2b(f"{run_seed}/{role}/{index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


LOSS_SETTINGS = {
    "objective": "learner.objective", "sapo_tau_pos": "learner.sapo_tau_pos", "sapo_tau_neg": "learner.sapo_tau_neg",
    "kl_coef": "learner.kl.coef", "kl_estimator": "learner.kl.estimator",
    "clip_low": "learner.clip_low", "clip_high": "learner.clip_high", "dual_clip": "learner.dual_clip",
    "agg": "learner.loss_agg", "norm_constant": "learner.loss_norm_constant", "entropy_coef": "learner.entropy_coef",
    "behaviour_cap": "learner.behaviour_cap", "correction__weights": "learner.correction.weights",
    "weights": "learner.correction.weights", "weight_cap": "learner.correction.weight_cap",
    "weight_lower": "learner.correction.weight_lower",
    "reject": "learner.correction.reject", "reject_upper": "learner.correction.reject_upper",
    "reject_lower": "learner.correction.reject_lower", "veto": "learner.correction.veto",
}
"""The config field each field of the loss's spec (`LossSpec`, `MismatchCorrection`) comes from."""


def _check_loss(cfg: Config) -> None:
    """The loss's rules, as the spec states them (`rayrep.types.SpecError`), named by the
    config's fields and values."""
    try:
        cfg.learner.loss_spec()
    except SpecError as error:
        names = {field: LOSS_SETTINGS[field] for field in error.values}
        values = {field: get_dotted(cfg, name) for field, name in names.items()}
        raise ConfigError(error.named(names, values)) from None


def validate(cfg: Config) -> None:
    """Types and ranges of every field, then each section's rules (`check`): a rule that ties
    fields of several sections is the section's whose knob it limits."""
    check_fields(cfg)
    for section in (cfg.learner, cfg.generator, cfg.placement, cfg.run, cfg.serve, cfg.verifier, cfg.tools, cfg.replay,
                    cfg.data):
        section.check(cfg)
