"""LoRA adapters as PEFT writes them: what a LoRA run trains, syncs and saves.

An adapter is a folder in PEFT's own format: `adapter_config.json` (a `peft.LoraConfig`, its
`base_model_name_or_path` naming the base policy) and `adapter_model.safetensors` (tensors
named `base_model.model.<module>.lora_A.weight` / `lora_B.weight`). `peft` loads it
(`PeftModel.from_pretrained`), and so does vLLM (`LoRARequest`), which is how the engines
take each new adapter and how a server serves one. Wherever rayrep takes a policy's path (a
run's checkpoint, an evaluation, a server), an adapter folder stands for its base with the
adapter applied (`base_policy`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rayrep.config import Config, InputError

if TYPE_CHECKING:
    from peft import LoraConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ranks a vLLM 0.32 engine can be sized for (`max_lora_rank`): an adapter of rank r needs
the smallest of them at least r."""

_ADAPTER_NAME = ".default"
"""What PEFT adds to an adapter's parameter names in the model (its adapter's name, "default"),
and leaves out of the files it writes."""


def is_adapter(path: str | Path) -> bool:
    """Whether `path` is a LoRA adapter folder (rather than a whole checkpoint or a hub id)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def base_policy(path: str | Path) -> str:
    """The base policy of `path`: `path` itself, or for an adapter folder the base its
    `adapter_config.json` names (an InputError if it names none)."""
    if not is_adapter(path):
        return str(path)
    config = json.loads((Path(path) / ADAPTER_CONFIG).read_text())
    base = config.get("base_model_name_or_path")
    if not base:
        raise InputError(f"{Path(path) / ADAPTER_CONFIG}: base_model_name_or_path is empty; the adapter does not say "
                         "which policy it adapts")
    return base


def adapter_rank(path: str | Path) -> int:
    """The rank of the adapter at `path` (its `adapter_config.json`'s `r`)."""
    return int(json.loads((Path(path) / ADAPTER_CONFIG).read_text())["r"])


def lora_config(cfg: Config, base: str) -> "LoraConfig":
    """The run's adapter, as PEFT describes it (`learner.lora_*`), for the base policy `base`."""
    from peft import LoraConfig

    learner = cfg.learner
    return LoraConfig(r=learner.lora_rank, lora_alpha=learner.lora_alpha, lora_dropout=learner.lora_dropout,
                      target_modules=list(learner.lora_target_modules), bias="none", task_type="CAUSAL_LM",
                      base_model_name_or_path=str(Path(base).resolve()) if Path(base).exists() else base)


def vllm_max_lora_rank(rank: int) -> int:
    """The engine setting that admits an adapter of `rank`."""
    return next(r for r in VLLM_LORA_RANKS if r >= rank)


def file_key(name: str) -> str:
    """An adapter parameter's name in PEFT's files, from its name in the model PEFT changed
    (`model.layers.0.self_attn.q_proj.lora_A.default.weight` ->
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`)."""
    return "base_model.model." + name.replace(_ADAPTER_NAME + ".", ".")


def write_adapter(folder: str | Path, tensors: dict[str, torch.Tensor], config: "LoraConfig",
                  with_tokenizer: bool = False) -> str:
    """Write an adapter folder (`tensors` by their file keys, `config` by PEFT's own writer),
    and `with_tokenizer` its base's tokenizer beside it (a checkpoint: what reads a policy's
    tokenizer reads it there). Written beside and renamed into place: a reader never sees
    half an adapter, and one there is replaced only by a complete one."""
    from safetensors.torch import save_file

    from rayrep.models.checkpoint import copy_tokenizer, written_whole

    out = Path(folder)
    with written_whole(out) as staging:
        config.save_pretrained(str(staging))
        if with_tokenizer:
            copy_tokenizer(config.base_model_name_or_path, staging)
        save_file({name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}, staging / ADAPTER_WEIGHTS,
                  metadata={"format": "pt"})
    return str(out)


def merge_adapter(adapter: str | Path, out: str | Path, dtype: torch.dtype,
                  config_overrides: dict | None = None) -> str:
    """`adapter` merged into its base (W + alpha/r * B A, by PEFT), written as a whole Hugging
    Face checkpoint in `dtype` at `out`, beside the base's config (with `config_overrides`)
    and tokenizer."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rayrep.models.checkpoint import save_checkpoint

    base = base_policy(adapter)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, **(config_overrides or {}))
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    state = {name: t.to(dtype) for name, t in merged.state_dict().items()
             if not (merged.config.tie_word_embeddings and name == "lm_head.weight")}
    return save_checkpoint(state, base, str(out), config_overrides)
