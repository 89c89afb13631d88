"""LearnerWorker: one data-parallel rank of the policy's training group (a Ray actor).

W workers form one `torch.distributed` group (gloo on CPU, NCCL on GPU) and shard the
policy with FSDP2 or DeepSpeed ZeRO-2 (`rayrep/learner/sharding.py`; a single fp32 rank
trains the model itself, as plain PyTorch does). Every rank receives the
step's `BatchRecipe` (where each row's arrays are: the generators' parts and the buffer
shards' draws, by reference), collates the whole `TrainBatch` itself and picks its own
rows, so the split needs no communication and every rank knows the mini-batch's global
token count, which makes token-mean exact across ranks and micro-batches.

The worker knows nothing of the algorithm: rows, advantages, masks and a `LossSpec`. It owns
the rank's state (where it is, its moves, its updates, its sync and saves); the forward passes
and how rows are split are `rayrep.learner.forward`'s.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

import ray
import torch
import torch.distributed as dist

from rayrep.cluster.cores import CoreLoan
from rayrep.cluster.memory import (FORWARD_PASS, GRADIENTS, LEARNER, MASTER_GATHERED, OPTIMIZER, PARAMETERS, REFERENCE,
                                   UPDATE, WHOLE_TENSOR, memory_plan)
from rayrep.cluster.residency import ABSENT, DEVICE, HOST, Holding, Residency
from rayrep.config import Config
from rayrep.heap import keep_freed_memory, long_lived
from rayrep.learner.forward import Entropy, PolicyForward, idle_rows, mini_batches, rows_per_rank
from rayrep.learner.loss import kl_penalty, mini_batch_totals, policy_loss
from rayrep.learner.mismatch import correct, correction_sums, mismatch_sums
from rayrep.learner.reference import FrozenPolicy, Reference
from rayrep.learner.sharding import Sharding, compute_dtype, with_lora
from rayrep.learner.sums import MetricSums
from rayrep.library_output import route_library_output
from rayrep.models.adapter import file_key, lora_config, write_adapter
from rayrep.sync.collective import TIED_EMBEDDING, WeightManifest
from rayrep.types import BatchRecipe, LossSpec, TokenSequences, TrainBatch

if TYPE_CHECKING:
    from rayrep.sync.transport import WeightChannel

class LearnerWorker:
    def __init__(self, cfg: Config, rank: int, world_size: int, threads: int):
        from rayrep.cluster.placement import pinned_cores

        route_library_output()

        cores = pinned_cores(cfg, "learner", rank, threads)
        if cores is not None:  # before any thread starts: the threads inherit it
            os.sched_setaffinity(0, cores)
        if cfg.placement.device == "gpu" and not cfg.placement.threads:
            # A GPU learner's CPU work (casts and copies of checkpoints, host-memory moves) gets
            # its GPU's share of the node's cores, not the one CPU Ray accounts its bundle.
            threads = max(threads, (os.cpu_count() or 1) // cfg.placement.gpus_per_node)
        torch.set_num_threads(threads)
        if cfg.placement.device == "cpu":  # an update's activations: no fresh pages for each (rayrep.heap)
            keep_freed_memory()
        torch.manual_seed(cfg.run.seed)
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        on_gpu = cfg.placement.device == "gpu"
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        self.weight_channel: WeightChannel | None = None
        plan = memory_plan(cfg)
        self.residency = Residency(f"learner rank {rank}", LEARNER,
                                   {PARAMETERS: ABSENT, REFERENCE: ABSENT, OPTIMIZER: ABSENT},
                                   plan.sizes[LEARNER] if plan else None, self.device)
        """Where this rank's parameters and optimizer state are (and, where the run models
        its GPUs, what it holds on its GPU): every operation below checks it first."""
        # The policy, once `setup` has loaded and sharded it:
        self.sharding: Sharding | None = None
        self.forward: PolicyForward | None = None
        self.reference: Reference | None = None
        """The KL penalty's reference policy (`learner.kl.coef`), or None."""
        self.frozen_reference: FrozenPolicy | None = None
        """Its own weights (None with LoRA: the base with the adapter off is the reference)."""
        self.lora = None
        """The LoRA adapter this group trains on the frozen base (`learner.lora_rank`), or None."""
        self.tied_embedding: str | None = None
        """The input embedding's name where the output head shares it (a sync sends it once)."""
        self.config_overrides: dict = {}
        """What the run's config changes of the policy's own (`rayrep.models.config_overrides`)."""

    def pid(self) -> int:
        """The process holding this rank (whether it still answers: `LearnerGroup.dead`)."""
        return os.getpid()

    def address(self) -> tuple[str, int]:
        """This worker's node address and a port free on it (rank 0 hosts the rendezvous)."""
        from rayrep.cluster.placement import free_port

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, model_path: str, master_addr: str, master_port: int) -> None:
        """Join the data-parallel group, load and shard the policy, build the optimizer.

        The weights load in the checkpoint's dtype and become fp32 as they are sharded
        (`sharding.make_masters`): they are the master weights that the optimizer updates;
        the sharding computes in `model.dtype` (mixed precision). A LoRA run's frozen base
        loads in `model.dtype`, its adapter's masters are fp32.
        """
        with long_lived():
            from transformers import AutoModelForCausalLM

            from rayrep.learner.sharding import make_sharding

        cfg, rank, world_size = self.cfg, self.rank, self.world_size
        dist.init_process_group(
            cfg.placement.collective_backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(minutes=30),
        )
        from rayrep.models import config_overrides

        self.config_overrides = config_overrides(cfg, model_path)
        # Loaded on the CPU, in the checkpoint's own dtype: each rank keeps only its shard on the
        # device, and the sharding makes the fp32 masters of its shards as it shards each layer
        # (an fp32 load would hold a whole fp32 copy of the policy per rank: 30.9 GB for a 7B
        # one). A LoRA run's base is frozen in the compute dtype: loaded in it (PEFT makes the
        # adapter fp32 all the same).
        lora = cfg.learner.lora_rank > 0
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=compute_dtype(cfg) if lora else "auto",
                                                     **self.config_overrides)
        model.config.use_cache = False
        if cfg.learner.gradient_checkpointing:
            # Keep each layer's input only and recompute the rest in backward.
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.tied_embedding = TIED_EMBEDDING if model.config.tie_word_embeddings else None
        self.lora = lora_config(cfg, model_path) if lora else None
        if self.lora is not None:
            model = with_lora(model, self.lora, compute_dtype(cfg))
        self.sharding = make_sharding(model, cfg, world_size, self.device)
        self.sharding.model.train()
        self.forward = PolicyForward(cfg, self.sharding, self.device, rank, world_size)
        if cfg.learner.kl.coef:
            # The run's starting policy, whatever a resume loads into the policy after.
            if self.lora is None:
                self.frozen_reference = FrozenPolicy.load(model_path, cfg, world_size, self.device,
                                                          self.config_overrides)
                self.residency.sizes[REFERENCE] = self.frozen_reference.nbytes()
                self.residency.move(REFERENCE, DEVICE)
            self.reference = Reference(cfg, self.frozen_reference or self.sharding, self.device, rank, world_size,
                                       lora=self.lora is not None)
        if cfg.learner.sharding.shards_parameters:
            # This rank's shards as they are: the parameters (fp32, or a frozen LoRA base in the
            # compute dtype), and for those that train, two fp32 moments and an fp32 gradient.
            local = [p.to_local() if hasattr(p, "to_local") else p for p in self.sharding.model.parameters()]
            trained = 4 * sum(t.numel() for t, p in zip(local, self.sharding.model.parameters()) if p.requires_grad)
            self.residency.sizes.update({PARAMETERS: sum(t.numel() * t.element_size() for t in local),
                                         OPTIMIZER: 2 * trained, GRADIENTS: trained})
        self.residency.move(PARAMETERS, DEVICE)
        if not cfg.learner.sharding.state_moves:  # (DeepSpeed's fp32 partitions exist from the start, on the GPU for good)
            self.residency.move(OPTIMIZER, DEVICE)
        self.offload()  # colocated: the engines start once the learners' state has left the GPU

    # ------------------------------------------------------------------ forward passes and training

    def mean_entropies(self, answers: TokenSequences) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, [n] mean token entropy of each answer over its policy's tokens) for this
        rank's share of `answers` (ExGRPO's choice of the answer to replay: the stored answers,
        a ref resolved by Ray, as the replay shards packed them); each answer is a row and a
        question of its own."""
        prompts, responses, tool_masks = answers.sequences()
        batch = TrainBatch.of_sequences(prompts, responses, range(len(responses)), tool_masks=tool_masks)
        # Colocated, the hand-over to the learners brought the state back; this pass moves nothing.
        self.residency.require("ExGRPO's entropy pass", PARAMETERS)
        with self.residency.working_on(FORWARD_PASS):
            return self.forward.mean_entropies(batch)

    def kl_to_reference(self, batch: BatchRecipe | TrainBatch, estimator: str
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, [n] each row's summed KL estimate between these weights and the reference,
        [n] its valid tokens) for this rank's share of `batch` (the KL in the reward): the
        policy's log-probs and the reference's, each a pass without a graph."""
        batch = batch.collate()
        self.residency.require("the KL in the reward", PARAMETERS, self._reference_part())
        steps = [range(batch.num_prompts)]
        with self.residency.working_on(FORWARD_PASS):
            rows, policy = self.forward.old_logprobs(batch, rows_per_rank(batch.prompt_index, steps[0], self.world_size))
            reference = self.reference.logprobs(batch, steps)[rows]
        mask = batch.response_mask[rows]
        kl = kl_penalty(policy.double(), reference.double(), estimator, mask, torch.float64)
        return rows, kl.sum(-1), mask.sum(-1).float()

    def _reference_part(self) -> str:
        """The part the reference's pass reads: its own weights, or with LoRA the policy's."""
        return REFERENCE if self.frozen_reference is not None else PARAMETERS

    def update(self, batch: BatchRecipe | TrainBatch, loss: LossSpec,
               core_offers: Sequence[ray.ObjectRef] = ()) -> dict:
        """Mini-batch policy-gradient updates over `batch`; returns metric sums to merge across ranks.
        `core_offers`: generators' offers of their cores once idle, borrowed between passes once
        every one has resolved (`rayrep.cluster.cores`; in a list, so Ray passes the refs).
        A recipe's rows are read from where the generators and buffer shards left them, and
        collated here: every rank the whole batch, so that the rows' padding, and so the
        numbers, are what one collation gives.

        Needs the parameters and the optimizer state on the device (the state appears there
        with the first step). Where the roles take turns, the allocator's cache is released at
        the end: it would keep the update's peak through the weight sync that follows."""
        self._require_state("an update")
        batch = batch.collate()
        with self.residency.working_on(UPDATE), CoreLoan(core_offers) as loan:
            sums = self._update(batch, loss, loan)
        if core_offers:
            sums.add("update_on_lent_cores", loan.borrowed_share(), 1.0)
        if self.sharding.optimizer.state and self.residency.at(OPTIMIZER) == ABSENT:
            self.residency.move(OPTIMIZER, self.residency.at(PARAMETERS))  # AdamW made it beside the parameters
        if self.cfg.placement.takes_turns:
            self.residency.release_cache()
        return sums.state()

    def _require_state(self, operation: str) -> None:
        self.residency.require(operation, PARAMETERS)
        if self.residency.at(OPTIMIZER) != ABSENT:  # (absent until the first step makes it)
            self.residency.require(operation, OPTIMIZER)

    def _update(self, batch: TrainBatch, loss: LossSpec, loan: CoreLoan) -> MetricSums:
        learner = self.cfg.learner
        steps = mini_batches(batch.num_prompts, learner.mini_batch_prompts)
        sums = MetricSums()
        old_logprobs = batch.old_logprobs.clone()
        # Decoupled PPO: every row's "old" is the proximal policy (these weights, before the
        # update); the recorded log-probs stay as the behaviour policy's.
        recompute_old = torch.ones_like(batch.recompute_old) if loss.behaviour_cap is not None else batch.recompute_old
        rejects = loss.correction is not None and loss.correction.rejects
        start = time.perf_counter()
        if recompute_old.any():
            # Later mini-batches see updated weights, so their "old" must be taken before any
            # update. The first mini-batch's weights have not moved when it is trained: its
            # first forward pass is the old policy, and it takes its own (no separate pass),
            # unless a rejection must know every mini-batch's kept tokens before training it.
            for prompts in steps[0 if rejects else 1:]:
                loan.take()
                rows, recomputed = self.forward.old_logprobs(batch, rows_per_rank(batch.prompt_index, prompts, self.world_size))
                recompute = recompute_old[rows]
                old_logprobs[rows[recompute]] = recomputed[recompute]
        kept_counts = self._kept_token_counts(batch, steps, old_logprobs, loss) if rejects else None
        if self.rank == 0:
            sums.count("time_old_logprobs", time.perf_counter() - start)
            sums.add("lr", self.sharding.scheduler.get_last_lr()[0], 1.0)  # the rate of every step of this rollout
        ref_logprobs = None
        if loss.kl_coef:
            if self.reference is None:
                raise ValueError(f"the loss has a KL penalty (kl_coef={loss.kl_coef}) but these learners started "
                                 "without a reference policy: learner.kl.coef was 0")
            start = time.perf_counter()
            self.residency.require("the reference pass", self._reference_part())
            ref_logprobs = self.reference.logprobs(batch, steps)
            if self.rank == 0:
                sums.count("time_ref_logprobs", time.perf_counter() - start)
        for epoch in range(learner.epochs):
            for index, prompts in enumerate(steps):
                own_old = recompute_old if epoch == 0 and index == 0 and not rejects else None
                self._step(batch, prompts, old_logprobs, own_old, loss, sums, loan, kept_counts, ref_logprobs)
        self.sharding.scheduler.step()  # the schedule counts rollouts, not optimizer steps
        return sums

    def _step(self, batch, prompts: range, old_logprobs, recompute_now: torch.Tensor | None, loss: LossSpec,
              sums: MetricSums, loan: CoreLoan, kept_counts: torch.Tensor | None = None,
              ref_logprobs: torch.Tensor | None = None) -> None:
        """One optimizer step on the questions `prompts`. `recompute_now`: the rows whose old
        log-probs are this pass's own (the first mini-batch of a rollout, before any update),
        or None; their log-probs are kept in `old_logprobs` for the later epochs.
        `kept_counts`: each row's tokens left by the mismatch correction's rejection; `ref_logprobs`:
        the reference policy's log-probs of every row of this rank (the KL penalty's)."""
        shares = rows_per_rank(batch.prompt_index, prompts, self.world_size)
        # The counts over every rank and micro-batch of this mini-batch.
        rows_of_all = torch.cat(shares)
        counted = batch.response_mask[rows_of_all] if kept_counts is None else kept_counts[rows_of_all]
        totals = mini_batch_totals(counted, loss.agg, self.cfg.learner.micro_batch_size)
        passes = self._passes(batch, shares, loss)
        split = self._forward_only_allowed(loss)
        last_trained = max(index for index, (_, trains) in enumerate(passes) if trains)
        entropy_mode: Entropy = "grad" if loss.entropy_coef else "detached"
        for index, (chunk, trains) in enumerate(passes):
            loan.take()  # before each pass, forward and backward: the lent cores too, once idle
            with contextlib.nullcontext() if trains else torch.no_grad():
                value = self._pass(batch, chunk, entropy_mode, old_logprobs, recompute_now, loss, sums, totals,
                                   ref_logprobs)
            if split and len(chunk):
                sums.add("forward_only_frac", 0.0 if trains else float(len(chunk)), float(len(chunk)))
            if trains:
                # Gradients are averaged over ranks; the loss is already a global mean.
                loan.take()
                self.sharding.backward(value * self.world_size, last_micro_batch=index == last_trained)
            elif passes[index + 1][1]:  # the last pass without a graph: as after any (FSDP2's root sharded)
                self.forward.after_pass_without_graph()
            # Each micro-batch's value is its share of the mini-batch loss: they sum to it.
            sums.count("loss_sum", float(value.detach()))
        grad_norm, stepped = self.sharding.step()
        if self.rank == 0:  # the same on every rank: count it once
            sums.count("optimizer_steps")
            sums.count("skipped_steps", 0.0 if stepped else 1.0)
            sums.add("grad_norm", grad_norm, 1.0)
            sums.largest("grad_norm_max", grad_norm)

    def _forward_only_allowed(self, loss: LossSpec) -> bool:
        return self.cfg.learner.forward_only_idle_questions and not loss.kl_coef and not loss.entropy_coef

    def _passes(self, batch: TrainBatch, shares: list[torch.Tensor], loss: LossSpec
                ) -> list[tuple[torch.Tensor, bool]]:
        """This rank's micro-batches of a mini-batch, each with whether it trains (a graph and
        a backward). With `learner.forward_only_idle_questions`, where the loss has no KL or
        entropy term, a question whose every answer has advantage 0 adds exactly 0 to the
        loss and its gradient (each objective's token loss is a product with the advantage):
        such questions pass first, forward only, for the metrics (and the old log-probs they
        keep), while the mini-batch's counts still hold them, so the loss is the same sum.
        Every rank runs as many passes of each kind (`micro_chunks`)."""
        if self._forward_only_allowed(loss):
            idle = idle_rows(batch)
            trained = [rows[~idle[rows]] for rows in shares]
            if any(len(rows) for rows in trained) and any(bool(idle[rows].any()) for rows in shares):
                untrained = self.forward.micro_chunks(batch, [rows[idle[rows]] for rows in shares])
                return [(chunk, False) for chunk in untrained] + \
                    [(chunk, True) for chunk in self.forward.micro_chunks(batch, trained)]
        return [(chunk, True) for chunk in self.forward.micro_chunks(batch, shares)]

    def _pass(self, batch: TrainBatch, chunk: torch.Tensor, entropy_mode: Entropy, old_logprobs: torch.Tensor,
              recompute_now: torch.Tensor | None, loss: LossSpec, sums: MetricSums, totals, ref_logprobs
              ) -> torch.Tensor:
        """The forward pass of one micro-batch and its share of the mini-batch loss; its
        metrics go to `sums`."""
        run = self.forward(batch, chunk, entropy_mode)
        logp, entropy, width, dummy = run.logp, run.entropy, run.width, run.dummy
        if not dummy:  # positions the forward pass computed that hold no token
            sums.add("padding_frac", float(run.positions - run.tokens), float(run.positions))
        rows = chunk if not dummy else torch.zeros(1, dtype=torch.long)
        mask = batch.response_mask[rows, :width].to(self.device)
        if dummy:
            mask = torch.zeros_like(mask)
        old = old_logprobs[rows, :width].to(self.device)
        if recompute_now is not None:
            own = recompute_now[rows]
            old = torch.where(own.to(self.device)[:, None], logp.detach(), old)
            if not dummy:
                old_logprobs[rows[own], :width] = logp.detach()[own.to(self.device)].cpu()
        behaviour = batch.old_logprobs[rows, :width].to(self.device) if loss.behaviour_cap is not None else None
        trained, weights = mask, None
        if loss.correction is not None and not dummy:
            trained, weights = self._correct(batch, rows, old, mask, loss, sums)
        value, metrics = policy_loss(
            logp, old, batch.advantages[rows].to(self.device), trained, loss,
            replay_mask=batch.replay_mask[rows].to(self.device), entropy=entropy, totals=totals,
            behaviour_logp=behaviour, correction_weights=weights,
            ref_logp=None if ref_logprobs is None else ref_logprobs[rows, :width].to(self.device),
        )
        if not dummy:
            self._note_mismatch(batch, rows, old, mask, sums)
            sums.add_loss_metrics(metrics)
        return value

    def _correct(self, batch: TrainBatch, rows: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, loss: LossSpec,
                 sums: MetricSums | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The mismatch correction of the fresh rows among `rows` (`rayrep.learner.mismatch`):
        (the mask without the tokens it rejects, the PPO losses' weights or None); what it
        did goes to `sums`. Replayed rows keep every token and a weight of 1."""
        fresh = ~batch.replay_mask[rows]
        if not fresh.any():
            return mask, None
        on_device = fresh.to(self.device)
        engine = batch.old_logprobs[rows[fresh], : old.shape[1]].to(self.device)
        corrected = correct(old[on_device].double(), engine.double(), mask[on_device], loss.correction)
        if sums is not None:
            for name, (total, count) in correction_sums(mask[on_device], corrected, loss.correction).items():
                sums.add(name, total, count)
        kept = mask.bool().clone()
        kept[on_device] = corrected.kept
        if corrected.weights is None:
            return kept, None
        weights = torch.ones_like(old)
        weights[on_device] = corrected.weights.to(old.dtype)
        return kept, weights

    def _kept_token_counts(self, batch: TrainBatch, steps: list[range], old_logprobs: torch.Tensor, loss: LossSpec
                           ) -> torch.Tensor:
        """[N] each row's valid tokens once the correction's rejection is applied: this rank
        counts its own rows of every mini-batch in `steps` (their old log-probs are all taken),
        and the ranks add theirs up, so that each knows every mini-batch's counts before it
        trains. One small all-reduce per update."""
        counts = torch.zeros(len(batch.lengths), dtype=torch.float64)
        own = torch.cat([rows_per_rank(batch.prompt_index, prompts, self.world_size)[self.rank] for prompts in steps])
        for rows in own.split(self.cfg.learner.micro_batch_size):
            width = int(batch.lengths[rows].max())
            mask = batch.response_mask[rows, :width].to(self.device)
            kept, _ = self._correct(batch, rows, old_logprobs[rows, :width].to(self.device), mask, loss, None)
            counts[rows] = kept.sum(-1).double().cpu()
        if self.world_size > 1:
            counts = counts.to(self.device)
            dist.all_reduce(counts)
            counts = counts.cpu()
        return counts

    def _note_mismatch(self, batch: TrainBatch, rows: torch.Tensor, old: torch.Tensor, mask: torch.Tensor,
                       sums: MetricSums) -> None:
        """How far the engines' log-probs of the fresh answers they sampled are from the
        learner's, at the weights the update began with (`rayrep.learner.mismatch`): the same
        weights on both sides, so what differs is the engines' kernels and dtype (and, with
        asynchronous rollouts, the versions between). Replayed answers are left out: their
        recorded log-probs are an older policy's, or none."""
        fresh = ~batch.replay_mask[rows]
        if not fresh.any():
            return
        on_device = fresh.to(self.device)
        engine = batch.old_logprobs[rows[fresh], : old.shape[1]].to(self.device)
        for name, (total, count) in mismatch_sums(old[on_device].double(), engine.double(), mask[on_device]).items():
            sums.add(name, total, count)

    # ------------------------------------------------------------------ taking turns with the generators

    def onload(self, optimizer: bool = True) -> list[str]:
        """Bring the parameters (and the optimizer state, and the KL's reference policy: what
        only an update needs) back to the GPU, where the roles take turns (FSDP2; DeepSpeed's
        state never leaves, the reference does); returns the parts that moved: none when they are there already
        (or, the optimizer's, not made yet)."""
        return self._move((PARAMETERS, REFERENCE, OPTIMIZER) if optimizer else (PARAMETERS,), DEVICE)

    def offload(self, parameters: bool = True, optimizer: bool = True) -> list[str]:
        """Move the parameters and/or the optimizer state (with the reference policy) to host
        memory while the colocated engines use the GPU (FSDP2; DeepSpeed's state stays), and
        release the allocator's cache, which would keep what the last operation freed; returns
        the parts that moved."""
        asked = ((PARAMETERS, parameters), (REFERENCE, optimizer), (OPTIMIZER, optimizer))
        moved = self._move(tuple(part for part, wanted in asked if wanted), HOST)
        if self.cfg.placement.takes_turns:
            self.residency.release_cache()
        return moved

    def _move(self, parts: tuple[str, ...], to: str) -> list[str]:
        if not self.cfg.placement.takes_turns:
            return []
        # DeepSpeed's state stays where its engine put it; the reference policy is our own module.
        movable = (PARAMETERS, REFERENCE, OPTIMIZER) if self.cfg.learner.sharding.state_moves else (REFERENCE,)
        target = self.device if to == DEVICE else torch.device("cpu")
        moved = []
        for part in parts:
            if part not in movable or self.residency.at(part) in (to, ABSENT):
                continue
            if part == PARAMETERS:
                self.sharding.model.to(target)  # FSDP2 moves each rank's shards
            elif part == REFERENCE:
                self.frozen_reference.model.to(target)
            else:
                for state in self.sharding.optimizer.state.values():
                    for name, value in state.items():
                        if torch.is_tensor(value) and value.dim() > 0:
                            state[name] = value.to(target, non_blocking=True)
            self.residency.move(part, to)
            moved.append(part)
        return moved

    def memory_report(self) -> Holding:
        """What this rank holds on its GPU, now and at its peak since the last report (`Residency.report`)."""
        return self.residency.report()

    # ------------------------------------------------------------------ weights out

    def weight_specs(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, global shape, dtype) of what a sync sends: the compute dtype (bf16 on the
        paper presets), which the generators run in; the fp32 masters stay here. With LoRA,
        the adapter's tensors alone, by the names of PEFT's files (the engines keep the base)."""
        if self.lora is not None:
            return [(file_key(name), tuple(param.shape), self.cfg.model.dtype)
                    for name, param in self.sharding.module.named_parameters() if param.requires_grad]
        return [(name, tuple(param.shape), self.cfg.model.dtype) for name, param in self.sharding.module.named_parameters()]

    def adapter_config(self):
        """The `peft.LoraConfig` of the adapter this group trains (a sync's manifest carries
        it, for the engines to write the adapter they load), or None: full weights."""
        return self.lora

    def tied_embedding_name(self) -> str | None:
        return self.tied_embedding

    def join_weight_group(self, host: str, port: int, world_size: int) -> None:
        """This rank's end of the weight transport (`rayrep.cluster.placement.weight_transport`): rank
        0 broadcasts to every engine worker, or, colocated, each rank hands the engine worker
        beside it its tensors."""
        from rayrep.cluster.placement import weight_transport
        from rayrep.sync.transport import TRANSPORTS

        self.weight_channel = TRANSPORTS[weight_transport(self.cfg)].join_as_learner(
            host, port, world_size, self.rank, self.cfg.placement.collective_backend, self.device,
            timedelta(seconds=self.cfg.sync.timeout_s))

    def leave_weight_group(self) -> None:
        """Leave the weight transport (it is rebuilt when a generator is replaced)."""
        if self.weight_channel is not None:
            self.weight_channel.close()
            self.weight_channel = None

    def broadcast_weights(self, manifest: WeightManifest, onload: bool = False) -> float:
        """Gather full tensors (all ranks) and send them through this rank's end of the weight
        transport, if it has one; returns seconds spent. `onload`: the state is off the GPU (a
        sync while colocated generators hold it, for a replaced generator): the weights come
        back for the gathers and leave again."""
        start = time.perf_counter()
        moved = self.onload(optimizer=False) if onload else []
        self.residency.require("a weight sync", PARAMETERS)
        with torch.no_grad(), self.residency.working_on((WHOLE_TENSOR,)):
            # Every rank iterates together: under FSDP2 each tensor is an all-gather.
            tensors = (tensor for _, tensor in self.sharding.full_tensors(compute_dtype(self.cfg),
                                                                          trained_only=self.lora is not None))
            try:
                if self.weight_channel is not None:
                    self.weight_channel.send(manifest, tensors, self.residency)
            except Exception:  # a generator died mid-sync (the runtime replaces it: `Runtime.sync_weights`)
                self.leave_weight_group()  # the live generators' receives fail now, not at the timeout
                raise
            finally:
                for _ in tensors:  # the other ranks' all-gathers still need this one's
                    pass
        if moved:
            self.offload(optimizer=False)
        return time.perf_counter() - start

    def full_state_dict(self, dtype: torch.dtype = torch.float32, trained_only: bool = False
                        ) -> dict[str, torch.Tensor] | None:
        """The full weights (`trained_only`: the LoRA adapter's) on CPU at rank 0 (None
        elsewhere), the fp32 masters unless `dtype` says otherwise; every rank must call it.
        Gathered in CPU memory: nothing comes back to the GPU (`Sharding.full_state`)."""
        return self.sharding.full_state(dtype, self.rank, trained_only)

    def save(self, path: str, base_model_path: str) -> str | None:
        """Save the policy in `model.dtype` (rank 0 writes; every rank must call): a Hugging
        Face checkpoint directory, or with LoRA the adapter in PEFT's format beside the base's
        tokenizer (`rayrep.models.adapter`)."""
        from rayrep.models.checkpoint import save_checkpoint

        # DeepSpeed gathers each fp32 master whole on the GPU (FSDP2 casts its shards where they lie).
        with self.residency.working_on((MASTER_GATHERED,)):
            state = self.full_state_dict(compute_dtype(self.cfg), trained_only=self.lora is not None)
        if self.rank != 0:
            return None
        if self.lora is not None:
            return write_adapter(path, {file_key(name): t for name, t in state.items()}, self.lora, with_tokenizer=True)
        return save_checkpoint(state, base_model_path, path, self.config_overrides)

    def save_state(self, folder: str) -> dict | None:
        """Write this rank's part of the learner checkpoint (fp32 masters, AdamW moments) to
        `folder`, from where the shards lie (CPU memory while the engines hold the GPU); rank
        0 returns the state all ranks share (see `FSDP2Sharding.save_state`)."""
        from pathlib import Path

        shared = self.sharding.save_state(Path(folder), self.rank, self.world_size)
        return shared if self.rank == 0 else None

    def load_state(self, folder: str, shared: dict) -> None:
        """Continue from a learner checkpoint, written by a group of this size or another.
        Each shard is loaded where the parameters are (host memory while colocated engines
        hold the GPU) and the optimizer state made there: nothing comes to the GPU for it."""
        from pathlib import Path

        self.sharding.load_state(Path(folder), shared)
        if self.sharding.optimizer.state:
            self.residency.move(OPTIMIZER, self.residency.at(PARAMETERS))

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


# The class stays plain (importable by name) so Ray pickles its methods by reference.
RemoteLearnerWorker = ray.remote(LearnerWorker)
