"""Checkers other than math: the text checkers, a user's function in the sandbox child (one
that raises, hangs, exits or returns garbage costs its completion a counted status, never the
sandbox), and the check of a user's checker before a run starts (one line, exit 2)."""

from __future__ import annotations

import json
import re
import time

import psutil
import pytest

from conftest import job_here
from rayrep.config import ConfigError
from rayrep.types import Prompt
from rayrep.verifier.checkers import CheckerError, Routing, choice, exact, final_answer, plugin, score_value
from rayrep.verifier.group import Question, check_checkers
from rayrep.verifier.sandbox import MathSandbox, SandboxError

pytestmark = pytest.mark.timeout(120)

ROW = {"data_source": "quiz", "extra_info": {}}
OPTIONS = {"data_source": "mc", "extra_info": {"choices": ["Paris", "Lyon", "Nice", "Lille"]}}


@pytest.mark.parametrize("completion, read, where", [
    ("Let me think.\nThe capital is \\boxed{Paris}.", "Paris", "boxed"),
    ("Thinking...\nThe answer is  PARIS!\nDone, I hope", "PARIS!", "answer line"),
    ("Thinking...\nFinal answer: Paris", "Paris", "answer line"),
    ("first line\n  Paris.  \n\n", "Paris.", "last line"),
    ("   \n\n ", None, "empty completion"),
])
def test_the_final_answer_says_what_it_read_and_where(completion, read, where):
    assert final_answer(completion) == (read, where)


@pytest.mark.parametrize("completion, truth, correct", [
    ("\\boxed{paris}", "Paris", True),
    ("The answer is:   New   York.", "new york", True),  # case, runs of spaces, end punctuation
    ('answer: "Paris"', "Paris", True),  # quotes at the ends
    ("answer: Paris, France", "Paris", False),  # inner punctuation and words count
    ("\\boxed{Lyon}", "Paris", False),
    ("answer: 3.0", "3", False),  # exact is text, not math: route numbers to math
])
def test_exact_matches_normalised_text_only(completion, truth, correct):
    assert exact(completion, truth, ROW)[0] is correct


@pytest.mark.parametrize("completion, truth, correct, read", [
    ("The answer is (A).", "A", True, "A"),
    ("answer: b", "B", True, "B"),
    ("\\boxed{C.}", "C", True, "C"),
    ("So the answer is Paris.", "A", True, "A"),  # an option's text stands for its letter
    ("answer: A", "Paris", True, "A"),  # and a ground truth given as the option's text
    ("answer: E", "A", False, "E"),  # no fifth option: no letter read
    ("answer: Marseille", "A", False, "Marseille"),
])
def test_choice_reads_letters_and_option_texts(completion, truth, correct, read):
    ok, answer, _ = choice(completion, truth, OPTIONS)
    assert (ok, answer) == (correct, read)


def test_choice_without_options_reads_letters_and_refuses_a_truth_it_cannot_read():
    assert choice("answer: (d)", "D", ROW)[0] is True
    with pytest.raises(ValueError, match="'Paris' is neither an option letter nor an option's text"):
        choice("answer: A", "Paris", ROW)


@pytest.mark.parametrize("value, expected", [
    (0.25, (None, 0.25, ())),
    (1, (None, 1.0, ())),
    (True, (True, 1.0, ())),
    ({"score": 0.5, "correct": False, "format": 0.1}, (False, 0.5, (("format", 0.1),))),
])
def test_a_checkers_value_reads_as_a_verdict_a_score_and_components(value, expected):
    assert score_value(value) == expected


