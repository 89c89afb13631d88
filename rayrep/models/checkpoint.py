"""Hugging Face checkpoint directories written by the learner."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

# Everything of the base checkpoint except its weights travels with a trained one; its
# tokenizer travels with a trained adapter too (`rayrep.models.adapter`).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt")
_COPIED = ("config.json", "generation_config.json", *TOKENIZER_FILES)


def copy_tokenizer(base_model_path: str, out: Path) -> None:
    """The base's tokenizer files into `out` (a folder or a hub id's, from the local cache)."""
    base = Path(base_model_path)
    if not base.is_dir():
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(base_model_path).save_pretrained(out)
        return
    for name in TOKENIZER_FILES:
        if (base / name).exists():
            shutil.copy2(base / name, out / name)


@contextmanager
def written_whole(out: Path) -> Iterator[Path]:
    """A folder to fill in place of `out`: a temporary folder beside it, renamed into place
    once the block ends without error (removed otherwise). A reader never sees half of it,
    and a folder at `out` is replaced only by a complete one."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        yield staging
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def save_checkpoint(state: dict[str, torch.Tensor], base_model_path: str, out_path: str,
                    config_overrides: dict | None = None) -> str:
    """Write `state` as `out_path`/model.safetensors beside the base's config and tokenizer,
    the config with `config_overrides` applied (the model the weights were trained as).

    The base is a checkpoint folder or a hub id (read from the local cache). Written to a
    temporary folder and renamed into place: a reader never sees half a checkpoint, and an
    existing one is replaced only by a complete one.
    """
    from safetensors.torch import save_file

    out = Path(out_path)
    with written_whole(out) as staging:
        base = Path(base_model_path)
        if base.is_dir():
            for name in _COPIED:
                if (base / name).exists():
                    shutil.copy2(base / name, staging / name)
        else:
            from transformers import AutoConfig, AutoTokenizer

            AutoConfig.from_pretrained(base_model_path).save_pretrained(staging)
            AutoTokenizer.from_pretrained(base_model_path).save_pretrained(staging)
        if config_overrides:
            config = json.loads((staging / "config.json").read_text())
            config.update(config_overrides)
            (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file({k: v.contiguous() for k, v in state.items()}, staging / "model.safetensors", metadata={"format": "pt"})
    return str(out)
