import json

import pytest

from rayrep.config import (Config, ConfigError, LearnerConfig, config_fields, from_dict, help_text, load_preset, parse_cli, preset_names)
from rayrep.cli import parse_job_args, job_parser


def test_every_preset_loads_and_validates():
    names = preset_names()
    assert {"tiny-cpu", "qwen2.5-math-7b-rlep", "qwen2.5-math-7b-exgrpo"} <= set(names)
    for name in names:
        assert isinstance(load_preset(name), Config)


@pytest.mark.slow  # builds and installs a wheel
def test_presets_and_policies_ship_inside_an_installed_wheel(tmp_path):
    """Built as a wheel and imported from outside the source tree, the package still has its
    presets and its built tiny policies (weights, tokenizer, build record)."""
    import shutil
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    source = tmp_path / "source"  # a copy: building in place would leave build/ in the checkout
    shutil.copytree(root / "rayrep", source / "rayrep", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(source)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("rayrep-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(tmp_path / "site")
        files = set(archive.namelist())
    for preset in ("tiny-cpu", "tiny-cpu-hard"):
        shipped = {f"rayrep/models/policies/{preset}/{name}" for name in
                   ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "rayrep_build.json")}
        assert shipped <= files, shipped - files
    code = ("import rayrep, rayrep.config as c; print(rayrep.__file__); print(*c.preset_names()); "
            "print(c.load_preset('qwen2.5-math-7b-rlep').learner.num_workers)")
    # The editable install's import hook would find the source tree first: -I ignores it
    # (no site-packages), PYTHONPATH-free; the wheel's contents are put on sys.path by hand.
    done = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(tmp_path / 'site')!r}); {code}"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    where, names, workers = done.stdout.splitlines()
    assert where.startswith(str(tmp_path / "site"))
    assert {"tiny-cpu", "qwen2.5-math-7b-rlep", "qwen2.5-math-7b-exgrpo"} <= set(names.split()) and workers == "64"


def test_paper_presets_hold_the_papers_hyperparameters():
    rlep = load_preset("qwen2.5-math-7b-rlep")
    assert (rlep.algorithm.prompts_per_step, rlep.algorithm.group_size) == (512, 16)
    assert rlep.algorithm.rlep.replays_per_group == 2
    assert (rlep.learner.lr, rlep.learner.mini_batch_prompts, rlep.learner.weight_decay) == (1e-6, 64, 0.1)
    assert (rlep.learner.clip_low, rlep.learner.clip_high, rlep.learner.dual_clip) == (0.2, 0.28, 10.0)
    assert (rlep.verifier.overlong_buffer, rlep.generator.max_response_tokens) == (512, 3072)
    assert (rlep.learner.warmup_steps, rlep.run.steps, rlep.model.dtype) == (10, 400, "bfloat16")
    assert (rlep.generator.eval_samples, rlep.generator.eval_temperature) == (32, 1.0)
    ex = load_preset("qwen2.5-math-7b-exgrpo")
    assert (ex.algorithm.prompts_per_step, ex.algorithm.group_size, ex.run.steps) == (128, 8, 701)
    assert ex.algorithm.std_normalize is False
    assert (ex.algorithm.exgrpo.start_pass_rate, ex.algorithm.exgrpo.replay_ratio) == (0.35, 0.5)
    assert (ex.learner.clip_low, ex.learner.clip_high, ex.learner.dual_clip) == (0.2, 0.2, 0.0)
    assert (ex.learner.loss_agg, ex.learner.loss_norm_constant, ex.learner.entropy_coef) == ("seq-mean-token-sum-norm", 8192.0, 0.001)
    assert (ex.model.rope_theta, ex.model.max_position_embeddings) == (40000.0, 16384)
    assert (ex.learner.lr, ex.learner.warmup_steps, ex.learner.weight_decay, ex.learner.skip_grad_norm_above) == (1e-6, 0, 0.01, 500.0)
    assert ex.replay.max_answers_per_question == 0  # the code keeps every answer
    assert (ex.eval_samples("aime24"), ex.eval_samples("amc23"), ex.eval_samples("math500")) == (32, 32, 1)


