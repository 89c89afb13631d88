"""The one place rayrep reaches inside vLLM (0.32): what `LLM`'s public calls do not offer.

- `RequestLoop`: an engine's requests added, stepped and aborted by hand, as `LLM.generate`
  steps them, so that a prompt's answers are read as soon as they are done and a call can
  stop part way (`LLM.generate` and `LLM.enqueue` return when every request is done).
  Its answers come as `Completion`s, so that nothing else reads vLLM's output types.
- `WeightSyncExtension`: methods vLLM mixes into its worker (`LLM(worker_extension_cls=...)`),
  called through the public `LLM.collective_rpc`: weights arrive through them.
- `shared_nccl_environment`: the NCCL variables of a group shared with other processes,
  without those vLLM pins for its own (batch invariance).
- `remove_adapter`, and two filters of vLLM's log notices.

Each vLLM behaviour this file relies on has a test in `tests/test_vllm_internals.py`, so
that a vLLM upgrade that changes one fails there, naming it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from rayrep.sync.collective import TIED_EMBEDDING, WeightManifest


class _RotaryReloadNotice(logging.Filter):
    """Drops vLLM's per-sync warning that RotaryEmbedding "failed to load weights".

    Its cos/sin cache is computed from the config, never a checkpoint tensor: the reload
    puts the existing cache back, which is right (the sync tests check log-probs after a
    sync), but the warning would print on every step of every run.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.WARNING and "RotaryEmbedding: Failed to load weights" in record.getMessage())


logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_RotaryReloadNotice())


class _CpuSleepNotice(logging.Filter):
    """Drops vLLM's CPU worker's notice that sleep mode is not supported, which a CPU run that
    emulates GPUs (`placement.emulate_gpus`) would print at every sleep and wake: it makes the
    calls for their order and for vLLM's own bookkeeping (its scheduler pauses until the engine
    is fully awake again), and a CPU has no memory to free."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "sleep mode is not supported on CPU" not in record.getMessage()


logging.getLogger("vllm.v1.worker.cpu_worker").addFilter(_CpuSleepNotice())


def with_tied_head(weights: Iterable[tuple[str, torch.Tensor]], tied: str | None) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights`, and after the input embedding `tied` (when the output head shares it) the
    same tensor again as "lm_head.weight": vLLM keeps a head of its own, which its reload
    leaves as it was otherwise (a checkpoint has no lm_head tensor when the two are tied)."""
    for name, tensor in weights:
        yield name, tensor
        if name == tied:
            yield "lm_head.weight", tensor


def shared_nccl_environment():
    """The process's environment as NCCL should see it when a group shared with processes
    outside vLLM opens (rayrep's weight group): with `VLLM_BATCH_INVARIANT`, vLLM's GPU worker
    pins NCCL's protocol, algorithm, channels and threads for its own process
    (`init_batch_invariance`), and a learner that joins without them would hang the group; vLLM
    builds its own shared communicators inside this context (`weight_transfer/nccl_common.py`).
    With an NCCL older than 2.29.7 it cannot unpin them, and the group's agreement check
    (`rayrep.sync.collective.agree_on_nccl`) refuses to open instead of hanging."""
    from vllm.utils.nccl import unpinned_nccl_env

    return unpinned_nccl_env()


