"""LearnerGroup: W LearnerWorker actors training one policy, behind typed methods."""

from __future__ import annotations

import ray
import torch

from rayrep.config import Config
from rayrep.learner.worker import RemoteLearnerWorker
from rayrep.metrics import MetricSums
from rayrep.sync.collective import TensorSpec, WeightManifest
from rayrep.types import LossSpec, TrainBatch


class LearnerGroup:
    def __init__(self, cfg: Config, model_path: str, placement, total_optimizer_steps: int):
        count = cfg.learner.num_workers
        threads = placement.plan.threads["learner"]
        self.workers = [
            RemoteLearnerWorker.options(**placement.options("learner", rank)).remote(cfg, rank, count, threads)
            for rank in range(count)
        ]
        master_addr, master_port = ray.get(self.workers[0].address.remote())
        ray.get([w.setup.remote(model_path, master_addr, master_port, total_optimizer_steps) for w in self.workers])
        self.base_model_path = model_path

    def compute_logprobs(self, batch: TrainBatch | ray.ObjectRef, with_entropy: bool = False):
        """Per-token log-probs [N, L] (and entropies, or None) of every row under the current weights."""
        ref = batch if isinstance(batch, ray.ObjectRef) else ray.put(batch)
        shares = ray.get([w.compute_logprobs.remote(ref, with_entropy) for w in self.workers])
        rows = torch.cat([s["rows"] for s in shares])
        logprobs = torch.empty(len(rows), shares[0]["logprobs"].shape[1])
        logprobs[rows] = torch.cat([s["logprobs"] for s in shares])
        entropy = None
        if with_entropy:
            entropy = torch.empty_like(logprobs)
            entropy[rows] = torch.cat([s["entropy"] for s in shares])
        return logprobs, entropy

    def update(self, batch: TrainBatch | ray.ObjectRef, loss: LossSpec) -> dict[str, float]:
        """Run the mini-batch updates of one rollout batch; returns merged metrics."""
        ref = batch if isinstance(batch, ray.ObjectRef) else ray.put(batch)
        merged = MetricSums()
        for state in ray.get([w.update.remote(ref, loss) for w in self.workers]):
            merged.merge(MetricSums(state))
        metrics = merged.result()
        steps = metrics.get("optimizer_steps", 0)
        if steps:
            metrics["loss"] = metrics.pop("loss_sum") / steps
        return metrics

    def weight_manifest(self, bucket_bytes: int) -> WeightManifest:
        specs = ray.get(self.workers[0].weight_specs.remote())
        tied = ray.get(self.workers[0].tied_embedding_name.remote())
        tensors = [TensorSpec(name, shape, getattr(torch, dtype)) for name, shape, dtype in specs]
        return WeightManifest.build(tensors, bucket_bytes, tied_embedding=tied)

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0's node address and a free port there: the weight group's rendezvous."""
        return ray.get(self.workers[0].address.remote())

    def join_weight_group(self, host: str, port: int, world_size: int, backend: str) -> list[ray.ObjectRef]:
        """Rank 0 joins as group rank 0; returns refs to wait on with the generators' joins."""
        return [self.workers[0].join_weight_group.remote(host, port, world_size, backend)]

    def broadcast_weights(self, manifest: WeightManifest) -> list[ray.ObjectRef]:
        """Every rank gathers, rank 0 broadcasts; returns refs (wait on them with the receivers')."""
        return [w.broadcast_weights.remote(manifest) for w in self.workers]

    def state_dict_for_sync(self) -> dict[str, torch.Tensor]:
        """Full CPU state dict, gathered from the shards (for checks and small models)."""
        return ray.get([w.full_state_dict.remote() for w in self.workers])[0]

    def save(self, path: str) -> str:
        return ray.get([w.save.remote(path, self.base_model_path) for w in self.workers])[0]

    def shutdown(self) -> None:
        ray.get([w.shutdown.remote() for w in self.workers])
        for worker in self.workers:
            ray.kill(worker)
