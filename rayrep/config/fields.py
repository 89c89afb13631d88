"""Typed config fields, independent of any one schema: declaring a field (`option`),
building a dataclass tree from plain data (`build`), checking each value against its
annotated type and range (`check_fields`), and reading or writing a field by its dotted name."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Iterator
from dataclasses import field
from typing import Any, Literal

from rayrep.errors import ConfigError


def option(default: Any, doc: str, *, min: float | None = None, max: float | None = None, added: bool = False):
    """A config field with its one-line doc and an optional inclusive numeric range.
    `added`: a field added after runs were recorded whose default does what those runs did,
    so that a recorded config without it counts as having its default (`differing_fields`)."""
    return field(default=default, metadata={"doc": doc, "min": min, "max": max, "added": added})

def build(data: dict, cls: type, prefix: str = "") -> Any:
    """Build a (nested) config dataclass `cls` from plain data, checking names and types."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a table of fields, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(
            f"unknown config field {prefix}{unknown[0]!s}; fields of {prefix.rstrip('.') or 'the config'}: "
            f"{', '.join(sorted(known))}"
        )
    values = {}
    for name, value in data.items():
        kind = hints[name]
        if dataclasses.is_dataclass(kind):
            values[name] = build(value, kind, f"{prefix}{name}.")
        else:
            values[name] = coerce(value, kind, f"{prefix}{name}")
    return cls(**values)


def coerce(value: Any, kind: Any, name: str) -> Any:
    """Check `value` against the annotated type; accept lossless conversions only."""
    origin = typing.get_origin(kind)
    if origin is Literal:
        choices = typing.get_args(kind)
        if value not in choices:
            raise ConfigError(f"{name}: {value!r} is not one of {', '.join(map(repr, choices))}")
        return value
    if origin is tuple:
        (item,) = {a for a in typing.get_args(kind) if a is not Ellipsis}
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name}: expected a list, got {value!r}")
        return tuple(coerce(v, item, f"{name}[{i}]") for i, v in enumerate(value))
    if origin in (types.UnionType, typing.Union):
        raise TypeError(f"{name}: union types are not supported in configs")
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            # NaN passes every range check and no knob means anything at infinity (TOML and
            # float() both read "nan" and "inf"); an int beyond float's range is infinite too.
            try:
                number = float(value)
            except OverflowError:
                number = math.inf
            if not math.isfinite(number):
                raise ConfigError(f"{name}: expected a finite number, got {number!r}")
            return number
        raise ConfigError(f"{name}: expected a number, got {value!r}")
    if kind is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{name}: expected a string, got {value!r}")
    raise TypeError(f"{name}: unsupported config type {kind}")


def parse_text(text: str, kind: Any, name: str) -> Any:
    """Turn a command-line string into a value of the field's type."""
    if kind is bool:
        lowered = text.lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{name}: expected true or false, got {text!r}")
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{name}: expected an integer, got {text!r}") from None
    if kind is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{name}: expected a number, got {text!r}") from None
    return text  # strings, Literal choices and comma-separated tuples are checked by _coerce


def leaf_fields(cls: type, prefix: str = "") -> Iterator[tuple[str, Any, dataclasses.Field]]:
    """(dotted name, type, dataclass field) for every leaf field of `cls`, in declaration order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            yield from leaf_fields(kind, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", kind, f


def check_fields(obj: Any) -> None:
    """Every leaf field of the dataclass tree `obj` against its annotated type, then its range."""
    for name, kind, _ in leaf_fields(type(obj)):
        coerce(get_dotted(obj, name), kind, name)
    _check_ranges(obj)


def _check_ranges(obj: Any, prefix: str = "") -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_ranges(value, name + ".")
            continue
        low, high = f.metadata.get("min"), f.metadata.get("max")
        if low is not None and value < low:
            raise ConfigError(f"{name}: {value!r} is below the minimum {low}")
        if high is not None and value > high:
            raise ConfigError(f"{name}: {value!r} is above the maximum {high}")


def get_dotted(data: Any, dotted: str) -> Any:
    """The value at `dotted` ("learner.lr") in nested dicts or dataclasses."""
    for part in dotted.split("."):
        data = data[part] if isinstance(data, dict) else getattr(data, part)
    return data


def set_dotted(data: dict, dotted: str, value: Any) -> None:
    *sections, leaf = dotted.split(".")
    for section in sections:
        data = data.setdefault(section, {})
        if not isinstance(data, dict):
            raise ConfigError(f"unknown config field {dotted}")
    data[leaf] = value


def merge(base: dict, update: dict) -> dict:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged

