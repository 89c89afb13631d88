"""The `code` checker: the completion's program run against the row's tests, in a process of
its own with hard limits.

The program is the completion's last fenced Python block (or, with
`verifier.code_whole_text`, the whole completion). The tests are the row's ground truth, in
one of the forms public code-RL sets use:

- a JSON list of assert statements (MBPP's `test_list`): ``["assert add(1, 2) == 3", ...]``;
- a JSON object of stdin/stdout cases (APPS, TACO, DeepCoder): ``{"inputs": ["1 2\\n"],
  "outputs": ["3\\n"]}``: each case a run of its own, its output compared line by line
  with trailing whitespace ignored;
- the same with a function name (their call-based problems): ``{"fn_name": "add",
  "inputs": [[1, 2]], "outputs": [3]}``: the function called on each argument list.

The score is 1 when every test passes, else 0 (or, with `verifier.code_partial_credit`, the
share passed, which is then the reward). Each run of the program (`run_program`):

- starts in a fresh folder, removed afterwards, with an empty environment, standard input
  closed (or a case's input), its output going to a file bounded by the file-size limit;
- has a wall-clock limit (killed past it), a CPU-time limit, an address-space limit, a
  file-size limit, no core dumps, few open files;
- as root: runs as a user of its own (a uid no other process has), so that it can signal
  no other process, read no other process's environment, write nowhere outside its folder,
  and be held to a process count; with a mount namespace of its own, /tmp and /dev/shm (the
  world-writable places) are small private ones, gone with the run; every process of that
  user is killed after the run, so nothing is left behind;
- in a network namespace of its own where the machine allows one (no interface but a
  loopback that is down); elsewhere, sockets are refused in Python (not a boundary).

What it does not protect against: the kernel's own holes, and a program crafted to forge
the harness's report from inside its process (the report carries a one-time token the
program is never handed, but it runs in the same interpreter).
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CodeLimits", "check_code", "extract_program", "parse_tests", "run_program"]

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_HARNESS = Path(__file__).with_name("code_harness.py")
_PRIVATE_PARENT = "/run/rayrep-code"
"""Where runs' folders lie when rayrep runs as root (not under /tmp: see `_confine`)."""
_WORLD_WRITABLE = (b"/tmp", b"/var/tmp", b"/dev/shm")
_CLONE_NEWNET, _CLONE_NEWNS = 0x40000000, 0x00020000
_MS_NOSUID, _MS_NODEV, _MS_REC, _MS_PRIVATE = 0x2, 0x4, 0x4000, 0x40000
_UID_BASE = 200_000
"""Sandboxed programs run as uid _UID_BASE + the sandbox child's pid: a user of their own."""


@dataclass(frozen=True)
class CodeLimits:
    """The limits of one run of a program (`verifier.code_*`)."""

    wall_s: float = 5.0
    cpu_s: int = 5
    memory_bytes: int = 512 * 1024**2
    processes: int = 16
    file_bytes: int = 16 * 1024**2
    partial_credit: bool = False
    whole_text: bool = False

    @classmethod
    def of(cls, verifier) -> "CodeLimits":
        return cls(verifier.code_timeout_s, verifier.code_cpu_s, verifier.code_memory_mib * 1024**2,
                   verifier.code_processes, verifier.code_file_mib * 1024**2, verifier.code_partial_credit,
                   verifier.code_whole_text)

    def budget_s(self, ground_truth: str) -> float:
        """The longest a whole check may take: a run per stdin/stdout case (one otherwise),
        each up to the wall-clock limit, plus starting and cleaning up."""
        try:
            tests = parse_tests(ground_truth)
        except ValueError:
            return 5.0
        runs = len(tests[1]["inputs"]) if tests[0] == "stdio" else 1
        return runs * (self.wall_s + 1.0) + 5.0


def extract_program(completion: str, whole_text: bool = False) -> str | None:
    """The last fenced Python block of `completion` (a fence with no language counts), or
    the whole text when `whole_text`; None when there is none."""
    if whole_text:
        return completion if completion.strip() else None
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else None


