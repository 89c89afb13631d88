"""bench/gpu_check.py runs where there is no GPU too: here on the CPU, at the small sizes it
picks by itself, with real vLLM and the real learner worker; each section leaves its JSON."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_on_cpu_at_small_sizes_and_writes_each_section(tmp_path):
    out = tmp_path / "figures"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--steps", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = {path.stem: json.loads(path.read_text()) for path in out.glob("*.json")}
    assert set(figures) == {"environment", "handoff", "learner", "logprobs", "sync", "generation"}
    for name, section in figures.items():
        assert "error" not in section, (name, section.get("traceback"))
    assert figures["environment"]["size"] == "small" and figures["environment"]["device"] == "CPU"
    handoff = figures["handoff"]
    assert handoff["transport"] == "shared-memory handles" and handoff["handoff_gbps"] > 0 and handoff["buckets"] == 8
    learner = figures["learner"]
    assert learner["master_dtypes"] == ["torch.float32"] and learner["adamw_state_dtypes"] == ["torch.float32"]
    assert learner["tokens_per_second"] > 0 and learner["grad_norm_first_update"] > 0
    # fp32 masters: an update at lr 1e-6 moves (nearly) every weight, by about the rate per step
    assert learner["fraction_of_fp32_masters_moved_after_updates_at_lr_1e-6"] > 0.99
    assert 1e-7 < learner["median_abs_change"] < 1e-4
    assert set(learner["plan_learner_parts_gib"]) >= {"logits and their gradient", "fp32 log-prob chunk"}
    assert [row["tokens"] for row in figures["logprobs"]["rows"]] == [64, 256]
    assert figures["sync"]["bytes"] == 2 * figures["sync"]["parameters"]  # every weight, once, in bf16
    assert figures["generation"]["tokens"] == 4 * 16  # vLLM is installed here
