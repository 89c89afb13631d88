"""The comparison pipeline behind jobs/rlep.py and jobs/exgrpo.py, run as a user runs it."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_exgrpo_job_compares_with_a_baseline_of_the_same_advantage(tmp_path, tiny_policy):
    """Both arms take ExGRPO's mean-only (Dr.GRPO) advantage, as the paper's on-policy
    baseline does, so the comparison isolates replay; the job writes both runs, the table
    and the plot."""
    out = tmp_path / "pipeline"
    done = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "exgrpo.py"), "--out", str(out), "--run.steps", "2", "--run.eval_every", "0",
         "--algorithm.prompts_per_step", "16", "--learner.mini_batch_prompts", "8", "--data.arithmetic_test_size", "32",
         "--algorithm.exgrpo.start_pass_rate", "0"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for run, name in (("baseline", "grpo"), ("exgrpo", "exgrpo")):
        config = json.loads((out / run / "config.json").read_text())
        assert config["algorithm"]["name"] == name and config["algorithm"]["std_normalize"] is False
    # one step-0 evaluation: the method's run takes the baseline's (the same start and draws)
    base_start, method_start = (json.loads((out / run / "evals.json").read_text())[0] for run in ("baseline", "exgrpo"))
    assert method_start == {**base_start, "time_eval": 0.0} and base_start["time_eval"] > 0
    comparison = json.loads((out / "comparison.json").read_text())
    assert comparison["metric"] == "test_pass@1" and comparison["baseline"]["final_step"] == 2
    assert (out / "comparison.png").stat().st_size > 0
    assert "ExGRPO" in done.stdout and "peak test_pass@1" in done.stdout
