"""The colocated weight transport on CPU: learner rank j hands the engine worker beside it
each bucket through a shared-memory handle (the CPU counterpart of a CUDA IPC handle), the
protocol the GPU path runs with CUDA IPC handles. Two real processes, a real TCPStore."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
import torch

from rayrep.cluster.placement import free_port, make_plan, weight_transport
from rayrep.config import load_preset
from rayrep.sync.collective import TensorSpec, WeightManifest
from rayrep.cluster.memory import LEARNER, SEND_BUFFERS
from rayrep.cluster.residency import ABSENT, Residency
from rayrep.sync.transport import SLOTS, TRANSPORTS, PeerDied, paired_worker

CPU = torch.device("cpu")
HANDLES = TRANSPORTS["handles"]


def manifest() -> WeightManifest:
    specs = [TensorSpec(f"layer{i}.weight", (8, 16), torch.float32) for i in range(5)]
    specs += [TensorSpec("norm.weight", (16,), torch.bfloat16), TensorSpec("head.weight", (4, 16), torch.bfloat16)]
    # 600 bytes a bucket: one fp32 tensor each, then the two bf16 ones together
    return WeightManifest.build(specs, bucket_bytes=600)


def weights(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(s.shape, generator=generator).to(s.dtype) for s in manifest().tensors]


def engine_worker(port: int, syncs: int, results, die_after: int | None, sender: int) -> None:
    """An engine worker's end: receive `syncs` syncs, report each one's tensors and how many
    buffers the sender (process `sender`) had in shared memory as the last bucket arrived;
    `die_after`: exit abruptly (as a killed process does) after copying that many buckets of the first."""
    import os

    channel = HANDLES.join_as_engine_worker("127.0.0.1", port, 2, 1, "gloo", CPU)
    for _ in range(syncs):
        received, buffers = {}, 0
        for count, (name, tensor) in enumerate(channel.receive(manifest())):
            received[name] = (str(tensor.dtype), tensor.float().tolist())  # plain values: the queue shares tensors by fd
            buffers = len(our_files(sender))
            if die_after is not None and count + 1 == die_after:
                os._exit(1)
        results.put((received, buffers))


def start_worker(port: int, syncs: int, die_after: int | None = None):
    import os

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=engine_worker, args=(port, syncs, results, die_after, os.getpid()), daemon=True)
    process.start()
    return process, results


def our_files(pid: int) -> list[Path]:
    return sorted(Path("/dev/shm").glob(f"rayrep-weights-{pid}-*"))


def test_the_engine_worker_receives_every_bucket_of_two_syncs_through_shared_memory_handles():
    """Every tensor arrives, sync after sync; the sender's two buffers exist for the sync's
    length only (between syncs the GPU is the engine's), and its residency says so."""
    import os

    layout = manifest()
    assert len(layout.buckets) > SLOTS + 1  # the sender refills its buffers
    port = free_port()
    process, results = start_worker(port, syncs=2)
    channel = HANDLES.join_as_learner("127.0.0.1", port, 2, 0, "gloo", CPU)
    residency = Residency("learner rank 0", LEARNER, {}, sizes={})
    try:
        for seed in (1, 2):  # a second sync has buffers of its own, and the store's keys start afresh
            sent = weights(seed)
            channel.send(layout, iter(sent), residency)
            received, buffers = results.get(timeout=60)
            assert list(received) == [s.name for s in layout.tensors]
            for spec, tensor in zip(layout.tensors, sent):
                dtype, values = received[spec.name]
                assert dtype == str(spec.dtype) and torch.equal(torch.tensor(values), tensor.float())
            assert buffers == SLOTS  # two buffers during the sync, whatever the number of buckets
            assert not our_files(os.getpid())  # and none after it
            assert residency.at(SEND_BUFFERS) == ABSENT
            assert residency.report().peak == SLOTS * layout.largest_bucket_bytes
    finally:
        channel.close()
        process.join(timeout=30)
    assert process.exitcode == 0


def test_a_learner_rank_hands_its_tensors_to_the_engine_worker_on_its_own_gpu():
    """vLLM's Ray executor numbers a tensor-parallel engine's workers' GPUs its own way: a
    learner rank pairs with the worker whose GPU has its own GPU's UUID, not its own index; on
    CPU, by index; a rank with no engine worker on its GPU is named."""
    workers = {0: "GPU-b", 1: "GPU-a", 2: "GPU-d", 3: "GPU-c"}  # (bundles a, b, c, d: learner ranks 0-3)
    assert [paired_worker(rank, gpu, workers) for rank, gpu in enumerate(["GPU-a", "GPU-b", "GPU-c", "GPU-d"])] \
        == [1, 0, 3, 2]
    assert paired_worker(2, "", {}) == 2
    with pytest.raises(RuntimeError, match="no engine worker shares learner rank 4's GPU \\(GPU-e\\)"):
        paired_worker(4, "GPU-e", workers)


def test_a_sender_whose_engine_worker_dies_fails_at_once_naming_it():
    port = free_port()
    process, _ = start_worker(port, syncs=1, die_after=1)
    channel = HANDLES.join_as_learner("127.0.0.1", port, 2, 0, "gloo", CPU)
    start = time.monotonic()
    try:
        with pytest.raises(PeerDied, match="engine worker 0"):
            channel.send(manifest(), iter(weights(1)))
    finally:
        channel.close()
        process.join(timeout=30)
    assert time.monotonic() - start < 30  # not the group's 10-minute timeout


def test_the_transport_is_chosen_in_one_place_and_the_plan_names_it():
    from rayrep.cluster.placement import TRANSPORT_DESCRIPTIONS
    from rayrep.sync.transport import TRANSPORTS

    assert set(TRANSPORT_DESCRIPTIONS) == set(TRANSPORTS)  # each transport's code and its description, by one name
    tiny = load_preset("tiny-cpu")
    assert weight_transport(tiny) == "handles"  # colocated: one engine beside one learner
    assert "shared-memory handles" in make_plan(tiny).describe()
    two_engines = tiny.replace(**{"generator.num_workers": 2})  # the second shares no learner's bundle
    assert weight_transport(two_engines) == "broadcast" and "gloo broadcast" in make_plan(two_engines).describe()
    split = tiny.replace(**{"placement.mode": "disaggregated", "generator.num_workers": 1})
    assert weight_transport(split) == "broadcast"
    for preset in ("qwen2.5-math-7b-rlep", "qwen2.5-math-7b-exgrpo"):
        cfg = load_preset(preset)
        assert weight_transport(cfg) == "handles" and "CUDA IPC handles" in make_plan(cfg).describe()
        gpu_split = cfg.replace(**{"placement.mode": "disaggregated", "generator.num_workers": 8})
        assert "NCCL broadcast" in make_plan(gpu_split).describe()


# ---------------------------------------------------------------- batch invariance and the NCCL group

ENGINE_NCCL_SIDE = """
import json, sys
import vllm.utils.nccl as nccl
from vllm.model_executor.determinism.batch_invariant import override_envs_for_invariance
from rayrep.generator.vllm_internals import shared_nccl_environment
from rayrep.sync.collective import nccl_settings

learner = nccl_settings()  # every process of the run starts with the same NCCL environment
# A CPU build loads no NCCL: the version probe stands for the NCCL the GPU worker would load.
nccl._nccl_has_no_cache = lambda: sys.argv[1] == "new"
override_envs_for_invariance()  # what vLLM's GPU worker does with VLLM_BATCH_INVARIANT=1
with shared_nccl_environment():
    engine = nccl_settings()
print(json.dumps({"learner": learner, "engine": engine, "pinned": nccl_settings()}))
"""


def engine_nccl_side(nccl: str) -> dict:
    """In a process of its own (vLLM's pins are process-wide and kept): the NCCL settings a
    learner joins with, and an engine with `VLLM_BATCH_INVARIANT` when it opens the weight
    group, under NCCL `nccl` ("new": 2.29.7 or later, "old": before)."""
    import json
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if not key.startswith("NCCL_")}
    env.update(NCCL_CUMEM_ENABLE="0", VLLM_BATCH_INVARIANT="1")
    done = subprocess.run([sys.executable, "-c", ENGINE_NCCL_SIDE, nccl], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_engine_with_batch_invariance_opens_the_weight_group_with_the_learners_nccl_settings():
    seen = engine_nccl_side("new")
    assert seen["pinned"]["NCCL_PROTO"] == "Simple" and seen["pinned"]["NCCL_NTHREADS"] == "1"  # vLLM's own, pinned
    assert seen["engine"] == seen["learner"] == {"NCCL_CUMEM_ENABLE": "0"}


def test_a_weight_group_whose_members_differ_in_nccl_settings_refuses_to_open_on_both_sides():
    """An NCCL that cannot unpin vLLM's settings (before 2.29.7): the members would hang at the
    first collective; the agreement before the group opens fails instead, on both sides."""
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed as dist

    from rayrep.sync.collective import agree_on_nccl

    seen = engine_nccl_side("old")
    assert seen["engine"] != seen["learner"]
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    joining = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    with ThreadPoolExecutor(2) as pool:
        ends = [pool.submit(agree_on_nccl, store, 0, 2, seen["learner"]),
                pool.submit(agree_on_nccl, joining, 1, 2, seen["engine"])]
        errors = [end.exception(timeout=60) for end in ends]
    assert all(isinstance(error, RuntimeError) for error in errors), errors
    assert "NCCL_PROTO: unset here, Simple at rank 1" in str(errors[0])
    assert "NCCL_PROTO: Simple here, unset at rank 0" in str(errors[1]) and "2.29.7" in str(errors[1])
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    joining = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    with ThreadPoolExecutor(2) as pool:  # members that agree go on
        ends = [pool.submit(agree_on_nccl, store, 0, 2, seen["learner"]),
                pool.submit(agree_on_nccl, joining, 1, 2, dict(seen["learner"]))]
        assert [end.result(timeout=60) for end in ends] == [None, None]
