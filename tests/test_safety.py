"""Safety audit: what the code does with user-handed files and commands, and what it exposes.

A static check over the sources of `rayrep/`, `jobs/` and `bench/` (their syntax trees, so
that comments and strings never count): nothing unpickles (pickle, cPickle, dill, marshal,
cloudpickle, shelve, joblib, numpy's allow_pickle, pandas' read_pickle), `torch.load` only
with `weights_only=True`, no `eval` / `exec` builtins, `yaml.load` only with a safe loader,
no shell (`shell=True`, `os.system`, `os.popen`), no `trust_remote_code=True` (a checkpoint
folder is user-handed: its code must not run), and no literal "0.0.0.0". User-handed files
are prompt sets, experience pools and snapshots (Parquet), configs (TOML) and checkpoints
(safetensors). Ray's own pickling of our objects between our processes (the object store,
the verifier sandbox's socket pair) is internal and out of scope.

Then cheap behavioural checks: every preset binds the server to 127.0.0.1 with finite
request caps, and the KubeRay files keep Ray's token authentication on
(`tests/test_deploy.py` checks the dashboard host and cluster.yaml's commands).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from rayrep.config import ConfigError, load_preset, parse_cli, preset_names

ROOT = Path(__file__).resolve().parents[1]
AUDITED = ("rayrep", "jobs", "bench")

UNPICKLING = {
    f"{module}.{function}"
    for module in ("pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib")
    for function in ("load", "loads", "Unpickler")
} | {"marshal.load", "marshal.loads", "shelve.open", "pandas.read_pickle", "torch.serialization.load"}
SHELL = {"os.system", "os.popen", "subprocess.getoutput", "subprocess.getstatusoutput"}
SAFE_YAML_LOADERS = {"yaml.SafeLoader", "yaml.CSafeLoader", "yaml.BaseLoader", "yaml.CBaseLoader"}


def _imported_names(tree: ast.AST) -> dict[str, str]:
    """Local name -> the dotted name it stands for (`import pickle as p`: p -> pickle;
    `from pickle import loads`: loads -> pickle.loads)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    names[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.AST, names: dict[str, str]) -> str | None:
    """The dotted name an expression refers to (`p.loads` -> pickle.loads), or None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(names.get(node.id, node.id))
    return ".".join(reversed(parts))


def _is_true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _keyword(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def audit_source(source: str, filename: str = "<source>") -> list[str]:
    """Every violation in one module, as 'file:line: what'."""
    tree = ast.parse(source, filename)
    names = _imported_names(tree)
    defined = {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    problems = []

    def report(node: ast.AST, what: str) -> None:
        problems.append(f"{filename}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in ("0.0.0.0", "::"):
            report(node, f"binds every interface ({node.value!r}); the default must stay 127.0.0.1")
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func, names) or ""
        if name in UNPICKLING:
            report(node, f"{name}(): unpickling runs code from the data")
        elif name == "torch.load" and not _is_true(_keyword(node, "weights_only")):
            report(node, "torch.load() without weights_only=True unpickles arbitrary objects")
        elif name in ("numpy.load", "np.load") and _is_true(_keyword(node, "allow_pickle")):
            report(node, "numpy.load(allow_pickle=True) unpickles arbitrary objects")
        elif name in ("eval", "exec", "builtins.eval", "builtins.exec") and name not in defined:
            report(node, f"{name}() runs text as code")
        elif name in ("yaml.load", "yaml.load_all"):
            loader = _keyword(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
            if loader is None or _dotted(loader, names) not in SAFE_YAML_LOADERS:
                report(node, f"{name}() without a safe loader (use yaml.safe_load)")
        elif name in ("yaml.unsafe_load", "yaml.unsafe_load_all", "yaml.full_load", "yaml.full_load_all"):
            report(node, f"{name}() builds arbitrary objects (use yaml.safe_load)")
        elif name in SHELL:
            report(node, f"{name}() runs a shell")
        elif name.startswith("subprocess.") and _keyword(node, "shell") is not None and not (
            isinstance(_keyword(node, "shell"), ast.Constant) and _keyword(node, "shell").value is False
        ):
            report(node, f"{name}(shell=...) runs a shell")
        if _keyword(node, "trust_remote_code") is not None and not (
            isinstance(_keyword(node, "trust_remote_code"), ast.Constant)
            and _keyword(node, "trust_remote_code").value is False
        ):
            report(node, f"{name or 'a call'}(trust_remote_code=...) runs code from a checkpoint folder")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("pickle", "cPickle", "_pickle", "dill", "marshal"):
            for alias in node.names:
                if alias.name in ("load", "loads", "Unpickler", "*"):
                    report(node, f"from {node.module} import {alias.name}: unpickling runs code from the data")
    return problems


def audited_files() -> list[Path]:
    return sorted(path for folder in AUDITED for path in (ROOT / folder).rglob("*.py"))


def test_the_audit_sees_the_whole_package():
    files = {path.relative_to(ROOT).as_posix() for path in audited_files()}
    assert {"rayrep/config/loading.py", "rayrep/buffer/files.py", "rayrep/data/loaders.py", "jobs/serve.py",
            "bench/buffer.py", "rayrep/verifier/sandbox.py"} <= files


RUNS_UNTRUSTED_CODE = {"rayrep/verifier/code_harness.py": ["exec() runs text as code"]}
"""The one file that runs untrusted code on purpose: the code checker's harness, inside its
sandboxed process (tests/test_code_checker.py holds it to its limits), and what it may do."""


def test_no_unpickling_eval_shell_or_remote_code_in_the_sources():
    problems = []
    for path in audited_files():
        name = path.relative_to(ROOT).as_posix()
        found = audit_source(path.read_text(encoding="utf-8"), name)
        allowed = RUNS_UNTRUSTED_CODE.get(name, [])
        problems += [p for p in found if p.partition(": ")[2] not in allowed]
        # (an allowance that is no longer used goes too)
        assert all(any(p.endswith(a) for p in found) for a in allowed), (name, allowed)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "source",
    [
        "import pickle\npickle.loads(b'')",
        "import pickle as p\np.load(open('f', 'rb'))",
        "from pickle import loads\n",
        "import dill\ndill.loads(b'')",
        "import marshal\nmarshal.loads(b'')",
        "import cloudpickle\ncloudpickle.loads(b'')",
        "import pandas as pd\npd.read_pickle('f')",
        "import numpy as np\nnp.load('f.npy', allow_pickle=True)",
        "import torch\ntorch.load('model.bin')",
        "import torch\ntorch.load('model.bin', weights_only=False)",
        "eval('1 + 1')",
        "exec('x = 1')",
        "import yaml\nyaml.load(text)",
        "import yaml\nyaml.load(text, Loader=yaml.Loader)",
        "import yaml\nyaml.full_load(text)",
        "import subprocess\nsubprocess.run('ls', shell=True)",
        "import subprocess as sp\nsp.Popen(cmd, shell=flag)",
        "import os\nos.system('ls')",
        "from transformers import AutoModel\nAutoModel.from_pretrained(path, trust_remote_code=True)",
        "serve.start(http_options={'host': '0.0.0.0'})",
    ],
)
def test_the_audit_finds_each_kind_of_violation(source):
    assert len(audit_source(source)) == 1, audit_source(source)


@pytest.mark.parametrize(
    "source",
    [
        "import torch\ntorch.load('model.pt', weights_only=True)",
        "import yaml\nyaml.safe_load(text)\nyaml.load(text, Loader=yaml.SafeLoader)",
        "import subprocess\nsubprocess.run(['ls'], shell=False)\nsubprocess.Popen([sys.executable, '-P'])",
        "model.eval()\nself.sharding.model.eval()",  # a method named eval, not the builtin
        "import numpy as np\nnp.load('f.npy')",
        "import pickle\ndata = pickle.dumps(obj)",  # writing is not reading
        "host = '127.0.0.1'  # '0.0.0.0' in a comment",
        "AutoModel.from_pretrained(path, trust_remote_code=False)",
    ],
)
def test_the_audit_lets_safe_code_through(source):
    assert audit_source(source) == []


# ---------------------------------------------------------------------- behaviour


@pytest.mark.parametrize("preset", preset_names())
def test_every_preset_serves_on_localhost_with_finite_request_caps(preset):
    serve = load_preset(preset).serve
    assert serve.host == "127.0.0.1"
    # Request caps: a positive default, and a range that keeps them positive.
    for cap in ("max_request_bytes", "max_ongoing_requests", "max_tokens", "max_n", "max_prompts"):
        value = getattr(serve, cap)
        assert isinstance(value, int) and 0 < value < 2**31, (cap, value)
    assert serve.max_request_bytes <= 64 * 1024**2
    assert 0 < serve.max_temperature < 100


@pytest.mark.parametrize(("field", "value"), [("serve.max_request_bytes", "0"), ("serve.max_ongoing_requests", "0"),
                                              ("serve.max_tokens", "-1"), ("serve.max_temperature", "inf")])
def test_request_caps_cannot_be_switched_off(field, value):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_cli([f"--{field}", value])


def test_the_rayjob_and_its_image_keep_token_authentication_on():
    """cluster.yaml's commands are checked in test_deploy.py; here the KubeRay side: the
    RayJob's cluster asks KubeRay for token authentication (Ray 2.60 turns it on by itself
    only for ray.init()'s local clusters), and no container env, start parameter or image
    layer sets RAY_AUTH_* over what the operator gives."""
    job = yaml.safe_load((ROOT / "deploy" / "kuberay-rayjob.yaml").read_text())
    cluster = job["spec"]["rayClusterSpec"]
    assert cluster["authOptions"] == {"mode": "token"}
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    assert groups and all(group["template"]["spec"]["containers"] for group in groups)
    for group in groups:
        assert not any("auth" in key.lower() for key in group["rayStartParams"]), group["rayStartParams"]
        for container in group["template"]["spec"]["containers"]:
            assert not any(env["name"].startswith("RAY_AUTH") for env in container.get("env", [])), container["name"]
    assert "RAY_AUTH_MODE" not in job["spec"]["entrypoint"]
    docker = [line for line in (ROOT / "deploy" / "Dockerfile").read_text().splitlines()
              if line.strip() and not line.lstrip().startswith("#")]
    assert docker and not any("RAY_AUTH" in line for line in docker)
