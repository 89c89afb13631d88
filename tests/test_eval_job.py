"""The evaluation job: its numbers on fixed answers against a hand count (real verifier pool
on a real local Ray cluster), its table, its JSON report, and `jobs/eval.py` end to end on
the tiny policy with a prompt file of two benchmarks."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import job_here

import rayrep.eval.report as evaluation
import rayrep.eval.evaluate
from rayrep.eval import summarize_by_source
from rayrep.eval.report import default_report_path, eval_report, format_table, write_report
from rayrep.eval.evaluate import eval_slices, score_answers
from rayrep.progress import Progress
from rayrep.types import Prompt

ROOT = Path(__file__).resolve().parents[1]


def run_eval_job(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "jobs" / "eval.py"), *args, "--logging.out_dir", str(cwd / "runs")],
                          capture_output=True, text=True, timeout=600, cwd=cwd)


def table_rows(text: str) -> dict[str, dict[str, str]]:
    """The table's rows by benchmark label, each cell under its header; labels may hold spaces."""
    lines = [line for line in text.splitlines() if line.startswith("benchmark ")]
    assert len(lines) == 1, text
    start = text.splitlines().index(lines[0])
    header = lines[0].split()
    rows = {}
    for line in text.splitlines()[start + 1:]:
        if not line.strip() or set(line) == {"-"}:
            continue
        cells = line.split()
        if len(cells) < len(header):
            break
        label = " ".join(cells[: len(cells) - len(header) + 1])
        rows[label] = dict(zip(header[1:], cells[len(cells) - len(header) + 1:]))
        if label == evaluation.MEAN:
            break
    return rows


# ---------------------------------------------------------------------------------------
# the table (pure)


def test_table_of_a_metrics_dict():
    # summarize_by_source of aime (2 questions x 4 answers) and math (3 x 1), as in
    # test_eval_metrics.test_summarize_by_source_by_hand
    metrics = {
        "aime/avg@4": 0.5, "aime/pass@1": 0.5, "aime/pass@2": 0.75, "aime/pass@4": 1.0, "aime/maj@4": 0.5,
        "aime/questions": 2, "math/avg@1": 2 / 3, "math/pass@1": 2 / 3, "math/maj@1": 2 / 3, "math/questions": 3,
        "pass@1": 0.6, "mean_pass@1": 7 / 12, "mean_maj@k": 7 / 12, "questions": 5,
        "mean_response_tokens": 21.5, "verifier_timeouts": 0, "verifier_errors": 0,
    }
    assert format_table(metrics) == "\n".join([
        "benchmark           questions  k  avg@k  pass@1  pass@2  pass@4  maj@k",
        "aime                        2  4   50.0    50.0    75.0   100.0   50.0",
        "math                        3  1   66.7    66.7       -       -   66.7",
        "----------------------------------------------------------------------",
        "all (pooled)                5  -      -    60.0       -       -      -",
        "mean of benchmarks          -  -      -    58.3       -       -   58.3",
    ])
    # Every benchmark with the same k: the pooled row has every metric.
    same_k = summarize_by_source(["a/b", "c"], [[1, 0], [1, 1]], [False, True])
    rows = table_rows(format_table(same_k))
    assert rows["a/b"] == {"questions": "1", "k": "2", "avg@k": "50.0", "pass@1": "50.0", "pass@2": "100.0",
                           "maj@k": "0.0"}
    assert rows[evaluation.POOLED] == {"questions": "2", "k": "2", "avg@k": "75.0", "pass@1": "75.0", "pass@2": "100.0",
                                       "maj@k": "50.0"}
    assert rows[evaluation.MEAN] == {"questions": "-", "k": "-", "avg@k": "-", "pass@1": "75.0", "pass@2": "-",
                                     "maj@k": "50.0"}


def test_slices_cover_the_questions_in_order_with_big_batches():
    # 500 questions x 4 answers, one generator: a twentieth (100 answers) is below the 256
    # answers an engine gets at least, so slices of 64 questions (256 answers), the last 52.
    slices = eval_slices([4] * 500, generators=1)
    assert [len(s) for s in slices] == [64] * 7 + [52]
    assert [i for s in slices for i in s] == list(range(500))
    # 30 questions x 32 answers and 1000 x 1 (1960 answers), 8 generators: 2048 per slice at least.
    assert eval_slices([32] * 30 + [1] * 1000, generators=8) == [range(0, 1030)]
    # large sets: about a twentieth of the answers each
    assert len(eval_slices([32] * 5000, generators=1)) == 20


