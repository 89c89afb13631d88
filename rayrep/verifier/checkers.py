"""Checkers: what scores a completion, chosen for each row by its `data_source`.

A checker is one of the built-ins or a user's function:

- `math`: math-verify on the final answer (`rayrep.verifier.math`), the default.
- `exact`: the final answer equals the ground truth once both are normalised (case,
  whitespace, punctuation at the ends). The final answer is read from the last
  ``\\boxed{...}``, else from the last line that says "answer: X" or "answer is X", else the
  last non-empty line; the verdict's `answer` and `detail` say what was read and from where.
- `choice`: a multiple-choice answer: the ground truth is an option's letter ("B") or its
  text; the completion's final answer (read as `exact` reads it) is a letter, "(B)", "B.",
  or an option's text, matched against the row's options (`extra_info["choices"]` or
  `extra_info["options"]`, a list, lettered A, B, ...).
- A user's function, named `path/to/file.py:function` or `package.module:function`:
  ``function(completion: str, ground_truth: str, row: dict) -> float | bool | dict``. `row`
  holds the row's `data_source`, `prompt` (its chat messages), `ground_truth` and `extra_info`.
  A number is the score; a bool is the verdict (score 1 or 0); a dict holds `score` (a
  number), optionally `correct` (a bool) and other named numbers (components, logged as
  such). Without `correct`, an answer is a success when its score reaches
  `verifier.success_threshold`.

Every checker runs in the verifier's sandbox child (`rayrep.verifier.sandbox`), under its
time and memory limits: a user's function that raises, hangs or returns something else
costs its completion a counted status (`error`, `timeout`, `bad_value`), never the run.
This module is pure Python: the child imports it, and so does the driver, to route rows
and check a user's function before any actor starts.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from rayrep.config.schema import CHECKERS as BUILTIN
from rayrep.config.schema import VerifierConfig
from rayrep.errors import InputError
from rayrep.verifier.final_answer import MAX_ANSWER_CHARS, last_boxed_content

__all__ = ["BUILTIN", "CheckerError", "Plugin", "Routing", "choice", "exact", "final_answer", "format_values",
           "normalise", "plugin", "score_value"]


class CheckerError(InputError):
    """A user's checker that cannot be used (its file, its import, its first call)."""


@dataclass(frozen=True)
class Plugin:
    """A user's checker function: where it is and, for a file, its source (which travels to
    the sandbox children on any node, so the file need exist only where the job starts)."""

    spec: str
    """As the user named it: ``path.py:function`` or ``module:function``."""
    function: str
    path: str | None = None
    """The file's absolute path, for a file; its source is `source`."""
    module: str | None = None
    """The module to import, for a module."""
    source: str | None = None
    takes: tuple[str, ...] = ("completion", "ground_truth", "row")
    """What it is called with: a checker's arguments, or a tool's (`TOOL_ARGUMENTS`)."""

    @property
    def role(self) -> str:
        return "tool" if self.takes == TOOL_ARGUMENTS else "checker"


TOOL_ARGUMENTS = ("call",)
"""A user's tool function takes the call's text and returns its output's (`rayrep.verifier.tools`)."""


def plugin(spec: str, takes: tuple[str, ...] = Plugin.takes) -> Plugin:
    """The user's checker (or tool, `takes=TOOL_ARGUMENTS`) that `spec` names (a name
    `checker_name` accepted), its file read (CheckerError: a missing or unreadable file)."""
    role = "tool" if takes == TOOL_ARGUMENTS else "checker"
    where, _, function = spec.rpartition(":")
    if not (where.endswith(".py") or "/" in where):
        return Plugin(spec, function, module=where, takes=takes)
    path = Path(where).expanduser().resolve()
    if not path.is_file():
        raise CheckerError(f"{role} {spec!r}: no such file {str(path)!r}")
    try:
        source = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckerError(f"{role} {spec!r}: cannot read {str(path)!r}: {err}") from None
    return Plugin(spec, function, path=str(path), source=source, takes=takes)


@dataclass(frozen=True)
class Routing:
    """Which checker scores each row: `by_source[data_source]`, else `default`."""

    default: str = "math"
    by_source: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, verifier: VerifierConfig) -> "Routing":
        """`verifier.reward` and `verifier.by_source`."""
        return cls(verifier.reward, tuple(verifier.routes.items()))

    def checker(self, data_source: str) -> str:
        return dict(self.by_source).get(data_source, self.default)

    def plugins(self) -> tuple[Plugin, ...]:
        """The user's checkers named, each once, their files read."""
        named = dict.fromkeys([self.default, *(checker for _, checker in self.by_source)])
        return tuple(plugin(checker) for checker in named if checker not in BUILTIN)


# ---------------------------------------------------------------- the built-in text checkers

