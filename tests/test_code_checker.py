"""The `code` checker: a completion's program against a row's tests (asserts, stdin/stdout
cases, function calls), and hostile programs, each held by its limit: it scores 0 with a
status, and leaves no process and no file behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil
import pytest

from rayrep.verifier.code import (_PRIVATE_PARENT, _UID_BASE, CodeLimits, _network_namespace_allowed, check_code,
                                  extract_program, parse_tests)
from rayrep.verifier.sandbox import MathSandbox

pytestmark = pytest.mark.timeout(300)

LIMITS = CodeLimits(wall_s=2.0, cpu_s=30, memory_bytes=256 * 1024**2, processes=8, file_bytes=4 * 1024**2)
"""Small limits; the CPU time's far above the wall clock's, so that a loop meets the wall
clock however busy the machine is (the CPU-time limit: its own test)."""
ASSERTS = json.dumps(["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(-1, 1) == 0"])
STDIO = json.dumps({"inputs": ["1 2\n", "5 5\n", "0 0\n"], "outputs": ["3\n", "10\n", "1\n"]})
CALLS = json.dumps({"fn_name": "add", "inputs": [[1, 2], [[1], [2]]], "outputs": [3, [1, 2]]})
ROOT = os.geteuid() == 0


def fenced(program: str) -> str:
    return f"Let me write it.\n```python\n{program}\n```\nDone."


def test_the_program_is_the_last_fenced_block_or_the_whole_text():
    text = "```python\nx = 1\n```\nthen\n```\ny = 2\n```"
    assert extract_program(text) == "y = 2\n" and extract_program("no code") is None
    assert extract_program("print(1)", whole_text=True) == "print(1)"


@pytest.mark.parametrize("truth, message", [
    ("assert f() == 1", "not JSON"),
    (json.dumps({"inputs": ["1"], "outputs": []}), "1 inputs and 0 outputs"),
    (json.dumps({"fn_name": "f", "inputs": [1], "outputs": [1]}), "argument lists"),
    (json.dumps([1, 2]), "a list of assert statements or an object"),
])
def test_tests_it_cannot_read_are_named(truth, message):
    with pytest.raises(ValueError, match=message):
        parse_tests(truth)


@pytest.mark.parametrize("truth, program, passed", [
    (ASSERTS, "def add(a, b):\n    return a + b", (True, 1.0)),
    (ASSERTS, "def add(a, b):\n    return a * b if a > 0 else a + b", (False, 2 / 3)),  # add(2, 2) and add(-1, 1) pass
    (STDIO, "a, b = map(int, input().split())\nprint(a + b)", (False, 2 / 3)),
    (STDIO, "a, b = map(int, input().split())\nprint(a + b or 1)   ", (True, 1.0)),
    (CALLS, "def add(a, b):\n    return a + b", (True, 1.0)),  # [1] + [2] == [1, 2]
])
def test_each_test_format_scores_what_passes(truth, program, passed):
    correct, score, status, _ = check_code(fenced(program), truth, LIMITS)
    assert (correct, score, status) == (passed[0], None, "ok")  # all or nothing: the verdict
    partial = CodeLimits(**{**LIMITS.__dict__, "partial_credit": True})
    assert check_code(fenced(program), truth, partial)[:2] == (passed[0], pytest.approx(passed[1]))


HOSTILE = {
    "an infinite loop": ("while True:\n    pass", "timeout", "wall-clock limit"),
    "a sleep past the limit": ("import time\ntime.sleep(600)", "timeout", "wall-clock limit"),
    "a fork bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", "timeout",
                    "wall-clock limit"),
    "a 10 GB allocation": ("x = bytearray(10 * 1024**3)", "error", "MemoryError"),
    "writing 1 GB to a file": ("with open('big', 'wb') as f:\n    for _ in range(1024):\n        f.write(b'x' * 1024**2)",
                               "error", "File too large"),
    "writing outside its folder": ("open('../EVIL', 'w').write('x')", "error", "Permission denied"),  # beside its folder
    "writing to /tmp": ("open('/tmp/rayrep-evil', 'w').write('x')", "ok", "0 of 3"),  # a private /tmp, gone with it
    "a socket to 127.0.0.1": ("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)", "error",
                              "Network is unreachable"),
    "reading the parent's environment": ("import os\nassert set(os.environ) <= {'LC_CTYPE'}\n"  # (Python's locale coercion)
                                         "print(open(f'/proc/{os.getppid()}/environ').read())", "error",
                                         "Permission denied"),
    "killing its parent": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", "error", "not permitted"),
    "printing 100 MB": ("print('x' * (100 * 1024**2))", "error", "status 120"),
    "exiting early": ("import os\nos._exit(0)", "error", "ended before the tests reported"),
}


@pytest.mark.skipif(not ROOT, reason="the program runs as a user of its own only when rayrep runs as root")
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_program_scores_zero_with_a_status_and_leaves_nothing_behind(name):
    program, status, detail = HOSTILE[name]
    if not _network_namespace_allowed():  # (a machine that gives no namespaces: sockets refused in Python)
        if name == "writing to /tmp":
            pytest.skip("without a mount namespace of its own, /tmp is the machine's (docs/your-own-task.md)")
        detail = detail.replace("Network is unreachable", "network access is refused in the code sandbox")
    correct, _, got, said = check_code(fenced(program), ASSERTS, LIMITS)
    assert (correct, got) == (False, status) and detail in said, said
    sandboxed = [p.pid for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real >= _UID_BASE]
    assert sandboxed == []
    assert list(Path(_PRIVATE_PARENT).iterdir()) == []
    assert not Path("/tmp/rayrep-evil").exists()


def test_a_program_that_burns_its_cpu_time_is_stopped_by_that_limit():
    limits = CodeLimits(**{**LIMITS.__dict__, "wall_s": 60.0, "cpu_s": 1})
    assert check_code(fenced("while True:\n    pass"), ASSERTS, limits) == (
        False, None, "error", "the program was stopped: CPU-time limit of 1 s")


def test_the_code_checker_runs_in_the_sandbox_child_under_a_budget_of_its_own():
    """A check of the `code` checker may take more than the verifier's limit per completion:
    a run per case. The child survives every program."""
    with MathSandbox(code_limits=LIMITS) as sandbox:
        child = sandbox.child_pids()[0]
        programs = ["def add(a, b):\n    return a + b", "while True:\n    pass", "import os\nos._exit(3)"]
        verdicts = sandbox.check_batch([("code", fenced(p), ASSERTS, {}) for p in programs]
                                       + [("code", fenced("print(sum(map(int, input().split())))"), STDIO, {}),
                                          ("code", "no program", ASSERTS, {}), ("code", fenced("x"), "[oops", {})],
                                       timeout_s=1.0)
        assert [(v.correct, v.status) for v in verdicts] == [
            (True, "ok"), (False, "timeout"), (False, "error"), (False, "ok"), (False, "no_answer"), (False, "error")]
        assert verdicts[3].detail == "2 of 3 tests passed" and "not JSON" in verdicts[5].detail
        assert sandbox.child_pids()[0] == child  # no kill: the child enforced the program's limits itself
