"""avg@k, unbiased pass@k, maj@k and the summary, against values worked out by hand."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from fractions import Fraction
from math import comb

import numpy as np
import pytest

from rayrep.eval import avg_at_k, maj_at_k, pass_at_k, pass_ks, summarize, summarize_by_source

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------------------------
# pass@k


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (10, 3, 1, 0.3),  # pass@1 is the plain success rate
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (8, 0, 3, 0.0),  # nothing correct
        (8, 6, 3, 1.0),  # n - c = 2 < k: every draw of 3 holds a correct one
        (8, 8, 8, 1.0),
        (1, 1, 1, 1.0),
    ],
)
def test_pass_at_k_known_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_the_exact_binomial_formula():
    for n in range(1, 25):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - Fraction(comb(n - c, k), comb(n, k))
                assert pass_at_k(n, c, k) == pytest.approx(float(exact), abs=1e-12), (n, c, k)


def test_pass_at_k_is_stable_for_large_n():
    # C(1000, 100) has 140 digits: the product form never builds it.
    exact = 1 - Fraction(comb(990, 100), comb(1000, 100))
    assert pass_at_k(1000, 10, 100) == pytest.approx(float(exact), rel=1e-12)
    assert pass_at_k(np.int64(10), np.int64(3), np.int64(1)) == pytest.approx(0.3)


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((3, 1, 4), "k"),
        ((3, 4, 1), "c"),
        ((-1, 0, 1), "n"),
        ((5, -1, 1), "c"),
        ((5, 1, -2), "k"),
        ((5, 1, 0), "k"),
    ],
)
def test_pass_at_k_names_the_bad_argument(args, name):
    with pytest.raises(ValueError, match=rf"^{name} must"):
        pass_at_k(*args)


def test_pass_at_k_rejects_non_integers():
    with pytest.raises(TypeError, match="n must be an int"):
        pass_at_k(2.5, 1, 1)
    with pytest.raises(TypeError, match="c must be an int"):
        pass_at_k(4, True, 1)


# ---------------------------------------------------------------------------------------
# avg@k and summarize


def test_avg_at_k():
    assert avg_at_k([[1, 0, 1, 1], [0, 0, 0, 0]]) == pytest.approx(0.375)  # (3/4 + 0) / 2
    assert avg_at_k([[True, False], [True, True]]) == pytest.approx(0.75)
    assert avg_at_k(np.array([[1, 1, 0], [0, 0, 1]], dtype=bool)) == pytest.approx(0.5)
    assert avg_at_k([[1], [0, 1, 1, 1]]) == pytest.approx(0.875)  # each problem weighs the same


@pytest.mark.parametrize(
    ("correct", "message"),
    [([], "empty"), ([[1, 0], []], r"correct\[1\] is empty"), ([[1, 2]], r"correct\[0\] holds 2"),
     ([[1, -1.0]], "holds -1.0"), ([1, 0, 1], "2-D")],
)
def test_avg_at_k_rejects_bad_input(correct, message):
    with pytest.raises(ValueError, match=message):
        avg_at_k(correct)


def test_summarize_by_hand():
    correct = [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
    summary = summarize(correct, ks=(1, 2, 4))
    assert summary.keys() == {"avg@4", "pass@1", "pass@2", "pass@4", "num_problems", "samples_per_problem"}
    assert summary["avg@4"] == pytest.approx(0.25)  # (1/4 + 2/4 + 0) / 3
    assert summary["pass@1"] == pytest.approx(0.25)
    # problem 1: 1 - C(3,2)/C(4,2) = 1/2; problem 2: 1 - C(2,2)/C(4,2) = 5/6; problem 3: 0
    assert summary["pass@2"] == pytest.approx((1 / 2 + 5 / 6 + 0) / 3)
    assert summary["pass@4"] == pytest.approx(2 / 3)
    assert summary["num_problems"] == 3 and summary["samples_per_problem"] == 4


def test_summarize_defaults_and_errors():
    expected_keys = {"avg@8", "pass@1", "pass@8", "num_problems", "samples_per_problem"}
    assert set(summarize(np.ones((2, 8)))) == expected_keys
    with pytest.raises(ValueError, match="ks"):
        summarize([[1, 0]], ks=(3,))
    with pytest.raises(ValueError, match="equal rows"):
        summarize([[1, 0], [1]])


def test_eval_module_is_light_at_import():
    code = (
        "import sys, rayrep.eval; "
        "print(sorted(m for m in ('torch', 'ray', 'sympy', 'math_verify') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "[]", done.stderr


# ---------------------------------------------------------------------------------------
# maj@k (real math-verify in the default sandbox)


def test_maj_at_k_groups_equivalent_answers():
    # As strings "3" would win 2 to 1; by value, 2 = 4/2 = 2.0 wins 3 to 2.
    answers = [r"\boxed{2}", r"\boxed{3}", r"\boxed{\frac{4}{2}}", r"\boxed{3}", r"\boxed{2.0}"]
    assert maj_at_k(answers, "2") == 1.0
    assert maj_at_k(answers, "3") == 0.0
    assert maj_at_k(answers, "2", k=4) == 1.0  # 2 votes each: 2 came first
    assert maj_at_k(answers, "3", k=4) == 0.0


def test_maj_at_k_ties_go_to_the_earliest_answer():
    assert maj_at_k([r"\boxed{3}", r"\boxed{2}"], "3") == 1.0
    assert maj_at_k([r"\boxed{3}", r"\boxed{2}"], "2") == 0.0


def test_maj_at_k_without_answers_does_not_vote():
    # Two empty boxes would outvote the 7 if they counted as a group.
    assert maj_at_k([r"\boxed{}", r"\boxed{}", r"\boxed{7}"], "7") == 1.0
    assert maj_at_k(["I don't know.", "No idea."], "7") == 0.0
    assert maj_at_k(["The answer is 12.", "so it is 12", r"\boxed{13}"], "12") == 1.0


def test_maj_at_k_survives_a_pathological_answer():
    start = time.monotonic()
    assert maj_at_k([r"\boxed{9^{9^{9^{9}}}}", r"\boxed{4}", r"\boxed{4}"], "4") == 1.0
    assert time.monotonic() - start < 10.0  # one comparison against the tower times out (limit 1 s)


def test_maj_at_k_bad_arguments():
    with pytest.raises(ValueError, match="k must"):
        maj_at_k([r"\boxed{1}"], "1", k=2)
    with pytest.raises(ValueError, match="k must"):
        maj_at_k([r"\boxed{1}"], "1", k=0)
    with pytest.raises(ValueError, match="k must"):
        maj_at_k([], "1")
    with pytest.raises(TypeError, match="sequence"):
        maj_at_k(r"\boxed{1}", "1")


def test_summarize_by_source_by_hand():
    # aime: 2 questions x 4 samples; math: 3 questions x 1 sample.
    sources = ["aime", "math", "aime", "math", "math"]
    correct = [[1, 0, 0, 0], [1], [1, 1, 0, 1], [0], [1]]
    majority = [False, True, True, False, True]
    out = summarize_by_source(sources, correct, majority)
    assert out["aime/avg@4"] == pytest.approx((1 / 4 + 3 / 4) / 2)
    assert out["aime/pass@2"] == pytest.approx(((1 - 3 / 6) + 1.0) / 2)  # 1 - C(3,2)/C(4,2); 1 - C(1,2)/C(4,2)
    assert out["aime/pass@4"] == 1.0 and out["aime/maj@4"] == 0.5 and out["aime/questions"] == 2
    assert out["math/avg@1"] == out["math/pass@1"] == pytest.approx(2 / 3) and out["math/maj@1"] == pytest.approx(2 / 3)
    # pooled: every question weighs the same; mean: every benchmark weighs the same
    assert out["pass@1"] == pytest.approx((1 / 4 + 1 + 3 / 4 + 0 + 1) / 5)
    assert out["mean_pass@1"] == pytest.approx((1 / 2 + 2 / 3) / 2)
    assert out["mean_maj@k"] == pytest.approx((1 / 2 + 2 / 3) / 2)
    assert "avg@4" not in out and out["questions"] == 5  # k differs between benchmarks: no pooled avg@k
    # standard error of pass@1: per-question scores 0.25, 1, 0.75, 0, 1 (mean 0.6), sample variance / n
    squares = (0.25 - 0.6) ** 2 + (1 - 0.6) ** 2 + (0.75 - 0.6) ** 2 + (0 - 0.6) ** 2 + (1 - 0.6) ** 2
    assert out["pass@1_se"] == pytest.approx(math.sqrt(squares / 4 / 5))


def test_summarize_by_source_pools_when_every_question_has_the_same_k():
    out = summarize_by_source(["a", "b"], [[1, 0], [1, 1]], [True, True])
    assert out["avg@2"] == out["pass@1"] == pytest.approx(0.75) and out["maj@2"] == 1.0 and out["pass@2"] == 1.0
    assert pass_ks(32) == [1, 2, 4, 8, 16, 32] and pass_ks(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError, match="differ in length"):
        summarize_by_source(["a"], [[1], [0]], [True, False])
