"""LearnerWorker: one data-parallel rank of the policy's training group (a Ray actor).

W workers form one `torch.distributed` group (gloo on CPU, NCCL on GPU) and shard the
policy with FSDP2 or DeepSpeed ZeRO-2 (`rayrep/learner/sharding.py`). Every rank receives
the whole `TrainBatch` (one object ref) and picks its own rows, so the split needs no
communication and every rank knows the mini-batch's global token count, which makes
token-mean exact across ranks and micro-batches.

The worker knows nothing of the algorithm: rows, advantages, masks and a `LossSpec`.
"""

from __future__ import annotations

import math
import time
from datetime import timedelta

import ray
import torch
import torch.distributed as dist

from rayrep.config import Config
from rayrep.learner.loss import loss_denominator, policy_loss
from rayrep.metrics import MetricSums
from rayrep.types import LossSpec, TrainBatch


def rows_per_rank(prompt_index: torch.Tensor, prompts: range, world_size: int) -> list[torch.Tensor]:
    """Row indices of each rank for the questions in `prompts`: whole questions, near-equal shares."""
    ranks = []
    for rank in range(world_size):
        start = prompts.start + (len(prompts) * rank) // world_size
        stop = prompts.start + (len(prompts) * (rank + 1)) // world_size
        ranks.append(torch.nonzero((prompt_index >= start) & (prompt_index < stop)).flatten())
    return ranks


def micro_batches(rows: torch.Tensor, count: int) -> list[torch.Tensor]:
    """`rows` in `count` near-equal chunks (some empty when rows are fewer than count)."""
    return [chunk for chunk in torch.tensor_split(rows, count)]


