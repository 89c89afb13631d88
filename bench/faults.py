"""What a generator's death costs a training run: N steps with the generator SIGKILLed at a
random point of every k-th step, against the same run undisturbed, in one process.

    python bench/faults.py [--steps 8] [--every 2] [--seed 0] [config overrides...]

The undisturbed run goes first; its step times give the kill points: in each k-th step
of the disturbed run, a random moment in [0, that step's undisturbed time) after the step
before it was logged. Wherever the kill lands (in a generate call, in the weight sync,
between calls) the run replaces the generator and goes on. Printed: the completed steps;
the prompts lost (asked for in a step but not trained on: must be 0); the steps that
repeat the undisturbed run metric for metric (every value but the clock and the death
counters: per-prompt seeds make the retried prompts' answers those the dead engine would
have given); what the generator was doing when killed; and the slowdown, the disturbed
run's time over the undisturbed run's.
"""

import json
import random
import signal
import sys
import threading
import time
from pathlib import Path

import psutil

from rayrep.run.layout import RunFolder

from rayrep.cli import job_parser, parse_job_args
from rayrep.run.log import read_metrics

CLOCK = ("time", "tokens_per_second", "sync_seconds", "sync_gbps")
RECOVERY = ("generator_", "sync_generator_", "verifier_replaced", "verifier_retried")


def generator_processes() -> list[psutil.Process]:
    """This process's generator actors (Ray titles a worker `ray::<class>[.<method>]`)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.cmdline()[:1] and child.cmdline()[0].startswith("ray::GeneratorWorker"):
                found.append(child)
        except psutil.Error:
            pass
    return found


def logged_steps(run_dir: Path) -> set[int]:
    path = RunFolder(run_dir).metrics
    if not path.exists():
        return set()
    return {json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()}


def kill_generators(run_dir: Path, steps: list[int], delays: dict[int, float], stop: threading.Event,
                    kills: list[tuple[int, str]]) -> None:
    """For each step in `steps`: once the step before it is logged, wait its delay, then
    SIGKILL a generator process; `kills` gets (step, what the generator was doing)."""
    for step in steps:
        while not stop.is_set() and step - 1 not in logged_steps(run_dir):
            time.sleep(0.02)
        if stop.wait(delays[step]):
            return
        while not stop.is_set():
            processes = generator_processes()
            if processes:
                try:
                    doing = processes[0].cmdline()[0].partition(".")[2] or "idle"
                    processes[0].send_signal(signal.SIGKILL)
                    kills.append((step, doing))
                    break
                except psutil.Error:
                    pass
            time.sleep(0.01)  # between a death and its replacement: no generator to kill yet


def comparable(record: dict) -> dict:
    return {k: v for k, v in record.items()
            if not k.startswith(("time_", *RECOVERY)) and k not in CLOCK}


def main(argv=None):
    parser = job_parser(__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=2, help="kill the generator in every k-th step")
    parser.add_argument("--seed", type=int, default=0, help="the kill points' random seed")
    args, cfg = parse_job_args(parser, argv)
    cfg = cfg.replace(**{"run.steps": args.steps, "run.eval_every": 0, "logging.plots": False,
                         "logging.out_dir": f"runs/bench-faults-{int(time.time())}"})

    from rayrep.train import train

    start = time.perf_counter()
    undisturbed = train(cfg.replace(**{"logging.run_name": "undisturbed"}), log=lambda _: None)
    undisturbed_s = time.perf_counter() - start
    expected = {r["step"]: r for r in read_metrics(RunFolder(undisturbed.run_dir).metrics)}

    rng = random.Random(args.seed)
    targets = [step for step in range(1, args.steps + 1) if step % args.every == 0]
    delays = {step: rng.uniform(0.0, expected[step]["time_step"]) for step in targets}
    disturbed_dir = Path(cfg.logging.out_dir) / "disturbed"
    stop, kills = threading.Event(), []
    killer = threading.Thread(target=kill_generators, args=(disturbed_dir, targets, delays, stop, kills))
    killer.start()
    start = time.perf_counter()
    try:
        train(cfg.replace(**{"logging.run_name": "disturbed"}), log=lambda _: None)
    finally:
        stop.set()
        killer.join()
    disturbed_s = time.perf_counter() - start

    records = [r for r in read_metrics(RunFolder(disturbed_dir).metrics) if r["step"] >= 1]
    questions, group = cfg.algorithm.prompts_per_step, cfg.algorithm.group_size
    # Every verdict is one answer that came back from a generator; a step trains on what it verified.
    verified = [sum(v for k, v in r.items() if k.startswith("verifier_") and not k.startswith(RECOVERY))
                for r in records]
    lost = sum(max(0, questions - n // group) for n in verified)
    same = sum(comparable(r) == comparable(expected[r["step"]]) for r in records)
    in_calls = sum(r.get("generator_replaced", 0) for r in records)
    in_syncs = sum(r.get("sync_generator_replaced", 0) for r in records)
    retried = sum(r.get("generator_retried_prompts", 0) for r in records)
    print(f"{args.steps} steps, {questions} questions x {group} answers each, generator killed in steps {targets}")
    print(f"kills: {', '.join(f'step {s} ({doing})' for s, doing in kills)}")
    print(f"completed steps: {len(records)} of {args.steps}")
    print(f"generators replaced: {in_calls + in_syncs} ({in_calls} found dead by a generate call, whose "
          f"prompts were asked again: {retried}; {in_syncs} by the weight sync)")
    print(f"lost prompts: {lost}")
    print(f"steps identical to the undisturbed run: {same} of {len(records)}")
    print(f"undisturbed {undisturbed_s:.1f} s, disturbed {disturbed_s:.1f} s: slowdown {disturbed_s / undisturbed_s:.3f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