@pytest.mark.parametrize("value, message", [
    (float("nan"), "the score is nan"),
    (float("inf"), "the score is inf"),
    ("1.0", "returned str, not a number, bool or dict"),
    (None, "returned NoneType"),
    ({"correct": True}, "a dict without 'score'"),
    ({"score": 1, "correct": 1}, "'correct' must be a bool, got int"),
    ({"score": 1, "length": "long"}, "component 'length' is str, not a number"),
])
def test_a_value_that_is_not_a_score_is_named(value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        score_value(value)


MINE = '''
import os, sys, time

def score(completion, ground_truth, row):
    if completion == "raise":
        raise KeyError("no such key")
    if completion == "hang":
        while True:
            pass
    if completion == "deaf":  # deaf to the soft deadline too: only the kill ends it
        import signal
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        while True:
            pass
    if completion == "exit":
        sys.exit(3)
    if completion == "nan":
        return float("nan")
    if completion == "text":
        return "great"
    words = len(completion.split())
    return {"score": float(completion.strip() == ground_truth), "words": words,
            "source_seen": float(row["data_source"] == "mine" and row["extra_info"]["level"] == 2)}
'''


@pytest.fixture(scope="module")
def mine(tmp_path_factory):
    path = tmp_path_factory.mktemp("checkers") / "mine.py"
    path.write_text(MINE)
    return f"{path}:score"


def test_a_users_checker_scores_in_the_sandbox_and_what_goes_wrong_is_a_status(mine):
    row = {"data_source": "mine", "extra_info": {"level": 2}}
    with MathSandbox(plugins=(plugin(mine),)) as sandbox:
        children = sandbox.child_pids()
        texts = ["42", "41 no", "raise", "nan", "text", "exit", "hang", "deaf", "42"]
        start = time.monotonic()
        verdicts = sandbox.check_batch([(mine, text, "42", row) for text in texts], timeout_s=1.0,
                                       success_threshold=1.0)
        assert time.monotonic() - start < 20  # each hang costs about the limit (generous: a busy machine)
        statuses = [v.status for v in verdicts]
        assert statuses == ["ok", "ok", "error", "bad_value", "bad_value", "error", "timeout", "timeout", "ok"]
        assert [v.correct for v in verdicts] == [True, False, False, False, False, False, False, False, True]
        assert verdicts[0].score == 1.0 and dict(verdicts[0].components) == {"checker_words": 1.0,
                                                                              "checker_source_seen": 1.0}
        assert verdicts[1].score == 0.0 and dict(verdicts[1].components)["checker_words"] == 2.0
        assert verdicts[2].detail == "KeyError: 'no such key'"
        assert verdicts[3].detail == "the score is nan" and verdicts[4].detail == "returned str, not a number, bool or dict"
        assert verdicts[5].detail == "SystemExit: 3"
        # The first hang ended at the soft deadline; the deaf one cost its child (killed, replaced
        # by the spare), and the last answer was checked by the next.
        assert verdicts[6].detail.startswith("stopped in the sandbox") and verdicts[7].detail.startswith("sandbox killed")
        assert children[0] not in sandbox.child_pids() and not psutil.pid_exists(children[0])
        # A score below the threshold is not a success; at or above it is.
        (low, high) = sandbox.check_batch([(mine, "41", "42", row), (mine, "42", "42", row)], 1.0, success_threshold=0.5)
        assert (low.correct, high.correct) == (False, True)


def test_a_text_checker_and_math_route_together_in_one_round_trip():
    with MathSandbox() as sandbox:
        verdicts = sandbox.check_batch([("math", "\\boxed{1/2}", "0.5", {}), ("exact", "answer: Paris", "paris", ROW),
                                        ("choice", "answer: (B)", "Lyon", OPTIONS), ("exact", "", "x", ROW)])
    assert [(v.correct, v.status, v.score) for v in verdicts] == [
        (True, "ok", None), (True, "ok", None), (True, "ok", None), (False, "no_answer", None)]
    assert (verdicts[1].answer, verdicts[1].detail) == ("Paris", "answer line")


def test_routing_sends_each_data_source_to_its_checker(mine):
    from rayrep.config import load_preset

    cfg = load_preset("tiny-cpu").replace(**{"verifier.by_source": ["quiz=exact", f"mine={mine}"]})
    routing = Routing.of(cfg.verifier)
    assert [routing.checker(s) for s in ("quiz", "mine", "rayrep/arithmetic")] == ["exact", mine, "math"]
    assert [p.spec for p in routing.plugins()] == [mine]
    prompt = Prompt("q1", ({"role": "user", "content": "hi"},), "42", "mine", {"extra_info": {"level": 2}})
    assert Question.of(prompt, routing) == (mine, "42", {"data_source": "mine", "prompt": [{"role": "user", "content": "hi"}],
                                                         "ground_truth": "42", "extra_info": {"level": 2}})


@pytest.mark.parametrize("entries, message", [
    (["quiz"], "verifier.by_source: 'quiz' is not data_source=checker"),
    (["quiz=exact", "quiz=math"], "data_source 'quiz' is routed twice"),
    (["quiz=regex"], "verifier.by_source: 'regex' is not a checker"),
    (["quiz=mine.py:not a name"], "'mine.py:not a name' is not a checker"),
])
def test_a_malformed_route_is_refused_naming_it(tiny_cfg, entries, message):
    with pytest.raises(ConfigError, match=message):
        tiny_cfg.replace(**{"verifier.by_source": entries})


def prompt_file(folder, rows: int = 3) -> str:
    path = folder / "mixed.jsonl"
    path.write_text("".join(json.dumps({"data_source": "mine", "prompt": f"Say {i}.", "answer": str(i)}) + "\n"
                            for i in range(rows)))
    return str(path)


@pytest.mark.parametrize("source, message", [
    (None, "no such file"),
    ("import not_a_module_anywhere\ndef score(c, g, r):\n    return 1.0\n",
     "ModuleNotFoundError: No module named 'not_a_module_anywhere'"),
    ("def score(completion):\n    return 1.0\n", r"score\(completion\) does not take \(completion, ground_truth, row\)"),
    ("def other(c, g, r):\n    return 1.0\n", "'score' is not a function of"),
    ("def score(c, g, r):\n    return c.missing\n",
     "on question .* \\(data_source 'mine'\\), its ground truth as the answer: error: AttributeError"),
    ("def score(c, g, r):\n    return [1]\n", "bad_value: returned list"),
])
def test_a_bad_checker_is_refused_in_one_line_before_anything_starts(tmp_path, tiny_cfg, source, message):
    checker = tmp_path / "bad.py"
    if source is not None:
        checker.write_text(source)
    cfg = tiny_cfg.replace(**{"data.train_files": [prompt_file(tmp_path)], "verifier.reward": f"{checker}:score"})
    with pytest.raises(CheckerError, match=message):
        check_checkers(cfg, [Prompt("q", ({"role": "user", "content": "Say 0."},), "0", "mine")])
    # The job: exit 2, one line naming the checker, before the run's folder is written.
    done = job_here("train.py", "--data.train_files", prompt_file(tmp_path), "--verifier.reward", f"{checker}:score",
                    "--logging.out_dir", str(tmp_path / "runs"))
    assert done.returncode == 2, done.stderr
    (line,) = [line for line in done.stderr.splitlines() if line.strip()]
    assert str(checker) in line and not (tmp_path / "runs").exists()


def test_a_checker_that_loads_and_answers_passes_the_check(tmp_path, tiny_cfg, mine):
    cfg = tiny_cfg.replace(**{"verifier.by_source": [f"mine={mine}"]})
    check_checkers(cfg, [Prompt("q", ({"role": "user", "content": "Say 0."},), "0", "mine", {"extra_info": {"level": 2}})])


def test_a_sandbox_that_cannot_load_its_checker_says_which(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("raise RuntimeError('broken at import')\ndef score(c, g, r):\n    return 1.0\n")
    with pytest.raises(SandboxError, match=f"checker '{bad}:score': RuntimeError: broken at import"):
        MathSandbox(plugins=(plugin(f"{bad}:score"),), keep_spare=False).start()


def test_a_module_checker_is_imported_by_name():
    spec = "rayrep.verifier.checkers:exact"
    with MathSandbox(plugins=(plugin(spec),), keep_spare=False) as sandbox:
        (verdict,) = sandbox.check_batch([(spec, "answer: x", "x", ROW)])
    # (exact's own return value, a tuple, is not a score: the plug-in contract holds for it too)
    assert verdict.status == "bad_value" and "returned tuple" in verdict.detail
    with pytest.raises(CheckerError, match="no such file"):
        plugin("nowhere/mine.py:score")


def test_format_terms_are_read_as_written_and_their_values_named_as_logged(tiny_cfg):
    from rayrep.verifier.checkers import format_values

    cfg = tiny_cfg.replace(**{"verifier.format_terms": ["think=0.2", "boxed=0.1", "chars:10-40=-0.5"]})
    assert cfg.verifier.terms == (("think", 0.2), ("boxed", 0.1), ("chars:10-40", -0.5))
    assert format_values("<think>so 3</think> It is \\boxed{3}.", cfg.verifier.terms) == [
        ("format_think", 1.0), ("format_boxed", 1.0), ("format_chars", 1.0)]
    assert format_values("It is \\boxed{3 <think>", cfg.verifier.terms) == [
        ("format_think", 0.0), ("format_boxed", 0.0), ("format_chars", 1.0)]
    assert format_values("<think>only thinking</think>   ", cfg.verifier.terms)[0] == ("format_think", 0.0)
    for bad in ("think", "think=x", "stars=1", "chars:40-10=1", "boxed=nan"):
        with pytest.raises(ConfigError, match=f"verifier.format_terms: {re.escape(repr(bad))} is not term=weight"):
            tiny_cfg.replace(**{"verifier.format_terms": [bad]})
