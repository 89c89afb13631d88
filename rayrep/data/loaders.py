"""Prompt sets from files in the verl / DAPO row format, or in the plain one.

One row per question (DAPO-Math-17k, verl's preprocessed GSM8K and MATH, the RLEP pool)::

    {"data_source": "math_dapo",
     "prompt": [{"role": "user", "content": "..."}],
     "ability": "MATH",
     "reward_model": {"ground_truth": "34", "style": "rule"},
     "extra_info": {"index": "a1b2..."}}

or, as hand-made files usually are, plain (`question` in place of `prompt` too)::

    {"prompt": "What is 6 x 7?", "answer": "42"}

`load_prompts` reads `.jsonl` (one object per line), `.json` (a list of objects) and
`.parquet` files; `save_prompts` writes the same format, so the embedded task can be
exported and any exported set read back.

What becomes of a row:

- `prompt`, a chat list or a plain string (one user message), becomes `Prompt.messages`;
  each message keeps only its `role` and `content`.
  A row without `prompt` takes its question from `question`.
- `reward_model.ground_truth` becomes `Prompt.ground_truth` (integers and floats are
  turned into strings); the other `reward_model` keys (`style`, the RLEP pool's
  `candidates`) are kept in `Prompt.extra["reward_model"]`. A row without `reward_model`
  takes its ground truth from `answer`.
- `data_source` becomes `Prompt.data_source`, the file's stem when the row has none.
- Every other field (`ability`, `extra_info`, ...) goes into `Prompt.extra` untouched,
  except that top-level null fields (and null `reward_model` keys) are dropped: in a
  parquet file they only mean that the row lacks a column other rows have.
- `Prompt.uid` is `extra_info.index` when the row has one, else a hash of data source,
  messages and ground truth, so a question keeps its uid across runs and machines.

A bad row raises `PromptFileError` naming the file, the row (the line, for jsonl) and the
field; nothing is returned from a file with any bad row.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

from rayrep.config import InputError
from rayrep.types import Prompt

ROLES = ("system", "user", "assistant")
SUFFIXES = (".jsonl", ".json", ".parquet")
_SUFFIX_LIST = ", ".join(SUFFIXES)
# Where a row's question and ground truth are, verl / DAPO's field first, the plain one second.
_QUESTION_FIELDS = ("prompt", "question")
_ANSWER_FIELDS = ("reward_model", "answer")
# The fields of a row as `save_prompts` writes it.
_ROW_FIELDS = ("data_source", "prompt", "reward_model")


class PromptFileError(InputError):
    """A prompt file that cannot be read, or a row in it that is not a valid prompt.

    `PromptFileError("text")` works like any ValueError. Given `path` (and `row`, 1-based,
    the line number in a jsonl file, and `field`), the message starts with them:
    `data/train.jsonl, row 7: field 'reward_model.ground_truth' is missing`. They are kept
    as attributes too, None where not given.
    """

    def __init__(self, message: str, *, path=None, row: int | None = None, field: str | None = None):
        self.path = None if path is None else str(path)
        self.row = row
        self.field = field
        if field is not None:
            message = f"field '{field}' {message}"
        if path is not None:
            message = f"{self.path}: {message}" if row is None else f"{self.path}, row {row}: {message}"
        super().__init__(message)


class _RowError(Exception):
    """Raised inside row parsing; the caller adds the file and the row number."""

    def __init__(self, field: str | None, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


# ----------------------------------------------------------------------------- loading


def load_prompts(path: str | Path) -> list[Prompt]:
    """Read every row of a `.jsonl`, `.json` or `.parquet` prompt file, all or nothing."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise PromptFileError(
            f"unknown prompt file extension {path.suffix!r}; expected one of {_SUFFIX_LIST}", path=path
        )
    if not path.exists():
        raise PromptFileError("file not found", path=path)
    if not path.is_file():
        raise PromptFileError("not a file", path=path)

    if suffix == ".jsonl":
        rows = _read_jsonl(path)
    elif suffix == ".json":
        rows = _read_json(path)
    else:
        rows = _read_parquet(path)
    if not rows:
        raise PromptFileError("no rows (empty prompt file)", path=path)

    default_source = path.stem
    prompts: list[Prompt] = []
    first_row_of_uid: dict[str, int] = {}
    for row_number, row in rows:
        try:
            prompt, uid_field = _parse_row(row, default_source)
        except _RowError as err:
            raise PromptFileError(err.message, path=path, row=row_number, field=err.field) from None
        previous = first_row_of_uid.setdefault(prompt.uid, row_number)
        if previous != row_number:
            if uid_field in _QUESTION_FIELDS:
                message = (
                    f"repeats the question of row {previous} (same data_source, prompt and "
                    f"ground_truth, hence the same uid {prompt.uid!r}); rows {previous} and "
                    f"{row_number} are duplicates"
                )
            else:
                message = f"is {prompt.uid!r}, already used by row {previous}; uids must be unique"
            raise PromptFileError(message, path=path, row=row_number, field=uid_field)
        prompts.append(prompt)
    return prompts


