"""The bench scripts measure on a Ray cluster of their own: each `ray.init` in bench/ asks for
a new local cluster (`address="local"`), as runs started on a laptop do. Without it Ray joins
whatever cluster `/tmp/ray/ray_current_cluster` names, and waits for one that is gone."""

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def ray_inits(source: str) -> list[ast.Call]:
    return [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and node.func.attr == "init"
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "ray"]


def address(call: ast.Call) -> object:
    return next((ast.literal_eval(k.value) for k in call.keywords if k.arg == "address"), None)


def test_every_bench_starts_a_ray_cluster_of_its_own():
    calls = {path.name: ray_inits(path.read_text()) for path in sorted(BENCH.glob("*.py"))}
    assert sum(map(len, calls.values())) >= 5 and len(calls["step.py"]) == 2  # the scripts are read
    assert {name: [address(c) for c in found] for name, found in calls.items() if found} == \
        {name: ["local"] * len(found) for name, found in calls.items() if found}
    assert [address(c) for c in ray_inits("import ray\nray.init(num_cpus=2)\n")] == [None]  # what it catches
