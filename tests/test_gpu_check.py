"""bench/gpu_check.py runs where there is no GPU too (here: the CPU, small sizes, real vLLM)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_on_cpu_at_small_sizes(tmp_path):
    out = tmp_path / "figures.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--small", "--steps", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for line in ("learner:", "sync:", "generation:"):
        assert line in done.stdout
    figures = json.loads(out.read_text())
    assert figures["device"] == "cpu" and figures["dtype"] == "bfloat16"
    assert figures["learner"]["tokens_per_second"] > 0 and figures["learner"]["peak_memory_gib"] is None
    assert figures["sync"]["bytes"] == 2 * figures["parameters"]  # every weight, once, in bf16
    assert 0 < figures["sync"]["ratio"] and figures["sync"]["copy_gbps"] > 0
    assert figures["generation"]["tokens"] == 4 * 16  # vLLM is installed here
