"""What a CPU vLLM engine costs before its first answers, as rayrep builds it and as vLLM's
defaults would.

    python bench/startup.py [--rounds 3]

Each measurement is a fresh Python process (as a generator actor is), alternating the two
builds round by round (this machine's speed drifts from one minute to the next):

- **rayrep**: `make_engine` of the tiny preset: the KV cache sized through the engine's
  `kv_cache_memory_bytes` (`generator.cpu_kv_cache_gib`: 0.25 GiB on the tiny presets), the
  sampler's small kernels eager (`torch.compiler.set_stance("force_eager")`) and vLLM's
  import frozen out of the garbage collector's walks (`rayrep.heap.long_lived`);
- **defaults**: the same engine with the cache given as whole GiB through
  `VLLM_CPU_KVCACHE_SPACE=1` (the least it can say) and vLLM's sampler kernels compiled by
  inductor on the first call.

Both sample the same 64 prompts x 8 answers with the same seeds; the answers must be equal
token for token and log-prob for log-prob. It prints the medians of the engine's build and
of its first and second calls, and each as a ratio of defaults to rayrep.
"""

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import hashlib, json, os, sys, time
build = sys.argv[1]
import torch
from rayrep.config import load_preset
from rayrep.generator import engine
from rayrep.models import resolve_policy

cfg = load_preset("tiny-cpu")
policy = resolve_policy(cfg, log=lambda _: None)
torch.set_num_threads(1)
start = time.perf_counter()
if build == "rayrep":
    llm = engine.make_engine(cfg, policy, seed=0)
else:
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="WARNING", VLLM_CPU_KVCACHE_SPACE="1")
    from vllm import LLM
    args = engine.engine_args(cfg, policy, seed=0)
    del args["kv_cache_memory_bytes"]
    llm = LLM(**args)
built = time.perf_counter()
prompts = [[5, 6, 7, 8 + i % 8] for i in range(64)]
calls, answers = [], []
for _ in range(2):
    before = time.perf_counter()
    out = engine.sample(llm, prompts, n=8, temperature=1.0, top_p=1.0, max_tokens=48, seeds=list(range(64)))
    calls.append(time.perf_counter() - before)
    answers.append([[(r.response_ids.tolist(), r.logprobs.tolist()) for r in per_prompt] for per_prompt in out])
digest = hashlib.sha256(repr(answers).encode()).hexdigest()
print("RESULT " + json.dumps({"build_s": built - start, "first_s": calls[0], "second_s": calls[1], "answers": digest}))
"""


def measure(build: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, build], capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"the {build} engine failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    results = {"rayrep": [], "defaults": []}
    for round_ in range(rounds):
        for build in (("rayrep", "defaults") if round_ % 2 == 0 else ("defaults", "rayrep")):
            results[build].append(measure(build))
    digests = {r["answers"] for runs in results.values() for r in runs}
    from rayrep.machine import machine_name

    print(f"machine: {machine_name()}; {rounds} rounds; the same answers in every run: {len(digests) == 1}")
    print(f"{'median':<14}{'defaults':>10}{'rayrep':>10}{'ratio':>8}")
    for key, label in (("build_s", "engine build"), ("first_s", "first call"), ("second_s", "second call")):
        default = statistics.median(r[key] for r in results["defaults"])
        ours = statistics.median(r[key] for r in results["rayrep"])
        print(f"{label:<14}{default:>9.2f}s{ours:>9.2f}s{default / ours:>8.2f}")
    total = {build: statistics.median(r["build_s"] + r["first_s"] for r in runs) for build, runs in results.items()}
    print(f"{'to 1st answers':<14}{total['defaults']:>9.2f}s{total['rayrep']:>9.2f}s"
          f"{total['defaults'] / total['rayrep']:>8.2f}")
    if len(digests) != 1:
        raise SystemExit("the two builds sampled different answers")


if __name__ == "__main__":
    main()