def test_cli_overrides_any_field_with_both_spellings():
    cfg = parse_cli(["--learner.lr", "3e-6", "--algorithm.rlep.replays_per_group=4",
                     "--algorithm.exgrpo.clip_fresh_in_mixed", "true", "--data.arithmetic_levels", "add2, mix3"])
    assert cfg.learner.lr == 3e-6
    assert cfg.algorithm.rlep.replays_per_group == 4
    assert cfg.algorithm.exgrpo.clip_fresh_in_mixed is True
    assert cfg.data.arithmetic_levels == ("add2", "mix3")
    # Untouched fields keep the preset's values.
    assert cfg.algorithm.prompts_per_step == load_preset("tiny-cpu").algorithm.prompts_per_step


def test_later_sources_override_earlier(tmp_path):
    user = tmp_path / "mine.toml"
    user.write_text("[learner]\nlr = 2e-5\nwarmup_steps = 7\n")
    cfg = parse_cli(["--config", str(user), "--learner.lr", "5e-5"])
    assert (cfg.learner.lr, cfg.learner.warmup_steps) == (5e-5, 7)
    assert parse_cli(["--preset", "qwen2.5-math-7b-rlep"]).learner.num_workers == 64


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--learner.lr", "fast"], "learner.lr: expected a number, got 'fast'"),
        (["--learner.lr", "-1"], "learner.lr: -1.0 is below the minimum 0.0"),
        (["--run.steps", "2.5"], "run.steps: expected an integer, got '2.5'"),
        (["--generator.top_p", "1.5"], "generator.top_p: 1.5 is above the maximum 1.0"),
        (["--learner.mini_batch_prompts", "48"], "learner.mini_batch_prompts=48 must divide algorithm.prompts_per_step=64"),
        (["--algorithm.name", "ppo"], "algorithm.name: 'ppo' is not one of 'grpo', 'rlep', 'exgrpo'"),
        (["--preset", "huge-gpu"], "unknown preset 'huge-gpu'; known presets: "),
        (["--lr", "1e-6"], "unknown config field --lr; did you mean --learner.lr?"),
        (["--placement.enforce_eager", "true"], "unknown config field --placement.enforce_eager"),
        (["--generator.enforce_eager", "maybe"], "generator.enforce_eager: expected true or false, got 'maybe'"),
        (["--learner.lr"], "--learner.lr needs a value"),
        (["stray"], "unexpected argument 'stray'"),
        (["--learner.loss_agg", "seq-mean-token-sum"], "learner.loss_norm_constant=0.0 must be a number > 0.0"),
        (["--learner.dual_clip", "0.5"], "learner.dual_clip=0.5 must be a number > 1.0, or off"),
        (["--learner.correction.weights", "token", "--learner.behaviour_cap", "2"],
         "learner.correction.weights='token' and learner.behaviour_cap=2.0 both weigh the fresh tokens"),
        (["--learner.correction.reject", "token", "--learner.correction.reject_lower", "3"],
         "the rejection band [learner.correction.reject_lower=3.0, learner.correction.reject_upper=2.0] must hold 1"),
        (["--learner.correction.reject", "band"], "learner.correction.reject"),
        (["--run.partial_rollouts", "0.5", "--algorithm.dynamic_sampling", "true"],
         "run.partial_rollouts with algorithm.dynamic_sampling: not built"),
        (["--run.partial_rollouts", "-1"], "run.partial_rollouts: -1.0 is below the minimum 0.0"),
        (["--algorithm.prune.growth", "0.5"], "algorithm.prune.growth: 0.5 is below the minimum 1.0"),
        (["--algorithm.prioritized.replay_share", "1"], "algorithm.prioritized.replay_share: 1.0 is above the maximum 0.95"),
        (["--verifier.overlong_buffer", "100"], "verifier.overlong_buffer=100 exceeds generator.max_response_tokens=48"),
        (["--data.arithmetic_test_size", "2500"],
         "data.arithmetic_test_size=2500 exceeds data.arithmetic_test_reserve=2000: raise the reserve"),
        (["--generator.eval_samples_by_source", "aime24:32"], "generator.eval_samples_by_source: 'aime24:32' is not data_source=k"),
        (["--generator.eval_samples_by_source", "aime24=0"], "'aime24=0' is not data_source=k with k >= 1"),
    ],
)
def test_bad_values_fail_naming_the_field_and_value(argv, message):
    with pytest.raises(ConfigError) as err:
        parse_cli(argv)
    assert message in str(err.value)


