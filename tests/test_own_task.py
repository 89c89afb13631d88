"""A run on a prompt file of your own, its rows routed by data_source to three checkers:
math-verify, `exact` and a user's function (in the verifiers' sandbox children). It trains with accuracy and reward per data source, resumes exactly, and an
RLEP pool collected from it records which checker judged each source; a run that would judge
a source otherwise refuses the pool."""

from __future__ import annotations

import json
import re
import shutil
import time

import pytest

from rayrep.buffer.files import BufferFileError, pool_checkers
from rayrep.run.log import read_metrics
from rayrep.run.sinks import run_label

CHECKER = r'''
import re

BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def score(completion, ground_truth, row):
    """1 for the right boxed number, 0.1 for a wrong one, 0 without a box."""
    boxed = BOXED.findall(completion)
    if not boxed:
        return {"score": 0.0, "correct": False, "boxed": 0.0}
    right = boxed[-1].strip() == ground_truth.strip()
    return {"score": 1.0 if right else 0.1, "correct": right, "boxed": 1.0}
'''
SOURCES = ("rayrep/arithmetic", "plain", "mine")
"""The file's data sources, 16 questions each: math-verify's (the default), `exact`'s and the user's."""
CLOCK = ("time", "tokens_per_second", "sync_seconds", "sync_gbps")


@pytest.fixture(scope="module")
def task(tmp_path_factory, tiny_cfg):
    """The prompt file (the embedded task's questions under three data sources) and the routes."""
    from rayrep.data import load_split

    folder = tmp_path_factory.mktemp("own-task")
    questions = load_split(tiny_cfg.data, "train")[: 16 * len(SOURCES)]
    with open(folder / "mixed.jsonl", "w") as out:
        for index, prompt in enumerate(questions):
            out.write(json.dumps({"data_source": SOURCES[index % len(SOURCES)], "prompt": list(prompt.messages),
                                  "reward_model": {"ground_truth": prompt.ground_truth}}) + "\n")
    (folder / "boxed.py").write_text(CHECKER)
    routes = ["plain=exact", f"mine={folder / 'boxed.py'}:score"]
    return folder, {"data.train_files": [str(folder / "mixed.jsonl")], "verifier.by_source": routes,
                    "run.steps": 3, "run.save_every": 2, "run.eval_every": 0, "algorithm.prompts_per_step": 12,
                    "learner.mini_batch_prompts": 12, "data.arithmetic_test_size": 16, "logging.plots": False,
                    "verifier.overlong_factor": 0.0,  # (rewards are the checkers' and the format term's alone)
                    "verifier.format_terms": ["boxed=0.1"]}


@pytest.fixture(scope="module")
def run(ray_cluster, tiny_cfg, tiny_policy, task):
    """The run of 3 steps (a checkpoint at step 2), and the same run resumed from that checkpoint
    in a copy of its folder."""
    from rayrep.cli import resume_base
    from rayrep.config import parse_cli
    from rayrep.train import train

    folder, changes = task
    whole = train(tiny_cfg.replace(**changes, **{"logging.out_dir": str(folder), "logging.run_name": "whole"}),
                  log=lambda _: None).run_dir
    last = read_metrics(whole / "metrics.jsonl")[-1]
    exported = by_source_gauges(run_label(whole), {(f"{measure}_by_source", s): last[f"{measure}/{s}"]
                                                   for measure in ("accuracy", "reward") for s in SOURCES})
    copy = folder / "resumed"
    shutil.copytree(whole, copy, symlinks=True)
    (copy / "checkpoints" / "final").unlink()
    shutil.rmtree(copy / "checkpoints" / "step-3")
    train(parse_cli([], base=resume_base(str(copy))), log=lambda _: None, resume=True)
    return read_metrics(whole / "metrics.jsonl"), read_metrics(copy / "metrics.jsonl"), whole, exported


