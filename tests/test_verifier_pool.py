"""VerifierGroup on a real local Ray cluster: parallel scoring, time limits, counted statuses."""

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
    cfg = tiny_cfg.replace(**{"verifier.num_workers": 2, "verifier.timeout_s": 1.0})
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