def parse_tests(ground_truth: str) -> tuple[str, object]:
    """(mode, tests) of a row's ground truth: ("asserts", [statements]), ("stdio", {"inputs",
    "outputs"}) or ("call", {"fn_name", "inputs", "outputs"}); ValueError naming what is wrong."""
    try:
        tests = json.loads(ground_truth)
    except ValueError:
        raise ValueError("the tests (the ground truth) are not JSON: a list of assert statements, or an "
                         "object of inputs and outputs") from None
    if isinstance(tests, list) and tests and all(isinstance(t, str) for t in tests):
        return "asserts", tests
    if isinstance(tests, dict) and isinstance(tests.get("inputs"), list) and isinstance(tests.get("outputs"), list):
        if len(tests["inputs"]) != len(tests["outputs"]) or not tests["inputs"]:
            raise ValueError(f"the tests have {len(tests['inputs'])} inputs and {len(tests['outputs'])} outputs")
        if tests.get("fn_name"):
            if not all(isinstance(a, list) for a in tests["inputs"]):
                raise ValueError("a call-based test's inputs must be argument lists")
            return "call", tests
        if not all(isinstance(x, str) for x in tests["inputs"] + tests["outputs"]):
            raise ValueError("stdin/stdout tests must be strings")
        return "stdio", tests
    raise ValueError("the tests must be a list of assert statements or an object of inputs and outputs")


def check_code(completion: str, ground_truth: str, limits: CodeLimits) -> tuple[bool, float | None, str, str]:
    """(correct, score or None, status, detail) of `completion` against the tests: status
    "ok" when the tests ran (passing or not), "no_answer" without a program, "timeout" or
    "error" (a limit, a crash, the harness's report missing) otherwise; the detail says which."""
    mode, tests = parse_tests(ground_truth)
    program = extract_program(completion, limits.whole_text)
    if program is None:
        return False, _score(0, 1, limits), "no_answer", "no fenced Python block"
    if mode != "stdio":
        outcome = run_program(program, mode, tests, limits)
        if outcome.status != "ok":
            return False, _score(0, 1, limits), outcome.status, outcome.detail
        passed, total = outcome.passed, outcome.total
        return passed == total, _score(passed, total, limits), "ok", f"{passed} of {total} tests passed"
    passed, failed = 0, None  # (the first run that did not finish: its status, unless some case passed)
    for stdin, expected in zip(tests["inputs"], tests["outputs"]):
        outcome = run_program(program, "script", None, limits, stdin)
        if outcome.status != "ok":
            failed = failed or outcome
        elif _lines(outcome.output) == _lines(expected):
            passed += 1
    total = len(tests["inputs"])
    status = "ok" if passed or failed is None else failed.status
    return passed == total, _score(passed, total, limits), status, \
        failed.detail if failed else f"{passed} of {total} tests passed"


def _score(passed: int, total: int, limits: CodeLimits) -> float | None:
    return passed / total if limits.partial_credit else None


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]


@dataclass(frozen=True)
class Outcome:
    status: str
    detail: str = ""
    output: str = ""
    passed: int = 0
    total: int = 0


