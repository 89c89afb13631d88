"""Progress lines and their ETA, on a fake clock (no sleeps): expected values worked out by hand."""

import pytest

from rayrep.progress import Progress, format_duration
from rayrep.run.log import step_fields


class FakeClock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_training_eta_leaves_out_the_step_zero_evaluation():
    clock, lines = FakeClock(1000.0), []
    progress = Progress(60, "train", unit="step", log=lines.append, clock=clock)

    clock.now += 9.6  # the evaluation before training
    line = progress.update(0, **{"test pass@1": 0.262})
    assert line == "train  step 0/60 [..........] 0% | 10s elapsed, ETA -- | test pass@1 0.262"

    clock.now += 5.0  # step 1 took 5 s: 59 steps left at 5 s (with the evaluation it would be 59 x 14.6 s)
    line = progress.update(1, reward="+0.120", acc=0.45, gnorm=None, kept=3)
    assert line == ("train  step 1/60 [..........] 1% | 15s elapsed, ETA 4m55s | reward +0.120 acc 0.450 kept 3"
                    " | 5.0 s/step")

    clock.now += 11 * 3.0  # 11 more steps of 3 s: 38 s for 12 steps, 48 left -> 48 x 38 / 12 = 152 s
    line = progress.update(12, len=22.488, loss=-1234.4)
    assert line == "train  step 12/60 [##........] 20% | 48s elapsed, ETA 2m32s | len 22.5 loss -1234 | 3.2 s/step"

    clock.now += 48 * 3.0
    line = progress.update(60)
    assert line.startswith("train  step 60/60 [##########] 100% | 3m12s elapsed, ETA 0s | ")
    assert lines[-1] == line and len(lines) == 4
    assert not any("\r" in text or "\n" in text for text in lines)  # plain lines for log files


def test_collection_without_a_warm_up_counts_from_the_start():
    clock, lines = FakeClock(), []
    progress = Progress(256, "collect", unit="question", log=lines.append, clock=clock)
    clock.now = 3.0  # 64 questions in 3 s: 192 left take 9 s
    progress.update(64, kept=20, successes=95)
    assert lines == [
        "collect  question 64/256 [##........] 25% | 3s elapsed, ETA 9s | kept 20 successes 95 | 21.3 question/s"]


def test_no_eta_before_time_has_passed():
    clock = FakeClock()
    progress = Progress(10, "eval", unit="prompt", log=lambda _: None, clock=clock)
    assert "ETA --" in progress.update(1)  # no time on the clock yet: no rate, no division by zero
    assert "s/prompt" not in progress.update(1) and "prompt/s" not in progress.update(1)
    clock.now = 2.0
    assert "ETA 8s" in progress.update(2)  # 2 s for 2 prompts, 8 left
    empty = Progress(0, "eval", log=lambda _: None, clock=clock)
    assert "[##########] 100%" in empty.update(0)
    with pytest.raises(ValueError, match="total"):
        Progress(-1, "eval")


@pytest.mark.parametrize("seconds, text", [
    (0, "0s"), (59.4, "59s"), (59.6, "1m00s"), (92, "1m32s"), (3599, "59m59s"), (3600, "1h00m"), (7385, "2h03m"),
])
def test_durations(seconds, text):
    assert format_duration(seconds) == text


def test_training_fields_on_the_line():
    record = {
        "step": 3, "reward_mean": -0.30078125, "accuracy": 0.349609375, "response_length": 22.48828125,
        "fresh_entropy": 0.10291, "grad_norm": 0.19471, "test_pass@1": 0.262, "time_step": 6.0969,
        "time_eval": 9.598, "loss": -0.00025, "replay_share": 0.0,
    }
    clock = FakeClock()
    line = Progress(60, "train", log=lambda _: None, clock=clock).update(3, **step_fields(record))
    assert ("| reward -0.301 acc 0.350 len 22.5 ent 0.103 gnorm 0.19 test pass@1 0.262 took 6.1s eval 9.6s") in line
    assert step_fields({"step": 0, "time_eval": 9.6, "test_pass@1": 0.262, "grad_norm": None}) == {
        "test pass@1": "0.262", "eval": "9.6s"}
