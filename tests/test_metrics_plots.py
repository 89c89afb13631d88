"""metrics.jsonl mirrored to an offline wandb run, and a run's learning curves as PNGs (the
`python -m rayrep.plots plot` command, run as a subprocess)."""

import contextlib
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rayrep.plots import load_run_metrics, plot_curves, step_times
from rayrep.run.log import read_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ROOT = Path(__file__).resolve().parents[1]
LINE_COLORS = {"C0": (0x1F, 0x77, 0xB4), "C1": (0xFF, 0x7F, 0x0E)}
"""matplotlib's first two line colors: the first and second curve of a plot."""


def drawn(path: Path, size: tuple[int, int] | None = None) -> dict[str, int]:
    """A PNG (of `size`, width x height pixels, where given), read back: how many pixels of each of the
    first two curves' colors it holds (a curve drawn leaves hundreds; a blank plot none)."""
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    image = imread(path)[..., :3] * 255
    assert size is None or image.shape[1::-1] == size, (path, image.shape)
    return {name: int((abs(image - rgb).max(axis=-1) < 8).sum()) for name, rgb in LINE_COLORS.items()}


def step_record(step: int, replay_share: float = 0.0, **extra) -> dict:
    """A training step's record with the keys a real run logs (values made up)."""
    return {
        "step": step, "time_plan": 0.01, "time_generate": 1.5, "time_verify": 0.07, "verifier_ok": 512,
        "time_build": 0.02, "fresh_entropy": 0.10 - 0.01 * step, "grad_norm": 0.19, "lr": 1e-4,
        "time_old_logprobs": 1.2, "fresh_tokens": 11514.0, "replay_tokens": 2556.0 * (replay_share > 0),
        "loss": -0.00025, "time_update": 4.4, "policy_version": step, "time_sync": 0.04,
        "reward_mean": -0.3 + 0.1 * step, "replay_share": replay_share, "accuracy": 0.35, "response_length": 22.5,
        "generated_tokens": 11514, "tokens_per_second": 7588.4, "time_step": 6.1, "time": 1796090924.268 + step,
        **extra,
    }


def eval_record(step: int, pass1: float) -> dict:
    return {"time_eval": 9.6, "test_avg@4": pass1, "test_pass@1": pass1, "test_pass@4": 0.56, "test_maj@4": 0.32,
            "test_rayrep/arithmetic/pass@1": pass1}


def write_run(folder: Path, records: list[dict]) -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rayrep.plots", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


# ---------------------------------------------------------------- wandb, offline


def wandb_history(path: Path) -> dict[int, dict]:
    """The history rows of a `.wandb` run file: {step: {key: value}}.

    wandb has no public Python reader for it, so this reads the file as its writer lays it
    out: a 7-byte header (":W&B", magic 0xBEE1, version), then LevelDB-log records (4-byte
    CRC, 2-byte length, 1-byte type: full, first, middle, last) in 32 KiB blocks, each
    record a `wandb_internal_pb2.Record` protobuf.
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1, f"{path} is not a wandb run file"
    block, position, pieces, rows = 32768, 7, b"", {}
    while position + 7 <= len(data):
        left_in_block = block - position % block
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if left_in_block < 7 or (length == 0 and kind == 0):  # the padding at the end of a block
            position += left_in_block
            continue
        pieces += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            if record.WhichOneof("record_type") == "history":
                rows[record.history.step.num] = {
                    item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
    return rows


NETWORK_WATCH = textwrap.dedent("""
    import json, socket, sys
    from pathlib import Path

    def watch(event, args):  # every name lookup, and every connection that is not a local socket
        if event in ("socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr") or (
                event == "socket.connect" and args[0].family != socket.AF_UNIX):
            print("NETWORK", event, args[1:] if event == "socket.connect" else args, file=sys.stderr, flush=True)

    sys.addaudithook(watch)
    from rayrep.run.log import MetricsLog

    from rayrep.config import load_preset

    logging = load_preset("tiny-cpu").replace(**{"logging.wandb": True, "logging.wandb_project": "rayrep-test",
                                                 "logging.ray_metrics": False}).logging
    log = MetricsLog(Path(sys.argv[1]), {"seed": 7}, logging)
    for record in json.loads(sys.argv[2]):
        log.log(record)
    log.close()