def test_bad_toml_files_name_the_file(tmp_path):
    broken = tmp_path / "broken.toml"
    broken.write_text("[learner\nlr = 1")
    with pytest.raises(ConfigError, match="broken.toml"):
        parse_cli(["--config", str(broken)])
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[learner]\nlearning_rate = 1e-6\n")
    with pytest.raises(ConfigError, match="unknown config field learner.learning_rate"):
        parse_cli(["--config", str(unknown)])
    with pytest.raises(ConfigError, match="config file .*missing.toml does not exist"):
        parse_cli(["--config", str(tmp_path / "missing.toml")])
    # Not a TOML file: say so, instead of looking it up as a preset name.
    rows = tmp_path / "my.jsonl"
    rows.write_text('{"prompt": "1+1"}\n')
    with pytest.raises(ConfigError, match=r"config file .*my.jsonl: not a TOML file \(a config file ends in .toml\)"):
        parse_cli(["--config", str(rows)])
    with pytest.raises(ConfigError, match="config file .*folder.toml is not a file"):
        (tmp_path / "folder.toml").mkdir()
        parse_cli(["--config", str(tmp_path / "folder.toml")])
    # A preset given as a path is a config file too.
    with pytest.raises(ConfigError, match="config file .*missing.toml does not exist"):
        parse_cli(["--preset", str(tmp_path / "missing.toml")])


def test_direct_construction_is_validated_too():
    with pytest.raises(ConfigError, match="learner.micro_batch_size: 0 is below the minimum 1"):
        Config(learner=LearnerConfig(micro_batch_size=0))
    with pytest.raises(ConfigError, match="learner.strategy: 'zero3'"):
        Config(learner=LearnerConfig(strategy="zero3"))
    with pytest.raises(ConfigError, match="learner.skip_grad_norm_above=500.0 is not supported"):
        Config(learner=LearnerConfig(strategy="deepspeed", skip_grad_norm_above=500.0))


def test_shared_pool_settings_need_a_pool_and_one_source_of_replays():
    cfg = load_preset("tiny-cpu")
    with pytest.raises(ConfigError, match="replay.others_only=True.*these are for a shared pool"):
        cfg.replace(**{"replay.others_only": True})
    with pytest.raises(ConfigError, match="replay.retire_scope='run'.*these are for a shared pool"):
        cfg.replace(**{"replay.retire_scope": "run"})
    # RLEP's own input check, before any actor starts (another algorithm ignores algorithm.rlep.pool).
    from rayrep.algos.registry import check_inputs

    both = {"algorithm.rlep.pool": "p.parquet", "replay.pool": "shared"}
    with pytest.raises(ConfigError, match="algorithm.rlep.pool='p.parquet' and replay.pool='shared'.*jobs/pool.py import"):
        check_inputs(cfg.replace(**{"algorithm.name": "rlep", **both}), [], {})
    assert check_inputs(cfg.replace(**both), [], {}).pool is None
    cfg.replace(**{"replay.pool": "shared", "replay.others_only": True, "replay.retire_scope": "run"})


