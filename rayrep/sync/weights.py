"""WeightSync: after each update, the learner's weights go to every generator.

A sync gathers full tensors from the FSDP shards bucket by bucket and sends each bucket
through the run's weight transport (`rayrep.sync.transport`, chosen by
`rayrep.cluster.placement.weight_transport`): a broadcast from learner rank 0 over a group of
its own (gloo on CPU, NCCL on GPU) whose other members are the generator workers, or,
colocated, handles from each learner rank to the engine worker beside it. Generators load
everything in one `reload_weights` (`rayrep.generator.vllm_internals`) and move to the new policy
version. This module is the runtime's side; both ends run in the actors
(`LearnerWorker.broadcast_weights`, `GeneratorWorker.receive_weights`), and what it asks of
each group is `Senders` and `Receivers`, so that it imports neither.

A transport admits no new member: when a generator is replaced, every member leaves and a
new one is made with the replacement in it (`rebuild`), which then receives the current
weights at the current version. A generator that dies during a sync fails it: the learner
rank sending to it leaves (so the live generators stop waiting), and the runtime replaces
the dead one (`Runtime.sync_weights`), which rebuilds the transport and sends again.
"""

from __future__ import annotations

import time
from typing import Protocol

import ray

from rayrep.config import Config
from rayrep.sync.collective import WeightManifest


class Senders(Protocol):
    """What a sync asks of the learners (`rayrep.learner.group.LearnerGroup`)."""

    def weight_manifest(self, bucket_bytes: int) -> WeightManifest: ...

    def rendezvous_address(self) -> tuple[str, int]: ...

    def join_weight_group(self, host: str, port: int, world_size: int) -> list[ray.ObjectRef]: ...

    def leave_weight_group(self) -> list[ray.ObjectRef]: ...

    def broadcast_weights(self, manifest: WeightManifest, onload: bool = False) -> list[ray.ObjectRef]: ...


class Receivers(Protocol):
    """What a sync asks of the generators (`rayrep.generator.group.GeneratorGroup`): their
    actors (`join_weight_group`, `leave_weight_group`, `receive_weights` each) and a barrier."""

    workers: list

    def wait_until_idle(self) -> None: ...


def engine_ranks(engines: int, tensor_parallel_size: int) -> list[list[int]]:
    """Weight-group ranks of each engine's workers: learner rank 0 is rank 0, then engine e's
    tensor-parallel workers take 1 + e*T .. e*T + T (each receives the full tensors; vLLM's
    loader keeps its own shard of them)."""
    tp = tensor_parallel_size
    return [list(range(1 + e * tp, 1 + (e + 1) * tp)) for e in range(engines)]


class WeightSync:
    def __init__(self, cfg: Config, learners: Senders, generators: Receivers, version: int = 0):
        self.cfg, self.learners, self.generators = cfg, learners, generators
        self.manifest = learners.weight_manifest(int(cfg.sync.bucket_mb * 2**20))
        self.version = version
        self._join()

    def _join(self) -> None:
        """A new rendezvous: learner rank 0 and every worker of every engine of the generator group as it is now."""
        host, port = self.learners.rendezvous_address()
        ranks = engine_ranks(len(self.generators.workers), self.cfg.generator.tensor_parallel_size)
        world = 1 + sum(len(r) for r in ranks)
        # Every member's join must be in flight together: the rendezvous waits for all.
        ray.get(
            self.learners.join_weight_group(host, port, world)
            + [g.join_weight_group.remote(host, port, world, r[0]) for g, r in zip(self.generators.workers, ranks)]
        )

    def push(self) -> dict[str, float]:
        """Send the current weights to every generator, as the next policy version; returns
        timing and size."""
        self.version += 1
        return self._send(onload=False)

    def rebuild(self) -> dict[str, float]:
        """After a generator was replaced (`GeneratorGroup.complete`): a group admits no new
        member, so every member leaves it and a new one is made with the group's generators as
        they are now; then the current weights go to all of them at the current version (no
        new version: the survivors receive what they hold). The learners' parameters may be in
        host memory (the engines' turn on shared GPUs): they come back for it and leave after."""
        ray.get(self.learners.leave_weight_group() + [g.leave_weight_group.remote() for g in self.generators.workers])
        self._join()
        return self._send(onload=True)

    def _send(self, onload: bool) -> dict[str, float]:
        start = time.perf_counter()
        # No collective is queued before every engine is free to receive: a receive queued
        # behind a round sampled ahead (asynchronous rollouts) would leave learner rank 0's
        # first broadcast waiting on the group's timeout for as long as that round samples.
        self.generators.wait_until_idle()
        ray.get(
            self.learners.broadcast_weights(self.manifest, onload)
            + [g.receive_weights.remote(self.manifest, self.version) for g in self.generators.workers]
        )
        return self.timing(time.perf_counter() - start)

    def timing(self, seconds: float) -> dict[str, float]:
        size = self.manifest.total_bytes
        return {"policy_version": self.version, "sync_seconds": seconds, "sync_bytes": size, "sync_gbps": size / seconds / 1e9}