""")


def test_wandb_offline_run_holds_the_logged_metrics_and_stays_off_the_network(tmp_path):
    """A MetricsLog with wandb offline writes an offline run under the run folder whose history
    holds every number logged, at its step; no name is looked up and no connection leaves the
    machine from this process (wandb's own usage telemetry included)."""
    run_dir = tmp_path / "run"
    records = [
        {"step": 0, "test_pass@1": 0.25, "time_eval": 9.5},
        {"step": 1, "reward_mean": -0.5, "accuracy": 0.25, "verifier_ok": 512, "note": "text is not sent"},
        {"step": 2, "reward_mean": 0.125, "accuracy": 0.75, "grad_norm": float("nan"), "test_pass@1": 0.5},
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"), WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"),
               WANDB_DATA_DIR=str(tmp_path / "wandb-data"))
    done = subprocess.run([sys.executable, "-c", NETWORK_WATCH, str(run_dir), json.dumps(records)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "NETWORK" not in done.stderr, done.stderr

    offline_runs = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline_runs) == 1, list(run_dir.rglob("*"))
    history = wandb_history(offline_runs[0])
    assert sorted(history) == [0, 1, 2]
    expected = {
        0: {"test_pass@1": 0.25, "time_eval": 9.5},
        1: {"reward_mean": -0.5, "accuracy": 0.25, "verifier_ok": 512},
        2: {"reward_mean": 0.125, "accuracy": 0.75, "test_pass@1": 0.5},
    }
    for step, values in expected.items():
        assert {k: history[step].get(k) for k in values} == values
        assert history[step]["_step"] == step
    assert "note" not in history[1] and "grad_norm" not in history[2]  # text and NaN stay in metrics.jsonl only
    logged = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in logged] == [0, 1, 2] and logged[2]["grad_norm"] is None and logged[1]["note"]


# ---------------------------------------------------------------- plots


def tensorboard_events(folder: Path):
    """The event files of `folder`, as TensorBoard's server reads them (its plugins'
    accumulator: every event kept, a restart's orphaned steps purged)."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

    return EventAccumulator(str(folder), size_guidance={"tensors": 0}).Reload()


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float, float]]]:
    """Every scalar in the event files of `folder`: {tag: [(step, value, wall time)]}."""
    from tensorboard.util import tensor_util

    events = tensorboard_events(folder)
    return {tag: [(e.step, tensor_util.make_ndarray(e.tensor_proto).item(), e.wall_time) for e in events.Tensors(tag)]
            for tag in events.Tags()["tensors"] if not tag.endswith("/text_summary")}


def logged_scalars(records: list[dict]) -> dict[str, list[tuple[int, float, float]]]:
    """What TensorBoard should hold of `metrics.jsonl`'s records: every number but the step
    and wall time, {key: [(step, value, wall time)]}."""
    scalars = {}
    for record in records:
        for key, value in record.items():
            if isinstance(value, (int, float)) and key not in ("step", "time"):
                scalars.setdefault(key, []).append((record["step"], float(value), record["time"]))
    return scalars


def test_tensorboard_holds_every_number_of_the_log_and_a_failing_logger_costs_one_line(tmp_path, tiny_cfg):
    """TensorBoard event files hold each record's numbers at its step and wall time, as
    `metrics.jsonl` has them (to the digit), and the config as text. A logger that cannot
    start (its folder cannot be made) or that fails mid-run (a full disk) says so in one
    line; the run's records all reach `metrics.jsonl`."""
    import errno

    from rayrep.run.log import MetricsLog

    records = [{"step": 0, "test_pass@1": 0.1185, "time_eval": 1.5},
               {"step": 1, "reward_mean": -0.25, "accuracy": 1 / 3, "grad_norm": float("nan"), "note": "text",
                "sync_bytes": 3_289_600_123, "generator_replaced": 1},
               {"step": 2, "reward_mean": 0.125, "accuracy": 0.5, "grad_norm": 0.31}]
    logging = tiny_cfg.replace(**{"logging.tensorboard": True, "logging.ray_metrics": False}).logging
    lines = []
    log = MetricsLog(tmp_path / "run", {"seed": 7}, logging, log=lines.append)
    for record in records:
        log.log(record)
    log.close()
    expected = logged_scalars(read_metrics(tmp_path / "run" / "metrics.jsonl"))
    assert tensorboard_scalars(tmp_path / "run" / "tensorboard") == expected and not lines
    text = tensorboard_events(tmp_path / "run" / "tensorboard").Tensors("config/text_summary")[0] \
        .tensor_proto.string_val[0].decode()
    assert json.loads(text.removeprefix("```json").removesuffix("```")) == {"seed": 7}

    # Resumed from a step-1 checkpoint: what the stopped run logged after it is gone from both.
    from rayrep.run.log import keep_metrics_until

    keep_metrics_until(tmp_path / "run" / "metrics.jsonl", 1)
    log = MetricsLog(tmp_path / "run", {"seed": 7}, logging, resumed_at=1, log=lines.append)
    log.log({"step": 2, "reward_mean": 0.75})
    log.close()
    resumed = tensorboard_scalars(tmp_path / "run" / "tensorboard")
    assert [(step, value) for step, value, _ in resumed["reward_mean"]] == [(1, -0.25), (2, 0.75)]
    assert resumed.get("grad_norm", []) == []  # the stopped run's, at step 2 (step 1's was NaN: not a number)

    # The folder cannot be made (a file is where it would go): one line, and the log goes on.
    (tmp_path / "blocked").mkdir()
    (tmp_path / "blocked" / "tensorboard").write_text("a file")
    log = MetricsLog(tmp_path / "blocked", {"seed": 7}, logging, log=lines.append)
    # A full disk mid-run: the writer raises on the next record.
    log_full = MetricsLog(tmp_path / "full", {"seed": 7}, logging, log=lines.append)
    log_full.log(records[0])

    def no_space(*_, **__):
        raise OSError(errno.ENOSPC, "No space left on device")

    log_full.sinks[0].writer.add_scalar = no_space
    for record in records:
        log.log(record)
    for record in records[1:]:
        log_full.log(record)
    log.close()
    log_full.close()
    assert len(lines) == 2 and all(line.startswith("warning: TensorBoard stopped (") for line in lines), lines
    assert "No space left on device" in lines[1] and "holds every record" in lines[1]
    for run in ("blocked", "full"):
        assert [r["step"] for r in read_metrics(tmp_path / run / "metrics.jsonl")] == [0, 1, 2]


