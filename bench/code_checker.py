"""The code checker's throughput: completions checked per second by one verifier's sandbox,
on correct, failing and timing-out programs, and what its confinement costs.

    python bench/code_checker.py [--completions 40] [--wall-s 1.0] [--rounds 3]

Rows, each a batch of `--completions` completions through one `MathSandbox` (what one
verifier actor runs), as completions per second (medians over `--rounds`, the rows
alternating within a round):

- correct: a function that passes its 3 assert tests;
- failing: one that fails them;
- stdin/stdout, 3 cases: a script run once per case (3 runs a completion);
- timing out: an infinite loop, held to `--wall-s` (a few completions only: each costs the
  limit; the figure is per completion as well);

and, per run of a program, the parts of its cost: a bare `python -I -S -c pass` (the
interpreter's start, the floor), the same under the resource limits, the same confined as
a run is (the limits, its own user, its network and mount namespaces), and a whole checked
run (the folder written and removed, the harness, the tests, every process of its user
looked for and killed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

from rayrep.machine import machine_name
from rayrep.verifier.code import CodeLimits, _confine, _network_namespace_allowed, _python, run_program
from rayrep.verifier.sandbox import MathSandbox

ASSERTS = json.dumps(["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(-1, 1) == 0"])
STDIO = json.dumps({"inputs": ["1 2\n", "5 5\n", "0 0\n"], "outputs": ["3\n", "10\n", "0\n"]})
PROGRAMS = {
    "correct": ("def add(a, b):\n    return a + b", ASSERTS),
    "failing": ("def add(a, b):\n    return a - b", ASSERTS),
    "stdin/stdout, 3 cases": ("a, b = map(int, input().split())\nprint(a + b)", STDIO),
    "timing out": ("while True:\n    pass", ASSERTS),
}


def per_second(sandbox: MathSandbox, program: str, tests: str, count: int) -> float:
    checks = [("code", f"```python\n{program}\n```", tests, {})] * count
    start = time.perf_counter()
    sandbox.check_batch(checks, timeout_s=1.0)
    return count / (time.perf_counter() - start)


def spawn_seconds(limits: CodeLimits, confinement: str, repeats: int) -> float:
    """Median seconds of `python -I -S -c pass` started bare, under the resource limits only,
    or confined as a program's run is (limits, its own user, its namespaces)."""
    whole = confinement == "confined"
    uid = 200_000 + os.getpid() if whole and os.geteuid() == 0 else None
    isolated = whole and _network_namespace_allowed()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([_python(), "-I", "-S", "-c", "pass"], env={}, cwd="/", check=True,
                       preexec_fn=None if confinement == "bare" else lambda: _confine(limits, uid, isolated))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--completions", type=int, default=40)
    parser.add_argument("--wall-s", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    limits = CodeLimits(wall_s=args.wall_s)
    print(f"machine: {machine_name()}; uid {os.geteuid()}; network namespace: {_network_namespace_allowed()}")
    rates: dict[str, list[float]] = {name: [] for name in PROGRAMS}
    with MathSandbox(code_limits=limits) as sandbox:
        for _ in range(args.rounds):
            for name, (program, tests) in PROGRAMS.items():
                count = 3 if name == "timing out" else args.completions
                rates[name].append(per_second(sandbox, program, tests, count))
    print(f"\n{'completions':24s} {'per second':>10s} {'ms each':>8s}")
    for name, values in rates.items():
        rate = statistics.median(values)
        print(f"{name:24s} {rate:10.1f} {1000 / rate:8.1f}")
    repeats = max(10, args.completions // 2)
    bare, limited, confined = (spawn_seconds(limits, how, repeats) for how in ("bare", "limits", "confined"))
    start = time.perf_counter()
    for _ in range(repeats):
        run_program("def add(a, b):\n    return a + b", "asserts", json.loads(ASSERTS), limits)
    whole = (time.perf_counter() - start) / repeats
    print(f"\n{'one run of a program':46s} {'ms':>6s}")
    for name, seconds in (("bare interpreter start (python -I -S)", bare), ("the same, under the rlimits", limited),
                          ("the same, + its own user and namespaces", confined),
                          ("a whole checked run (folder, harness, report)", whole)):
        print(f"{name:46s} {1000 * seconds:6.1f}")


if __name__ == "__main__":
    main()