class LearnerWorker:
    def __init__(self, cfg: Config, rank: int, world_size: int, threads: int):
        torch.set_num_threads(threads)
        torch.manual_seed(cfg.run.seed)
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        on_gpu = cfg.placement.device == "gpu"
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        self.weight_group = None

    def address(self) -> tuple[str, int]:
        """This worker's node address and a port free on it (rank 0 hosts the rendezvous)."""
        from rayrep.placement import free_port

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, model_path: str, master_addr: str, master_port: int, total_optimizer_steps: int) -> None:
        """Join the data-parallel group, load and shard the policy, build the optimizer."""
        from transformers import AutoModelForCausalLM

        from rayrep.learner.sharding import make_sharding

        cfg, rank, world_size = self.cfg, self.rank, self.world_size
        dist.init_process_group(
            "nccl" if cfg.placement.device == "gpu" else "gloo",
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(minutes=30),
        )
        dtype = getattr(torch, cfg.model.dtype)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(self.device)
        model.config.use_cache = False
        self.tied_embedding = "model.embed_tokens.weight" if model.config.tie_word_embeddings else None
        self.sharding = make_sharding(cfg.learner.strategy, model, cfg, world_size, self.device, total_optimizer_steps)
        self.model = self.sharding.model
        self.model.train()

    # ------------------------------------------------------------------ forward passes

    def _token_logprobs(self, batch: TrainBatch, rows: torch.Tensor, with_entropy: bool):
        """Log-prob (and entropy) of every token of `rows` under the current weights: [n, L'] each.

        L' is the longest row of the chunk. An empty chunk runs one dummy row so that every
        rank takes part in the gradient collectives the same number of times.
        """
        if len(rows) == 0:
            rows = torch.zeros(1, dtype=torch.long)
            dummy = True
        else:
            dummy = False
        width = int(batch.lengths[rows].max())
        ids = batch.input_ids[rows, :width].to(self.device)
        attention = (torch.arange(width)[None, :] < batch.lengths[rows, None]).to(self.device)
        logits = self.model(input_ids=ids, attention_mask=attention.long()).logits.float()
        logits = logits[:, :-1] / batch.temperature
        log_probs = torch.log_softmax(logits, dim=-1)
        token_logp = torch.zeros(ids.shape, dtype=torch.float32, device=self.device)
        token_logp[:, 1:] = log_probs.gather(-1, ids[:, 1:, None]).squeeze(-1)
        entropy = None
        if with_entropy:
            entropy = torch.zeros(ids.shape, dtype=torch.float32, device=self.device)
            entropy[:, 1:] = -(log_probs.exp() * log_probs).sum(-1)
        return token_logp, entropy, width, dummy

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, with_entropy: bool = False) -> dict:
        """This rank's share of per-token log-probs (and entropies) of every row of `batch`.

        Returns {"rows": [n] row indices, "logprobs": [n, L], "entropy": [n, L] or None}.
        """
        mine = rows_per_rank(batch.prompt_index, range(batch.num_prompts), self.world_size)
        return self._logprobs_of(batch, mine, with_entropy)

    def _logprobs_of(self, batch: TrainBatch, rows_of_rank: list[torch.Tensor], with_entropy: bool) -> dict:
        size = self.cfg.learner.micro_batch_size
        count = max(1, max(math.ceil(len(r) / size) for r in rows_of_rank))
        mine = rows_of_rank[self.rank]
        out_logp = torch.zeros(len(mine), batch.input_ids.shape[1])
        out_entropy = torch.zeros_like(out_logp) if with_entropy else None
        position = 0
        self.model.eval()
        for chunk in micro_batches(mine, count):
            logp, entropy, width, dummy = self._token_logprobs(batch, chunk, with_entropy)
            if not dummy:
                out_logp[position : position + len(chunk), :width] = logp.cpu()
                if with_entropy:
                    out_entropy[position : position + len(chunk), :width] = entropy.cpu()
                position += len(chunk)
        self.model.train()
        return {"rows": mine, "logprobs": out_logp, "entropy": out_entropy}

    # ------------------------------------------------------------------ training

    def update(self, batch: TrainBatch, loss: LossSpec) -> dict:
        """Mini-batch policy-gradient updates over `batch`; returns metric sums to merge across ranks."""
        learner = self.cfg.learner
        num_prompts = batch.num_prompts
        minibatches = [
            range(start, min(start + learner.mini_batch_prompts, num_prompts))
            for start in range(0, num_prompts, learner.mini_batch_prompts)
        ]
        sums = MetricSums()
        old_logprobs = batch.old_logprobs.clone()
        start = time.perf_counter()
        if batch.recompute_old.any() and len(minibatches) * learner.epochs > 1:
            # Later mini-batches see updated weights, so "old" must be taken before any update.
            # (With a single optimizer step, the first forward pass is the old policy.)
            for prompts in minibatches:
                shares = rows_per_rank(batch.prompt_index, prompts, self.world_size)
                with torch.no_grad():
                    result = self._logprobs_of(batch, shares, with_entropy=False)
                recompute = batch.recompute_old[result["rows"]]
                old_logprobs[result["rows"][recompute]] = result["logprobs"][recompute]
            single_pass_old = False
        else:
            single_pass_old = True
        if self.rank == 0:
            sums.count("time_old_logprobs", time.perf_counter() - start)
        for _ in range(learner.epochs):
            for prompts in minibatches:
                self._step(batch, prompts, old_logprobs, single_pass_old, loss, sums)
        return sums.state()

    def _step(self, batch, prompts, old_logprobs, single_pass_old, loss: LossSpec, sums: MetricSums) -> None:
        learner = self.cfg.learner
        shares = rows_per_rank(batch.prompt_index, prompts, self.world_size)
        all_rows = torch.cat(shares)
        # The global count over every rank and micro-batch of this mini-batch.
        denominator = loss_denominator(batch.response_mask[all_rows], loss.agg)
        token_count = max(1, int(batch.response_mask[all_rows].sum()))
        count = max(1, max(math.ceil(len(r) / learner.micro_batch_size) for r in shares))
        chunks = micro_batches(shares[self.rank], count)
        for index, chunk in enumerate(chunks):
            logp, entropy, width, dummy = self._token_logprobs(batch, chunk, with_entropy=True)
            rows = chunk if not dummy else torch.zeros(1, dtype=torch.long)
            mask = batch.response_mask[rows, :width].to(self.device)
            if dummy:
                mask = torch.zeros_like(mask)
            old = old_logprobs[rows, :width].to(self.device)
            if single_pass_old:
                recompute = batch.recompute_old[rows].to(self.device)[:, None]
                old = torch.where(recompute, logp.detach(), old)
            replay = batch.replay_mask[rows].to(self.device)
            value, metrics = policy_loss(
                logp,
                old,
                batch.advantages[rows].to(self.device),
                mask,
                clip_low=loss.clip_low,
                clip_high=loss.clip_high,
                dual_clip=loss.dual_clip,
                agg=loss.agg,
                replay_mask=replay,
                replay_shaping=loss.replay_shaping,
                replay_beta=loss.replay_beta,
                clip=loss.clip,
                norm_constant=loss.norm_constant,
                denominator=max(1, denominator),
            )
            if loss.entropy_coef:
                value = value - loss.entropy_coef * (entropy * mask).sum() / token_count
            # Gradients are averaged over ranks; the loss is already a global mean.
            self.sharding.backward(value * self.world_size, last_micro_batch=index == len(chunks) - 1)
            if not dummy:
                sums.add_policy_metrics(metrics)
                for kind, rows_of_kind in (("fresh", ~replay), ("replay", replay)):
                    kind_mask = mask & rows_of_kind[:, None]
                    sums.add(f"entropy_{kind}", float((entropy.detach() * kind_mask).sum()), float(kind_mask.sum()))
            # Each micro-batch's value is its share of the mini-batch loss: they sum to it.
            sums.count("loss_sum", float(value.detach()))
        lr = self.sharding.last_lr()  # the rate this step applies (the scheduler moves on in step())
        grad_norm, stepped = self.sharding.step()
        if self.rank == 0:  # the same on every rank: count it once
            sums.count("optimizer_steps")
            sums.count("skipped_steps", 0.0 if stepped else 1.0)
            sums.add("grad_norm", grad_norm, 1.0)
            sums.extreme("grad_norm_max", grad_norm)
            sums.add("lr", lr, 1.0)

    # ------------------------------------------------------------------ weights out

    def weight_specs(self) -> list[tuple[str, tuple[int, ...], str]]:
        return [
            (name, tuple(param.shape), str(param.dtype).removeprefix("torch."))
            for name, param in self.sharding.module.named_parameters()
        ]

    def tied_embedding_name(self) -> str | None:
        return self.tied_embedding

    def join_weight_group(self, host: str, port: int, world_size: int, backend: str) -> None:
        from rayrep.sync.collective import open_group

        if self.rank == 0:
            self.weight_group = open_group(host, port, world_size, 0, backend, self.device)

    def broadcast_weights(self, manifest) -> float:
        """Gather full tensors (all ranks) and broadcast them from rank 0; returns seconds spent."""
        from rayrep.sync.collective import send_buckets

        start = time.perf_counter()
        with torch.no_grad():
            # Every rank iterates together: under FSDP2 each tensor is an all-gather.
            tensors = (tensor for _, tensor in self.sharding.full_tensors())
            if self.rank == 0:
                send_buckets(self.weight_group, manifest, tensors, self.device)
            else:
                for _ in tensors:  # take part in the all-gathers
                    pass
        return time.perf_counter() - start

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The full state dict on CPU at rank 0 (None elsewhere); every rank must call it."""
        state = {name: tensor.cpu().clone() for name, tensor in self.sharding.full_tensors()}
        return state if self.rank == 0 else None

    def save(self, path: str, base_model_path: str) -> str | None:
        """Save a Hugging Face checkpoint directory (rank 0 writes; every rank must call)."""
        from rayrep.models.checkpoint import save_checkpoint

        state = self.full_state_dict()
        if self.rank == 0:
            return save_checkpoint(state, base_model_path, path)
        return None

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


# The class stays plain (importable by name) so Ray pickles its methods by reference.
RemoteLearnerWorker = ray.remote(LearnerWorker)
