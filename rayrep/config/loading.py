"""Where a Config comes from: a named preset (`rayrep/presets/<name>.toml`, shipped with
the package; `tiny-cpu` by default), optionally user TOML files, and command-line overrides
of any field (`--learner.lr 1e-6`); a stopped run's saved config.json when it resumes."""

from __future__ import annotations

import importlib.resources
import json
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rayrep.config.fields import build, get_dotted, leaf_fields, merge, parse_text, set_dotted
from rayrep.config.schema import Config
from rayrep.errors import ConfigError

DEFAULT_PRESET = "tiny-cpu"


def from_dict(data: dict) -> Config:
    """A validated Config from plain data (a parsed TOML file, a run's config.json)."""
    return build(data, Config)


def config_fields() -> Iterator[tuple[str, Any, Any]]:
    """(dotted name, type, dataclass field) for every leaf field of the Config, in order."""
    return leaf_fields(Config)


def preset_names() -> list[str]:
    """The presets shipped with the package."""
    folder = importlib.resources.files("rayrep.presets")
    return sorted(entry.name.removesuffix(".toml") for entry in folder.iterdir() if entry.name.endswith(".toml"))


def _preset_text(name: str) -> tuple[str, str]:
    """(where it came from, TOML text) of a named preset, or of a TOML file given by path."""
    if name.endswith(".toml") or "/" in name or "\\" in name:
        return _config_file_text(name)
    entry = importlib.resources.files("rayrep.presets").joinpath(f"{name}.toml")
    if not entry.is_file():
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(preset_names())}")
    return f"preset {name}", entry.read_text(encoding="utf-8")


def _config_file_text(path: str) -> tuple[str, str]:
    """(path, TOML text) of a user config file, or an error that says what is wrong with it."""
    file = Path(path)
    if file.suffix != ".toml":
        raise ConfigError(f"config file {path}: not a TOML file (a config file ends in .toml)")
    if not file.exists():
        raise ConfigError(f"config file {path} does not exist")
    if not file.is_file():
        raise ConfigError(f"config file {path} is not a file")
    try:
        return path, file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {path}: cannot be read ({err})") from None


def _parse_toml(origin: str, text: str) -> dict:
    try:
        return tomllib.loads(text)
    # Besides TOMLDecodeError (a ValueError): a plain ValueError for an integer over Python's
    # digit limit, RecursionError for arrays nested thousands deep.
    except (ValueError, RecursionError) as err:
        raise ConfigError(f"{origin}: {err}") from None



def load_preset(name: str = DEFAULT_PRESET) -> Config:
    """A named preset (or a TOML file given by path) as a validated Config."""
    return from_dict(_parse_toml(*_preset_text(name)))


def help_text(cfg: Config | None = None, origin: str = "") -> str:
    """Every field with its type, value and doc: the values of `cfg` (from `origin`, a preset
    or a run's config), else the schema's defaults."""
    values = cfg.to_dict() if cfg is not None else None
    lines = [f"config fields, as {origin} sets them (override with --<field> VALUE):" if origin
             else "config fields (override with --<field> VALUE):"]
    for name, kind, f in config_fields():
        type_name = getattr(kind, "__name__", None) or str(kind).replace("typing.", "")
        value = f.default if values is None else get_dotted(values, name)
        value = tuple(value) if isinstance(value, list) else value
        lines.append(f"  --{name} ({type_name}, default {value!r}): {f.metadata.get('doc', '')}")
    return "\n".join(lines)


def parse_cli(argv: list[str], base: dict | None = None) -> Config:
    """Build a Config from `--preset NAME`, `--config FILE.toml` and `--section.field VALUE` args.

    Later sources override earlier ones: preset < config file < field overrides. `base`: a
    saved config (a run's config.json) in place of the preset.
    """
    preset, user = cli_sources(argv)
    if base is not None and preset != DEFAULT_PRESET:
        raise ConfigError("--preset does not apply when resuming: the run's own config.json is the base")
    return from_dict(merge(base if base is not None else _parse_toml(*_preset_text(preset)), user))


def cli_sources(argv: list[str]) -> tuple[str, dict]:
    """(the preset named, what the user sets on top of it: the `--config` files merged in
    order, then the `--section.field` overrides, as a nested dict)."""
    preset, user = DEFAULT_PRESET, {}
    kinds = {name: kind for name, kind, _ in config_fields()}
    args = list(argv)
    overrides = []
    while args:
        arg = args.pop(0)
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --learner.lr 1e-6")
        key, has_value, value = arg[2:].partition("=")
        if not has_value:
            if not args:
                raise ConfigError(f"{arg} needs a value")
            value = args.pop(0)
        if key == "preset":
            preset = value
        elif key == "config":
            user = merge(user, _parse_toml(*_config_file_text(value)))
        elif key in kinds:
            overrides.append((key, value))
        else:
            close = [k for k in kinds if k.endswith("." + key.rpartition(".")[2])]
            hint = f"; did you mean {', '.join('--' + k for k in close)}?" if close else ""
            raise ConfigError(f"unknown config field --{key}{hint}")
    for key, text in overrides:
        set_dotted(user, key, parse_text(text, kinds[key], key))
    return preset, user


def differing_fields(
    theirs: dict, ours: dict, keep: Callable[[str], bool] = lambda name: True
) -> list[tuple[str, Any, Any]]:
    """`(section.field, their value, our value)` for every field where two configs as
    `Config.to_json` writes them (a run's `config.json`) differ, by name; only the names
    `keep` accepts. A field one of them lacks counts as None, or as its default where it
    was added with the behaviour before it as its default (`option(added=True)`)."""
    added = {name: json.loads(json.dumps(f.default)) for name, _, f in config_fields() if f.metadata.get("added")}

    def flat(data: dict, prefix: str = "") -> dict:
        fields = {}
        for key, value in data.items():
            if isinstance(value, dict):
                fields.update(flat(value, f"{prefix}{key}."))
            elif keep(f"{prefix}{key}"):
                fields[f"{prefix}{key}"] = value
        return fields

    a, b = flat(theirs), flat(ours)
    for fields in (a, b):
        for name, default in added.items():
            if keep(name):
                fields.setdefault(name, default)
    return [(name, a.get(name), b.get(name)) for name in sorted(set(a) | set(b)) if a.get(name) != b.get(name)]