def test_a_runs_metrics_reach_tensorboard_and_rays_prometheus_endpoint_as_its_log_has_them(short_run_dir, short_run):
    """The short run (tests/conftest.py): its TensorBoard files hold every number of its
    `metrics.jsonl`; the node's Prometheus endpoint, scraped while it trained, served every
    training series that the run's records feed, labelled with the run, and their last values
    are the log's: each gauge its key's value at the last step that logged it, each counter
    the sum over steps."""
    import re

    from conftest import METRICS_PAGES

    from rayrep.run.sinks import COUNTERS, DERIVED_GAUGES, TRAIN_GAUGES, run_label

    assert tensorboard_scalars(short_run_dir / "tensorboard") == logged_scalars(short_run)

    label, series = run_label(short_run_dir), {}
    for page in METRICS_PAGES:  # in order: the last page that has a series holds its last value
        for name, labels, value in re.findall(r"^ray_rayrep_train_(\w+)\{([^}]*)\} (\S+)$", page, re.M):
            tags = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            if tags.get("run") == label:
                series[name, tags.get("phase", tags.get("role"))] = float(value)
    logged = {key: [r[key] for r in short_run if isinstance(r.get(key), (int, float))] for key in
              {key for key, _ in TRAIN_GAUGES.values()} | {"time_step", "generated_tokens", "fresh_tokens",
                                                             "replay_tokens"}}
    gauges = {name: logged[key][-1] for name, (key, _) in TRAIN_GAUGES.items() if logged[key]}
    assert gauges.keys() >= {"step", "step_seconds", "generated_tokens_per_second", "reward", "accuracy", "sync_seconds",
                             "policy_version"}
    steps = [r for r in short_run if r.get("time_step")]
    trained = [(r.get("fresh_tokens") or 0) + (r.get("replay_tokens") or 0) for r in steps]
    assert {name: series.get((name, None)) for name in gauges} == gauges
    assert series["trained_tokens_per_second", None] == trained[-1] / steps[-1]["time_step"]
    shares = {phase: value for (name, phase), value in series.items() if name == "phase_share"}
    assert {"generate", "verify", "update", "sync", "other"} <= set(shares) and sum(shares.values()) == \
        pytest.approx(1.0, abs=1e-6)
    assert series["steps_total", None] == len(steps) == 2
    assert series["generated_tokens_total", None] == sum(logged["generated_tokens"])
    assert series["trained_tokens_total", None] == sum(trained)
    assert set(DERIVED_GAUGES) | {f"{name}_total" for name in COUNTERS} >= {name for name, _ in series
                                                                            if name not in gauges}


def test_plot_command_writes_each_curve_and_an_overview(tmp_path):
    rlep = write_run(tmp_path / "rlep", [
        {"step": 0, **eval_record(0, 0.26)},
        step_record(1, replay_share=0.18, replay_entropy=0.09),
        step_record(2, replay_share=0.16, replay_entropy=0.08, **eval_record(2, 0.34)),
    ])
    done = run_cli("plot", str(rlep))
    assert done.returncode == 0, done.stderr
    written = [Path(line) for line in done.stdout.splitlines()]
    names = {"reward", "test_accuracy", "entropy", "response_length", "replay_share", "step_time", "overview"}
    assert {p.name for p in written} == {f"{name}.png" for name in names}
    for path in written:
        assert path.parent == rlep / "plots"
        assert path.read_bytes()[:8] == PNG_SIGNATURE, path
        if path.name in {"reward.png", "replay_share.png", "response_length.png"}:  # one curve each, drawn
            assert drawn(path)["C0"] > 50, path

    # GRPO logs a replay share of 0 at every step: no replay panel; eval records only at step 0.
    grpo = write_run(tmp_path / "grpo", [{"step": 0, **eval_record(0, 0.26)}, step_record(1), step_record(2)])
    done = run_cli("plot", str(grpo))
    assert done.returncode == 0, done.stderr
    assert sorted(Path(line).name for line in done.stdout.splitlines()) == sorted(
        f"{name}.png" for name in names - {"replay_share"})
    assert sorted(p.name for p in (grpo / "plots").iterdir()) == sorted(Path(x).name for x in done.stdout.splitlines())