def test_round_trip_and_replace():
    cfg = load_preset("tiny-cpu")
    assert from_dict(cfg.to_dict()) == cfg
    changed = cfg.replace(**{"learner.lr": 1e-3, "algorithm.name": "rlep"})
    assert (changed.learner.lr, changed.algorithm.name) == (1e-3, "rlep")
    assert cfg.learner.lr != 1e-3  # the original is untouched
    with pytest.raises(ConfigError):
        cfg.replace(**{"learner.lr": "x"})


def test_every_field_has_a_doc_shown_in_help():
    text = help_text()
    names = [name for name, _, _ in config_fields()]
    assert "learner.lr" in names and "algorithm.rlep.replays_per_group" in names
    for name, _, f in config_fields():
        assert f.metadata.get("doc"), f"{name} has no doc"
        assert f"--{name} (" in text


def test_job_parser_separates_job_flags_and_exits_on_config_errors(capsys):
    parser = job_parser("demo")
    parser.add_argument("--checkpoint")
    args, cfg = parse_job_args(parser, ["--checkpoint", "ck", "--learner.lr", "1e-5"])
    assert args.checkpoint == "ck" and cfg.learner.lr == 1e-5
    with pytest.raises(SystemExit) as exit_info:
        parse_job_args(parser, ["--learner.lr", "oops"])
    assert exit_info.value.code == 2
    assert "learner.lr: expected a number, got 'oops'" in capsys.readouterr().err


def test_help_shows_the_values_of_the_chosen_preset(capsys):
    """`--help` lists each field with the value the preset (and config files) give it, not
    the schema's default."""
    for argv, steps, origin in ((["--help"], 60, "preset tiny-cpu"),
                                (["--preset", "qwen2.5-math-7b-rlep", "-h"], 400, "preset qwen2.5-math-7b-rlep"),
                                (["--preset=tiny-cpu-hard", "--help"], 60, "preset tiny-cpu-hard")):
        with pytest.raises(SystemExit) as exit_info:
            parse_job_args(job_parser("demo"), argv)
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        assert f"config fields, as {origin} sets them" in out
        assert f"  --run.steps (int, default {steps}): rollout steps" in out
    assert "--generator.max_response_tokens (int, default 72)" in out  # tiny-cpu-hard's, not tiny-cpu's 48


