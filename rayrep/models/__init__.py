"""The policy: the embedded tiny model, or any Hugging Face checkpoint."""

from __future__ import annotations

from rayrep.config import Config, InputError
from rayrep.models.adapter import base_policy
from rayrep.models.recipe import read_record, shipped_policy, tiny_spec


def resolve_policy(cfg: Config, log=print) -> str:
    """Path (or hub id) of the base policy: for `model.path = "tiny"`, the shipped policy
    built with the recipe the config describes, its weights checked against its record."""
    if cfg.model.path != "tiny":
        return cfg.model.path
    path = shipped_policy(tiny_spec(cfg))
    record = read_record(path)
    # Figures are comparable only between runs of the same base weights: say which.
    log(f"policy: the embedded tiny policy {path.name}, weights sha256 {record['weights_sha256'][:16]} "
        f"(shipped; built with torch {record['torch']} on {record['machine']})")
    return str(path)


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
    """The checkpoint's model config (`config.json`; an adapter's: its base's), or an
    InputError naming the path. A hub id is read from the local cache, or (not `local_only`)
    fetched from the hub."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(base_policy(model_path), local_files_only=local_only)
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
