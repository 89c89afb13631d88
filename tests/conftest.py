"""Shared fixtures: the real embedded tiny policy (shipped in the package) and the default
config; the session's Ray cluster and the runs several tests read; the suite's two tiers.

Tiers: a test is `slow` when it needs the session's Ray cluster (any fixture built on
`ray_session`: marked here, at collection) or is marked so itself (it starts a cluster, a
vLLM engine, a job or a run of its own). `make test-fast` runs the rest (`pytest -m "not
slow"`), about two minutes here; `make test` runs both. A test left unmarked that connects
to Ray fails (`_fast_tests_start_no_cluster`)."""

import pytest

from rayrep.config import load_preset


def pytest_collection_modifyitems(items):
    for item in items:
        if "ray_session" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


def _connected_to_ray() -> bool:
    import sys

    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


@pytest.fixture(autouse=True)
def _fast_tests_start_no_cluster(request):
    """A test of the fast tier may not connect to Ray (in the whole suite, the session's
    cluster may be up before it, from a slow test: that one is not its doing). One that
    starts a cluster belongs to the slow tier (`pytest.mark.slow`)."""
    before = _connected_to_ray()
    yield
    if request.node.get_closest_marker("slow") is None and not before:
        assert not _connected_to_ray(), (
            f"{request.node.nodeid} connected to Ray: mark it `pytest.mark.slow` (tests/conftest.py, tiers)")


@pytest.fixture(scope="session")
def tiny_cfg():
    return load_preset("tiny-cpu")


@pytest.fixture(scope="session")
def tiny_policy(tiny_cfg) -> str:
    """Path of the embedded tiny policy checkpoint of the default preset (shipped, hash checked)."""
    from rayrep.models import resolve_policy

    return resolve_policy(tiny_cfg)


SHORT_RUN = {"run.steps": 2, "run.eval_every": 0, "algorithm.prompts_per_step": 16, "learner.mini_batch_prompts": 8,
             "data.arithmetic_test_size": 32, "learner.behaviour_cap": 2.0, "logging.plots": False,
             "placement.emulate_gpus": True, "logging.tensorboard": True}
"""Two cheap GRPO steps of the tiny preset: the run that several tests vary one knob of. It
takes turns as a colocated GPU run does (`placement.emulate_gpus`): its engines sleep and
wake, its learners' state moves, and the device-memory ledger checks every transition. It
logs to TensorBoard and Ray's metrics too."""

METRICS_PAGES: list[str] = []
"""The node's Prometheus page (Ray's metrics agent) as scraped every second while
`short_run_dir` trained, until the run's last step was there."""


@pytest.fixture(scope="session")
def short_run_dir(ray_session, tiny_cfg, tiny_policy, tmp_path_factory):
    """The folder of `SHORT_RUN` (seed 0, synchronous; its one checkpoint: step-2), trained
    once for the whole session, on the session's cluster, its metrics scraped meanwhile
    (`METRICS_PAGES`). Tests read it, never write it."""
    import re
    import threading
    import time
    import urllib.request

    from rayrep.run.sinks import run_label
    from rayrep.train import train

    endpoint = metrics_endpoint()
    stop = threading.Event()

    def scrape() -> None:
        while not stop.wait(1.0):
            try:
                METRICS_PAGES.append(urllib.request.urlopen(endpoint, timeout=10).read().decode())
            except OSError:
                pass  # (the agent busy: the next second)

    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    try:
        cfg = tiny_cfg.replace(**SHORT_RUN, **{"logging.out_dir": str(tmp_path_factory.mktemp("short")),
                                               "logging.run_name": "seed-0"})
        run_dir = train(cfg, log=lambda _: None).run_dir
        # Ray's agent has a step's figures within its report interval (a second here) of their being set.
        last = re.compile(r'^ray_rayrep_train_steps_total\{[^}]*run="' + re.escape(run_label(run_dir)) + r'"[^}]*\} '
                          + re.escape(f"{float(SHORT_RUN['run.steps'])}") + "$", re.M)
        deadline = time.monotonic() + 60
        while not (METRICS_PAGES and last.search(METRICS_PAGES[-1])) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        stop.set()
        scraper.join()
    return run_dir


