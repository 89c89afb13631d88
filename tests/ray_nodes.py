"""Ray nodes started from the CLI by tests, and stopped through the processes the tests
started (never `ray stop`, which would stop every Ray process on the machine)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

RAY = str(Path(sys.executable).parent / "ray")


def start_ray_node(*args: str, env: dict | None = None) -> subprocess.Popen:
    """`ray start --block ...` in a session of its own, its output discarded."""
    return subprocess.Popen([RAY, "start", "--block", "--disable-usage-stats", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def wait_for_head(address: str, head: subprocess.Popen, env: dict, deadline: float) -> None:
    """Until `ray status` answers at `address` (by `deadline`, a `time.monotonic()` value)."""
    while subprocess.run([RAY, "status", "--address", address], capture_output=True, env=env).returncode:
        if time.monotonic() > deadline or head.poll() is not None:
            raise RuntimeError("the Ray head did not come up")
        time.sleep(1)


def stop_ray_node(process: subprocess.Popen) -> None:
    process.terminate()  # `ray start --block` stops its node when it is terminated
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def kill_session(leader: int) -> None:
    """SIGKILL what is left of the processes in the session `leader` started (the nodes an
    autoscaler launched from it, say), after its own node was stopped."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == leader and int(stat.parent.name) != os.getpid():  # field 6: the session id
            try:
                os.kill(int(stat.parent.name), signal.SIGKILL)
            except ProcessLookupError:
                pass