@pytest.mark.parametrize("case", ["no folder", "no metrics file", "empty metrics file"])
def test_plot_command_refuses_a_run_without_metrics(tmp_path, case):
    run_dir = tmp_path / "run"
    if case != "no folder":
        run_dir.mkdir()
    if case == "empty metrics file":
        (run_dir / "metrics.jsonl").write_text("\n")
    named = run_dir if case == "no folder" else run_dir / "metrics.jsonl"
    done = run_cli("plot", str(run_dir))
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and str(named) in lines[0] and "Traceback" not in done.stderr, done.stderr
    assert not (run_dir / "plots").exists()


def test_step_time_phases_add_up_to_the_step_and_its_evaluation():
    """Nested phases come out of their parents (the old log-probs within the update); the
    untimed rest of the step is `other`; eval is its own part."""
    records = [
        {"step": 0, "time_eval": 9.0},
        {"step": 1, "time_plan": 0.3, "time_generate": 2.0, "time_verify": 0.1, "time_hand_over": 0.4,
         "time_select": 0.2, "time_build": 0.1, "time_old_logprobs": 1.0, "time_update": 3.0, "time_sync": 0.3,
         "time_step": 6.9, "time": 1796090924.0},
    ]
    steps, phases = step_times(records)
    assert steps == [0, 1]
    expected = {"plan": [0, 0.3], "generate": [0, 2.0], "verify": [0, 0.1], "hand_over": [0, 0.4],
                "select": [0, 0.2], "build": [0, 0.1], "old_logprobs": [0, 1.0], "update": [0, 2.0],
                "sync": [0, 0.3], "other": [0, 0.5], "eval": [9.0, 0]}
    assert list(phases) == list(expected)  # the order they run, eval last
    for name, values in expected.items():
        assert phases[name] == pytest.approx(values), name


def test_metrics_of_the_latest_run_in_a_reused_folder(tmp_path):
    """A later run with the same run name appends to metrics.jsonl with steps from 0 again;
    a last line still being written is left out."""
    run_dir = write_run(tmp_path / "run", [{"step": 0}, {"step": 1, "reward_mean": 0.1}, {"step": 2},
                                           {"step": 0}, {"step": 1, "reward_mean": 0.7}])
    with open(run_dir / "metrics.jsonl", "a") as file:
        file.write('{"step": 2, "rew')
    assert load_run_metrics(run_dir) == [{"step": 0}, {"step": 1, "reward_mean": 0.7}]


def test_failed_plots_leave_a_warning_not_a_failed_run(tmp_path):
    from rayrep.plots import write_plots

    lines = []
    write_plots(tmp_path / "missing", log=lines.append)
    assert len(lines) == 1 and lines[0].startswith("warning: no plots for") and "missing" in lines[0]


def test_comparison_plot_still_draws(tmp_path):
    evals = [{"step": 0, "test_pass@1": 0.26}, {"step": 10, "test_pass@1": 0.34}]
    path = plot_curves({"baseline": evals, "rlep": evals[:1]}, tmp_path / "cmp" / "comparison.png", title="t")
    colors = drawn(path, (768, 480))
    # The baseline's line and markers, and the other run's one point (a marker) and legend entry.
    assert colors["C0"] > 200 and colors["C1"] > 20, colors
    alone = drawn(plot_curves({"baseline": evals}, tmp_path / "alone.png"), (768, 480))
    assert alone["C0"] > 200 and alone["C1"] == 0, alone


# ---------------------------------------------------------------------- seeded studies


def curve(values, se=0.01, every=10):
    return [{"step": every * i, "test_pass@1": v, "test_pass@1_se": se} for i, v in enumerate(values)]


def test_mean_and_standard_error_by_hand():
    from rayrep.stats.formulas import mean_and_se

    mean, se = mean_and_se([1.0, 2.0, 3.0, 4.0])
    # deviations -1.5, -0.5, 0.5, 1.5: squares sum to 5; sample variance 5/3; SE sqrt(5/3/4)
    assert mean == 2.5 and se == pytest.approx((5 / 3 / 4) ** 0.5)
    one = mean_and_se([0.7])
    assert one[0] == 0.7 and one[1] != one[1]  # NaN: one seed has no spread
    with pytest.raises(ValueError):
        mean_and_se([])


