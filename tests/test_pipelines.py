"""The comparison pipeline behind jobs/rlep.py and jobs/exgrpo.py, run through a job's `main`."""

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_exgrpo_job_compares_with_a_baseline_of_the_same_advantage(ray_cluster, tmp_path, tiny_policy, capsys,
                                                                       monkeypatch):
    """Both arms take ExGRPO's mean-only (Dr.GRPO) advantage, as the paper's on-policy
    baseline does, so the comparison isolates replay; the job writes both runs, the table
    and the plot; both arms train a LoRA adapter. The job's `main` runs here, on the session's cluster: a process of its own
    would spend about 20 s starting Python, vLLM and a cluster (the jobs' command lines and
    errors, as processes: test_job_errors.py)."""
    import runpy

    out = tmp_path / "pipeline"
    monkeypatch.chdir(tmp_path)
    job = runpy.run_path(str(ROOT / "jobs" / "exgrpo.py"))  # its main, not run: __name__ is not "__main__"
    job["main"](["--out", str(out), "--run.steps", "2", "--run.eval_every", "0", "--algorithm.prompts_per_step", "16",
                 "--learner.mini_batch_prompts", "8", "--data.arithmetic_test_size", "32",
                 "--algorithm.exgrpo.start_pass_rate", "0", "--learner.lora_rank", "8", "--learner.lora_merge", "true"])
    stdout = capsys.readouterr().out
    for run, name in (("baseline", "grpo"), ("exgrpo", "exgrpo")):
        config = json.loads((out / run / "config.json").read_text())
        assert config["algorithm"]["name"] == name and config["algorithm"]["std_normalize"] is False
    # one step-0 evaluation: the method's run takes the baseline's (the same start and draws)
    base_start, method_start = (json.loads((out / run / "evals.json").read_text())[0] for run in ("baseline", "exgrpo"))
    assert method_start == {**base_start, "time_eval": 0.0} and base_start["time_eval"] > 0
    comparison = json.loads((out / "comparison.json").read_text())
    assert comparison["metric"] == "test_pass@1" and comparison["baseline"]["final_step"] == 2
    assert (out / "comparison.png").stat().st_size > 0
    assert "ExGRPO" in stdout and "peak test_pass@1" in stdout
    # The pipeline as one record (the README's results are such records), rendered beside it as
    # the README renders it; the evaluations printed as rendered; the kernels each run used.
    import torch

    from rayrep.pipelines.summary import eval_table, render

    record = json.loads((out / "results.json").read_text())
    assert (out / "results.md").read_text() == render(record) and "\n".join(eval_table(record)) in stdout
    assert [r["step"] for r in record["evals"]["exgrpo"]] == [0, 2] and record["pool"] is None
    assert record["evals"]["baseline"][0]["test_pass@1"] == base_start["test_pass@1"]
    for run in ("baseline", "exgrpo"):
        (start,) = json.loads((out / run / "machine.json").read_text())
        assert start["step"] == 0 and start["torch_kernels"] == torch.backends.cpu.get_cpu_capability()
    assert record["machine"] == start
    # Both arms trained a LoRA adapter (`--learner.lora_rank 8`): their policies are adapters,
    # and each final one is merged into the base too (`--learner.lora_merge`): a whole
    # checkpoint whose logits are the base's with the adapter, as PEFT applies it.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    checkpoints = out / "exgrpo" / "checkpoints"
    assert all((out / run / "checkpoints" / "final" / "adapter_config.json").exists() for run in ("baseline", "exgrpo"))
    ids = torch.tensor([[5, 17, 42, 99, 7, 12, 3]])
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(str(checkpoints / "final-merged"))(ids).logits
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_policy),
                                            str(checkpoints / "final"))(ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_policy)(ids).logits
    assert torch.allclose(merged, adapted, atol=1e-4) and not torch.allclose(merged, base, atol=1e-4)


def test_a_finished_run_is_reused_only_under_the_settings_it_ran_with(tmp_path, tiny_cfg):
    """Resuming a pipeline (or a study), a finished run stands for the run asked for only if
    it ran with the same settings; otherwise the first differing field is named, and the
    finished run is left as it is. Settings that cannot have changed it may differ."""
    import pytest

    from rayrep.config import ConfigError
    from rayrep.pipelines.compare import run_stage

    cfg = tiny_cfg.replace(**{"algorithm.name": "grpo", "logging.out_dir": str(tmp_path), "logging.run_name": "baseline"})
    run = tmp_path / "baseline"
    (run / "checkpoints" / "final").mkdir(parents=True)
    (run / "config.json").write_text(cfg.to_json())
    evals = [{"step": 0, "test_pass@1": 0.2}, {"step": 60, "test_pass@1": 0.3}]
    (run / "evals.json").write_text(json.dumps(evals))
    before = sorted((p, p.stat().st_mtime_ns) for p in run.rglob("*"))

    # the same run: reused (no training: this test starts no Ray cluster)
    harmless = {"logging.plots": False, "run.start_eval": str(tmp_path / "other"), "algorithm.exgrpo.start_pass_rate": 0.2,
                "algorithm.rlep.replays_per_group": 4}
    for changes in ({}, harmless):
        reused = run_stage(cfg.replace(**changes), resume=True, log=lambda _: None)
        assert (reused.run_dir, reused.final_checkpoint, reused.evals) == (run, str(run / "checkpoints" / "final"), evals)
    for changes, named in [({"learner.lr": 2e-4}, "learner.lr = 0.0001, not the 0.0002"),
                           ({"run.seed": 1}, "run.seed = 0, not the 1"),
                           ({"algorithm.std_normalize": False}, "algorithm.std_normalize = True, not the False")]:
        with pytest.raises(ConfigError, match=f"{run} finished with {named} asked for now"):
            run_stage(cfg.replace(**changes), resume=True, log=lambda _: None)
    assert sorted((p, p.stat().st_mtime_ns) for p in run.rglob("*")) == before  # nothing written
    # an RLEP run's own section counts
    rlep = cfg.replace(**{"algorithm.name": "rlep", "algorithm.rlep.pool": "pool.parquet"})
    (run / "config.json").write_text(rlep.to_json())
    with pytest.raises(ConfigError, match="algorithm.rlep.replays_per_group = 2, not the 4"):
        run_stage(rlep.replace(**{"algorithm.rlep.replays_per_group": 4}), resume=True, log=lambda _: None)