def _read_jsonl(path: Path) -> list[tuple[int, object]]:
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for line_number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rows.append((line_number, json.loads(line)))
                except json.JSONDecodeError as err:
                    message = f"invalid JSON ({err.msg}, column {err.colno})"
                    raise PromptFileError(message, path=path, row=line_number) from None
                except (ValueError, RecursionError) as err:  # an integer over the digit limit, deep nesting
                    raise PromptFileError(f"invalid JSON ({err})", path=path, row=line_number) from None
    except UnicodeDecodeError as err:
        message = f"not UTF-8 text ({err.reason} at byte {err.start} of a line)"
        raise PromptFileError(message, path=path) from None
    return rows


def _read_json(path: Path) -> list[tuple[int, object]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise PromptFileError(f"not UTF-8 text ({err.reason} at byte {err.start})", path=path) from None
    except json.JSONDecodeError as err:
        message = f"invalid JSON ({err.msg}, line {err.lineno}, column {err.colno})"
        raise PromptFileError(message, path=path) from None
    except (ValueError, RecursionError) as err:  # an integer over the digit limit, deep nesting
        raise PromptFileError(f"invalid JSON ({err})", path=path) from None
    if not isinstance(data, list):
        message = f"a .json prompt file must hold a list of rows, got {_type_name(data)}"
        raise PromptFileError(message, path=path)
    return list(enumerate(data, start=1))


def _read_parquet(path: Path) -> list[tuple[int, object]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        raise PromptFileError(f"cannot read as parquet ({err})", path=path) from None
    # One conversion for the whole table: per-row scalar conversions are orders of
    # magnitude slower on a 17k-row set.
    try:
        return list(enumerate(table.to_pylist(), start=1))
    except (pa.ArrowException, OverflowError, ValueError) as err:
        # A date, time or duration beyond Python's range (in any column): name the column.
        for name in table.column_names:
            try:
                table.column(name).to_pylist()
            except (pa.ArrowException, OverflowError, ValueError):
                raise PromptFileError(f"holds a value Python cannot represent ({err})", path=path, field=name) from None
        raise PromptFileError(f"cannot convert the rows ({err})", path=path) from None


def _parse_row(row, default_source: str) -> tuple[Prompt, str]:
    """A row as a Prompt, and the field its uid came from (for duplicate errors)."""
    if not isinstance(row, dict):
        raise _RowError(None, f"a row must be an object, got {_type_name(row)}")

    question_field = next((key for key in _QUESTION_FIELDS if key in row), "prompt")
    if question_field not in row:
        raise _RowError("prompt", "is missing (a plain row gives the question as 'question' or 'prompt')")
    messages = _parse_messages(_required(row, question_field), question_field)

    answer_field = next((key for key in _ANSWER_FIELDS if key in row), None)
    if answer_field is None:
        raise _RowError("reward_model", "is missing (a plain row gives the ground truth as 'answer')")
    reward_model = {}
    if answer_field == "answer":
        ground_truth = _parse_ground_truth(_required(row, "answer"), "answer")
    else:
        reward_model = _required(row, "reward_model")
        if not isinstance(reward_model, dict):
            raise _RowError("reward_model", f"must be an object, got {_type_name(reward_model)}")
        ground_truth = _parse_ground_truth(
            _required(reward_model, "ground_truth", "reward_model.ground_truth"), "reward_model.ground_truth"
        )

    data_source = row.get("data_source")
    if data_source is None:
        data_source = default_source
    elif not isinstance(data_source, str) or not data_source.strip():
        raise _RowError("data_source", f"must be a non-empty string, got {data_source!r}")
    else:
        _unicode(data_source, "data_source")

    # A null field is an absent one: parquet has a null wherever a row lacks a column, or
    # a struct lacks a key that other rows have.
    used = ("data_source", question_field, answer_field)
    extra = {key: value for key, value in row.items() if key not in used and value is not None}
    reward_rest = {
        key: value for key, value in reward_model.items() if key != "ground_truth" and value is not None
    }
    if reward_rest:
        extra["reward_model"] = reward_rest

    index = _index(row.get("extra_info"))
    if index is not None:
        uid, uid_field = index, "extra_info.index"
    else:
        uid, uid_field = content_uid(data_source, messages, ground_truth), question_field
    return Prompt(uid, messages, ground_truth, data_source, extra), uid_field


def _required(mapping: dict, key: str, field: str | None = None):
    field = field or key
    if key not in mapping:
        raise _RowError(field, "is missing")
    value = mapping[key]
    if value is None:
        raise _RowError(field, "is null")
    return value


def _parse_messages(prompt, name: str = "prompt") -> tuple[dict, ...]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise _RowError(name, "is empty")
        return ({"role": "user", "content": _unicode(prompt, name)},)
    if not isinstance(prompt, (list, tuple)):
        raise _RowError(name, f"must be a chat list or a string, got {_type_name(prompt)}")
    if not prompt:
        raise _RowError(name, "is empty")
    messages = []
    for i, message in enumerate(prompt):
        field = f"{name}[{i}]"
        if not isinstance(message, dict):
            raise _RowError(field, f"must be a {{role, content}} object, got {_type_name(message)}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise _RowError(f"{field}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise _RowError(f"{field}.content", f"must be a string, got {_type_name(content)}")
        messages.append({"role": role, "content": _unicode(content, f"{field}.content")})
    if not any(m["role"] == "user" and m["content"].strip() for m in messages):
        raise _RowError(name, "has no non-empty user message")
    return tuple(messages)


def _parse_ground_truth(value, field: str) -> str:
    if isinstance(value, bool):  # a bool is an int to Python, but never an answer
        raise _RowError(field, f"must be a string or a number, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise _RowError(field, f"must be a finite number, got {value!r}")
    if isinstance(value, (int, float)):
        return str(value)
    if not isinstance(value, str):
        raise _RowError(field, f"must be a string or a number, got {_type_name(value)}")
    if not value.strip():
        raise _RowError(field, "is empty")
    return _unicode(value, field)


def _index(extra_info) -> str | None:
    """`extra_info.index` as a uid, or None when the row has none."""
    if not isinstance(extra_info, dict):
        return None
    index = extra_info.get("index")
    if index is None:
        return None
    field = "extra_info.index"
    if isinstance(index, bool):
        raise _RowError(field, f"must be a string or an integer, got {index!r}")
    if isinstance(index, float) and index.is_integer():  # an int column that went through NaN
        index = int(index)
    if isinstance(index, int):
        return str(index)
    if not isinstance(index, str):
        raise _RowError(field, f"must be a string or an integer, got {_type_name(index)}")
    if not index.strip():
        raise _RowError(field, "is empty")
    return _unicode(index, field)


def _unicode(text: str, field: str) -> str:
    """`text`, unless it holds a lone surrogate (which JSON's \\ud800 escape gives): no
    tokenizer, hash or file encoding takes one."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise _RowError(field, f"is not valid Unicode (a lone surrogate at character {err.start})") from None
    return text


def content_uid(data_source: str, messages, ground_truth: str) -> str:
    """A stable uid from a question's content: equal content, equal uid, on any machine."""
    payload = json.dumps(
        [data_source, [[m["role"], m["content"]] for m in messages], ground_truth],
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return hashlib.sha1(payload.encode("utf-8")).hexdigest()[:16]


def _type_name(value) -> str:
    return "null" if value is None else type(value).__name__


# ----------------------------------------------------------------------------- saving


def save_prompts(prompts, path: str | Path) -> Path:
    """Write prompts as verl / DAPO rows to a `.jsonl`, `.json` or `.parquet` file.

    The uid is written as `extra_info.index`, so `load_prompts` gives back the same uids,
    messages, ground truths and data sources. `Prompt.extra` becomes the row's other
    fields, `extra["reward_model"]` joining the ground truth in `reward_model`. Returns
    the path, for `load_prompts(save_prompts(prompts, path))`.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ValueError(
            f"{path}: unknown prompt file extension {path.suffix!r}; expected one of {_SUFFIX_LIST}"
        )
    prompts = list(prompts)
    if not prompts:
        raise ValueError(f"{path}: no prompts to save (an empty prompt file cannot be loaded back)")

    rows, seen = [], {}
    for i, prompt in enumerate(prompts):
        if prompt.uid in seen:
            raise ValueError(f"{path}: prompts {seen[prompt.uid]} and {i} share the uid {prompt.uid!r}")
        seen[prompt.uid] = i
        rows.append(_to_row(prompt))

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        if suffix == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            # Columns are the union of all rows' fields (from_pylist would keep only the
            # first row's); a row without a field gets a null there, which loading drops.
            columns: dict[str, list] = {}
            for row in rows:
                for key in row:
                    columns.setdefault(key, [])
            try:
                table = pa.Table.from_pydict({key: [row.get(key) for row in rows] for key in columns})
            except (pa.ArrowException, TypeError) as err:
                raise ValueError(
                    f"{path}: the prompts' extra fields do not fit one parquet schema ({err}); "
                    "save to .jsonl instead"
                ) from err
            pq.write_table(table, tmp)
        else:
            with open(tmp, "w", encoding="utf-8") as f:
                if suffix == ".jsonl":
                    for row in rows:
                        f.write(json.dumps(row, ensure_ascii=False) + "\n")
                else:
                    json.dump(rows, f, ensure_ascii=False, indent=1)
                    f.write("\n")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _to_row(prompt: Prompt) -> dict:
    extra = dict(prompt.extra)
    reward_rest = extra.pop("reward_model", None) or {}
    extra_info = extra.pop("extra_info", None)
    if not isinstance(reward_rest, dict):
        raise ValueError(
            f"prompt {prompt.uid!r}: extra['reward_model'] must be a dict, got {_type_name(reward_rest)}"
        )
    if extra_info is None:
        extra_info = {}
    elif not isinstance(extra_info, dict):
        raise ValueError(
            f"prompt {prompt.uid!r}: extra['extra_info'] must be a dict, got {_type_name(extra_info)}"
        )
    row = {
        "data_source": prompt.data_source,
        "prompt": [{"role": m["role"], "content": m["content"]} for m in prompt.messages],
    }
    row.update((key, value) for key, value in extra.items() if key not in _ROW_FIELDS)
    row["reward_model"] = {
        "ground_truth": prompt.ground_truth,
        **{key: value for key, value in reward_rest.items() if key != "ground_truth"},
    }
    row["extra_info"] = {**extra_info, "index": prompt.uid}
    return row