def test_study_summary_of_made_up_curves():
    from rayrep.stats.formulas import mean_and_se
    from rayrep.stats.study import first_step_reaching, mean_curve, study_table, summarize_study

    assert first_step_reaching([(0, 0.1), (10, 0.3), (20, 0.5)], 0.3) == 10
    assert first_step_reaching([(0, 0.1)], 0.3) is None
    curves = {
        # peaks 0.30, 0.32, 0.34: the level is their mean, 0.32
        "baseline": [curve([0.2, 0.30, 0.28]), curve([0.2, 0.25, 0.32]), curve([0.2, 0.34, 0.31])],
        # reaches 0.32 at step 10, at step 20, never
        "rlep": [curve([0.2, 0.33, 0.35], se=0.02), curve([0.2, 0.30, 0.32], se=0.02), curve([0.2, 0.25, 0.31], se=0.02)],
    }
    summary = summarize_study(curves)
    assert summary["baseline_mean_peak"] == pytest.approx(0.32)
    base, rlep = summary["arms"]["baseline"], summary["arms"]["rlep"]
    assert base["peak"][0] == pytest.approx(0.32) and base["peak"][1] == pytest.approx(0.02 / 3 ** 0.5)
    assert base["final"][0] == pytest.approx((0.28 + 0.32 + 0.31) / 3)
    assert base["reaches"] == [None, 20, 10]  # the baseline's own seeds against its mean peak
    assert rlep["reaches"] == [10, 20, None]
    assert rlep["reach_step"][0] == pytest.approx(15) and rlep["reach_step"][1] == pytest.approx(5)  # sd 7.07 / sqrt 2
    assert rlep["peak"][0] == pytest.approx((0.35 + 0.32 + 0.31) / 3) and rlep["eval_se"] == pytest.approx(0.02)
    # Paired by seed: final gains +0.07, 0.00, 0.00; curve gains (mean of steps 10-20) +0.05,
    # +0.025, -0.045.
    assert rlep["paired_seeds"] == 3 and "final_gain" not in base
    assert rlep["final_gain"][0] == pytest.approx(0.07 / 3) and rlep["final_gain"][1] == pytest.approx(0.07 / 3)
    gains = [0.05, 0.025, -0.045]
    assert rlep["curve_gain"][0] == pytest.approx(sum(gains) / 3)
    assert rlep["curve_gain"][1] == pytest.approx(mean_and_se(gains)[1])
    table = study_table(summary)
    assert "rlep" in table and "15 +/- 5 (2/3)" in table and "32.7 +/- " in table and "baseline mean peak: 32.0%" in table
    assert "+2.3 +/- 2.3" in table and "+1.0 +/- " in table
    # The lead in each half of the run (split at step 10: step 10, then step 20): +0.03,
    # +0.05, -0.09, then +0.07, 0, 0. Each seed's baseline peaks at step 10, 20, 10 (0.30,
    # 0.32, 0.34); RLEP reaches those at 10, 20, never: ratios 1 and 1.
    assert rlep["half_middle"] == 10
    assert rlep["half_gains"][0][0] == pytest.approx(-0.01 / 3) and rlep["half_gains"][1][0] == pytest.approx(0.07 / 3)
    assert rlep["half_gains"][1][1] == pytest.approx(mean_and_se([0.07, 0.0, 0.0])[1])
    assert rlep["own_peak_steps"] == [(10, 10), (20, 20), (None, 10)] and rlep["own_peak_ratio"] == (1.0, 0.0)
    assert "10/10, 20/20, -/10" in table and "1.00 +/- 0.00" in table and "+2.3 +/- 2.3" in table.split("halves")[1]
    # The mean curve: at step 10 the baseline's seeds evaluated 0.30, 0.25, 0.34.
    assert [step for step, _, _ in base["curve"]] == [0, 10, 20]
    assert base["curve"][1] == (10, *mean_and_se([0.30, 0.25, 0.34]))
    assert "29.7 +/- 2.6" in table.split("by step")[1]
    # only the steps every run evaluated: a run stopped after step 10 leaves step 20 out
    assert [step for step, _, _ in mean_curve([curve([0.2, 0.3, 0.4]), curve([0.2, 0.5])])] == [0, 10]
    with pytest.raises(ValueError, match="no finished 'baseline' run"):
        summarize_study({"rlep": curves["rlep"]})
    # Contrasts pair two other arms by seed, over the seeds both ran: here an ablation of two
    # seeds (1 and 2) against RLEP's three; final differences 0.34 - 0.32 and 0.29 - 0.31.
    ablation = [curve([0.2, 0.31, 0.34]), curve([0.2, 0.27, 0.29])]
    summary = summarize_study({**curves, "ablation": ablation}, seeds={"ablation": [1, 2]},
                              contrasts=[("ablation", "rlep"), ("missing", "rlep")])
    assert list(summary["contrasts"]) == ["ablation - rlep"]
    contrast = summary["contrasts"]["ablation - rlep"]
    assert contrast["paired_seeds"] == 2 and contrast["final_gains"] == pytest.approx([0.02, -0.02])
    assert contrast["final_gain"][0] == pytest.approx(0.0) and contrast["final_gain"][1] == pytest.approx(0.02)
    assert contrast["curve_gain"][0] == pytest.approx(((0.325 - 0.31) + (0.28 - 0.28)) / 2)
    assert "ablation - rlep" in study_table(summary) and "+2.0, -2.0" in study_table(summary)
    # An arm twice as long, evaluated every 20 steps (half the generation a step, the same in
    # all): paired at the same share of each run, its step 20 against the baseline's step 10.
    # Seed 0's baseline peaks at step 10 (0.30); the long arm first reaches it at its step 40,
    # the baseline's 20 at that scale: ratio 2. At equal steps it would pair its step 20 with
    # the baseline's 20 and have no evaluation at the baseline's step 10.
    summary = summarize_study({"baseline": curves["baseline"][:1], "long": [curve([0.2, 0.26, 0.31], every=20)]})
    long = summary["arms"]["long"]
    assert long["curve_gain"][0] == pytest.approx(((0.26 + 0.31) - (0.30 + 0.28)) / 2)
    assert long["half_gains"][0][0] == pytest.approx(0.26 - 0.30) and long["half_gains"][1][0] == pytest.approx(0.31 - 0.28)
    assert long["own_peak_steps"] == [(20, 10)] and long["own_peak_ratio"][0] == pytest.approx(2.0)
    assert "20/10" in study_table(summary)
    # a length that does not divide the other's still lands its last step on the other's last
    from rayrep.stats.study import _rescaled

    assert _rescaled([(0, 0.1), (11, 0.2)], [(0, 0.1), (60, 0.3)])[-1][0] == 60
    assert _rescaled([(0, 0.1), (10, 0.2)], [(0, 0.1)]) == [(0, 0.1), (10, 0.2)]  # nothing to rescale to


