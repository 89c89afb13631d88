"""End to end, as the README says: `ray start --head` with its default resources (2 CPUs on a
2-core machine; token authentication on), then the GRPO baseline through `ray job submit`.
The head and every client share a token of the test's own (`RAY_AUTH_TOKEN_PATH`), so the
tests need no `~/.ray/auth_token` (which a `ray.init()` elsewhere may or may not have made)."""

import itertools
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from ray_nodes import RAY, start_ray_node, stop_ray_node

from rayrep.cluster.placement import free_port

pytestmark = pytest.mark.slow  # Ray clusters of their own and submitted jobs

REPO = Path(__file__).resolve().parent.parent


ENV = dict(os.environ, RAY_AUTH_MODE="token")
"""The head's and its clients' environment; the head fixture adds its token's path."""

HEAD: dict = {}
"""What the head fixture made: its temp folder ("temp_dir") and the Grafana dashboards folder it was given ("dashboards")."""


@pytest.fixture(scope="module")
def ray_head(tiny_policy):
    """A Ray head started from the CLI; stopped through the process we started (never `ray stop`).
    It is given rayrep's Grafana dashboard as docs/watching-a-run.md says (Ray's dashboards
    written beside it, in a folder Ray's Grafana set-up loads)."""
    temp_dir = tempfile.mkdtemp(prefix="rr-", dir="/tmp")  # short: Ray's unix sockets live here
    dashboards = Path(temp_dir) / "grafana-dashboards"
    dashboards.mkdir()
    shutil.copy(REPO / "deploy" / "grafana-dashboard.json", dashboards)
    HEAD.update(temp_dir=Path(temp_dir), dashboards=dashboards)
    token = Path(temp_dir) / "auth_token"
    token.write_text(secrets.token_hex(32))
    ENV["RAY_AUTH_TOKEN_PATH"] = str(token)
    dashboard = free_port()
    # The job agent's port is free too: the default (52365) is taken by any other Ray node on
    # the machine (the suite's own cluster, say), and a head whose agent cannot listen takes
    # no job ("No available agent to submit job").
    head = start_ray_node("--head", "--port", str(free_port()), "--dashboard-host", "127.0.0.1",
                          "--dashboard-port", str(dashboard), "--dashboard-agent-listen-port", str(free_port()),
                          "--temp-dir", temp_dir,
                          env=dict(ENV, RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR=str(dashboards)))
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
        with pytest.raises(urllib.error.HTTPError) as refused:  # token authentication is on
            urllib.request.urlopen(f"{address}/api/jobs/", timeout=10)
        assert refused.value.code == 401, refused.value
        yield address
    finally:
        stop_ray_node(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


def submit_job(address: str, job: list[str], env: dict, options: list[str] = ()) -> subprocess.CompletedProcess:
    """`ray job submit [options]` of `python <job...>` from the repository (waiting for its end
    unless `options` say --no-wait). The head's job agent registers a little after the
    dashboard answers: a submission it refused for that (nothing was started) is tried again,
    for up to a minute."""
    deadline = time.monotonic() + 60
    while True:
        submit = subprocess.run(
            [RAY, "job", "submit", "--address", address, "--working-dir", str(REPO), *options, "--",
             sys.executable, *job],
            capture_output=True, text=True, env=env, timeout=900,
        )
        if "No available agent to submit job" not in submit.stderr or time.monotonic() > deadline:
            return submit
        time.sleep(2)


@pytest.fixture(scope="module")
def submitted_run(ray_head, tmp_path_factory):
    """A 2-step GRPO run submitted to the head: (`ray job submit`'s result, its run folder)."""
    out_dir = tmp_path_factory.mktemp("runs")
    submit = submit_job(
        ray_head, ["jobs/grpo.py", "--run.steps", "2", "--run.eval_every", "0",
                   "--algorithm.prompts_per_step", "16", "--learner.mini_batch_prompts", "8",
                   "--data.arithmetic_test_size", "64", "--logging.out_dir", str(out_dir),
                   "--logging.run_name", "submitted"], ENV)
    return submit, out_dir / "submitted"


def test_grpo_runs_through_ray_job_submit(submitted_run):
    submit, run_dir = submitted_run
    assert submit.returncode == 0, submit.stdout[-3000:] + submit.stderr[-3000:]
    assert "succeeded" in submit.stdout
    assert "test pass@1:" in submit.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[-1]["policy_version"] == 2
    assert (run_dir / "checkpoints" / "final" / "model.safetensors").exists()
    # The terminal has rayrep's lines; the actors' library output (vLLM's CPU-backend notices
    # among it) went to the run's log file, through the actors' runtime_env merged with the job's.
    terminal = submit.stdout + submit.stderr
    assert "pid=" not in terminal, terminal[-3000:]  # Ray prefixes every forwarded actor line "(Role pid=N)"
    assert "WARNING" in (run_dir / "libraries.log").read_text()


def test_a_submitted_server_follows_the_run_as_it_trains_on_and_stops_cleanly(ray_head, submitted_run):
    """`jobs/serve.py --follow` submitted to the cluster serves the finished run's checkpoint;
    while a client keeps asking for the run by name, a submitted resume of the run writes two
    more checkpoints. Every request is answered, the checkpoint named in the answers moves on
    from the first to the last, never back, and after the switch the served log-probs are the
    last checkpoint's own (transformers on its folder), not the first's. `ray job stop` then
    shuts the server down."""
    import threading

    import httpx
    import openai
    from transformers import AutoTokenizer

    from test_serve import PROMPT, policy_logprobs

    submit, run_dir = submitted_run
    assert submit.returncode == 0, "the training job failed: see the test above"
    first = run_dir / "checkpoints" / "step-2"
    ids = AutoTokenizer.from_pretrained(str(first)).encode(PROMPT, add_special_tokens=False)
    before = policy_logprobs(str(first), ids)
    port = free_port()
    job = f"serve-{port}"
    # `ray job stop` waits RAY_JOB_STOP_WAIT_TIME_S (3 s by default) before it kills the job:
    # the server needs a few more to shut Serve down. Half a CPU for the replica: the head's
    # two hold it and the resumed run's 1.5.
    runtime_env = json.dumps({"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "120"}})
    started = submit_job(ray_head, ["jobs/serve.py", "--follow", str(run_dir), "--serve.port", str(port),
                                    "--serve.cpus_per_replica", "0.5", "--serve.follow_every_s", "0.5"], ENV,
                         ["--no-wait", "--submission-id", job, "--runtime-env-json", runtime_env])
    assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]

    def job_cli(*args: str) -> str:
        done = subprocess.run([RAY, "job", *args, "--address", ray_head, job], capture_output=True, text=True,
                              env=ENV, timeout=300)
        return done.stdout + done.stderr

    answers, stop = [], threading.Event()

    def keep_asking(http: httpx.Client) -> None:
        while not stop.is_set():
            response = http.post("/v1/completions", json={"model": "submitted", "prompt": PROMPT, "max_tokens": 8,
                                                          "temperature": 0})
            answers.append((response.status_code, response.json().get("model")))
            stop.wait(0.5)  # a steady client, not one that takes both cores from the training run

    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        deadline = time.monotonic() + 300
        for attempt in itertools.count(1):
            try:
                models = client.models.list().data
                break
            except (openai.APIConnectionError, openai.NotFoundError) as error:
                # Serve's proxy takes the port before the application is deployed, and until then it
                # answers every path 404 itself; any other 404 (the application's own) is a failure.
                if isinstance(error, openai.NotFoundError):
                    assert "for available routes" in error.response.text, error.response.text
                assert time.monotonic() < deadline, job_cli("status") + job_cli("logs")[-3000:]
                if attempt % 10 == 0:  # (a `ray job status` is a process of its own: not every second)
                    status = job_cli("status")
                    assert "FAILED" not in status, status + job_cli("logs")[-3000:]
                time.sleep(1)
        # Named after the run and its newest checkpoint; the run's name always means the newest.
        assert [m.id for m in models] == ["submitted/step-2", "submitted"]
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
            asking = threading.Thread(target=keep_asking, args=(http,))
            asking.start()
            try:
                resumed = submit_job(ray_head, ["jobs/train.py", "--resume", str(run_dir), "--run.steps", "4",
                                                "--run.save_every", "1", "--logging.plots", "false"], ENV)
                assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and (not answers or answers[-1][1] != "submitted/step-4"):
                    time.sleep(0.2)
            finally:
                stop.set()
                asking.join()
            listed = http.get("/v1/models").json()["data"]
            scored = http.post("/v1/completions", json={"model": "submitted", "prompt": PROMPT, "max_tokens": 0,
                                                        "echo": True, "logprobs": 0}).json()
    finally:
        job_cli("stop")
    assert len(answers) > 10 and {status for status, _ in answers} == {200}, answers
    names = [name for i, (_, name) in enumerate(answers) if i == 0 or name != answers[i - 1][1]]
    assert names[0] == "submitted/step-2" and names[-1] == "submitted/step-4" and names == sorted(names), names
    assert [m["id"] for m in listed] == ["submitted/step-4", "submitted"] and listed[1]["root"] == "submitted/step-4"
    served = scored["choices"][0]["logprobs"]["token_logprobs"][1:]
    after = policy_logprobs(str(run_dir / "checkpoints" / "step-4"), ids)
    expected = [float(after[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert served == pytest.approx(expected, abs=2e-3)
    assert served != pytest.approx([float(before[i - 1, ids[i]]) for i in range(1, len(ids))], abs=2e-3)

    logs = job_cli("logs")
    assert "was stopped" in job_cli("status")
    assert "shutting down the server" in logs and "server stopped" in logs, logs[-3000:]
    with pytest.raises(openai.APIConnectionError):  # Serve is gone from the cluster
        client.models.list()


def test_rays_grafana_set_up_provisions_rayrep_s_dashboard_beside_its_own(ray_head):
    """The head's Grafana provisioning (what `grafana-server --config <session>/metrics/grafana/
    grafana.ini` loads) reads the dashboards folder it was given, where Ray wrote its own
    dashboards beside rayrep's."""
    import yaml

    provisioning = HEAD["temp_dir"] / "session_latest" / "metrics" / "grafana" / "provisioning" / "dashboards"
    (provider,) = yaml.safe_load((provisioning / "default.yml").read_text())["providers"]
    assert Path(provider["options"]["path"]) == HEAD["dashboards"]
    written = {path.name for path in HEAD["dashboards"].glob("*.json")}
    assert {"grafana-dashboard.json", "default_grafana_dashboard.json", "serve_grafana_dashboard.json"} <= written
    assert json.loads((HEAD["dashboards"] / "grafana-dashboard.json").read_text())["uid"] == "rayrepDashboard"
