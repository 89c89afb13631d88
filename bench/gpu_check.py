"""One GPU, one script: the learner's mixed-precision update, the weight-sync packing path,
and (where vLLM is installed) generation, on a Qwen2-shaped policy built from a config.

    python bench/gpu_check.py                    # ~0.5B parameters on the GPU (CPU if none)
    python bench/gpu_check.py --small --steps 2  # under a million parameters: the CPU test's size
    python bench/gpu_check.py --out figures.json

Needs torch and transformers only (and rayrep's own pure-torch modules: the FSDP2 sharding,
the loss, the weight-sync packing). A bare GPU machine may have nothing else: vLLM is used
for the generation figure when it is installed and skipped with a message when it is not;
Ray is not needed. Nothing is downloaded: the weights are random, the shape Qwen2.5-0.5B's.

Printed, each next to its reference measured in the same run:
- learner: tokens/s of full updates (forward, backward, AdamW step) under the mixed
  precision policy (compute in `--dtype`, fp32 master weights and optimizer state), and
  the peak memory they took;
- sync: GB/s of packing every weight into flat buckets of the compute dtype and through a
  broadcast of a one-member group (what a sync costs before the network), next to a
  device-to-device copy of the same bytes;
- generation: output tokens/s of a vLLM engine on the same weights.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # rayrep from this checkout

from rayrep.config import load_preset  # noqa: E402
from rayrep.learner.loss import mini_batch_totals, policy_loss  # noqa: E402
from rayrep.learner.sharding import FSDP2Sharding  # noqa: E402
from rayrep.sync.collective import TensorSpec, WeightManifest, open_group, send_buckets  # noqa: E402
from rayrep.types import LossSpec  # noqa: E402

SHAPES = {
    # Qwen2.5-0.5B's shape: 0.49B parameters.
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "small": dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def learner_check(model, cfg, device, sequences: int, length: int, steps: int) -> dict:
    sharding = FSDP2Sharding(model, cfg, world_size=1, device=device)
    vocab = model.config.vocab_size
    spec = LossSpec()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (sequences, length), generator=generator).to(device)
    mask = torch.zeros(sequences, length, dtype=torch.bool, device=device)
    mask[:, length // 4 :] = True  # the last three quarters are "response"
    advantages = torch.randn(sequences, generator=generator).to(device)
    micro = max(1, cfg.learner.micro_batch_size)
    totals = mini_batch_totals(mask[:, 1:], spec.agg, micro)

    def update() -> float:
        for start in range(0, sequences, micro):
            rows = slice(start, start + micro)
            logits = sharding.model(input_ids=ids[rows]).logits.float()[:, :-1]
            logp = torch.log_softmax(logits, -1).gather(-1, ids[rows, 1:, None]).squeeze(-1)
            loss, _ = policy_loss(logp, logp.detach(), advantages[rows], mask[rows, 1:], spec, totals=totals)
            sharding.backward(loss, last_micro_batch=start + micro >= sequences)
        grad_norm, _ = sharding.step()
        return grad_norm

    update()  # warm-up: allocations, kernels
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        update()
    synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return {"tokens_per_second": steps * sequences * length / seconds, "seconds_per_update": seconds / steps,
            "peak_memory_gib": None if peak is None else peak / 2**30, "sharding": sharding}


def sync_check(sharding, dtype: torch.dtype, device: torch.device, bucket_mb: float, repeats: int) -> dict:
    named = [(name, tensor) for name, tensor in sharding.full_tensors()]
    manifest = WeightManifest.build([TensorSpec(n, tuple(t.shape), dtype) for n, t in named], int(bucket_mb * 2**20))
    backend = "nccl" if device.type == "cuda" else "gloo"
    group = open_group("127.0.0.1", free_port(), 1, 0, backend, device)
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        send_buckets(group, manifest, (t for _, t in sharding.full_tensors()), device)
        synchronize(device)
        times.append(time.perf_counter() - start)
    total = manifest.total_bytes
    source = torch.empty(total, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    copies = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        copies.append(time.perf_counter() - start)
    sync_gbps, copy_gbps = total / min(times) / 1e9, total / min(copies) / 1e9
    return {"bytes": total, "buckets": len(manifest.buckets), "sync_gbps": sync_gbps, "copy_gbps": copy_gbps,
            "ratio": sync_gbps / copy_gbps}


def generation_check(model, dtype: str, prompts: int, new_tokens: int) -> dict | str:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "vLLM is not installed here: generation skipped"
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        llm = LLM(model=folder, skip_tokenizer_init=True, dtype=dtype, enforce_eager=not torch.cuda.is_available(),
                  max_model_len=64 + new_tokens, seed=0)
        params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=1.0, detokenize=False)
        requests = [TokensPrompt(prompt_token_ids=list(range(10 + i, 42 + i))) for i in range(prompts)]
        llm.generate(requests[:2], params, use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"tokens_per_second": produced / seconds, "tokens": produced, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="under a million parameters (the CPU test)")
    parser.add_argument("--steps", type=int, default=5, help="timed learner updates")
    parser.add_argument("--sequences", type=int, default=None, help="sequences per update (default 16; 4 with --small)")
    parser.add_argument("--length", type=int, default=None, help="tokens per sequence (default 1024; 64 with --small)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--prompts", type=int, default=None, help="generation requests (default 256; 4 with --small)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens per request (default 512; 16 with --small)")
    parser.add_argument("--out", help="also write the figures as JSON to this file")
    args = parser.parse_args()
    small = args.small
    sequences = args.sequences or (4 if small else 16)
    length = args.length or (64 if small else 1024)

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    print(f"device: {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'CPU'}; torch {torch.__version__}")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1)
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES["small" if small else "0.5b"], max_position_embeddings=4096)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.use_cache = False
    parameters = sum(p.numel() for p in model.parameters())
    print(f"policy: Qwen2-shaped, {parameters / 1e6:.1f}M parameters, random weights; compute {args.dtype}")
    cfg = load_preset("tiny-cpu").replace(**{
        "model.dtype": args.dtype, "learner.lr": 1e-6, "learner.warmup_steps": 0,
        "learner.micro_batch_size": max(1, sequences // 4), "run.steps": args.steps + 1,
    })
    figures: dict = {"device": device.type, "parameters": parameters, "dtype": args.dtype}

    learner = learner_check(model, cfg, device, sequences, length, args.steps)
    sharding = learner.pop("sharding")
    figures["learner"] = learner
    peak = learner["peak_memory_gib"]
    print(f"learner: {learner['tokens_per_second']:,.0f} tokens/s ({sequences} x {length} tokens, "
          f"{learner['seconds_per_update']:.2f} s per update)" + (f", peak memory {peak:.1f} GiB" if peak else ""))

    sync = sync_check(sharding, getattr(torch, args.dtype), device, bucket_mb=512 if not small else 1, repeats=3)
    figures["sync"] = sync
    print(f"sync: {sync['bytes'] / 1e9:.2f} GB in {sync['buckets']} buckets at {sync['sync_gbps']:.1f} GB/s; "
          f"device copy of the same bytes {sync['copy_gbps']:.1f} GB/s; ratio {sync['ratio']:.2f}")

    full = {name: tensor.to(getattr(torch, args.dtype)) for name, tensor in sharding.full_tensors()}
    dist.destroy_process_group()
    export = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    export.load_state_dict(full, strict=False)
    generation = generation_check(export, args.dtype, args.prompts or (4 if small else 256),
                                  args.new_tokens or (16 if small else 512))
    figures["generation"] = generation
    if isinstance(generation, str):
        print(f"generation: {generation}")
    else:
        print(f"generation: {generation['tokens_per_second']:,.0f} tokens/s ({generation['tokens']} tokens in "
              f"{generation['seconds']:.1f} s)")
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