def test_what_each_arm_spent_to_reach_each_target_paired_by_seed(tmp_path):
    """`spent` adds up each run's generated tokens and step seconds to its evaluations;
    `frontier_targets` sets the levels (the baseline's mean final and peak, and what every
    run reaches); `summarize_compute` says what each arm spent to first reach each, and,
    paired by seed, its tokens over its own baseline's; an arm that never reaches one says so."""
    from rayrep.plots import plot_study_tokens
    from rayrep.stats.study import compute_table, frontier_targets, spent, summarize_compute

    def run(tokens_per_step, seconds_per_step, values):
        steps = [{"step": s, "generated_tokens": tokens_per_step, "time_step": seconds_per_step} for s in range(1, 21)]
        return spent(steps, curve(values))  # evaluations at steps 0, 10, 20

    assert run(100, 2.0, [0.1, 0.2, 0.3]) == [(0, 0.0, 0.0, 0.1), (10, 1000.0, 20.0, 0.2), (20, 2000.0, 40.0, 0.3)]
    runs = {"baseline": [run(100, 2.0, [0.1, 0.2, 0.3]), run(100, 2.0, [0.1, 0.3, 0.25])],
            "half": [run(50, 1.0, [0.1, 0.3, 0.3]), run(50, 1.0, [0.1, 0.2, 0.35])],
            "stuck": [run(100, 1.0, [0.1, 0.2, 0.2]), run(100, 1.0, [0.1, 0.15, 0.2])]}
    seeds = {arm: [0, 1] for arm in runs}
    targets = frontier_targets(runs)
    assert targets == {"baseline final": pytest.approx(0.275), "baseline peak": pytest.approx(0.3),
                       "every arm": pytest.approx(0.2)}
    compute = summarize_compute(runs, targets, seeds)
    base, half, stuck = (compute[arm]["targets"] for arm in ("baseline", "half", "stuck"))
    # The baseline's peak (0.3): seed 0 at 2000 tokens, seed 1 at 1000; "half" at 500 (seed 0)
    # and 1000 (seed 1): paired, 500 / 2000 and 1000 / 1000.
    assert base["baseline peak"]["reached"] == 2 and base["baseline peak"]["tokens"] == (1500.0, pytest.approx(500.0))
    assert half["baseline peak"]["ratio"] == (pytest.approx(0.625), pytest.approx(0.375))
    assert half["baseline peak"]["ratio_seeds"] == 2 and half["baseline peak"]["seconds"][0] == pytest.approx(15.0)
    assert stuck["baseline peak"]["reached"] == 0 and stuck["baseline peak"]["ratio"] == (None, None)
    assert stuck["every arm"]["ratio"] == (pytest.approx(1.5), pytest.approx(0.5))  # 1000 / 1000, 2000 / 1000
    assert compute["half"]["tokens_per_step"][0] == pytest.approx(50.0)
    assert compute["half"]["curve"][1] == (10, 500.0, 10.0, pytest.approx(0.25), pytest.approx(0.05))
    table = compute_table(compute)
    assert "target: baseline peak, 30.0%" in table and "0.62 +/- 0.38 (2)" in table and "not reached" in table
    path = plot_study_tokens(compute, tmp_path / "tokens.png", reference=("baseline", "half"))
    assert path.stat().st_size > 10_000


def test_study_plot_is_a_png(tmp_path):
    from rayrep.plots import plot_study

    path = plot_study({"baseline": [curve([0.2, 0.3]), curve([0.25, 0.35])], "rlep": [curve([0.2, 0.4])]},
                      tmp_path / "study.png", title="made up")
    colors = drawn(path, (864, 528))
    assert colors["C0"] > 200 and colors["C1"] > 200, colors  # both arms' mean curves


def load_study_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("replay_study", Path(__file__).resolve().parents[1] / "bench" / "replay_study.py")
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    return study