def by_source_gauges(label: str, expected: dict) -> dict[tuple[str, str], float]:
    """{(gauge, data_source): value} of the run labelled `label`, as the node's metrics agent
    serves them, once they are `expected` (the last step's: Ray's agent has them within its
    report interval) or after 30 s."""
    import urllib.request

    from conftest import metrics_endpoint

    deadline, found = time.monotonic() + 30, {}
    while found != expected and time.monotonic() < deadline:
        page = urllib.request.urlopen(metrics_endpoint(), timeout=10).read().decode()
        for name, labels, value in re.findall(r"^ray_rayrep_train_(\w+_by_source)\{([^}]*)\} (\S+)$", page, re.M):
            tags = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            if tags.get("run") == label:
                found[name, tags["data_source"]] = float(value)
        time.sleep(0.5)
    return found


def test_a_mixed_run_reports_each_data_source_and_resumes_exactly(run):
    whole, resumed, _, exported = run
    steps = [r for r in whole if r["step"] > 0]
    for record in steps:
        assert {f"accuracy/{s}" for s in SOURCES} | {f"reward/{s}" for s in SOURCES} <= set(record), record["step"]
        assert not any(k.startswith("verifier_") and k != "verifier_ok" for k in record)  # no errors, no timeouts
        # The user's checker's scores are the rewards of its rows (1 right, 0.1 boxed and wrong, 0
        # unboxed), its verdicts the accuracy: the mean reward lies between the accuracy and the
        # accuracy plus a tenth of the rest; the format term adds 0.1 for each boxed answer (a
        # right one is boxed: at least the accuracy's tenth).
        accuracy, reward = record["accuracy/mine"], record["reward/mine"]
        assert accuracy * 1.1 - 1e-6 <= reward <= accuracy + 0.1 * (1 - accuracy) + 0.1 + 1e-6
        # math-verify's and exact's rows earn the run's DAPO style, +1 right and -1 wrong, and the term.
        for source in ("rayrep/arithmetic", "plain"):
            assert 0 <= record[f"reward/{source}"] - (2 * record[f"accuracy/{source}"] - 1) <= 0.1 + 1e-6
        # Each part logged: the format term over every answer, the checker's own over its rows.
        assert 0 < record["format_boxed"] <= 1 and 0 <= record["checker_boxed"] <= 1
    # The embedded task's answers are boxed integers: every checker finds some right.
    assert all(sum(r[f"accuracy/{s}"] for r in steps) > 0 for s in SOURCES)
    # Ray's metrics: each source's last step's figures, labelled data_source.
    assert exported == {(f"{measure}_by_source", s): whole[-1][f"{measure}/{s}"]
                        for measure in ("accuracy", "reward") for s in SOURCES}
    # The resumed run's step 3 is the uninterrupted run's.
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    same = [{k: v for k, v in r.items() if not k.startswith(("time_", "memory_")) and k not in CLOCK}
            for r in (whole[3], resumed[3])]
    assert same[0] == same[1]


def test_an_rlep_pool_records_its_checkers_and_another_routing_is_refused(run, tiny_cfg, task):
    from rayrep.algos.rlep import check_pool_checkers
    from rayrep.pipelines.collect import collect_pool

    folder, changes = task
    cfg = tiny_cfg.replace(**changes, **{"algorithm.rlep.collect_questions": 24, "algorithm.rlep.collect_samples": 4,
                                         "algorithm.rlep.min_successes": 1})
    _, _, whole, _ = run
    stats = collect_pool(cfg, str(whole / "checkpoints" / "final"), folder / "pool.parquet", log=lambda _: None)
    judged = pool_checkers(stats["pool"])
    expected = {"rayrep/arithmetic": "math", "plain": "exact", "mine": f"{folder / 'boxed.py'}:score"}
    assert judged == {source: expected[source] for source in judged} and len(judged) >= 2
    check_pool_checkers(cfg, stats["pool"])  # the routing that collected it
    other = sorted(judged)[-1]
    routes = [f"{other}=choice", *(r for r in changes["verifier.by_source"] if not r.startswith(f"{other}="))]
    with pytest.raises(BufferFileError, match=f"its answers of data_source '{other}' were judged by checker "
                                              f"'{expected[other]}'; this run scores '{other}' with 'choice'"):
        check_pool_checkers(cfg.replace(**{"verifier.by_source": routes}), stats["pool"])
