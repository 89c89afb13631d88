"""The math verifier: real math-verify in real sandbox processes, no mocks."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from rayrep.verifier import math as vm
from rayrep.verifier.math import MathSandbox, SandboxError, Verdict, last_boxed_content

pytestmark = pytest.mark.timeout(120)

LIMIT_S = 1.0  # the per-item limit every check below runs with (the default)
WALL_LIMIT_S = 6.0
"""The promise checked here: any single call returns within a few seconds, pathological or
not (math-verify alone takes minutes on some of these). Generous on purpose: a loaded CI
machine may add seconds of scheduling delay; only a missing hard limit exceeds this."""


@pytest.fixture(scope="module")
def warm_default():
    """The process-wide sandbox, started before any call is timed."""
    return vm.default_sandbox().start()


@pytest.fixture
def sandbox():
    """A private sandbox, for tests that kill its children."""
    with MathSandbox() as box:
        yield box


def _alive(pid: int) -> bool:
    """Whether the process exists at all: a zombie (killed but never reaped) counts."""
    return psutil.pid_exists(pid)


def _stall(pid: int) -> None:
    """Freeze a child the way an uninterruptible C loop would: no signal handler runs."""
    os.kill(pid, signal.SIGSTOP)


# ---------------------------------------------------------------------------------------
# Final-answer extraction (pure Python, parent side)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so \boxed{68}.", "68"),
        (r"\boxed{1} first, then \boxed{2}", "2"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed {\{1,2\}}", r"\{1,2\}"),  # escaped braces do not close the box
        (r"\boxed{a{b}c} trailing", "a{b}c"),
        (r"x \boxed{3} y \boxed{4", "3"),  # a box cut off at the end falls back to the one before
        ("no box here: 42", None),
        (r"\boxed", None),
    ],
)
def test_last_boxed_content(text, expected):
    assert last_boxed_content(text) == expected


def test_last_boxed_content_caps_length():
    text = r"\boxed{" + "1" * 50 + "}"
    assert last_boxed_content(text, max_chars=50) == "1" * 50
    assert last_boxed_content(text, max_chars=49) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("\\boxed{" * 150_000, None),  # a million characters of boxes that never close
        ("\\boxed{" + "{" * 1_000_000, None),
        ("a" * 1_000_000 + r"\boxed{5}", "5"),
        (r"\boxed{4}" + "\\boxed{" * 150_000, "4"),
    ],
    ids=["many-unclosed-boxes", "megabyte-of-braces", "megabyte-then-box", "box-then-unclosed-boxes"],
)
def test_extraction_of_a_megabyte(text, expected):
    # How fast this runs (linear time) is measured by bench/verifier.py.
    assert last_boxed_content(text, max_chars=vm.MAX_ANSWER_CHARS) == expected


# ---------------------------------------------------------------------------------------
# Ordinary answers through the stable API


@pytest.mark.parametrize(
    ("completion", "truth"),
    [
        (r"The total is \boxed{68}.", "68"),
        (r"\boxed{\frac{1}{2}}", "0.5"),
        (r"\boxed{\frac{1}{2}}", "1/2"),
        (r"\boxed{\dfrac{3}{4}}", r"\frac{3}{4}"),
        (r"\boxed{2\sqrt{2}}", r"\sqrt{8}"),
        ("The answer is 42.", "42"),
        (r"\boxed{-7}", "-7"),
        (r"\boxed{\{1,2\}}", r"\{2,1\}"),
        (r"\boxed{(1, 2)}, \boxed{(2, 1)}", "(2,1),(1,2)"),  # several boxes: one answer, as math-verify reads it
        (r"\boxed{1} and \boxed{2} and \boxed{3}", r"\{1,2,3\}"),
        (r"So $x=\boxed{2}$ or $x=\boxed{-3}$.", "2,-3"),
    ],
)
def test_correct_answers_score_one(warm_default, completion, truth):
    assert vm.score(completion, truth) == 1.0
    assert vm.score(completion, truth, style="dapo") == 1.0


@pytest.mark.parametrize(
    ("completion", "truth"),
    [
        (r"\boxed{69}", "68"),
        (r"\boxed{7}", "-7"),
        (r"\boxed{\frac{1}{3}}", "0.5"),
        ("The answer is 41.", "42"),
        (r"Try \boxed{6}. No wait, it is \boxed{5}.", "6"),
        # Several boxes answer together (as math-verify reads them), so a correction keeps the
        # first answer too, and boxing every candidate scores nothing.
        (r"Try \boxed{5}. No wait, it is \boxed{6}.", "6"),
        (r"\boxed{1} \boxed{2} \boxed{3} \boxed{4} \boxed{5}", "3"),
    ],
)
def test_wrong_answers_score_zero(warm_default, completion, truth):
    assert vm.score(completion, truth) == 0.0
    assert vm.score(completion, truth, style="dapo") == -1.0


def test_verdict_reports_answer_and_status(warm_default):
    verdict = vm.verify(r"so \boxed{\frac{1}{2}}", "0.5")
    assert verdict == Verdict(True, "ok", r"\frac{1}{2}", "")
    assert vm.verify("I have no idea.", "3").status == "no_answer"
    assert vm.verify(r"\boxed{}", "3").status == "no_answer"


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="style"):
        vm.score(r"\boxed{1}", "1", style="sparse")
    with pytest.raises(ValueError, match="timeout_s"):
        vm.verify(r"\boxed{1}", "1", timeout_s=0)
    with pytest.raises(TypeError, match="completion"):
        vm.verify(None, "1")
    with pytest.raises(ValueError, match="length"):
        vm.verify_batch(["a", "b"], ["1"])


def test_guards_reject_before_the_sandbox(warm_default):
    long_answer = vm.verify(r"\boxed{" + "1+" * 600 + "1}", "1201")
    assert long_answer.status == "error" and "longer than" in long_answer.detail
    deep = vm.verify(r"\boxed{" + "{" * 60 + "1" + "}" * 60 + "}", "1")
    assert deep.status == "error" and "nested" in deep.detail
    assert vm.verify(r"\boxed{1}", "").status == "error"


# ---------------------------------------------------------------------------------------
# Parity with math-verify used directly

# (completion, ground truth): a spread of answer forms, checked both ways below.
PARITY = [
    (r"The total is \boxed{68}.", "68"), (r"The total is \boxed{69}.", "68"), (r"\boxed{\frac{1}{2}}", "0.5"),
    (r"\boxed{\frac{1}{2}}", "1/2"), (r"\boxed{\dfrac{3}{4}}", r"\frac{3}{4}"), (r"\boxed{2\sqrt{2}}", r"\sqrt{8}"),
    (r"\boxed{-7}", "-7"), (r"\boxed{7}", "-7"), (r"\boxed{\{1,2\}}", r"\{2,1\}"),
    (r"\boxed{(1, 2)}, \boxed{(2, 1)}", "(2,1),(1,2)"), (r"\boxed{1} and \boxed{2} and \boxed{3}", r"\{1,2,3\}"),
    (r"So $x=\boxed{2}$ or $x=\boxed{-3}$.", "2,-3"), (r"\boxed{1} \boxed{2} \boxed{3} \boxed{4} \boxed{5}", "3"),
    (r"Try \boxed{5}. No wait, it is \boxed{6}.", "6"), (r"\boxed{[0, 1)}", "[0,1)"), (r"\boxed{(0, 1]}", "[0,1)"),
    ("The answer is 42.", "42"), ("The answer is 41.", "42"), ("so $x = 5$", "5"), (r"\boxed{x = 5}", "5"),
    (r"\boxed{50\%}", "50"), (r"\boxed{30^\circ}", "30"), (r"\boxed{2\pi}", r"2\pi"), (r"\boxed{\pi}", "3.14"),
    (r"\boxed{\text{(A)}}", "A"), (r"\boxed{A}", "A"), (r"\boxed{B}", "A"), (r"\boxed{0.333}", r"\frac{1}{3}"),
    (r"\boxed{1000}", "1,000"), (r"\boxed{1,000}", "1000"), (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}"),
    (r"\boxed{x^2+2x+1}", "(x+1)^2"), (r"\boxed{y = 2x + 1}", "2x+1"), (r"Final answer: $\frac{7}{2}$", "3.5"),
    ("I think it is 12 or maybe 13", "13"), (r"\boxed{}", "3"), ("no idea", "3"), (r"\boxed{3} \boxed{3}", "3"),
    (r"\boxed{\infty}", r"\infty"), (r"\boxed{-\infty, 2}", r"(-\infty, 2)"), (r"\boxed{e^{i\pi}}", "-1"),
    (r"\boxed{10^{3}}", "1000"), (r"\boxed{\$18.90}", "18.90"), (r"\boxed{12 \text{ cm}}", "12"),
    (r"\boxed{\frac{a}{b}}", "a/b"), (r"\boxed{3, 5}", "5, 3"), (r"\boxed{(3, 5)}", "(5, 3)"),
    (r"\boxed{\frac{1}{2}}", r"$\frac{1}{2}$"), (r"\boxed{0.5}", r"\(\frac{1}{2}\)"), (r"\boxed{} \boxed{4}", "4"),
    (r"\boxed{2} \boxed{}", "2"), (r"\boxed{x=2} and \boxed{x=-3}", "2, -3"), (r"\boxed{3} or \boxed{4}", "3"),
    (r"\boxed{1}, \boxed{2}", r"\{1, 2\}"), (r"\boxed{(1,2)} \boxed{(3,4)}", "(1,2),(3,4)"),
]

# Where rayrep differs on purpose (the README lists them with the reasons):
DELIBERATE = {
    # A bare ground truth is read as the content of a box; math-verify alone reads LaTeX only
    # between delimiters, and an escaped dollar sign then makes 18.90 unequal to itself.
    (r"\boxed{18.90}", r"\$18.90"): 1.0,
    # Without a box, only the last 2,000 characters are read (bounded work on long text).
    ("The answer is 42." + " and so on" * 300, "42"): 0.0,
    # A boxed answer over 1,000 characters is rejected before any parser sees it.
    (r"\boxed{" + "+".join(["1"] * 600) + "}", "600"): 0.0,
}


def math_verify_directly(completion: str, truth: str) -> float:
    from math_verify import parse, verify

    delimited = any(d in truth for d in ("$", "\\(", "\\[", "\\boxed"))
    return float(verify(parse(truth if delimited else f"${truth}$"), parse(completion)))


@pytest.mark.parametrize(("completion", "truth"), PARITY)
def test_scores_agree_with_math_verify_used_directly(warm_default, completion, truth):
    assert vm.score(completion, truth) == math_verify_directly(completion, truth)


@pytest.mark.parametrize(("completion", "truth"), list(DELIBERATE))
def test_deliberate_differences_from_math_verify(warm_default, completion, truth):
    ours = DELIBERATE[(completion, truth)]
    assert vm.score(completion, truth) == ours != math_verify_directly(completion, truth)


# ---------------------------------------------------------------------------------------
# Pathological inputs: bounded wall time, honest status


PATHOLOGICAL = [
    (r"\boxed{9^{9^{9^{9}}}}", "9", {"timeout", "error"}),
    ("x" * 1_000_000, "1", {"no_answer", "error"}),
    ("{" * 10_000, "1", {"error", "no_answer"}),
    (r"\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}", "1", {"error"}),
    (os.urandom(100_000).decode("latin-1"), "1", {"error", "no_answer"}),
    (r"\boxed{10^{10^{10^{10}}}}", "1", {"timeout", "error"}),
    (r"\boxed{2^{10^{9}}}", "2", {"timeout", "error"}),
]


def test_pathological_inputs_return_quickly_one_after_another(warm_default):
    for completion, truth, statuses in PATHOLOGICAL:
        start = time.monotonic()
        verdict = vm.verify(completion, truth)
        elapsed = time.monotonic() - start
        assert elapsed < WALL_LIMIT_S, (completion[:40], elapsed)
        assert not verdict.correct
        assert verdict.status in statuses, (completion[:40], verdict)
        assert vm.score(completion, truth) == 0.0
    # and the sandbox still answers ordinary questions afterwards
    assert vm.score(r"\boxed{68}", "68") == 1.0


def test_soft_deadline_stops_slow_work_without_a_kill(sandbox):
    before = sandbox.child_pids()
    verdict = sandbox.verify(r"\boxed{9^{9^{9^{9}}}}", "9", timeout_s=LIMIT_S)
    assert verdict.status == "timeout" and "stopped in the sandbox" in verdict.detail
    assert sandbox.child_pids() == before  # the same child answers: nothing was killed


def test_hard_kill_replaces_a_stuck_child_with_the_warm_spare(sandbox):
    """A child that no signal can stop is killed at the limit; the spare takes over."""
    previous_spare = None
    for _ in range(3):
        start = time.monotonic()
        sandbox.start()  # promotes the spare if the last round killed the active child
        active, spare = sandbox.child_pids()
        assert previous_spare in (None, active)
        _stall(active)
        verdict = sandbox.verify(r"\boxed{68}", "68", timeout_s=1.0)
        elapsed = time.monotonic() - start
        assert verdict.status == "timeout" and "killed" in verdict.detail
        assert elapsed < WALL_LIMIT_S, elapsed
        assert not _alive(active)
        assert sandbox.child_pids() == [spare]
        previous_spare = spare
    # The next call runs on the spare that was started before the kill, not on a child
    # started afterwards.
    assert sandbox.verify(r"\boxed{68}", "68").correct
    assert sandbox.child_pids()[0] == previous_spare


def test_score_from_worker_threads(warm_default):
    completions = [
        r"\boxed{68}", r"\boxed{9^{9^{9^{9}}}}", "The answer is 42.", r"\boxed{2\sqrt{2}}", r"\boxed{5}"
    ]
    truths = ["68", "9", "42", r"\sqrt{8}", "6"]

    def timed(pair):
        start = time.monotonic()
        return vm.score(*pair), time.monotonic() - start

    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(timed, zip(completions, truths)))
    assert [r for r, _ in results] == [1.0, 0.0, 1.0, 1.0, 0.0]
    # Callers queue behind the one pathological item, never much longer.
    assert max(t for _, t in results) < 2 * WALL_LIMIT_S


def test_pathological_input_from_a_thread_running_an_event_loop(warm_default):
    """Async Ray actors run their event loop off the main thread, where SIGALRM cannot work."""
    outcome = {}

    async def check():
        start = time.monotonic()
        outcome["verdict"] = vm.verify(r"\boxed{10^{10^{10^{10}}}}", "1")
        outcome["elapsed"] = time.monotonic() - start
        outcome["ok"] = await asyncio.to_thread(vm.score, r"\boxed{2\sqrt{2}}", r"\sqrt{8}")

    thread = threading.Thread(target=asyncio.run, args=(check(),))
    thread.start()
    thread.join(20)
    assert outcome["verdict"].status == "timeout"
    assert outcome["elapsed"] < WALL_LIMIT_S
    assert outcome["ok"] == 1.0


# ---------------------------------------------------------------------------------------
# Batches


def test_batch_with_a_pathological_item_in_the_middle(warm_default):
    completions = [r"\boxed{68}", r"\boxed{1/2}", r"\boxed{9^{9^{9^{9}}}}", r"\boxed{7}", "The answer is 42."]
    truths = ["68", "0.5", "9", "-7", "42"]
    start = time.monotonic()
    verdicts = vm.verify_batch(completions, truths)
    assert time.monotonic() - start < 2 * WALL_LIMIT_S
    assert [v.correct for v in verdicts] == [True, True, False, False, True]
    assert [v.status for v in verdicts] == ["ok", "ok", "timeout", "ok", "ok"]


def test_batch_continues_on_the_spare_after_a_kill(sandbox):
    completions = [r"\boxed{68}", r"\boxed{9^{9^{9^{9}}}}", r"\boxed{-7}", r"\boxed{8}", "The answer is 42."]
    truths = ["68", "9", "-7", "7", "42"]
    first_child = sandbox.child_pids()[0]
    result = {}
    worker = threading.Thread(
        target=lambda: result.update(v=sandbox.verify_batch(completions, truths, timeout_s=2.0))
    )
    worker.start()
    # The first item takes milliseconds and the second keeps the child busy for 1.75 s
    # (its soft deadline): freezing the child now leaves only the hard kill to end it.
    time.sleep(0.5)
    _stall(first_child)
    worker.join(20)
    verdicts = result["v"]
    assert [v.status for v in verdicts] == ["ok", "timeout", "ok", "ok", "ok"]
    assert "killed" in verdicts[1].detail
    assert [v.correct for v in verdicts] == [True, False, True, False, True]
    assert not _alive(first_child)


# ---------------------------------------------------------------------------------------
# Equivalence and extraction (used by maj@k)


def test_equivalent(warm_default):
    assert vm.equivalent(r"\frac{1}{2}", "0.5")
    assert vm.equivalent(r"2\sqrt{2}", r"\sqrt{8}")
    assert not vm.equivalent("2", "3")
    start = time.monotonic()
    assert not vm.equivalent("1", r"9^{9^{9^{9}}}")
    assert time.monotonic() - start < WALL_LIMIT_S


def test_extract_answer(warm_default):
    assert vm.extract_answer(r"so it is \boxed{ \frac{2}{3} }") == r"\frac{2}{3}"
    assert vm.extract_answer(r"first \boxed{1}, then \boxed{ \frac{2}{3} }") == r"1,\frac{2}{3}"  # math-verify's reading
    assert vm.extract_answer("The answer is 42.") == "42"
    assert vm.extract_answer("I cannot solve this.") is None


# ---------------------------------------------------------------------------------------
# Process hygiene


def test_close_leaves_no_child_processes():
    box = MathSandbox().start()
    pids = box.child_pids()
    assert len(pids) == 2 and all(_alive(pid) for pid in pids)  # active + warm spare
    _stall(pids[0])
    assert box.verify(r"\boxed{1}", "1", timeout_s=0.5).status == "timeout"
    pids += box.child_pids()
    box.close()
    box.close()  # idempotent
    assert box.child_pids() == []
    assert not any(_alive(pid) for pid in pids)
    assert not {p.pid for p in psutil.Process().children(recursive=True)} & set(pids)
    with pytest.raises(RuntimeError, match="closed"):
        box.verify(r"\boxed{1}", "1")


def test_children_are_cleaned_up_at_interpreter_exit(tmp_path):
    script = (
        "from rayrep.verifier import math as vm\n"
        "assert vm.score(r'\\boxed{3}', '3') == 1.0\n"
        "print(*vm.default_sandbox().child_pids())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids)


def test_parent_does_not_import_math_verify():
    code = "import sys, rayrep.verifier.math; print('sympy' in sys.modules or 'math_verify' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr


def test_memory_limit_is_applied_in_the_child():
    # Far below what importing sympy needs: only an enforced limit makes start-up fail.
    with pytest.raises(SandboxError):
        MathSandbox(memory_limit_bytes=32 * 2**20, keep_spare=False).start()


# ---------------------------------------------------------------------------------------
# Any script can score: the sandbox never imports the caller's main module


UNGUARDED = (
    "from rayrep.verifier.math import score\n"
    "print(score('\\\\boxed{42}', '42'), score('\\\\boxed{41}', '42', style='dapo'))\n"
)


def test_an_unguarded_script_scores(tmp_path):
    script = tmp_path / "check.py"
    script.write_text(UNGUARDED)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1.0", "-1.0"]


def test_python_dash_c_scores(tmp_path):
    done = subprocess.run([sys.executable, "-c", UNGUARDED], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1.0", "-1.0"]


def test_code_piped_on_stdin_scores(tmp_path):
    done = subprocess.run([sys.executable, "-"], input=UNGUARDED, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1.0", "-1.0"]


def test_a_module_in_the_callers_folder_cannot_shadow_the_childs_imports(tmp_path):
    # The parent never imports math_verify (test_parent_does_not_import_math_verify); the child does.
    (tmp_path / "math_verify.py").write_text("raise SystemExit('the user module math_verify.py was imported')\n")
    done = subprocess.run([sys.executable, "-c", UNGUARDED], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1.0", "-1.0"]