class WeightSyncExtension:
    """Methods that run inside each vLLM worker (one per tensor-parallel rank)."""

    def rayrep_join_weight_group(self, host: str, port: int, world_size: int, first_rank: int, backend: str,
                                 transport: str, timeout_s: float) -> None:
        # Our own transport, beside the group vLLM created for itself (a world of size 1 on
        # CPU): a broadcast from the learner's rank 0, or colocated, handles from the learner
        # rank beside this worker. This worker's rank within its engine (its tensor-parallel
        # rank) follows the engine's first.
        from datetime import timedelta

        from rayrep.sync.transport import TRANSPORTS

        rank = first_rank + getattr(self, "rank", 0)
        with shared_nccl_environment():
            self._rayrep_channel = TRANSPORTS[transport].join_as_engine_worker(
                host, port, world_size, rank, backend, self._rayrep_device(), timedelta(seconds=timeout_s))

    def rayrep_leave_weight_group(self) -> None:
        """Leave the transport (to join a rebuilt one, after a generator was replaced); a worker
        that never joined one has nothing to leave."""
        channel = getattr(self, "_rayrep_channel", None)
        if channel is not None:
            channel.close()
            self._rayrep_channel = None

    def rayrep_receive_weights(self, manifest: WeightManifest) -> int:
        """Receive every bucket and load them in one `reload_weights` call; returns tensors loaded."""
        # One reload over all buckets: reloading per bucket can split a layer's fused q/k/v
        # projection across calls and leave part of it stale.
        loaded = self._rayrep_reload(with_tied_head(self._rayrep_channel.receive(manifest), manifest.tied_embedding))
        if self._rayrep_device().type == "cuda":
            # The received copies and the layers the reload materialised went back to torch's
            # cache: the KV cache that wakes next is mapped by vLLM outside it, and needs the room.
            torch.cuda.empty_cache()
        return loaded

    def rayrep_receive_adapter(self, manifest: WeightManifest, folder: str) -> int:
        """A LoRA run's sync: receive the adapter's tensors (every worker of the engine takes
        part in the transport) and write them as an adapter folder at `folder` (the engine's
        first worker), which the engine then loads through vLLM's public `LoRARequest`; the
        base weights stay as they are. Returns tensors received."""
        from rayrep.models.adapter import write_adapter

        # Copied out of the flat buckets, which the transport may reuse for the next one.
        tensors = {name: tensor.to("cpu", copy=True) for name, tensor in self._rayrep_channel.receive(manifest)}
        if getattr(self, "rank", 0) == 0:
            write_adapter(folder, tensors, manifest.adapter)
        return len(tensors)

    def rayrep_load_folder(self, folder: str) -> int:
        """Load a checkpoint folder's weights (its *.safetensors, tensor by tensor) in place;
        returns tensors loaded. vLLM's own `reload_weights(weights_path=...)` would leave a
        head tied to the embeddings stale (0.32: "ParallelLMHead: Failed to load weights")."""
        from safetensors import safe_open

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            for file in sorted(Path(folder).glob("*.safetensors")):
                with safe_open(str(file), "pt", device="cpu") as tensors:
                    for name in tensors.keys():
                        yield name, tensors.get_tensor(name)

        tied = TIED_EMBEDDING if getattr(self.model_config.hf_config, "tie_word_embeddings", False) else None
        return self._rayrep_reload(with_tied_head(weights(), tied))

    def _rayrep_reload(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """One `reload_weights` call over `weights`; returns how many tensors it was given."""
        loaded = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal loaded
            for pair in weights:
                loaded += 1
                yield pair

        self.reload_weights(weights_iterator=counted())
        return loaded

    def _rayrep_device(self) -> torch.device:
        return torch.device("cpu") if self.device_config.device_type == "cpu" else self.device


EXTENSION_CLASS = f"{WeightSyncExtension.__module__}.{WeightSyncExtension.__qualname__}"
"""What an engine is given as its `worker_extension_cls`."""


@dataclass(frozen=True)
class Completion:
    """One answer of a request, as an engine step reports it: all of it (`RequestLoop` not
    streamed), or the tokens it added in that step (streamed)."""

    index: int
    """Which of the request's `n` answers."""
    token_ids: Sequence[int]
    logprobs: list[float]
    """The sampled tokens' log-probs, one per token of `token_ids`."""
    finish_reason: str | None
    """None while the answer goes on (streamed)."""


class RequestLoop:
    """An engine's requests stepped by hand, as `LLM.generate` steps its batch: requests added
    under names of the caller's choosing, the engine stepped while any is left, and each
    step's finished requests (streamed: each step's new tokens of every request) reported
    under the name it was given. Sampling neither detokenises each token nor builds a log-prob
    entry per token: the sampled token's log-prob alone, as one flat list."""

    def __init__(self, llm, streamed: bool):
        from vllm.sampling_params import RequestOutputKind

        self._engine = llm.llm_engine
        self._kind = RequestOutputKind.DELTA if streamed else RequestOutputKind.FINAL_ONLY

    def add(self, name: str, prompt_ids: list[int], *, n: int, seed: int | None, temperature: float, top_p: float,
            max_tokens: int, min_tokens: int = 0, adapter=None, stop_token_ids: list[int] | None = None) -> str:
        """Queue `n` answers to the prompt `prompt_ids`; returns the engine's own id of the
        request (which `abort` takes). `stop_token_ids`: tokens that end an answer besides the
        end of sequence (each kept as the answer's last)."""
        from vllm import SamplingParams
        from vllm.inputs import tokens_input

        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed,
                                min_tokens=min_tokens, logprobs=0, flat_logprobs=True, detokenize=False,
                                output_kind=self._kind, stop_token_ids=stop_token_ids)
        return self._engine.add_request(name, tokens_input(prompt_ids), params, lora_request=adapter)

    def busy(self) -> bool:
        """Any request left."""
        return self._engine.has_unfinished_requests()

    def step(self) -> Iterator[tuple[str, list[Completion]]]:
        """One engine step: (the name a request was added under, its answers) of each request
        it reports."""
        for output in self._engine.step():
            yield output.request_id, [Completion(c.index, c.token_ids, sampled_logprobs(c), c.finish_reason)
                                      for c in output.outputs]

    def abort(self, ids: Iterable[str]) -> None:
        """Stop the requests of these engine ids (`add`'s), their answers dropped. By the
        engine's ids, not the names given: aborted by its name, vLLM 0.32 drops an n > 1
        request's answers but keeps its parent's record, and the engine stays busy."""
        self._engine.abort_request(list(ids), internal=True)


def sampled_logprobs(completion) -> list[float]:
    """The sampled tokens' log-probs of an engine's output (`flat_logprobs`, `logprobs=0`: one
    entry per position, the sampled token's)."""
    flat = completion.logprobs
    if not completion.token_ids:
        return []
    if flat is None or len(flat.logprobs) != len(completion.token_ids) or flat.token_ids != list(completion.token_ids):
        raise RuntimeError("vLLM returned log-probs of other tokens than the sampled ones (logprobs=0 asked)")
    return flat.logprobs


def remove_adapter(llm, adapter) -> None:
    """Drop a LoRA adapter (a `LoRARequest` sampled with before) from the engine: `LLM` has
    no public call for it."""
    llm.llm_engine.remove_lora(adapter.lora_int_id)
