"""End to end, as the README says: `ray start --head` with its default resources (2 CPUs on a
2-core machine; token authentication on), then the GRPO baseline through `ray job submit`."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from rayrep.placement import free_port

REPO = Path(__file__).resolve().parent.parent
RAY = str(Path(sys.executable).parent / "ray")


@pytest.fixture
def ray_head(tiny_policy):
    """A Ray head started from the CLI; stopped through the process we started (never `ray stop`)."""
    temp_dir = tempfile.mkdtemp(prefix="rr-", dir="/tmp")  # short: Ray's unix sockets live here
    dashboard = free_port()
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--port", str(free_port()),
         "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard), "--temp-dir", temp_dir,
         "--disable-usage-stats"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
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
        head.terminate()  # `ray start --block` stops its cluster when it is terminated
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_grpo_runs_through_ray_job_submit(ray_head, tmp_path):
    out_dir = tmp_path / "runs"
    env = dict(os.environ, RAY_AUTH_MODE="token")
    submit = subprocess.run(
        [RAY, "job", "submit", "--address", ray_head, "--working-dir", str(REPO), "--",
         sys.executable, "jobs/grpo.py", "--run.steps", "2", "--run.eval_every", "0",
         "--algorithm.prompts_per_step", "16", "--learner.mini_batch_prompts", "8",
         "--data.arithmetic_test_size", "64", "--logging.out_dir", str(out_dir), "--logging.run_name", "submitted"],
        capture_output=True, text=True, env=env, timeout=900,
    )
    assert submit.returncode == 0, submit.stdout[-3000:] + submit.stderr[-3000:]
    assert "succeeded" in submit.stdout
    assert "test pass@1:" in submit.stdout
    records = [json.loads(line) for line in (out_dir / "submitted" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[-1]["policy_version"] == 2
    assert (out_dir / "submitted" / "checkpoints" / "final" / "model.safetensors").exists()
