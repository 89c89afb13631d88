"""GeneratorWorker: a Ray actor owning one vLLM engine.

It samples rollouts with their behaviour log-probs, scores given sequences (for checks
and evaluation), and loads new weights from the learner through the weight-sync group.
"""

from __future__ import annotations

import ray

from rayrep.config import Config
from rayrep.sync.collective import WeightManifest
from rayrep.types import Rollout


class GeneratorWorker:
    def __init__(self, cfg: Config, model_path: str, worker_index: int, threads: int):
        import torch

        from rayrep.generator.engine import make_engine

        torch.set_num_threads(threads)
        self.cfg = cfg
        self.version = 0
        self.llm = make_engine(
            cfg,
            model_path,
            seed=cfg.seed("generator", worker_index),
            worker_extension_cls="rayrep.sync.vllm_ext.WeightSyncExtension",
        )

    def generate(
        self, prompt_ids: list[list[int]], n: int | list[int], temperature: float, top_p: float, max_tokens: int
    ) -> list[list[Rollout]]:
        from rayrep.generator.engine import sample

        return sample(
            self.llm, prompt_ids, n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, version=self.version
        )

    def join_weight_group(self, host: str, port: int, world_size: int, rank: int) -> None:
        backend = self.cfg.placement.collective_backend
        self.llm.collective_rpc("rayrep_join_weight_group", args=(host, port, world_size, rank, backend))

    def receive_weights(self, manifest: WeightManifest, version: int) -> int:
        loaded = self.llm.collective_rpc("rayrep_receive_weights", args=(manifest,))[0]
        # Cached prefixes were computed with the old weights.
        self.llm.reset_prefix_cache()
        self.version = version
        return loaded

    def policy_version(self) -> int:
        return self.version


# The class stays plain (importable by name) so Ray pickles its methods by reference.
RemoteGeneratorWorker = ray.remote(GeneratorWorker)