def test_a_job_refuses_a_setting_it_sets_itself(tmp_path, capsys):
    """A field the job sets (jobs/grpo.py: the algorithm) given another value by the user, on
    the command line or in a config file, stops the job with its name; the job's own value
    passes, and a preset's value is the job's to replace (the RLEP preset's baseline)."""
    parser = job_parser("demo", sets={"algorithm.name": ("grpo", "the baseline")})
    assert parse_job_args(parser, ["--algorithm.name", "grpo"])[1].algorithm.name == "grpo"
    assert parse_job_args(parser, ["--preset", "qwen2.5-math-7b-rlep"])[1].algorithm.name == "grpo"
    staged = job_parser("pipeline", sets={"algorithm.name": (None, "stage by stage")})
    assert parse_job_args(staged, ["--preset", "qwen2.5-math-7b-rlep"])[1].algorithm.name == "rlep"
    user = tmp_path / "mine.toml"
    user.write_text('[algorithm]\nname = "exgrpo"\n')
    for job, argv in ((parser, ["--algorithm.name", "rlep"]), (parser, ["--config", str(user)]),
                      (staged, ["--algorithm.name", "grpo"])):
        with pytest.raises(SystemExit) as exit_info:
            parse_job_args(job, argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "algorithm.name = " in err and "sets it itself (" in err and "); leave it out" in err


def test_choosing_an_algorithm_applies_what_it_needs_and_the_users_word_still_counts(tmp_path):
    """ExGRPO's advantage has no std scaling: choosing it (command line, config file, or a
    job that sets it) sets `algorithm.std_normalize` false over the preset's true; a value the
    user gives stays (and ExGRPO's check refuses true, naming the field); others keep theirs."""
    from rayrep.algos.registry import check_inputs

    user = tmp_path / "mine.toml"
    user.write_text('[algorithm]\nname = "exgrpo"\n')
    chosen = [["--algorithm.name", "exgrpo"], ["--config", str(user)],
              ["--preset", "qwen2.5-math-7b-rlep", "--algorithm.name", "exgrpo"]]
    for argv in chosen:
        assert parse_job_args(job_parser("demo"), argv)[1].algorithm.std_normalize is False, argv
    assert parse_job_args(job_parser("demo", sets={"algorithm.name": ("exgrpo", "the method")}), [])[1].algorithm.std_normalize is False
    assert parse_job_args(job_parser("demo"), ["--algorithm.name", "rlep"])[1].algorithm.std_normalize is True
    kept = parse_job_args(job_parser("demo"), ["--algorithm.name", "exgrpo", "--algorithm.std_normalize", "true"])[1]
    assert kept.algorithm.std_normalize is True
    with pytest.raises(ConfigError, match="algorithm.std_normalize must be false for exgrpo.*leave --algorithm.std_normalize out"):
        check_inputs(kept, [], {})


@pytest.mark.parametrize("argv, spec", [
    (["--learner.dual_clip", "0.5"], {"dual_clip": 0.5}),
    (["--learner.loss_agg", "seq-mean-token-sum", "--learner.loss_norm_constant", "0"],
     {"agg": "seq-mean-token-sum", "norm_constant": 0.0}),
    (["--learner.correction.weights", "token", "--learner.behaviour_cap", "2"],
     {"behaviour_cap": 2.0, "correction": {"weights": "token"}}),
    (["--learner.correction.reject", "token", "--learner.correction.reject_lower", "3"],
     {"correction": {"reject": "token", "reject_lower": 3.0}}),
])
def test_a_loss_rule_is_stated_once_the_config_naming_its_own_fields(argv, spec):
    """The loss's rules live in its spec (`LossSpec`, `MismatchCorrection`): the config
    refuses what the spec refuses, in the spec's words, naming the config's fields."""
    from rayrep.config.schema import LOSS_SETTINGS
    from rayrep.types import LossSpec, MismatchCorrection

    with pytest.raises(ConfigError) as from_config:
        parse_cli(argv)
    correction = spec.pop("correction", None)
    with pytest.raises(ValueError) as from_spec:
        LossSpec(**spec, correction=MismatchCorrection(**correction) if correction else None)
    expected = str(from_spec.value)
    for field, name in LOSS_SETTINGS.items():  # the spec's names, as the config says them
        owner = "MismatchCorrection" if name.startswith("learner.correction.") and "__" not in field else "LossSpec"
        expected = expected.replace(f"{owner}.{field.replace('__', '.')}=", f"{name}=")
    assert str(from_config.value) == expected


def test_a_recorded_config_without_a_field_added_since_counts_as_its_default():
    """A run recorded before a field existed stands for one with the field's default only where
    the field was added with the old behaviour as default (`option(added=True)`)."""
    from rayrep.config import differing_fields

    ours = json.loads(load_preset("tiny-cpu").to_json())
    recorded = json.loads(load_preset("tiny-cpu").to_json())
    for name in ("pool", "max_version_lag", "others_only", "retire_scope"):
        del recorded["replay"][name]
    assert differing_fields(recorded, ours) == []
    assert differing_fields(recorded, json.loads(load_preset("tiny-cpu").replace(**{"replay.max_version_lag": 3})
                                                 .to_json())) == [("replay.max_version_lag", -1, 3)]
    del recorded["algorithm"]["exgrpo"]["retire_from"]  # its default is not what runs did before it
    assert differing_fields(recorded, ours) == [("algorithm.exgrpo.retire_from", None, "training-set")]
