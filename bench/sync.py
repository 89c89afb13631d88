"""How fast the weight sync is at size, next to what the transport itself gives.

    python bench/sync.py [--sizes 3 200 1000] [--repeats 3] [config overrides...]

For each size (MB of weights as sent), a random Qwen2-shaped model of about that size (the
tiny policy's tokenizer) is loaded by one learner and one vLLM generator on a local Ray
cluster, as in a run. Measured side by side, the medians of `--repeats`:

- **sync**: `WeightSync.push` end to end: the learner gathers the full tensors, packs
  buckets and broadcasts them (pipelined: the next bucket is packed while one is on the
  wire), the generator receives them and reloads its engine's weights;
- **raw**: one broadcast of the same number of bytes in one tensor, over the same weight
  group between the same two processes: the transport's own rate;
- **copy**: a memory copy of the same bytes in this process;
- **reload**: the engine loading the same tensors from memory (`reload_weights`), no
  transport: the loader's share of a sync.

It prints each rate in GB/s, the ratio sync / raw (the goal: at least 0.8 at 200 MB and
above), and the sync's and the reload's seconds.

With `--lora-ranks R ...`, the same model is trained as a LoRA adapter of each rank (every
projection, `learner.lora_rank`) and, side by side with the full weights' sync: what a sync
sends (the adapter alone), its seconds end to end (`WeightSync.push`: gathered, sent,
written as a PEFT folder by the engine), the first sample after it (vLLM loads the new
adapter with the first request that names it) against the second, and each learner's state
(parameters, AdamW moments, gradients, as the learner holds them).
"""

import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from rayrep.cli import job_parser, parse_job_args
from step import in_memory_copy_gbps

SHAPES = {  # hidden, intermediate, layers, heads, kv heads: about this many MB in float32
    3: (128, 512, 4, 4, 2),
    200: (1024, 2816, 4, 16, 4),
    1000: (2048, 5632, 5, 16, 4),
}


def random_model(size_mb: int, tiny_policy: str, folder: Path) -> Path:
    """A randomly initialised Qwen2 of about `size_mb` MB (fp32) with the tiny tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    hidden, intermediate, layers, heads, kv_heads = SHAPES[size_mb]
    shape = AutoConfig.from_pretrained(tiny_policy).to_dict()
    shape.pop("layer_types", None)  # (one per layer: derived again for the new depth)
    shape.update({"hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
                  "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": hidden // heads})
    config = AutoConfig.for_model(**shape)
    torch.manual_seed(size_mb)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = folder / f"random-{size_mb}mb"
    model.save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny_policy).save_pretrained(path)
    return path


def raw_broadcast_seconds(learners, generators, num_bytes: int) -> float:
    """One broadcast of `num_bytes` from learner rank 0 to every generator over their weight group."""
    import ray

    def send(learner, size):
        payload = torch.ones(size, dtype=torch.uint8)
        start = time.perf_counter()
        learner.weight_channel.broadcast(payload, root=0)
        return time.perf_counter() - start

    def receive(worker, size):
        payload = torch.empty(size, dtype=torch.uint8)
        worker._rayrep_channel.broadcast(payload, root=0)
        return int(payload[-1])

    def receive_in_engine(generator, size):
        return generator.llm.collective_rpc(receive, args=(size,))

    calls = [learners.workers[0].__ray_call__.remote(send, num_bytes)]
    calls += [g.__ray_call__.remote(receive_in_engine, num_bytes) for g in generators.workers]
    seconds, *received = ray.get(calls)
    assert all(value == [1] for value in received), received  # the bytes arrived
    return seconds


def reload_seconds(generators, manifest) -> float:
    """The generator's engine loading the same tensors from memory (`reload_weights`, as a
    sync ends), with no transport: the loader's share of a sync."""
    import ray

    def load(worker, manifest):
        tensors = [(spec.name, torch.zeros(spec.shape, dtype=spec.dtype)) for spec in manifest.tensors]
        if manifest.tied_embedding:
            tensors.append(("lm_head.weight", dict(tensors)[manifest.tied_embedding]))
        start = time.perf_counter()
        worker.reload_weights(weights_iterator=iter(tensors))
        return time.perf_counter() - start

    def in_engine(generator, manifest):
        return generator.llm.collective_rpc(load, args=(manifest,))[0]

    return ray.get(generators.workers[0].__ray_call__.remote(in_engine, manifest))


@contextmanager
def one_learner_and_generator(cfg, path: str):
    """(learners, generators, their weight sync) for the model at `path` on a local Ray
    cluster (this process's, or one started for them), all gone after the block."""
    import ray

    from rayrep.cluster.placement import Placement, make_plan
    from rayrep.generator.group import GeneratorGroup
    from rayrep.learner.group import LearnerGroup
    from rayrep.roles.system import connect_ray
    from rayrep.sync.weights import WeightSync

    plan = make_plan(cfg)
    started = connect_ray(plan)
    placement = Placement(plan)
    learners = LearnerGroup(cfg, path, placement)
    generators = GeneratorGroup.create(cfg, path, placement)
    try:
        yield learners, generators, WeightSync(cfg, learners, generators)
    finally:
        learners.shutdown()
        ray.get([worker.drop_adapters.remote() for worker in generators.workers])  # (a LoRA run's folders)
        for worker in generators.workers:
            ray.kill(worker)
        placement.remove()
        if started:
            ray.shutdown()


