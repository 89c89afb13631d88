"""Bad input stops a job before anything starts, with one line naming the file, row, field
or value, exit status 2, and nothing written."""

import json
from pathlib import Path

import pytest
from conftest import job_here


def run_job(script: str, *args: str, cwd: Path):
    return job_here(script, *args, "--logging.out_dir", str(cwd / "runs"), cwd=cwd)


def assert_one_line_error(done, expected: str) -> None:
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1].endswith(expected), done.stderr


def test_a_bad_row_of_a_prompt_file_is_named_in_one_line(tmp_path, tiny_policy):
    rows = [{"prompt": "1+1?", "reward_model": {"ground_truth": "2"}}, {"prompt": "2+2?", "reward_model": {}}]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    done = run_job("grpo.py", "--data.train_files", str(data), cwd=tmp_path)
    assert_one_line_error(done, f"grpo.py: {data}, row 2: field 'reward_model.ground_truth' is missing")
    assert not (tmp_path / "runs").exists()  # no run folder, nothing half-written


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("--config", "my.jsonl"), "config file my.jsonl: not a TOML file (a config file ends in .toml)"),
        (("--config", "missing.toml"), "config file missing.toml does not exist"),
        (("--preset", "huge-gpu"), "known presets: qwen2.5-math-7b-exgrpo, qwen2.5-math-7b-rlep, tiny-cpu, tiny-cpu-hard, tiny-cpu-tool"),
    ],
)
def test_config_file_errors_say_what_is_wrong_with_the_file(tmp_path, args, expected):
    (tmp_path / "my.jsonl").write_text('{"prompt": "1+1?"}\n')
    done = run_job("rlep.py", *args, cwd=tmp_path)
    assert_one_line_error(done, expected)
    assert not (tmp_path / "runs").exists()


def test_pipeline_inputs_are_checked_before_any_stage(tmp_path, tiny_policy):
    pool = tmp_path / "nowhere.parquet"
    no_pool = run_job("rlep.py", "--baseline-checkpoint", tiny_policy, "--pool", str(pool), cwd=tmp_path)
    no_checkpoint = run_job("exgrpo.py", "--baseline-checkpoint", str(tmp_path), cwd=tmp_path)
    assert_one_line_error(no_pool, f"rlep.py: {pool}: no such file")
    assert_one_line_error(no_checkpoint, f"baseline checkpoint {tmp_path}: not a checkpoint folder (no config.json in it)")
    assert not (tmp_path / "runs").exists()


def test_a_kv_cache_too_small_for_a_steps_sequences_at_once_is_refused_before_anything_starts(tmp_path):
    """A CPU engine runs a step's answers in one wave (`rayrep.generator.engine.CpuEngineBatch`):
    a cache that holds fewer is named, with the size that holds them (64 x 8 sequences of 80 +
    48 tokens, 2 KiB a token: 0.125 GiB), before any actor starts or any file is written."""
    done = run_job("grpo.py", "--generator.cpu_kv_cache_gib", "0.05", cwd=tmp_path)
    assert_one_line_error(done, "a step gives each engine 512 sequences of up to 128 tokens, which need 0.125 GiB of "
                                "KV cache to run at once; generator.cpu_kv_cache_gib holds 204: raise it to 0.125, or "
                                "give each engine fewer (generator.num_workers, algorithm.prompts_per_step)")
    assert not (tmp_path / "runs").exists()
