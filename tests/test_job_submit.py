"""End to end, as the README says: `ray start --head` with its default resources (2 CPUs on a
2-core machine; token authentication on), then the GRPO baseline through `ray job submit`."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from ray_nodes import RAY, start_ray_node, stop_ray_node

from rayrep.placement import free_port

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def ray_head(tiny_policy):
    """A Ray head started from the CLI; stopped through the process we started (never `ray stop`)."""
    temp_dir = tempfile.mkdtemp(prefix="rr-", dir="/tmp")  # short: Ray's unix sockets live here
    dashboard = free_port()
    head = start_ray_node("--head", "--port", str(free_port()), "--dashboard-host", "127.0.0.1",
                          "--dashboard-port", str(dashboard), "--temp-dir", temp_dir)
    address = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(address, timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or head.poll() is not None:
                    raise RuntimeError(f"the Ray head did not come up at {address}")
                time.sleep(1)
        yield address
    finally:
        stop_ray_node(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


def submit_job(address: str, job: list[str], env: dict) -> subprocess.CompletedProcess:
    """`ray job submit` of `python <job...>` from the repository, waiting for its end. The head's
    job agent registers a little after the dashboard answers: a submission it refused for that
    (nothing was started) is tried again, for up to a minute."""
    deadline = time.monotonic() + 60
    while True:
        submit = subprocess.run(
            [RAY, "job", "submit", "--address", address, "--working-dir", str(REPO), "--", sys.executable, *job],
            capture_output=True, text=True, env=env, timeout=900,
        )
        if "No available agent to submit job" not in submit.stderr or time.monotonic() > deadline:
            return submit
        time.sleep(2)


def test_grpo_runs_through_ray_job_submit(ray_head, tmp_path):
    out_dir = tmp_path / "runs"
    env = dict(os.environ, RAY_AUTH_MODE="token")
    submit = submit_job(
        ray_head, ["jobs/grpo.py", "--run.steps", "2", "--run.eval_every", "0",
                   "--algorithm.prompts_per_step", "16", "--learner.mini_batch_prompts", "8",
                   "--data.arithmetic_test_size", "64", "--logging.out_dir", str(out_dir),
                   "--logging.run_name", "submitted"], env)
    assert submit.returncode == 0, submit.stdout[-3000:] + submit.stderr[-3000:]
    assert "succeeded" in submit.stdout
    assert "test pass@1:" in submit.stdout
    records = [json.loads(line) for line in (out_dir / "submitted" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[-1]["policy_version"] == 2
    assert (out_dir / "submitted" / "checkpoints" / "final" / "model.safetensors").exists()