def test_report_path_and_atomic_write(tmp_path):
    when = 1_700_000_000.0  # a fixed time: the name holds it in local time
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(when))
    run_checkpoint = default_report_path("runs", "runs/grpo-1/checkpoints/final", when)
    assert run_checkpoint == Path(f"runs/eval/grpo-1-final-{stamp}.json")
    assert default_report_path("out", "Qwen/Qwen2.5-Math-7B", when) == Path(f"out/eval/Qwen2.5-Math-7B-{stamp}.json")
    path = tmp_path / "deep" / "report.json"
    write_report(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}
    with pytest.raises(TypeError):  # not JSON: the old file stays whole, no temporary file is left
        write_report(path, {"a": object()})
    assert json.loads(path.read_text()) == {"a": 1} and sorted(p.name for p in path.parent.iterdir()) == ["report.json"]


# ---------------------------------------------------------------------------------------
# bad input: one line, exit 2, before anything is built or started


def test_bad_input_is_refused_before_anything_starts(tmp_path):
    rows = [{"data_source": "aime", "prompt": "1+1?", "reward_model": {"ground_truth": "2"}},
            {"data_source": "aime", "prompt": "2+2?", "reward_model": {"ground_truth": None}}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cases = [
        (["--prompts", str(bad)], f"eval.py: {bad}, row 2: field 'reward_model.ground_truth' is null"),
        (["--prompts", str(tmp_path / "aime.csv")],
         "unknown prompt file extension '.csv'; expected one of .jsonl, .json, .parquet"),
        (["--out", str(tmp_path)], f"eval.py: report {tmp_path}: is a folder; give a file name"),
        (["--checkpoint", str(tmp_path)], f"eval.py: model {tmp_path}: cannot read its config.json"),
    ]
    for args, expected in cases:
        done = job_here("eval.py", *args, "--logging.out_dir", str(tmp_path / "runs"), cwd=tmp_path)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr
        last = [line for line in done.stderr.splitlines() if line.strip()][-1]
        assert last.startswith(expected) or last.endswith(expected), (expected, done.stderr)
    assert not (tmp_path / "runs").exists()  # nothing written


def test_a_known_start_evaluation_is_taken_only_from_the_same_start(tmp_path, tiny_cfg):
    """`run.start_eval`: another run's step-0 evaluation stands for this run's only when that
    run had the same model, data, generator, verifier and seed settings; otherwise the
    first differing field is named (before anything starts)."""
    from rayrep.config import ConfigError
    from rayrep.run.evaluation import known_start_evaluation

    baseline = tmp_path / "baseline"
    baseline.mkdir()
    (baseline / "config.json").write_text(tiny_cfg.replace(**{"algorithm.name": "grpo"}).to_json())
    start = {"step": 0, "time_eval": 41.9, "test_pass@1": 0.1185, "test_pass@1_se": 0.0048}
    (baseline / "evals.json").write_text(json.dumps([start, {**start, "step": 10, "test_pass@1": 0.2}]))
    # another algorithm, learner, run length and name: the same start
    arm = tiny_cfg.replace(**{"algorithm.name": "rlep", "learner.behaviour_cap": 2.0, "logging.run_name": "rlep", "run.steps": 5,
                              "run.start_eval": str(baseline)})
    assert known_start_evaluation(arm) == {**start, "time_eval": 0.0}
    for change, named in [({"data.arithmetic_test_size": 100}, "data.arithmetic_test_size = 500 there, 100 here"),
                          ({"generator.eval_samples": 8}, "generator.eval_samples = 4 there, 8 here"),
                          ({"model.tiny_warm_start_steps": 10}, "model.tiny_warm_start_steps = 1300 there, 10 here"),
                          ({"run.seed": 1}, "run.seed = 0 there, 1 here")]:
        with pytest.raises(ConfigError, match=re.escape(f"{baseline} started otherwise: {named}")):
            known_start_evaluation(arm.replace(**change))
    (baseline / "evals.json").write_text(json.dumps([{**start, "step": 10}]))
    with pytest.raises(ConfigError, match="has no step-0 evaluation"):
        known_start_evaluation(arm)
    with pytest.raises(ConfigError, match="is not a finished run's folder"):
        known_start_evaluation(arm.replace(**{"run.start_eval": str(tmp_path / "nowhere")}))


# ---------------------------------------------------------------------------------------
# the job end to end: tiny policy, a prompt file with two benchmarks of different k


@pytest.mark.slow  # the evaluation job, its engines on a Ray cluster of its own
def test_eval_job_on_a_prompt_file_with_two_benchmarks(tmp_path, tiny_policy, tiny_cfg):
    from rayrep.data import load_split

    test = load_split(tiny_cfg.data, "test")
    rows = [{"data_source": source, "prompt": [{"role": "user", "content": p.text}],
             "reward_model": {"ground_truth": p.ground_truth, "style": "rule"}, "extra_info": {"index": p.uid}}
            for source, part in (("add", test[:4]), ("mix", test[4:10])) for p in part]
    prompts = tmp_path / "bench.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))

    done = run_eval_job("--prompts", str(prompts), "--generator.eval_samples", "4",
                        "--generator.eval_samples_by_source", "mix=2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]

    progress = re.findall(r"^eval  question (\d+)/10 .*ETA", done.stdout, flags=re.M)
    assert progress and progress[0] == "0" and progress[-1] == "10", done.stdout
    reports = list((tmp_path / "runs" / "eval").iterdir())
    assert len(reports) == 1 and reports[0].name.startswith(Path(tiny_policy).name + "-"), reports  # no temporary left
    report = json.loads(reports[0].read_text())
    assert report["checkpoint"] == tiny_policy and report["prompt_files"] == [str(prompts)]
    assert {key: report["sampling"][key] for key in ("temperature", "top_p", "max_tokens", "k")} == {
        "temperature": 1.0, "top_p": 1.0, "max_tokens": tiny_cfg.generator.max_response_tokens,
        "k": {"add": 4, "mix": 2}}
    assert report["eval_seconds"] > 0 and report["questions"] == 10
    m = report["metrics"]
    assert (m["add/questions"], m["mix/questions"], m["questions"]) == (4, 6, 10)
    assert {"add/avg@4", "add/pass@2", "add/pass@4", "add/maj@4", "mix/avg@2", "mix/pass@2", "mix/maj@2"} <= m.keys()
    assert "avg@4" not in m and "mix/pass@4" not in m  # k differs: no pooled avg@k; pass@j only up to k
    for source, k in (("add", 4), ("mix", 2)):
        assert m[f"{source}/avg@{k}"] == pytest.approx(m[f"{source}/pass@1"])
        assert m[f"{source}/pass@1"] <= m[f"{source}/pass@2"] <= m[f"{source}/pass@{k}"]
        assert 0 <= m[f"{source}/maj@{k}"] <= m[f"{source}/pass@{k}"]
    assert m["pass@1"] == pytest.approx((4 * m["add/pass@1"] + 6 * m["mix/pass@1"]) / 10)
    assert m["mean_pass@1"] == pytest.approx((m["add/pass@1"] + m["mix/pass@1"]) / 2)

    # The printed table: a row per benchmark, then the aggregates, with the report's numbers.
    rows = table_rows(done.stdout)
    assert list(rows) == ["add", "mix", evaluation.POOLED, evaluation.MEAN]
    assert rows["add"] == {"questions": "4", "k": "4", "avg@k": f"{100 * m['add/avg@4']:.1f}",
                           "pass@1": f"{100 * m['add/pass@1']:.1f}", "pass@2": f"{100 * m['add/pass@2']:.1f}",
                           "pass@4": f"{100 * m['add/pass@4']:.1f}", "maj@k": f"{100 * m['add/maj@4']:.1f}"}
    assert rows["mix"]["k"] == "2" and rows["mix"]["pass@4"] == "-"
    assert rows["mix"]["maj@k"] == f"{100 * m['mix/maj@2']:.1f}"
    assert rows[evaluation.MEAN]["pass@1"] == f"{100 * m['mean_pass@1']:.1f}"
    assert f"report: {reports[0].relative_to(tmp_path)}" in done.stdout or f"report: {reports[0]}" in done.stdout


# ---------------------------------------------------------------------------------------
# the numbers on fixed answers, through the job's scoring, table and report (real Ray)


@pytest.fixture(scope="module")
def verifiers(ray_cluster, tiny_cfg):
    from rayrep.verifier.group import VerifierGroup

    pool = VerifierGroup.create(tiny_cfg.replace(**{"verifier.num_workers": 2}))
    yield pool
    pool.shutdown()


def prompt(uid: str, source: str, truth: str) -> Prompt:
    return Prompt(uid, ({"role": "user", "content": f"question {uid}"},), truth, source)


# aime: 4 answers per question, math: 2; the benchmarks' questions interleaved.
PROMPTS = [prompt("a1", "aime", "1/2"), prompt("m1", "math", "10"), prompt("a2", "aime", "7"),
           prompt("m2", "math", "3"), prompt("m3", "math", "12")]
ANSWERS = [
    [r"\boxed{0.5}", r"\boxed{3}", "no answer here", r"\boxed{\frac{1}{2}}"],  # 2 of 4; 1/2 = 0.5 wins 2 to 1
    [r"\boxed{10}", r"\boxed{10}"],  # 2 of 2; majority right
    [r"\boxed{8}", r"\boxed{8}", r"\boxed{7}", r"\boxed{9}"],  # 1 of 4; 8 wins: majority wrong
    [r"\boxed{4}", r"\boxed{3}"],  # 1 of 2; a 1-1 tie goes to the earlier 4: majority wrong
    ["I give up", r"\boxed{13}"],  # 0 of 2
]
BY_HAND = {
    "aime/avg@4": 0.375,  # (2/4 + 1/4) / 2
    "aime/pass@1": 0.375,
    "aime/pass@2": 2 / 3,  # a1: 1 - C(2,2)/C(4,2) = 5/6; a2: 1 - C(3,2)/C(4,2) = 1/2; (5/6 + 1/2) / 2
    "aime/pass@4": 1.0,  # both have a correct answer
    "aime/maj@4": 0.5,  # a1 right, a2 wrong
    "aime/questions": 2,
    "math/avg@2": 0.5,  # (2/2 + 1/2 + 0) / 3
    "math/pass@1": 0.5,
    "math/pass@2": 2 / 3,  # m1: 1, m2: 1 - C(1,2)/C(2,2) = 1, m3: 0
    "math/maj@2": 1 / 3,  # m1 right only
    "math/questions": 3,
    "pass@1": 0.45,  # pooled over questions: (2/4 + 2/2 + 1/4 + 1/2 + 0) / 5
    # its standard error: squared deviations .0025 + .3025 + .04 + .0025 + .2025 = .55, / (5 - 1) / 5
    "pass@1_se": math.sqrt(0.55 / 4 / 5),
    "mean_pass@1": 0.4375,  # benchmarks weigh the same: (0.375 + 0.5) / 2
    "mean_maj@k": 5 / 12,  # (1/2 + 1/3) / 2
    "questions": 5,
    "verifier_timeouts": 0,
    "verifier_errors": 0,
}


def test_fixed_answers_score_as_counted_by_hand(verifiers, tiny_cfg, tmp_path):
    metrics = score_answers(verifiers, PROMPTS, ANSWERS)
    assert metrics.keys() == BY_HAND.keys()  # k differs between the benchmarks: no pooled avg@k, pass@2, maj@k
    for name, expected in BY_HAND.items():
        assert metrics[name] == pytest.approx(expected, abs=1e-12), name

    # The job's report and table of these metrics.
    cfg = tiny_cfg.replace(**{"generator.eval_samples": 2, "generator.eval_samples_by_source": ["aime=4"],
                              "generator.eval_top_p": 0.95})
    path = write_report(tmp_path / "eval" / "fixed.json", eval_report(cfg, "ckpt", PROMPTS, metrics, 12.34))
    report = json.loads(path.read_text())
    assert report["metrics"] == pytest.approx(BY_HAND, abs=1e-12)
    assert report["sampling"]["k"] == {"aime": 4, "math": 2} and report["sampling"]["top_p"] == 0.95
    assert (report["checkpoint"], report["eval_seconds"], report["questions"]) == ("ckpt", 12.3, 5)
    rows = table_rows(format_table(metrics))
    assert rows["aime"] == {"questions": "2", "k": "4", "avg@k": "37.5", "pass@1": "37.5", "pass@2": "66.7",
                            "pass@4": "100.0", "maj@k": "50.0"}
    assert rows["math"] == {"questions": "3", "k": "2", "avg@k": "50.0", "pass@1": "50.0", "pass@2": "66.7",
                            "pass@4": "-", "maj@k": "33.3"}
    assert rows[evaluation.POOLED] == {"questions": "5", "k": "-", "avg@k": "-", "pass@1": "45.0", "pass@2": "-",
                                       "pass@4": "-", "maj@k": "-"}
    assert rows[evaluation.MEAN] == {"questions": "-", "k": "-", "avg@k": "-", "pass@1": "43.8", "pass@2": "-",
                                     "pass@4": "-", "maj@k": "41.7"}


def test_slices_give_the_same_numbers_and_report_progress(verifiers, monkeypatch):
    """Slicing changes only how the work is cut. MIN_SLICE_ANSWERS is shrunk (monkeypatch) so
    that 14 answers make several slices: at least 2 answers (1 per verifier) each."""
    monkeypatch.setattr(rayrep.eval.evaluate, "MIN_SLICE_ANSWERS", 1)
    assert eval_slices([len(a) for a in ANSWERS], 2) == [range(i, i + 1) for i in range(5)]
    lines: list[str] = []
    sliced = score_answers(verifiers, PROMPTS, ANSWERS, progress=Progress(5, "eval", unit="question", log=lines.append))
    assert sliced == score_answers(verifiers, PROMPTS, ANSWERS)
    assert [re.match(r"eval  question (\d)/5", line).group(1) for line in lines] == ["0", "1", "2", "3", "4", "5"]
    # running pooled pass@1: a1 2/4; then m1 2/2 -> 0.75; a2 1/4 -> 1.75/3; m2 1/2 -> 2.25/4; m3 0 -> 2.25/5
    running = [re.search(r"pass@1 (\S+)", line).group(1) for line in lines[1:]]
    assert running == ["0.500", "0.750", "0.583", "0.562", "0.450"]


ROUTED = [Prompt("c1", ({"role": "user", "content": "capital of France?"},), "Paris", "capitals"),
          Prompt("q1", ({"role": "user", "content": "which is prime?"},), "C", "quiz", {"extra_info": {"choices": ["4", "9", "7"]}}),
          Prompt("m1", ({"role": "user", "content": "say 3"},), "3", "mine")]
ROUTED_ANSWERS = [
    ["answer: paris", "answer: Lyon", "answer: Lyon", "\\boxed{PARIS.}"],  # 2 of 4; Lyon 2 - paris 2: the earlier paris wins
    ["answer: (B)", "answer: 7", "the answer is C"],  # 2 of 3 (7 is option C); C wins
    ["3", "three", "3", "raise"],  # scored by the function: 2 of 4, one error; no majority to vote on
]
MINE = "def score(completion, ground_truth, row):\n    if completion == 'raise':\n        raise ValueError('no')\n" \
       "    return float(completion == ground_truth)\n"


def test_each_benchmark_is_scored_by_its_checker_and_voted_on_as_it_reads_answers(ray_cluster, tiny_cfg, tmp_path):
    """Rows routed by data_source to `exact`, `choice` and a user's function in one
    evaluation: pass@k per benchmark by each checker's verdicts, maj@k by what `exact` and
    `choice` read (none for the function, which reads no answer), the function's error counted."""
    from rayrep.verifier.group import VerifierGroup

    (tmp_path / "mine.py").write_text(MINE)
    cfg = tiny_cfg.replace(**{"verifier.num_workers": 1, "verifier.by_source": [
        "capitals=exact", "quiz=choice", f"mine={tmp_path / 'mine.py'}:score"]})
    routed = VerifierGroup.create(cfg)
    try:
        metrics = score_answers(routed, ROUTED, ROUTED_ANSWERS)
    finally:
        routed.shutdown()
    assert (metrics["capitals/pass@1"], metrics["quiz/pass@1"], metrics["mine/pass@1"]) == (0.5, 2 / 3, 0.5)
    assert (metrics["capitals/maj@4"], metrics["quiz/maj@3"]) == (1.0, 1.0) and "mine/maj@4" not in metrics
    assert metrics["mean_maj@k"] == 1.0 and metrics["verifier_errors"] == 1
    rows = table_rows(format_table(metrics))
    assert rows["mine"]["maj@k"] == "-" and rows["capitals"]["maj@k"] == "100.0"
