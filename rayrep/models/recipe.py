"""The embedded tiny policy's recipe and the policies that ship built: what determines a
policy's weights (`TinyPolicySpec`, from a config: `tiny_spec`), their build records, and
the shipped policy of a recipe (`shipped_policy`, its weights checked against its record).
Light to import; the build itself is `rayrep.models.tiny`."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from rayrep.config import Config, ConfigError
from rayrep.data.arithmetic import DEFAULT_LEVELS, TEST_RESERVE
from rayrep.errors import InputError

# Bump when the build recipe changes in a way the spec does not capture.
RECIPE_VERSION = 2
"""2: built with `PORTABLE_KERNELS` (1: with whatever kernels the CPU chose), past a test
reserve of 2,000 problems (1: 1,000)."""

@dataclass(frozen=True)
class TinyPolicySpec:
    """Everything that determines the tiny policy's weights (`cache_key` names the recipe)."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_positions: int = 256
    levels: tuple[str, ...] = DEFAULT_LEVELS
    num_train: int = 20000
    task_seed: int = 0
    test_reserve: int = TEST_RESERVE
    """The task's problems kept for test splits: the warm start uses those after them."""
    warm_start_steps: int = 1300
    warm_start_batch: int = 64
    warm_start_lr: float = 3e-3
    warm_start_slips: float = 0.4
    """Share of warm-start targets whose last step carries an arithmetic slip (see below)..."""
    warm_start_slip_steps: int = 250
    """...in the last this-many steps only: arithmetic is learned clean first."""
    seed: int = 0
    tool_calls: float = 0.0
    """Share of warm-start answers that call the calculator with `tool_markup` (the tool's
    output framed by the chat template, as the generators frame it) instead of working by hand."""
    tool_markup: tuple[str, ...] = ()
    """(call start, call end), with `tool_calls`."""

    def cache_key(self) -> str:
        fields = asdict(self)
        if not self.tool_calls:  # (the recipes from before tools: their keys as they were)
            del fields["tool_calls"], fields["tool_markup"]
        blob = json.dumps({"recipe": RECIPE_VERSION, **fields}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def padded_vocab_size(tokenizer) -> int:
    """The embedding rows of the tiny policy: its tokenizer's size, rounded up to 8."""
    return 8 * math.ceil(len(tokenizer) / 8)


def weights_sha256(model_dir: Path) -> str:
    """SHA-256 of a checkpoint's tensors (each one's name, dtype, shape and bytes, in name
    order): equal exactly when the weights are, whatever the file's layout."""
    import torch
    from safetensors import safe_open

    digest = hashlib.sha256()
    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as weights:
        for name in sorted(weights.keys()):
            tensor = weights.get_tensor(name).contiguous()
            digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


BUILD_RECORD = "rayrep_build.json"

SHIPPED = Path(__file__).parent / "policies"
"""The built policies that ship inside the package, one folder per preset: resolving
`model.path = "tiny"` uses these, so that every machine starts from the same weights (a
build repeats byte for byte on one CPU model only, even with `PORTABLE_KERNELS`)."""


def read_record(policy_dir: Path) -> dict:
    return json.loads((Path(policy_dir) / BUILD_RECORD).read_text())


def shipped_records(root: Path = SHIPPED) -> dict[str, dict]:
    """{folder name: build record} of the policies shipped in `root`."""
    if not root.is_dir():
        return {}
    return {entry.name: read_record(entry) for entry in sorted(root.iterdir()) if (entry / BUILD_RECORD).is_file()}


def tiny_spec(cfg: Config):
    """The tiny policy's build recipe: its size and warm start from `model.tiny_*`, its task
    (levels, seed) from `data`. The run's train and test sizes do not enter: train splits
    are prefixes of one sequence and test problems are never in one (see make_splits)."""
    hidden = cfg.model.tiny_hidden_size
    if hidden % 32:
        raise ConfigError(f"model.tiny_hidden_size: {hidden} must be a multiple of 32 (the head size)")
    return TinyPolicySpec(
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_layers=cfg.model.tiny_layers,
        num_heads=hidden // 32,
        num_kv_heads=max(1, hidden // 64),
        levels=cfg.data.arithmetic_levels,
        num_train=cfg.model.tiny_warm_start_problems,
        task_seed=cfg.data.arithmetic_seed,
        test_reserve=cfg.data.arithmetic_test_reserve,
        warm_start_steps=cfg.model.tiny_warm_start_steps,
        warm_start_slips=cfg.model.tiny_warm_start_slips,
        warm_start_slip_steps=cfg.model.tiny_warm_start_slip_steps,
        tool_calls=cfg.model.tiny_warm_start_tool_calls,
        tool_markup=(cfg.tools.call_start, cfg.tools.call_end) if cfg.model.tiny_warm_start_tool_calls else (),
    )


# The config field behind each field of the recipe that a config sets; the sizes derived from
# the hidden size follow it, and the other fields are fixed.
RECIPE_FIELDS = {
    "hidden_size": "model.tiny_hidden_size", "num_layers": "model.tiny_layers", "levels": "data.arithmetic_levels",
    "num_train": "model.tiny_warm_start_problems", "task_seed": "data.arithmetic_seed",
    "test_reserve": "data.arithmetic_test_reserve", "warm_start_steps": "model.tiny_warm_start_steps",
    "warm_start_slips": "model.tiny_warm_start_slips", "warm_start_slip_steps": "model.tiny_warm_start_slip_steps",
    "tool_calls": "model.tiny_warm_start_tool_calls", "tool_markup": "tools.call_start and tools.call_end",
}
DERIVED = ("intermediate_size", "num_heads", "num_kv_heads")


def shipped_policy(spec, root: Path | None = None) -> Path:
    """The folder of the shipped policy built with `spec`'s recipe; an InputError when its
    files do not hash to its record, or when no shipped policy has that recipe (saying how
    to build one)."""
    root = Path(root or SHIPPED)
    records = shipped_records(root)
    for name, record in records.items():
        if record["cache_key"] == spec.cache_key():
            path = root / name
            found = weights_sha256(path)
            if found != record["weights_sha256"]:
                raise InputError(
                    f"{path}: its weights hash to {found[:16]}, not to the {record['weights_sha256'][:16]} of its "
                    f"build record: the files were changed; reinstall rayrep, or rebuild them with "
                    f"`python -m rayrep.models.tiny build --preset {name} --out {path}`")
            return path
    def listed(fields: dict) -> dict:
        return {key: list(value) if isinstance(value, tuple) else value for key, value in fields.items()}

    wanted, defaults = listed(asdict(spec)), listed(asdict(TinyPolicySpec()))

    def differences(record: dict) -> list[str]:
        built = {**defaults, **record["spec"]}  # (a record from before a field existed: its default)
        found = [f"{RECIPE_FIELDS.get(key, 'the fixed ' + key)} = {built.get(key)!r} there, {value!r} here"
                 for key, value in wanted.items() if built.get(key) != value and key not in DERIVED]
        if record.get("recipe_version") != RECIPE_VERSION:
            found.append(f"build recipe version {record.get('recipe_version')} there, {RECIPE_VERSION} here")
        return found

    if not records:
        raise InputError(f"model.path = 'tiny': no tiny policy is shipped in {root}; reinstall rayrep")
    closest = min(records, key=lambda name: len(differences(records[name])))
    raise InputError(
        f"model.path = 'tiny': no shipped tiny policy has the recipe this config describes; the closest, "
        f"{closest}, differs: {'; '.join(differences(records[closest]))}. Build one with the same config "
        f"arguments (`python -m rayrep.models.tiny build --preset {closest} ... --out DIR`, a few minutes) and "
        f"pass --model.path DIR; to rebuild the shipped one after changing its recipe, "
        f"--out {root / closest}")