def test_the_study_script_reports_the_finished_runs_it_finds(tmp_path):
    """bench/replay_study.py's report: finished runs only (a final checkpoint and evals.json),
    by arm in seed order, into study.json and study.png."""
    study = load_study_script()

    def finished(seed, arm, values, replayed=(0.0, 0.0)):
        run = tmp_path / f"seed-{seed}" / arm
        (run / "checkpoints" / "final").mkdir(parents=True)
        (run / "evals.json").write_text(json.dumps(curve(values)))
        steps = [{"step": step, "accuracy": 0.3, "replay_share": share} for step, share in enumerate(replayed, 1)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [{"step": 0, "test_pass@1": 0.2}, *steps]))

    lines = []
    assert study.report(tmp_path, ["baseline", "rlep"], [0, 1], "made-up", lines.append) is None  # nothing yet
    finished(0, "baseline", [0.2, 0.3])
    finished(1, "baseline", [0.2, 0.4])
    finished(1, "rlep", [0.2, 0.5], replayed=(0.1, 0.2))
    (tmp_path / "seed-0" / "rlep").mkdir()  # stopped before its end: not counted
    (tmp_path / "seed-0" / "rlep" / "evals.json").write_text(json.dumps(curve([0.9])))
    summary = study.report(tmp_path, ["baseline", "rlep"], [0, 1], "made-up", lines.append)
    assert summary["runs"] == {"baseline": [0, 1], "rlep": [1]} and summary["baseline_mean_peak"] == pytest.approx(0.35)
    assert summary["arms"]["rlep"]["reaches"] == [10]
    # how much each arm replayed, mean over steps and seeds (an arm that never did says so)
    assert summary["arms"]["rlep"]["replay_share"] == pytest.approx(0.15) and summary["arms"]["baseline"]["replay_share"] == 0
    # paired with seed 1's baseline (0.4), not with the first baseline run found (seed 0's 0.3)
    assert summary["arms"]["rlep"]["paired_seeds"] == 1
    assert summary["arms"]["rlep"]["final_gain"][0] == pytest.approx(0.1)
    assert json.loads((tmp_path / "study.json").read_text())["runs"] == summary["runs"]
    assert (tmp_path / "study.png").is_file() and any("baseline mean peak: 35.0%" in line for line in lines)
    # --report-only: the same report, and nothing run
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    again = study.main(["--out", str(tmp_path), "--seeds", "0", "1", "--arms", "rlep", "--report-only"])
    assert again["runs"] == summary["runs"] and again["arms"]["rlep"]["final_gain"] == summary["arms"]["rlep"]["final_gain"]
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before
    # Restarted with another setting, the study refuses to reuse a finished run that ran
    # otherwise, before anything runs (or is written).
    from rayrep.config import ConfigError, parse_cli

    cfg = parse_cli(["--preset", "tiny-cpu-hard", "--data.arithmetic_test_size", "2000", "--generator.eval_samples", "4"])
    for seed, arm in ((0, "baseline"), (1, "baseline"), (1, "rlep")):
        seeded = study.seed_config(cfg, tmp_path, seed)
        (tmp_path / f"seed-{seed}" / arm / "config.json").write_text(study.arm_config(seeded, arm, tmp_path / f"seed-{seed}").to_json())
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(ConfigError, match="seed-0/baseline finished with learner.lr = 0.0001, not the 0.0003 asked for"):
        study.main(["--out", str(tmp_path), "--seeds", "0", "1", "--learner.lr", "3e-4"])
    with pytest.raises(ConfigError, match="seed-1/rlep finished with algorithm.rlep.replays_per_group = 2, not the 3"):
        study.main(["--out", str(tmp_path), "--seeds", "1", "--arms", "rlep", "--algorithm.rlep.replays_per_group", "3"])
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_every_arm_of_the_study_is_a_valid_run_and_every_contrast_names_arms(tmp_path):
    """Each arm's settings are fields a run accepts with values it accepts on the study's
    preset (a typo in an arm would otherwise surface only when its turn came, hours into a
    study), and the contrasts and the frontier's reference name arms that exist."""
    from rayrep.config import parse_cli
    from rayrep.config.fields import get_dotted

    study = load_study_script()
    seeded = study.seed_config(parse_cli(["--preset", "tiny-cpu-hard"]), tmp_path, 0)
    for arm, changes in study.ARMS.items():
        cfg = study.arm_config(seeded, arm, tmp_path / "seed-0").to_dict()
        assert all(get_dotted(cfg, name) == value for name, value in changes.items()), arm
    named = {name for pair in study.CONTRASTS for name in pair} | set(study.FRONTIER_ARMS) | set(study.DEFAULT_ARMS)
    assert named <= set(study.ARMS), named - set(study.ARMS)


