"""bench/gpu_check.py runs where there is no GPU too: here on the CPU, at the small sizes it
picks by itself, with the real learner worker taking turns as on GPUs (the residency checks
live), the real handle transport, a stand-in engine process and real vLLM; each section
leaves its JSON."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # bench/gpu_check.py in a process of its own, every section

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_on_cpu_at_small_sizes_and_writes_each_section(tmp_path):
    out = tmp_path / "figures"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = {path.stem: json.loads(path.read_text()) for path in out.glob("*.json")}
    assert set(figures) == {"environment", "order", "learner_memory", "timeline", "host_memory", "soak", "handoff",
                            "logprobs", "generation"}
    for name, section in figures.items():
        assert "error" not in section, (name, section.get("traceback"))
    assert figures["environment"]["device"] == "CPU"
    # ExGRPO's order: the entropy pass moves nothing, so the update finds its parameters on the
    # device; offload then onload gives back every parameter and moment bit for bit.
    order = figures["order"]
    assert order["entropy_pass_then_update_ok"] and order["step0_after_entropy_pass"][0] == "device"
    for step in ("step0", "step1"):
        assert order[step]["bit_identical_after_offload_onload"] and order[step]["tensors_compared"] > 0
        assert order[step]["after_update"][:2] == ["device", "device"]
    assert order["step1"]["onload_moved"] == ["parameters", "optimizer state"]  # AdamW's state exists by then
    memory = figures["learner_memory"]
    for preset in ("rlep", "exgrpo"):
        assert set(memory[preset]["by_layers"]) == {"2", "4"} and memory[preset]["plan_transient_28_layers_gib"] > 0
        assert all(row["tokens_per_second"] > 0 for row in memory[preset]["by_layers"].values())
    # The colocated timeline: every weight arrives bit for bit; the engine that dies mid-sync
    # is replaced and receives the weights; the ledger saw every phase and no GPU overflowed.
    timeline = figures["timeline"]
    assert timeline["sync_bit_for_bit"]["equal"] and timeline["sync_bit_for_bit"]["tensors"] > 0
    assert "died during the sync" in timeline["engine_died_during_sync"]
    assert timeline["replacement_received_tensors"] == timeline["sync_bit_for_bit"]["tensors"]
    phases = [row["phase"] for row in timeline["transitions"]]
    assert {"learner set-up", "engine start-up", "hand-over", "update", "sync", "resume", "replacement"} <= set(phases)
    assert not timeline["ledger_breaches"]
    # A LoRA engine's pinned backups as the plan counts them: each CUDA segment rounded up to a power of two.
    host = figures["host_memory"]
    assert host["segments"] > 28 * 4 and 1.8 < host["planned_gb"] / host["unrounded_gb"] < 2.0
    soak = figures["soak"]
    assert soak["syncs"] == 20 and soak["wrong_syncs"] == 0 and soak["buckets"] > 2
    handoff = figures["handoff"]
    assert handoff["transport"] == "shared-memory handles" and handoff["handoff_gbps"] > 0 and handoff["buckets"] == 8
    assert [row["tokens"] for row in figures["logprobs"]["rows"]] == [64, 256]
    assert figures["generation"]["tokens"] == 4 * 16  # vLLM is installed here
