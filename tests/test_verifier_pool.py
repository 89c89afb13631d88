"""VerifierGroup on a real local Ray cluster: parallel scoring, time limits, counted statuses."""

import os
import time

import pytest
import ray

from rayrep.generator.group import PendingRollouts
from rayrep.types import Prompt, Rollout
from rayrep.verifier.group import Settings, VerifierGroup


def chunk(texts_per_prompt, start=0):
    rollouts = [[Rollout([1], [2], [0.0], text, "stop") for text in texts] for texts in texts_per_prompt]
    return PendingRollouts(range(start, start + len(rollouts)), ray.put(rollouts))


def asked(*truths: str, source: str = "math", extra: dict | None = None) -> list[Prompt]:
    """Questions of `source` with these ground truths."""
    return [Prompt(f"{source}-{i}", ({"role": "user", "content": f"question {i}"},), truth, source, extra or {})
            for i, truth in enumerate(truths)]


@pytest.fixture(scope="module")
def pool(ray_cluster, tiny_cfg):
    cfg = tiny_cfg.replace(**{"verifier.num_workers": 2, "verifier.timeout_s": 1.0, "verifier.by_source": ["code=code"],
                              "verifier.code_timeout_s": 2.0, "verifier.code_memory_mib": 256})
    verifiers = VerifierGroup.create(cfg)
    yield verifiers
    verifiers.shutdown()


def test_scores_in_prompt_order_across_workers(pool):
    chunks = [chunk([["\\boxed{3}", "\\boxed{4}"], ["\\boxed{10}"]]), chunk([["no answer", "\\boxed{0.5}"]], start=2)]
    verdicts = pool.check(chunks, asked("3", "10", "1/2"))
    assert verdicts.correct == [[True, False], [True], [False, True]]
    assert verdicts.statuses == {"ok": 4, "no_answer": 1}
    assert verdicts.majority is None


def test_majority_votes_are_judged_where_the_answers_are(pool):
    # 3 vs 4 tie: the earliest answer's group wins; 0.5 and 1/2 are one answer (math-verify).
    chunks = [chunk([["\\boxed{3}", "\\boxed{4}"], ["\\boxed{0.5}", "\\boxed{7}", "\\boxed{1/2}"]]),
              chunk([["no answer", "\\boxed{9}", "\\boxed{8}", "\\boxed{8}"]], start=2)]
    verdicts = pool.check(chunks, asked("4", "1/2", "8"), majority=True)
    assert verdicts.majority == [False, True, True]
    assert verdicts.correct == [[False, True], [True, False, True], [False, False, True, True]]


def test_a_hanging_input_costs_at_most_the_limit_and_is_counted(pool):
    slow = "\\boxed{9^{9^{9^{9}}}}"
    chunks = [chunk([[slow, "\\boxed{7}"]]), chunk([["\\boxed{7}", slow]], start=1)]
    start = time.monotonic()
    verdicts = pool.check(chunks, asked("7", "7"))
    elapsed = time.monotonic() - start
    assert verdicts.correct == [[False, True], [True, False]]
    assert verdicts.statuses["timeout"] == 2 and verdicts.statuses["ok"] == 2
    # Each pathological answer costs at most the 1 s limit (math-verify alone would take
    # minutes on it); the bound is generous, for a busy machine.
    assert elapsed < 15.0


def test_zero_workers_score_in_process(ray_cluster):
    verdicts = VerifierGroup(Settings(timeout_s=1.0)).check([chunk([["\\boxed{2}"]])], asked("2"))
    assert verdicts.correct == [[True]]


def test_hostile_programs_cost_their_completions_and_leave_the_verifiers_and_the_machine_as_they_were(pool):
    """The code checker on the verifier actors: a fork bomb, an infinite loop, a 10 GB
    allocation, a kill of its parent and a program that reads its verifier's environment each
    score 0 with their status; both actors answer from the same processes, and no process of
    the programs' users is left (tests/test_code_checker.py: every limit, one by one)."""
    import psutil

    from rayrep.verifier.code import _UID_BASE

    tests = '["assert add(1, 2) == 3"]'
    hostile = ["import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
               "while True:\n    pass", "x = bytearray(10 * 1024**3)", "import os\nos.kill(os.getppid(), 9)",
               "import os\nprint(open(f'/proc/{os.getppid()}/environ').read())",
               "def add(a, b):\n    return a + b"]
    pids = ray.get([w.pid.remote() for w in pool.workers])
    chunks = [chunk([[f"```python\n{p}\n```" for p in hostile[:3]]]), chunk([[f"```python\n{p}\n```" for p in hostile[3:]]], 1)]
    verdicts = pool.check(chunks, asked(tests, tests, source="code"))
    assert verdicts.correct == [[False, False, False], [False, False, True]]
    assert verdicts.statuses == {"timeout": 2, "error": 3, "ok": 1}
    assert ray.get([w.pid.remote() for w in pool.workers]) == pids
    if os.geteuid() == 0:
        assert [p.pid for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real >= _UID_BASE] == []
