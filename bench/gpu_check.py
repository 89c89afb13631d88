"""One GPU, a few minutes: the figures that say whether the paper presets' GPU paths work.

    python bench/gpu_check.py                       # the GPU's sizes (CPU: small ones, by itself)
    python bench/gpu_check.py --out results/ --size 1.5b
    python bench/gpu_check.py --sections handoff logprobs

Needs torch and transformers only, plus rayrep's own modules; Ray (a stand-in takes its
place when it is missing) and vLLM (generation is skipped without it) are optional, and
nothing is downloaded: the policy is Qwen2-shaped with random weights, built from a config.
Each section writes `<out>/<section>.json` as soon as it finishes (a section that fails
writes its error), so a run cut short keeps what it measured:

- handoff: the colocated weight hand-off, two processes on one device through rayrep's
  own transport (CUDA IPC handles on a GPU, shared-memory handles on CPU), against a
  device copy of the same bytes; and whether NCCL refuses two ranks on one GPU (the reason
  the colocated presets do not broadcast).
- learner: the real `LearnerWorker` (setup, offload, onload, update, as a run calls them)
  with memory after each; fp32 masters and AdamW state; weights that move at lr 1e-6;
  the memory plan's learner phase for the same config against the measured peak.
- logprobs: peak memory of the chunked log-prob and entropy path (forward and backward)
  at 4k and 9k tokens against a plain fp32 `log_softmax` of the same logits and the
  `[micro, L, V]` fp32 estimate.
- sync: packing every weight into compute-dtype buckets and a one-member broadcast,
  against a device copy.
- generation: output tokens/s of a vLLM engine on the same weights (where vLLM is installed).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # rayrep from this checkout

try:  # the learner worker module makes its Ray actor class at import; a bare GPU machine has no Ray
    import ray  # noqa: F401
except ImportError:
    stand_in = types.ModuleType("ray")
    stand_in.remote = lambda cls: cls
    sys.modules["ray"] = stand_in

from rayrep.config import load_preset# noqa: E402
from rayrep.cluster.placement import free_port# noqa: E402
from rayrep.sync.collective import TensorSpec, WeightManifest, open_group  # noqa: E402
from rayrep.sync.transport import join_as_engine_worker, join_as_learner  # noqa: E402

GIB = 2**30
SHAPES = {
    "small": dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    # Qwen2.5-0.5B's and Qwen2.5-1.5B's shapes: 0.49B and 1.54B parameters.
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
}
SECTIONS = ("handoff", "learner", "logprobs", "sync", "generation")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gib(num_bytes: float | None) -> float | None:
    return None if num_bytes is None else num_bytes / GIB


def allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def best_seconds(run, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


# ---------------------------------------------------------------------------- handoff


def buckets_of(total_bytes: int, bucket_bytes: int) -> WeightManifest:
    """bf16 tensors of `bucket_bytes` each, `total_bytes` in all: a sync's manifest."""
    count = max(1, total_bytes // bucket_bytes)
    specs = [TensorSpec(f"weight{i}", (bucket_bytes // 2,), torch.bfloat16) for i in range(count)]
    return WeightManifest.build(specs, bucket_bytes)


def receive_handoffs(port: int, device_name: str, manifest: WeightManifest, syncs: int, results) -> None:
    """The engine worker's end, in a process of its own: receive `syncs` syncs, report the
    last value of each (the bytes arrived)."""
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    channel = join_as_engine_worker("handles", "127.0.0.1", port, 2, 1, "gloo", device)
    for _ in range(syncs):
        last = None
        for _, tensor in channel.receive(manifest):
            last = tensor
        results.put(float(last[-1]))


def duplicate_nccl_rank(port: int, rank: int, results) -> None:
    """One of two NCCL ranks on GPU 0: the first collective fails ("Duplicate GPU detected")."""
    try:
        torch.cuda.set_device(0)
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
        group = dist.ProcessGroupNCCL(store, rank, 2)
        probe = torch.ones(1, device="cuda")
        options = dist.BroadcastOptions()
        options.rootRank = 0
        group.broadcast([probe], options).wait()
        torch.cuda.synchronize()
        results.put((rank, "ok", ""))
    except Exception as error:  # noqa: BLE001 - the error is the figure
        results.put((rank, type(error).__name__, str(error)[:400]))


def handoff_check(device: torch.device, total_bytes: int, bucket_bytes: int, repeats: int) -> dict:
    context = multiprocessing.get_context("spawn")
    manifest = buckets_of(total_bytes, bucket_bytes)
    sent = [torch.full(spec.shape, float(i % 7 + 1), dtype=spec.dtype, device=device)
            for i, spec in enumerate(manifest.tensors)]
    port = free_port()
    results = context.Queue()
    receiver = context.Process(target=receive_handoffs, args=(port, str(device), manifest, repeats + 1, results),
                               daemon=True)
    receiver.start()
    channel = join_as_learner("handles", "127.0.0.1", port, 2, 0, "gloo", device)
    times = []
    try:
        for _ in range(repeats + 1):  # the first opens the handles: not timed
            synchronize(device)
            start = time.perf_counter()
            channel.send(manifest, iter(sent))
            synchronize(device)
            times.append(time.perf_counter() - start)
            assert results.get(timeout=120) == float((len(sent) - 1) % 7 + 1)
    finally:
        channel.close()
        receiver.join(timeout=60)
    seconds = min(times[1:])
    source = torch.empty(manifest.total_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    copy_seconds = best_seconds(lambda: target.copy_(source), repeats, device)
    figures = {
        "transport": "CUDA IPC handles" if device.type == "cuda" else "shared-memory handles",
        "bytes": manifest.total_bytes, "buckets": len(manifest.buckets),
        "handoff_gbps": manifest.total_bytes / seconds / 1e9, "device_copy_gbps": manifest.total_bytes / copy_seconds / 1e9,
    }
    figures["ratio"] = figures["handoff_gbps"] / figures["device_copy_gbps"]
    if device.type == "cuda":
        port, results = free_port(), context.Queue()
        ranks = [context.Process(target=duplicate_nccl_rank, args=(port, r, results), daemon=True) for r in (0, 1)]
        for process in ranks:
            process.start()
        outcomes = []
        for _ in ranks:
            try:
                outcomes.append(results.get(timeout=120))
            except Exception:  # noqa: BLE001 - a rank that hangs is a finding too
                outcomes.append((None, "no answer within 120 s", ""))
        for process in ranks:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
        figures["nccl_two_ranks_one_gpu"] = [{"rank": r, "outcome": kind, "message": text} for r, kind, text in outcomes]
        figures["nccl_refused"] = all(kind != "ok" for _, kind, _ in outcomes)
    else:
        figures["nccl_two_ranks_one_gpu"] = "no GPU: not run"
    return figures


# ---------------------------------------------------------------------------- learner


def learner_check(model_dir: str, config, device: torch.device, dtype: str, sequences: int, length: int,
                  steps: int) -> dict:
    from rayrep.learner.sums import MetricSums
    from rayrep.learner.worker import LearnerWorker
    from rayrep.runtime.memory import ModelShape, estimate
    from rayrep.types import LossSpec, TrainBatch

    gpu = device.type == "cuda"
    cfg = load_preset("tiny-cpu").replace(**{
        "model.path": model_dir, "model.dtype": dtype, "learner.lr": 1e-6, "learner.warmup_steps": 0,
        "learner.micro_batch_size": max(1, sequences // 4), "learner.mini_batch_prompts": 1,
        "algorithm.prompts_per_step": 1, "algorithm.group_size": sequences, "run.steps": steps + 2,
        "generator.max_response_tokens": length - 16, "data.max_prompt_tokens": 16,
        "placement.device": "gpu" if gpu else "cpu", "placement.mode": "colocated",
        "placement.gpu_memory_gib": torch.cuda.get_device_properties(device).total_memory / GIB if gpu else 80.0,
    })
    figures: dict = {}
    worker = LearnerWorker(cfg, rank=0, world_size=1, threads=os.cpu_count() or 1)
    start = time.perf_counter()
    worker.setup(model_dir, "127.0.0.1", free_port())
    figures["setup_seconds"] = time.perf_counter() - start
    figures["after_setup_gib"] = gib(allocated(device))  # colocated GPUs: offloaded at the end of setup
    params = list(worker.sharding.model.parameters())
    figures["master_dtypes"] = sorted({str(p.dtype) for p in params})

    generator = torch.Generator().manual_seed(0)
    vocab = config.vocab_size
    prompts = [torch.randint(3, vocab, (16,), generator=generator).tolist() for _ in range(sequences)]
    responses = [torch.randint(3, vocab, (length - 16,), generator=generator).tolist() for _ in range(sequences)]
    batch = TrainBatch.of_sequences(prompts, responses, [0] * sequences,
                                    advantages=torch.randn(sequences, generator=generator).tolist(),
                                    recompute_old=[True] * sequences)
    before = worker.full_state_dict()
    peaks, seconds = [], []
    for step in range(steps + 1):
        worker.onload()
        if step == 0:
            figures["after_onload_gib"] = gib(allocated(device))
        if gpu:
            torch.cuda.reset_peak_memory_stats(device)
        synchronize(device)
        start = time.perf_counter()
        metrics = worker.update(batch, LossSpec())
        synchronize(device)
        seconds.append(time.perf_counter() - start)
        peaks.append(torch.cuda.max_memory_allocated(device) if gpu else None)
        if step == 0:
            state = worker.sharding.optimizer.state
            figures["adamw_state_dtypes"] = sorted({str(v.dtype) for s in state.values() for v in s.values()
                                                    if torch.is_tensor(v) and v.dim() > 0})
            figures["grad_norm_first_update"] = MetricSums(metrics).result().get("grad_norm")
        worker.offload()
        if step == 0:
            figures["after_offload_gib"] = gib(allocated(device))
    after = worker.full_state_dict()
    moved = torch.cat([(after[n] != before[n]).flatten() for n in before]).float().mean()
    change = torch.cat([(after[n] - before[n]).abs().flatten() for n in before])
    figures.update({
        "sequences": sequences, "length": length, "updates_timed": steps,
        "tokens_per_second": sequences * length / min(seconds[1:]), "seconds_per_update": min(seconds[1:]),
        "update_peak_gib": gib(max(peaks)) if gpu else None,
        "fraction_of_fp32_masters_moved_after_updates_at_lr_1e-6": float(moved),
        "median_abs_change": float(change.median()),
    })
    plan = estimate(cfg, ModelShape.of(config))
    figures["plan_learner_parts_gib"] = {name: value / GIB for name, value in plan.learner.items()}
    figures["plan_learner_sum_gib"] = sum(plan.learner.values()) / GIB
    figures["plan_sync_parts_gib"] = {name: value / GIB for name, value in plan.sync.items()}
    if gpu:
        figures["measured_peak_over_plan"] = max(peaks) / sum(plan.learner.values())
    worker.shutdown()
    return figures


# ---------------------------------------------------------------------------- logprobs


def logprob_check(device: torch.device, vocab: int, token_counts: list[int], chunk_tokens: int) -> dict:
    from rayrep.learner.logprobs import token_logprobs

    gpu = device.type == "cuda"
    rows = []
    for tokens in token_counts:
        row: dict = {"tokens": tokens, "vocab": vocab, "fp32_full_tensor_gib": tokens * vocab * 4 / GIB}
        for way in ("chunked", "plain"):
            logits = torch.randn(1, tokens, vocab, device=device, dtype=torch.bfloat16).requires_grad_()
            ids = torch.randint(0, vocab, (1, tokens), device=device)
            synchronize(device)
            base = allocated(device)
            if gpu:
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            if way == "chunked":
                logp, entropy = token_logprobs(logits, ids, 0.7, "grad", chunk_tokens)
            else:  # what the learner computed before: the whole [1, L, V] in fp32, several times
                log_probs = torch.log_softmax(logits[:, :-1].float() / 0.7, -1)
                logp = log_probs.gather(-1, ids[:, 1:, None]).squeeze(-1)
                entropy = -(log_probs.exp() * log_probs).sum(-1)
            (logp.sum() + entropy.sum()).backward()
            synchronize(device)
            row[f"{way}_seconds"] = time.perf_counter() - start
            if gpu:
                row[f"{way}_peak_above_logits_gib"] = (torch.cuda.max_memory_allocated(device) - base) / GIB
            del logits, logp, entropy
            if way == "plain":
                del log_probs
        # the plan's parts for it: the logits' gradient beside them, and the fp32 chunk
        row["plan_gradient_and_chunk_gib"] = (tokens * vocab * 2 + 4 * min(tokens, chunk_tokens) * vocab * 4) / GIB
        rows.append(row)
    return {"chunk_tokens": chunk_tokens, "rows": rows}


# ---------------------------------------------------------------------------- sync and generation


def sync_check(model, dtype: torch.dtype, device: torch.device, bucket_mb: float, repeats: int) -> dict:
    named = [(name, tensor.detach().to(device)) for name, tensor in model.named_parameters()]
    manifest = WeightManifest.build([TensorSpec(n, tuple(t.shape), dtype) for n, t in named], int(bucket_mb * 2**20))
    backend = "nccl" if device.type == "cuda" else "gloo"
    group = open_group("127.0.0.1", free_port(), 1, 0, backend, device)
    try:
        seconds = best_seconds(lambda: group.send(manifest, (t for _, t in named)), repeats, device)
    finally:
        group.close()
    total = manifest.total_bytes
    source = torch.empty(total, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    copy_seconds = best_seconds(lambda: target.copy_(source), repeats, device)
    sync_gbps, copy_gbps = total / seconds / 1e9, total / copy_seconds / 1e9
    return {"bytes": total, "buckets": len(manifest.buckets), "sync_gbps": sync_gbps, "copy_gbps": copy_gbps,
            "ratio": sync_gbps / copy_gbps}


def generation_check(model_dir: str, dtype: str, prompts: int, new_tokens: int) -> dict:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return {"skipped": "vLLM is not installed here"}
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype=dtype, enforce_eager=not torch.cuda.is_available(),
              max_model_len=64 + new_tokens, seed=0)
    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=1.0, detokenize=False)
    requests = [TokensPrompt(prompt_token_ids=list(range(10 + i, 42 + i))) for i in range(prompts)]
    llm.generate(requests[:2], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"tokens_per_second": produced / seconds, "tokens": produced, "seconds": seconds}


# ---------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SHAPES), help="policy shape (default: 0.5b on a GPU, small on CPU)")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--steps", type=int, default=3, help="timed learner updates")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--out", default="gpu_check_results", help="folder for one JSON file per section")
    args = parser.parse_args()

    gpu = torch.cuda.is_available()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    size = args.size or ("0.5b" if gpu else "small")
    big = size != "small"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    environment = {"device": torch.cuda.get_device_name(0) if gpu else "CPU", "torch": torch.__version__,
                   "cuda": torch.version.cuda, "size": size, "dtype": args.dtype}
    (out / "environment.json").write_text(json.dumps(environment, indent=2))
    print(f"device: {environment['device']}; torch {torch.__version__}; policy {size}; out {out}/", flush=True)

    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[size], max_position_embeddings=16384)
    with tempfile.TemporaryDirectory() as folder:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(folder)
        parameters = sum(p.numel() for p in model.parameters())
        print(f"policy: Qwen2-shaped, {parameters / 1e6:.1f}M parameters, random weights", flush=True)
        runs = {
            "handoff": lambda: handoff_check(device, (2 * GIB) if big else 8 * 2**20, (256 if big else 1) * 2**20,
                                             repeats=3),
            "learner": lambda: learner_check(folder, config, device, args.dtype, sequences=16 if big else 4,
                                             length=1024 if big else 64, steps=args.steps),
            "logprobs": lambda: logprob_check(device, config.vocab_size, [4096, 9216] if big else [64, 256],
                                              chunk_tokens=1024 if big else 32),
            "sync": lambda: sync_check(model, getattr(torch, args.dtype), device, 256 if big else 1, repeats=3),
            "generation": lambda: generation_check(folder, args.dtype, 256 if big else 4, 512 if big else 16),
        }
        for name in args.sections:
            start = time.perf_counter()
            try:
                figures = runs[name]()
            except Exception as error:  # noqa: BLE001 - a failed section is recorded; the next ones still run
                figures = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-4000:]}
            figures["section_seconds"] = time.perf_counter() - start
            figures["parameters"] = parameters
            (out / f"{name}.json").write_text(json.dumps(figures, indent=2, default=str))
            shown = {k: v for k, v in figures.items() if k not in ("traceback",)}
            print(f"{name}: {json.dumps(shown, default=str)}", flush=True)
            synchronize(device)
            if gpu:
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