_ANSWER_LINE = re.compile(r"answer\s*(?:is|:)\s*(.+)$", re.IGNORECASE)
_END_PUNCTUATION = " \t\n\r.,;:!?\"'`*"
_SPACE = re.compile(r"\s+")


def final_answer(completion: str) -> tuple[str | None, str]:
    """(the final answer of `completion`, where it was read: "boxed", "answer line" or "last
    line"), or (None, why there is none)."""
    boxed = last_boxed_content(completion, MAX_ANSWER_CHARS)
    if boxed is not None:
        return boxed, "boxed"
    lines = [line.strip() for line in completion[-4 * MAX_ANSWER_CHARS:].splitlines() if line.strip()]
    for line in reversed(lines):
        found = _ANSWER_LINE.search(line[-MAX_ANSWER_CHARS:])
        if found and found.group(1).strip(_END_PUNCTUATION):
            return found.group(1), "answer line"
    if not lines:
        return None, "empty completion"
    return lines[-1][-MAX_ANSWER_CHARS:], "last line"


def normalise(text: str) -> str:
    """Case folded, runs of whitespace as one space, punctuation and quotes at the ends gone."""
    return _SPACE.sub(" ", text.casefold()).strip(_END_PUNCTUATION)


def exact(completion: str, ground_truth: str, row: dict) -> tuple[bool, str | None, str]:
    """(correct, the answer read, where from): `exact` (see the module's docstring)."""
    answer, where = final_answer(completion)
    if answer is None:
        return False, None, where
    return normalise(answer) == normalise(ground_truth), answer, where


_LETTER = re.compile(r"^\(?([A-Za-z])[).:]?$")


def _options(row: dict) -> list[str]:
    extra = row.get("extra_info") or {}
    options = extra.get("choices", extra.get("options")) if isinstance(extra, dict) else None
    return [str(o) for o in options] if isinstance(options, (list, tuple)) else []


def _as_letter(text: str, options: list[str]) -> str | None:
    """The option letter `text` names: a letter ("b", "(B)", "B.") or an option's text."""
    text = normalise(text)
    letter = _LETTER.match(text.upper())
    if letter and (not options or ord(letter.group(1).upper()) - ord("A") < len(options)):
        return letter.group(1).upper()
    for index, option in enumerate(options):
        if normalise(option) == text:
            return chr(ord("A") + index)
    return None


def choice(completion: str, ground_truth: str, row: dict) -> tuple[bool, str | None, str]:
    """(correct, the option letter read (else the answer as read), where from): `choice`
    (see the module's docstring)."""
    options = _options(row)
    truth = _as_letter(ground_truth, options)
    if truth is None:
        raise ValueError(f"the ground truth {ground_truth!r} is neither an option letter nor an option's text")
    answer, where = final_answer(completion)
    if answer is None:
        return False, None, where
    letter = _as_letter(answer, options)
    return letter == truth, letter or answer, where


_THINK = re.compile(r"\s*<think>.*?</think>\s*\S", re.DOTALL)


def format_values(completion: str, terms: tuple[tuple[str, float], ...]) -> list[tuple[str, float]]:
    """Each format term's value for `completion`, 1 or 0, in the order of `terms`, named as
    logged (`format_<term>`): `think`, a ``<think>...</think>`` block first and an answer
    after it; `boxed`, a ``\\boxed{}`` answer that closes; `chars:MIN-MAX`, a length in
    characters within the band."""
    values = []
    for term, _ in terms:
        if term == "think":
            value = _THINK.match(completion) is not None
        elif term == "boxed":
            value = last_boxed_content(completion, MAX_ANSWER_CHARS) is not None
        else:
            low, high = map(int, term.removeprefix("chars:").split("-"))
            value, term = low <= len(completion) <= high, "chars"
        values.append((f"format_{term}", float(value)))
    return values


def score_value(value) -> tuple[bool | None, float, tuple[tuple[str, float], ...]]:
    """A user's checker's return value as (correct or None, score, components); ValueError
    naming what is wrong with it."""
    if isinstance(value, bool):
        return value, float(value), ()
    if isinstance(value, (int, float)):
        return None, _finite(value, "the score"), ()
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"a dict without 'score' (keys {sorted(map(str, value))[:5]})")
        correct = value.get("correct")
        if correct is not None and not isinstance(correct, bool):
            raise ValueError(f"'correct' must be a bool, got {type(correct).__name__}")
        components = []
        for name, part in value.items():
            if name in ("score", "correct"):
                continue
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"component name {name!r} is not an identifier")
            components.append((name, _finite(part, f"component {name!r}")))
        return correct, _finite(value["score"], "'score'"), tuple(components)
    raise ValueError(f"returned {type(value).__name__}, not a number, bool or dict")


def _finite(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} is {type(value).__name__}, not a number")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{what} is {value}")
    return value