def lora_sync(cfg, path: str, repeats: int) -> tuple[int, float, float, float, int]:
    """(bytes a sync sends, its median seconds, the first and the second one-token sample
    after a sync, the learner's state in bytes) of `cfg` (`learner.lora_rank` 0: the weights)."""
    import ray

    from rayrep.cluster.memory import GRADIENTS, OPTIMIZER, PARAMETERS

    def sample_seconds() -> float:
        start = time.perf_counter()
        generators.gather(generators.generate([[5, 6, 7, 8]], n=1, temperature=1.0, top_p=1.0, max_tokens=1))
        return time.perf_counter() - start

    with one_learner_and_generator(cfg, path) as (learners, generators, sync):
        sync.push()
        sample_seconds()  # warm-up: first-touch allocations on both sides, the adapter's first load
        pushes, firsts, seconds = [], [], []
        for _ in range(repeats):
            pushes.append(sync.push()["sync_seconds"])
            firsts.append(sample_seconds())
            seconds.append(sample_seconds())
        sizes = ray.get(learners.workers[0].__ray_call__.remote(lambda worker: worker.residency.sizes))
        state = sum(sizes[part] for part in (PARAMETERS, OPTIMIZER, GRADIENTS))
        return (sync.manifest.total_bytes, statistics.median(pushes), statistics.median(firsts),
                statistics.median(seconds), state)


def main(argv=None):
    parser = job_parser(__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[3, 200, 1000], choices=sorted(SHAPES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lora-ranks", type=int, nargs="*", default=[])
    args, cfg = parse_job_args(parser, argv)

    from rayrep.models import resolve_policy

    cfg = cfg.replace(**{"learner.num_workers": 1, "generator.num_workers": 1, "verifier.num_workers": 0,
                         "placement.mode": "disaggregated", "placement.threads": 1, "placement.cpus_per_bundle": 1})
    tiny_policy = resolve_policy(cfg)
    rows, lora_rows = [], []
    with tempfile.TemporaryDirectory() as folder:
        for size in args.sizes:
            path = str(random_model(size, tiny_policy, Path(folder)))
            with one_learner_and_generator(cfg, path) as (learners, generators, sync):
                size_bytes = sync.manifest.total_bytes
                sync.push()  # warm-up: first-touch allocations on both sides
                sync_s = statistics.median(sync.push()["sync_seconds"] for _ in range(args.repeats))
                raw_broadcast_seconds(learners, generators, size_bytes)
                raw_s = statistics.median(raw_broadcast_seconds(learners, generators, size_bytes)
                                          for _ in range(args.repeats))
                reload_s = statistics.median(reload_seconds(generators, sync.manifest) for _ in range(args.repeats))
            rows.append((size_bytes, sync_s, raw_s, reload_s, in_memory_copy_gbps(size_bytes)))
            for rank in [0, *args.lora_ranks] if args.lora_ranks else []:
                lora_cfg = cfg.replace(**{"learner.lora_rank": rank})
                lora_rows.append((size, rank, *lora_sync(lora_cfg, path, args.repeats)))

    print(f"\nweight sync, 1 learner -> 1 vLLM generator, {cfg.placement.collective_backend}, "
          f"buckets of {cfg.sync.bucket_mb} MB; medians of {args.repeats}")
    print(f"{'MB':>8}{'sync GB/s':>12}{'raw GB/s':>12}{'sync/raw':>10}{'copy GB/s':>12}{'sync s':>9}{'reload s':>10}")
    for size_bytes, sync_s, raw_s, reload_s, copy_gbps in rows:
        sync_gbps, raw_gbps = size_bytes / sync_s / 1e9, size_bytes / raw_s / 1e9
        print(f"{size_bytes / 1e6:>8.1f}{sync_gbps:>12.3f}{raw_gbps:>12.3f}{sync_gbps / raw_gbps:>10.2f}"
              f"{copy_gbps:>12.2f}{sync_s:>9.3f}{reload_s:>10.3f}")
    if lora_rows:
        print(f"\nfull weights (rank 0) against LoRA adapters, fp32; medians of {args.repeats}")
        print(f"{'model MB':>9}{'rank':>6}{'sent MB':>10}{'sync s':>9}{'1st sample s':>14}{'2nd sample s':>14}"
              f"{'learner state MB':>18}")
        for size, rank, sent, sync_s, first_s, second_s, state in lora_rows:
            print(f"{size:>9}{rank:>6}{sent / 1e6:>10.3f}{sync_s:>9.3f}{first_s:>14.3f}{second_s:>14.3f}"
                  f"{state / 1e6:>18.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
