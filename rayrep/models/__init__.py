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


def resolve_policy(cfg: Config, log=print) -> str:
    """Path (or hub id) of the base policy; builds the tiny policy on first use."""
    if cfg.model.path != "tiny":
        return cfg.model.path
    from rayrep.models.tiny import build_info, ensure_tiny_policy

    cache = Path(cfg.model.cache_dir) if cfg.model.cache_dir else None
    path = ensure_tiny_policy(tiny_spec(cfg), cache, log=log)
    # Figures are comparable only between runs of the same base weights: say which.
    info = build_info(path)
    built_with = f"torch {info['torch']}, {info['cpu_capability']} kernels" if "torch" in info else "an earlier recipe"
    log(f"policy: the embedded tiny policy {path.name}, weights sha256 {info['weights_sha256'][:16]} ({built_with})")
    if info.get("cpu_capability") not in (None, "AVX2"):
        log(f"note: this CPU built the tiny policy with {info['cpu_capability']} kernels, not AVX2: its weights differ "
            f"from those AVX2 machines build, and so do the figures of its runs")
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