def run_program(program: str, mode: str, tests, limits: CodeLimits, stdin: str | None = None) -> Outcome:
    """One run of `program` in the harness's `mode` (see `rayrep.verifier.code_harness`),
    under `limits`, in a fresh folder removed afterwards (see the module's docstring)."""
    # As root, the run's folder lies in a folder of ours that others may pass through but not
    # write in, outside the world-writable places (which the run sees as private ones).
    uid = _UID_BASE + os.getpid() if os.geteuid() == 0 else None
    parent = None
    if uid is not None:
        parent = Path(_PRIVATE_PARENT)
        parent.mkdir(mode=0o711, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="rayrep-code-", dir=parent))
    os.chmod(base, 0o711)
    folder = base / "run"
    folder.mkdir()
    try:
        (folder / "solution.py").write_text(program)
        (folder / "tests.json").write_text(json.dumps(tests))
        shutil.copyfile(_HARNESS, folder / "harness.py")
        (folder / "stdin").write_text(stdin or "")
        token = secrets.token_hex(16)
        (folder / "token").write_text(token)  # (the harness reads and removes it before the program runs)
        if uid is not None:
            for path in [folder, *folder.iterdir()]:
                os.chown(path, uid, uid)
        os.chmod(folder, 0o700)
        isolated = _network_namespace_allowed()
        with open(folder / "stdin", "rb") as given, open(folder / "output", "wb") as output:
            process = subprocess.Popen(
                [_python(), "-I", "-S", "harness.py", mode, "free" if isolated else "guard"],
                cwd=folder, env={}, stdin=given, stdout=output, stderr=subprocess.STDOUT, close_fds=True,
                preexec_fn=lambda: _confine(limits, uid, isolated))
            status, detail = "ok", ""
            try:
                code = process.wait(limits.wall_s)
            except subprocess.TimeoutExpired:
                status, detail, code = "timeout", f"wall-clock limit of {limits.wall_s:g} s", None
            finally:  # (however this ends: the sandbox child's own deadline too)
                _end_all(process, uid)
        text = (folder / "output").read_bytes()[: 1 << 20].decode("utf-8", "replace")
        if status != "ok":
            return Outcome(status, detail)
        if code != 0:
            return Outcome("error", _exit_detail(code, text, limits))
        if mode == "script":
            return Outcome("ok", output=text)
        report = text.rstrip().rpartition("\n")[2].split()
        if len(report) != 3 or report[0] != token:
            return Outcome("error", "the program ended before the tests reported")
        return Outcome("ok", passed=int(report[1]), total=int(report[2]))
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _exit_detail(code: int, output: str, limits: CodeLimits) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        why = {"SIGXCPU": f"CPU-time limit of {limits.cpu_s} s", "SIGXFSZ": "file-size limit",
               "SIGKILL": "killed"}.get(name, name)
        return f"the program was stopped: {why}"
    last = output.strip().rpartition("\n")[2][-200:]
    return f"the program exited with status {code}: {last}"


def _python() -> str:
    """An interpreter the program's user may run: this one where every folder above it is
    open to others, else the system's."""
    own = os.path.realpath(sys.executable)
    if os.geteuid() != 0 or all(os.stat(p).st_mode & 0o005 == 0o005 for p in Path(own).parents):
        return own
    return shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or own


@functools.cache
def _network_namespace_allowed() -> bool:
    """Whether this machine lets a process take a network namespace of its own (tried once,
    in a child that exits at once)."""
    try:
        probe = subprocess.run([sys.executable, "-I", "-S", "-c", "import ctypes, sys; sys.exit("
                                f"ctypes.CDLL(None, use_errno=True).unshare({_CLONE_NEWNET}) != 0)"],
                               env={}, timeout=10, capture_output=True)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def _confine(limits: CodeLimits, uid: int | None, isolated: bool) -> None:
    """In the forked child, before the harness starts: a session of its own, the limits, the
    network namespace, the user (the sandbox child is single-threaded: this runs safely)."""
    import resource

    os.setsid()
    # CPU time: SIGXCPU at the limit, SIGKILL a second later for a program that ignores it.
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
    for limit, value in ((resource.RLIMIT_AS, limits.memory_bytes), (resource.RLIMIT_FSIZE, limits.file_bytes),
                         (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NOFILE, 64)):
        resource.setrlimit(limit, (value, value))
    libc = ctypes.CDLL(None, use_errno=True)
    if isolated:
        libc.unshare(_CLONE_NEWNET)
    if uid is not None and libc.unshare(_CLONE_NEWNS) == 0:
        # A private /tmp and /dev/shm (the world-writable places), small, gone with the run.
        libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None)
        size = f"size={limits.file_bytes}".encode()
        for place in _WORLD_WRITABLE:
            libc.mount(b"tmpfs", place, b"tmpfs", _MS_NOSUID | _MS_NODEV, size)
    if uid is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)


def _end_all(process: subprocess.Popen, uid: int | None) -> None:
    """Kill the run's process group, and every process of its user (what left the group),
    until none is left; reap the harness."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()
    if uid is None:
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = [int(p) for p in os.listdir("/proc") if p.isdigit() and _owner(int(p)) == uid]
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def _owner(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None
