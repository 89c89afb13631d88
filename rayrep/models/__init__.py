"""The policy: the embedded tiny model, or any Hugging Face checkpoint."""

from __future__ import annotations

from pathlib import Path

from rayrep.config import Config, ConfigError, InputError


def tiny_spec(cfg: Config):
    """The tiny policy's build recipe: its size and warm start from `model.tiny_*`, its task
    (levels, seed) from `data`. The run's train and test sizes do not enter: train splits
    are prefixes of one sequence and test problems are never in one (see make_splits)."""
    from rayrep.models.tiny import TinyPolicySpec

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
    )


# The config field behind each field of the recipe that a config sets; the sizes derived from
# the hidden size follow it, and the other fields are fixed.
RECIPE_FIELDS = {
    "hidden_size": "model.tiny_hidden_size", "num_layers": "model.tiny_layers", "levels": "data.arithmetic_levels",
    "num_train": "model.tiny_warm_start_problems", "task_seed": "data.arithmetic_seed",
    "test_reserve": "data.arithmetic_test_reserve", "warm_start_steps": "model.tiny_warm_start_steps",
    "warm_start_slips": "model.tiny_warm_start_slips", "warm_start_slip_steps": "model.tiny_warm_start_slip_steps",
}
DERIVED = ("intermediate_size", "num_heads", "num_kv_heads")


def resolve_policy(cfg: Config, log=print) -> str:
    """Path (or hub id) of the base policy: for `model.path = "tiny"`, the shipped policy
    built with the recipe the config describes, its weights checked against its record."""
    if cfg.model.path != "tiny":
        return cfg.model.path
    from rayrep.models.tiny import read_record

    path = shipped_policy(tiny_spec(cfg))
    record = read_record(path)
    # Figures are comparable only between runs of the same base weights: say which.
    log(f"policy: the embedded tiny policy {path.name}, weights sha256 {record['weights_sha256'][:16]} "
        f"(shipped; built with torch {record['torch']} on {record['machine']})")
    return str(path)


def shipped_policy(spec, root: Path | None = None) -> Path:
    """The folder of the shipped policy built with `spec`'s recipe; an InputError when its
    files do not hash to its record, or when no shipped policy has that recipe (saying how
    to build one)."""
    from dataclasses import asdict

    from rayrep.models.tiny import RECIPE_VERSION, SHIPPED, shipped_records, weights_sha256

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
    wanted = {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(spec).items()}

    def differences(record: dict) -> list[str]:
        found = [f"{RECIPE_FIELDS.get(key, 'the fixed ' + key)} = {record['spec'].get(key)!r} there, {value!r} here"
                 for key, value in wanted.items() if record["spec"].get(key) != value and key not in DERIVED]
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


def config_overrides(cfg: Config, model_path: str) -> dict:
    """Changes to the checkpoint's model config that `model.*` asks for, in the form both
    transformers (`from_pretrained(**overrides)`) and vLLM (`hf_overrides`) apply: the
    same dict on the learners and the generators, and in every saved checkpoint."""
    overrides: dict = {}
    if cfg.model.max_position_embeddings:
        overrides["max_position_embeddings"] = cfg.model.max_position_embeddings
    if cfg.model.rope_theta:
        base = read_model_config(model_path)
        rope = getattr(base, "rope_parameters", None)
        if isinstance(rope, dict):  # transformers 5 keeps the base inside rope_parameters
            overrides["rope_parameters"] = {**rope, "rope_theta": cfg.model.rope_theta}
        else:
            overrides["rope_theta"] = cfg.model.rope_theta
    return overrides


def read_model_config(model_path: str, local_only: bool = False):
    """The checkpoint's model config (`config.json`), or an InputError naming the path. A hub
    id is read from the local cache, or (not `local_only`) fetched from the hub."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_path, local_files_only=local_only)
    except (OSError, ValueError) as err:
        raise InputError(f"model {model_path}: cannot read its config.json ({err})") from None


def check_context(cfg: Config, model_path: str) -> int:
    """Refuse, before any actor starts, a prompt + response length above the positions the
    policy has (its config.json, or `model.max_position_embeddings`); returns the positions."""
    positions = cfg.model.max_position_embeddings or getattr(read_model_config(model_path), "max_position_embeddings", 0)
    wanted = cfg.data.max_prompt_tokens + cfg.generator.max_response_tokens
    if positions and wanted > positions:
        raise InputError(
            f"data.max_prompt_tokens ({cfg.data.max_prompt_tokens}) + generator.max_response_tokens "
            f"({cfg.generator.max_response_tokens}) = {wanted} exceeds the {positions} positions of {model_path}; "
            f"extend them with model.max_position_embeddings (and model.rope_theta), as the ExGRPO preset does"
        )
    return positions