def test_the_study_keeps_a_record_that_stands_for_its_runs(tmp_path):
    """`--record`: a finished run's settings, evaluations and step records are copied there;
    on a machine without the run folder (a fresh clone) the record stands for the run: it is
    reported, checked against the settings asked for, and not run again."""
    from rayrep.config import ConfigError, parse_cli

    study = load_study_script()
    out, record = tmp_path / "runs", tmp_path / "record"
    cfg = parse_cli(["--preset", "tiny-cpu-hard", "--data.arithmetic_test_size", "2000", "--generator.eval_samples", "4"])
    run = out / "seed-0" / "baseline"
    (run / "checkpoints" / "final").mkdir(parents=True)
    (run / "config.json").write_text(study.arm_config(study.seed_config(cfg, out, 0), "baseline", out / "seed-0").to_json())
    (run / "evals.json").write_text(json.dumps(curve([0.2, 0.3])))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "accuracy": 0.3, "replay_share": 0.0}) + "\n")
    (run / "machine.json").write_text(json.dumps([{"step": 0, "torch_kernels": "AVX2"}]))
    study.copy_files(study.RECORD_FILES, run, record / "seed-0" / "baseline")
    assert sorted(p.name for p in (record / "seed-0" / "baseline").iterdir()) == sorted(study.RECORD_FILES)  # nothing partial left
    shutil.rmtree(out)  # the run folder is gone: its record stands for it
    assert study.finished_run(out, None, 0, "baseline") is None
    assert study.finished_run(out, record, 0, "baseline") == record / "seed-0" / "baseline"
    args = ["--out", str(out), "--record", str(record), "--seeds", "0"]
    # checked against the settings asked for, as a run folder is, before anything runs
    with pytest.raises(ConfigError, match="record/seed-0/baseline finished with learner.lr = 0.0001, not the 0.0003"):
        study.main([*args, "--arms", "baseline", "--learner.lr", "3e-4"])
    # an RLEP arm still to run needs the seed's pool, which a record-only baseline cannot sample
    with pytest.raises(ConfigError, match="rlep for seed 0: its baseline is only recorded .* remove that record"):
        study.main([*args, "--arms", "rlep"])
    assert not out.exists()
    summary = study.main([*args, "--arms", "baseline", "--report-only"])
    assert summary["runs"] == {"baseline": [0]} and summary["baseline_mean_peak"] == pytest.approx(0.3)
    # a recorded run is not run again (no Ray, no training here: the study only reports)
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        summary = study.main([*args, "--arms", "baseline"])
    assert summary["runs"] == {"baseline": [0]} and "seed 0: baseline is recorded in" in printed.getvalue()
    assert not (out / "seed-0" / "baseline").exists()
    # A recorded RLEP run names its pool by the path it had where it ran (another checkout or
    # --out): the record still stands for the run, and other RLEP settings are still refused.
    elsewhere = tmp_path / "elsewhere"
    rlep = study.arm_config(study.seed_config(cfg, elsewhere, 0), "rlep", elsewhere / "seed-0")
    (record / "seed-0" / "rlep").mkdir()
    (record / "seed-0" / "rlep" / "config.json").write_text(rlep.to_json())
    (record / "seed-0" / "rlep" / "metrics.jsonl").write_text(json.dumps({"step": 1, "accuracy": 0.3, "replay_share": 0.1}) + "\n")
    (record / "seed-0" / "rlep" / "evals.json").write_text(json.dumps(curve([0.2, 0.35])))
    with contextlib.redirect_stdout(io.StringIO()):
        summary = study.main([*args, "--arms", "rlep"])
    assert summary["runs"] == {"baseline": [0], "rlep": [0]}
    with pytest.raises(ConfigError, match="record/seed-0/rlep finished with algorithm.rlep.replays_per_group = 2, not the 3"):
        study.main([*args, "--arms", "rlep", "--algorithm.rlep.replays_per_group", "3"])
    # a whole record is never rewritten; one cut off before its last file is copied again
    source = tmp_path / "source"
    source.mkdir()
    for name in study.RECORD_FILES:
        (source / name).write_text("new")
    study.keep_record(study.RECORD_FILES, source, record / "seed-0" / "rlep")
    assert (record / "seed-0" / "rlep" / "evals.json").read_text() != "new"
    (record / "seed-0" / "rlep" / "evals.json").unlink()
    study.keep_record(study.RECORD_FILES, source, record / "seed-0" / "rlep")
    assert all((record / "seed-0" / "rlep" / name).read_text() == "new" for name in study.RECORD_FILES)
    # a seed's RLEP pool: copied from the record to a seed folder without one, and recorded
    # from a seed folder that has one (nothing collected either way)
    (record / "seed-0" / "pool.parquet").write_bytes(b"PAR1 pool")
    (record / "seed-0" / "pool.json").write_text("{}")
    study.seed_pool(None, out / "seed-0", record, print)
    assert (out / "seed-0" / "pool.parquet").read_bytes() == b"PAR1 pool" and (out / "seed-0" / "pool.json").is_file()
    (out / "seed-1").mkdir()
    for name in study.POOL_FILES:
        shutil.copyfile(out / "seed-0" / name, out / "seed-1" / name)
    study.seed_pool(None, out / "seed-1", record, print)
    assert sorted(p.name for p in (record / "seed-1").iterdir()) == sorted(study.POOL_FILES)
    # a record cut off before its evals.json is not a finished run
    (record / "seed-0" / "baseline" / "evals.json").unlink()
    assert study.finished_run(out, record, 0, "baseline") is None
