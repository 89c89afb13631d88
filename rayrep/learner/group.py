"""LearnerGroup: W LearnerWorker actors training one policy, behind typed methods."""

from __future__ import annotations

from collections.abc import Sequence

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError

from rayrep.cluster.placement import Placement, death_cause, weight_transport
from rayrep.config import Config
from rayrep.learner.sums import MetricSums
from rayrep.learner.worker import RemoteLearnerWorker
from rayrep.sync.collective import TensorSpec, WeightManifest
from rayrep.sync.transport import TRANSPORTS
from rayrep.types import BatchRecipe, LossSpec, TokenSequences, TrainBatch


def as_ref(value: object) -> ray.ObjectRef:
    """One object-store copy that every worker reads, however many workers there are."""
    return value if isinstance(value, ray.ObjectRef) else ray.put(value)


class LearnerGroup:
    def __init__(self, cfg: Config, model_path: str, placement: Placement):
        count = cfg.learner.num_workers
        threads = placement.plan.threads["learner"]
        self.workers = [
            RemoteLearnerWorker.options(**placement.options("learner", rank)).remote(cfg, rank, count, threads)
            for rank in range(count)
        ]
        master_addr, master_port = ray.get(self.workers[0].address.remote())
        ray.get([w.setup.remote(model_path, master_addr, master_port) for w in self.workers])
        self.base_model_path = model_path
        self.cfg = cfg

    def mean_entropies(self, answers: list[ray.ObjectRef | TokenSequences]) -> list[torch.Tensor]:
        """Per set of answers (`TokenSequences`, or a ref to one, as the replay buffer returns
        them), [N] mean token entropy of each answer over its own response tokens, under the
        current weights. Each rank reduces its rows: only N numbers per set come back."""
        refs = [as_ref(a) for a in answers]  # one copy in the object store, read by every rank
        pending = [[w.mean_entropies.remote(ref) for w in self.workers] for ref in refs]
        means = []
        for shares in (ray.get(p) for p in pending):
            rows = torch.cat([rows for rows, _ in shares])
            values = torch.empty(len(rows))
            values[rows] = torch.cat([v for _, v in shares])
            means.append(values)
        return means

    def kl_to_reference(self, batch: BatchRecipe | TrainBatch, estimator: str) -> tuple[torch.Tensor, torch.Tensor]:
        """([N] the sum over each row's response tokens of the KL estimate between the current
        weights and the reference policy, [N] its token count) for the rows of `batch` (the
        KL in the reward, `learner.kl.in_reward`); each rank computes its rows'."""
        ref = ray.put(batch)
        shares = ray.get([w.kl_to_reference.remote(ref, estimator) for w in self.workers])
        count = sum(len(rows) for rows, _, _ in shares)
        sums, tokens = torch.zeros(count, dtype=torch.float64), torch.zeros(count)
        for rows, values, counts in shares:
            sums[rows], tokens[rows] = values, counts
        return sums, tokens

    def update(self, batch: BatchRecipe | TrainBatch, loss: LossSpec,
               core_offers: Sequence[ray.ObjectRef] = ()) -> dict[str, float]:
        """Run the mini-batch updates of one rollout batch; returns merged metrics. The batch
        goes to the ranks as one object in the store, and each collates it (`collate`): a
        `BatchRecipe`, the training loop's, is small, and each rank reads the rows' arrays
        from where they are; a `TrainBatch` (tests, tools) is its own collation.
        `core_offers`: the generators' offers of their cores once idle, which the rank may
        borrow (`rayrep.cluster.cores`)."""
        ref = ray.put(batch)
        merged = MetricSums()
        for state in ray.get([w.update.remote(ref, loss, list(core_offers)) for w in self.workers]):
            merged.merge(MetricSums(state))
        metrics = merged.result()
        steps = metrics.get("optimizer_steps", 0)
        if steps:
            metrics["loss"] = metrics.pop("loss_sum") / steps
        return metrics

    def save_state(self, folder: str) -> dict:
        """Every rank writes its shards of the optimizer's state to `folder` (a file system
        every learner node sees); returns the shared part, for the run checkpoint's JSON."""
        return ray.get([w.save_state.remote(folder) for w in self.workers])[0]

    def load_state(self, folder: str, shared: dict) -> None:
        ray.get([w.load_state.remote(folder, shared) for w in self.workers])

    def offload(self, parameters: bool = True, optimizer: bool = True) -> None:
        """Every rank's parameters and/or optimizer state to host memory, its allocator's
        cache released (where the roles take turns; a part already there does not move)."""
        ray.get([w.offload.remote(parameters, optimizer) for w in self.workers])

    def onload(self) -> None:
        """Every rank's parameters and optimizer state back on its GPU (where the roles take turns)."""
        ray.get([w.onload.remote() for w in self.workers])

    def memory_reports(self) -> list[ray.ObjectRef]:
        """Refs to every rank's `Holding` (what it held on its GPU since its last report)."""
        return [w.memory_report.remote() for w in self.workers]

    def weight_manifest(self, bucket_bytes: int) -> WeightManifest:
        specs = ray.get(self.workers[0].weight_specs.remote())
        tied, adapter = ray.get([self.workers[0].tied_embedding_name.remote(), self.workers[0].adapter_config.remote()])
        tensors = [TensorSpec(name, shape, getattr(torch, dtype)) for name, shape, dtype in specs]
        return WeightManifest.build(tensors, bucket_bytes, tied_embedding=None if adapter else tied, adapter=adapter)

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0's node address and a free port there: the weight group's rendezvous."""
        return ray.get(self.workers[0].address.remote())

    def join_weight_group(self, host: str, port: int, world_size: int) -> list[ray.ObjectRef]:
        """The ranks that send join the weight transport: rank 0 (a broadcast), or the first
        `world_size - 1` (colocated handles: one per engine worker, the one beside it);
        returns refs to wait on with the generators' joins."""
        senders = TRANSPORTS[weight_transport(self.cfg)].senders(world_size)
        return [w.join_weight_group.remote(host, port, world_size) for w in self.workers[:senders]]

    def leave_weight_group(self) -> list[ray.ObjectRef]:
        """Every rank leaves the weight transport (to rebuild it); returns refs to wait on with the generators'."""
        return [w.leave_weight_group.remote() for w in self.workers]

    def broadcast_weights(self, manifest: WeightManifest, onload: bool = False) -> list[ray.ObjectRef]:
        """Every rank gathers; the ranks that joined the weight transport send (rank 0's
        broadcast, or each rank's handles); returns refs (wait on them with the receivers').
        `onload`: the learners' state is off the GPU now (the generators hold it)."""
        return [w.broadcast_weights.remote(manifest, onload) for w in self.workers]

    def save(self, path: str) -> str:
        return ray.get([w.save.remote(path, self.base_model_path) for w in self.workers])[0]

    def dead(self, timeout_s: float = 30.0) -> dict[int, str]:
        """The ranks whose actor died, with Ray's account of why. A rank that does not answer
        within `timeout_s` (stuck in a collective with a dead peer, say) is not counted."""
        calls = [w.pid.remote() for w in self.workers]
        ray.wait(calls, num_returns=len(calls), timeout=timeout_s)
        found = {}
        for rank, call in enumerate(calls):
            try:
                ray.get(call, timeout=0)
            except RayActorError as error:
                found[rank] = death_cause(error)
            except GetTimeoutError:
                pass
        return found

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Each learner leaves its process groups, then goes; a dead one (or one stuck with a
        dead peer) is not waited for beyond `timeout_s`."""
        left = [w.shutdown.remote() for w in self.workers]
        ray.wait(left, num_returns=len(left), timeout=timeout_s)
        for worker in self.workers:
            ray.kill(worker)