@pytest.fixture(scope="session")
def short_run(short_run_dir) -> list[dict]:
    """The metrics of `SHORT_RUN`, one record per step."""
    from rayrep.run.log import read_metrics

    return read_metrics(short_run_dir / "metrics.jsonl")


def metrics_endpoint() -> str:
    """The Prometheus page of the (one) node of the cluster this process is connected to:
    where Ray's metrics agent serves every process's metrics."""
    import ray

    (node,) = [n for n in ray.nodes() if n["Alive"]]
    return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"


@pytest.fixture(scope="session")
def ray_session():
    """One real local Ray cluster for the whole session, started by the first module that
    asks for it and stopped at the end (a cluster's start and stop take about 6 s here).

    `address="local"` never attaches to some other cluster running on the machine. Four
    logical CPUs on a 2-core machine: the roles take turns, as in a real run. Processes
    report their metrics to the node's agent every second rather than every 10 s, so that
    the tests that scrape it wait less.
    """
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             _system_config={"metrics_report_interval_ms": 1000})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_cluster(ray_session):
    """The session's Ray cluster, whole again for each module: a module that leaves a
    placement group behind fails when it ends (naming the groups), and its groups are
    removed, so that the next module does not wait for CPUs that a leak holds."""
    yield
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    left = {pg_id: info["name"] for pg_id, info in ray.util.placement_group_table().items()
            if info["state"] != "REMOVED"}
    for pg_id in left:
        remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
    assert not left, f"the module left placement groups behind: {sorted(left.values())}"


def kill_and_wait(actor, timeout_s: float = 30.0) -> None:
    """`ray.kill(actor)`, then wait until it no longer answers: the kill lands a moment after
    the call returns, and a call sent before that is still answered."""
    import time

    import ray
    from ray.exceptions import RayActorError

    ray.kill(actor)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(actor.__ray_call__.remote(lambda _: None))  # any actor answers this, if alive
        except RayActorError:
            return
        assert time.monotonic() < deadline, "the killed actor still answers"
        time.sleep(0.1)


def job_here(job: str, *args: str, env: dict | None = None, cwd=None):
    """`python jobs/<job> ARGS` run in this process, for a job that only checks, plans and
    prints (`--dry-run`, input refused before anything starts): the script's `main` through
    `run_job`, as its entry point calls it, under its own `sys.argv`, with `env` on top of
    this environment and `cwd` as the working folder; its stdout, stderr and exit status
    captured (`subprocess.CompletedProcess`). A process of its own would spend about 4 s here
    importing what this one already has. Such a job must start nothing: a Ray connection it
    opened or closed fails here."""
    import contextlib
    import io
    import os
    import runpy
    import subprocess
    import sys
    from pathlib import Path
    from unittest import mock

    import ray

    from rayrep.cli import run_job

    path = Path(__file__).resolve().parents[1] / "jobs" / job
    main = runpy.run_path(str(path), run_name="job_here")["main"]  # (not "__main__": the entry point stays unrun)
    out, err, status, connected = io.StringIO(), io.StringIO(), 0, ray.is_initialized()
    with contextlib.ExitStack() as context:
        context.enter_context(mock.patch.object(sys, "argv", [str(path), *args]))
        context.enter_context(mock.patch.dict(os.environ, env or {}))
        if cwd is not None:
            context.enter_context(contextlib.chdir(cwd))
        context.enter_context(contextlib.redirect_stdout(out))
        context.enter_context(contextlib.redirect_stderr(err))
        try:
            run_job(main)
        except SystemExit as exit:
            status = exit.code if isinstance(exit.code, int) else (exit.code is not None)
            if isinstance(exit.code, str):
                err.write(exit.code + "\n")
    assert ray.is_initialized() == connected, f"{job} {' '.join(args)} opened or closed a Ray connection"
    return subprocess.CompletedProcess([sys.executable, str(path), *args], int(status), out.getvalue(), err.getvalue())
