"""Bad input, generated: every reader of user-handed files and the verifier's entry points.

Property-based (hypothesis). For prompt files (jsonl / json / parquet), experience pools,
buffer snapshots, config files and command lines, any input either gives a valid result or
raises the project's `InputError` subclass for it (`PromptFileError`, `BufferFileError`,
`ConfigError`), whose message names the file (and the row and field where there is one):
never another exception type, which `rayrep.config.run_job` would show as a traceback.
The verifier takes any model output and returns a verdict within its hard time limit.

Examples are derandomized (the same ones on every run, no example database). Besides one
valid input per reader, the `@example`s are inputs that escaped as another exception type
(KeyError, TypeError, ValueError, RecursionError, UnicodeEncodeError, ArrowNotImplementedError)
or gave a NaN setting, before the readers were fixed.
"""

from __future__ import annotations

import datetime
import decimal
import json
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rayrep.buffer.files import (
    ANSWER_SCHEMA,
    POOL_SCHEMA,
    POOL_VERSION,
    QUESTION_SCHEMA,
    SNAPSHOT_VERSION,
    BufferFileError,
    check_pool_file,
    read_pool,
    read_snapshot,
)
from rayrep.buffer.answers import SOURCES, VERDICTS
from rayrep.config import Config, ConfigError, config_fields, from_dict, parse_cli
from rayrep.data.loaders import ROLES, PromptFileError, load_prompts
from rayrep.verifier import math as vm
from rayrep.verifier.final_answer import MAX_ANSWER_CHARS, TAIL_CHARS, Verdict, completion_item, last_boxed_content

pytestmark = pytest.mark.timeout(180)


def fast(max_examples: int, deadline_s: float = 20.0):
    """Hypothesis settings of this file: fixed examples, no database, a generous per-example
    deadline (a hang, not a slow CI machine, is what it is there for)."""
    return settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=datetime.timedelta(seconds=deadline_s),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# ----------------------------------------------------------------------------- strategies

# Any code point, lone surrogates included: json.loads turns "\ud800" into one.
any_char = st.characters(exclude_categories=())
utf8_char = st.characters(codec="utf-8")
"""What a UTF-8 file (a TOML file, an Arrow string) can hold: no lone surrogates."""
short_text = st.text(any_char, max_size=12)
huge_text = st.builds(lambda c, n: c * n, st.sampled_from(["7", " ", "é", "{", "\\", "\n"]), st.integers(5_000, 200_000))
text = st.one_of(short_text, st.sampled_from(["", " ", "13", "What is 6+7?", "\\boxed{1}", "\x00", "\ud800"]), huge_text)
json_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-2**70, 2**70), st.floats(), short_text,
    st.sampled_from(["user", "system", "assistant", "13"]),
)
json_value = st.recursive(
    json_scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(short_text, inner, max_size=3),
    max_leaves=8,
)
def mostly(valid: st.SearchStrategy, anything: st.SearchStrategy) -> st.SearchStrategy:
    """A value that is right three times in four, so that rows get past their first field
    (two coin flips: one_of's choice of a branch leans towards the first and the last)."""
    return st.tuples(st.booleans(), st.booleans()).flatmap(lambda flips: anything if all(flips) else valid)


# Short, non-empty, any code point (a lone surrogate included), or a few real values.
some_text = st.one_of(st.text(any_char, min_size=1, max_size=12).filter(str.strip),
                      st.sampled_from(["13", "What is 6+7?", "\\frac{1}{2}", "q\ud800"]))
message = mostly(st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": text}),
                 st.fixed_dictionaries({}, optional={"role": json_value, "content": st.one_of(text, json_value)}))
chat = st.tuples(st.lists(message, max_size=2), some_text).map(lambda t: [*t[0], {"role": "user", "content": t[1]}])
ground_truth = mostly(st.one_of(some_text, st.integers(), st.floats(allow_nan=False, allow_infinity=False)),
                      st.one_of(text, st.floats(), st.booleans(), json_value))
index = mostly(st.one_of(some_text, st.integers(), st.sampled_from(["1", "2"])),  # "1", "2": repeated uids
               st.one_of(text, st.floats(), st.booleans(), json_value))
prompt_row = st.fixed_dictionaries(
    {
        "prompt": mostly(st.one_of(chat, some_text), st.one_of(st.lists(message | json_value, max_size=3), text,
                                                               json_value)),
        "reward_model": mostly(
            st.fixed_dictionaries({"ground_truth": ground_truth},
                                  optional={"style": json_value, "candidates": st.lists(text, max_size=2) | json_value}),
            st.one_of(st.fixed_dictionaries({}, optional={"ground_truth": ground_truth}), json_value)),
    },
    optional={
        "data_source": mostly(some_text, st.one_of(text, json_value)),
        "extra_info": mostly(st.fixed_dictionaries({}, optional={"index": index}), json_value),
        "ability": json_value,
    },
)
# DAPO rows (each field mostly right), sometimes one with fields missing, sometimes any JSON at all.
prompt_rows = st.lists(
    mostly(prompt_row, st.one_of(prompt_row.map(lambda row: dict(list(row.items())[1:])), json_value)), max_size=5
)


def check_prompts(prompts) -> None:
    """What every caller of load_prompts relies on."""
    assert prompts, "an empty list is never returned"
    uids = [p.uid for p in prompts]
    assert len(set(uids)) == len(uids)
    for p in prompts:
        for value in (p.uid, p.ground_truth, p.data_source):
            assert isinstance(value, str) and value.strip()
            value.encode("utf-8")  # usable text: a tokenizer and a parquet writer take it
        assert isinstance(p.messages, tuple) and p.messages
        for m in p.messages:
            assert set(m) == {"role", "content"} and m["role"] in ROLES and isinstance(m["content"], str)
            m["content"].encode("utf-8")
        assert any(m["role"] == "user" and m["content"].strip() for m in p.messages)


def check_prompt_error(err: PromptFileError, path: Path, rows: int | None) -> None:
    message = str(err)
    assert err.path == str(path) and message.startswith(str(path)), message
    if err.row is not None:
        assert f"row {err.row}:" in message, message
        if rows is not None:
            assert 1 <= err.row <= rows, (err.row, rows)
    if err.field is not None:
        assert f"field '{err.field}'" in message, message


def load_or_error(path: Path, rows: int | None):
    try:
        prompts = load_prompts(path)
    except PromptFileError as err:
        check_prompt_error(err, path, rows)
        return err
    check_prompts(prompts)
    return prompts


def jsonl_text(rows) -> str:
    """One row per line (so line numbers are row numbers); json.dumps escapes lone surrogates."""
    return "".join(json.dumps(row) + "\n" for row in rows)


# ----------------------------------------------------------------------------- prompt files


@fast(150)
@given(rows=prompt_rows)
@example(rows=[{"prompt": "What is 6+7?", "reward_model": {"ground_truth": "13"}}])  # a valid file
@example(rows=[{"prompt": "\ud800", "reward_model": {"ground_truth": "13"}}])
@example(rows=[{"prompt": "q", "reward_model": {"ground_truth": "1"}, "extra_info": {"index": "\udfff"}}])
def test_jsonl_and_json_prompt_files_load_or_name_the_bad_row(rows):
    with tempfile.TemporaryDirectory() as folder:
        jsonl, as_list = Path(folder, "set.jsonl"), Path(folder, "set.json")
        jsonl.write_text(jsonl_text(rows), encoding="utf-8")
        as_list.write_text(json.dumps(rows), encoding="utf-8")
        as_jsonl, as_json = load_or_error(jsonl, len(rows)), load_or_error(as_list, len(rows))
    # The same rows in both formats: both load (equal prompts) or both fail on the same row.
    if isinstance(as_jsonl, list):
        assert isinstance(as_json, list) and [p.uid for p in as_json] == [p.uid for p in as_jsonl]
    else:
        assert isinstance(as_json, PromptFileError) and as_json.row == as_jsonl.row and as_json.field == as_jsonl.field


@fast(100)
@given(data=st.one_of(st.binary(max_size=300), st.text(any_char, max_size=300).map(
    lambda s: s.encode("utf-8", "surrogatepass"))), suffix=st.sampled_from([".jsonl", ".json", ".parquet"]))
@example(data=b"1" * 5000, suffix=".json")  # over Python's int-from-text digit limit
@example(data=b'{"prompt": "q", "reward_model": {"ground_truth": ' + b"9" * 5000 + b"}}\n", suffix=".jsonl")
@example(data=b"[" * 100_000, suffix=".json")  # nesting deeper than the JSON decoder's recursion
@example(data=b"[" * 100_000 + b"]" * 100_000, suffix=".jsonl")
@example(data=b"PAR1" + bytes(range(256)) + b"PAR1", suffix=".parquet")
def test_any_bytes_as_a_prompt_file_load_or_fail_naming_the_file(data, suffix):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "set" + suffix)
        path.write_bytes(data)
        load_or_error(path, None)


# Parquet columns of random Arrow types, the DAPO ones among them.
def _chat_type(role=pa.string(), content=pa.string()):
    return pa.list_(pa.struct([("role", role), ("content", content)]))


scalar_types = st.sampled_from([
    pa.string(), pa.large_string(), pa.int64(), pa.int32(), pa.float64(), pa.bool_(), pa.binary(), pa.null(),
    pa.timestamp("us"), pa.date32(), pa.time64("us"), pa.duration("s"), pa.decimal128(10, 2),
    pa.dictionary(pa.int32(), pa.string()),
])
arrow_types = st.recursive(
    scalar_types,
    lambda inner: st.one_of(
        st.builds(pa.list_, inner),
        st.lists(st.tuples(st.sampled_from(["role", "content", "ground_truth", "index", "style", "x"]), inner),
                 min_size=1, max_size=3, unique_by=lambda f: f[0]).map(pa.struct),
        st.builds(pa.map_, st.just(pa.string()), inner),
    ),
    max_leaves=4,
)
dapo_types = {
    "data_source": mostly(st.just(pa.string()), arrow_types),
    "prompt": mostly(st.sampled_from([_chat_type(), pa.string()]),
                     st.builds(_chat_type, scalar_types, scalar_types) | arrow_types),
    "reward_model": mostly(st.builds(lambda t: pa.struct([("ground_truth", t), ("style", pa.string())]),
                                     st.sampled_from([pa.string(), pa.int64(), pa.float64()])),
                           st.builds(lambda t: pa.struct([("ground_truth", t)]), scalar_types) | arrow_types),
    "extra_info": mostly(st.builds(lambda t: pa.struct([("index", t)]), st.sampled_from([pa.string(), pa.int64()])),
                         st.builds(lambda t: pa.struct([("index", t)]), scalar_types) | arrow_types),
    "ability": arrow_types,
}


def arrow_values(t: pa.DataType, name: str = ""):
    """A strategy for Python values of Arrow type `t` (the value of field `name`), a null one time in 16."""
    if pa.types.is_null(t):
        return st.none()
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_dictionary(t):
        base = mostly(mostly(st.just("user"), st.sampled_from(ROLES)) if name == "role"
                      else st.text(utf8_char, min_size=1, max_size=12),
                      st.one_of(st.sampled_from(["", " ", "user", "13"]), st.integers(5_000, 50_000).map("x".__mul__)))
    elif pa.types.is_integer(t):
        bits = t.bit_width - 1
        base = st.one_of(st.integers(0, 9), st.integers(-(2**bits), 2**bits - 1))  # 0-9: repeated ids too
    elif pa.types.is_floating(t):
        base = st.floats()
    elif pa.types.is_boolean(t):
        base = st.booleans()
    elif pa.types.is_binary(t):
        base = st.binary(max_size=12)
    elif pa.types.is_temporal(t):  # as the integer Arrow stores: beyond Python's datetime range too
        high = 2**31 - 1 if pa.types.is_date32(t) else 2**62
        base = st.one_of(st.integers(0, 10**6), st.sampled_from([-high, high]), st.integers(-high, high))
    elif pa.types.is_decimal(t):
        base = st.decimals(-10**7, 10**7, places=2, allow_nan=False, allow_infinity=False)
    elif pa.types.is_map(t):
        base = st.lists(st.tuples(st.text(utf8_char, max_size=12), arrow_values(t.item_type)), max_size=2)
    elif pa.types.is_list(t):
        base = mostly(st.lists(arrow_values(t.value_type, name), min_size=1, max_size=3), st.just([]))
    elif pa.types.is_struct(t):
        base = st.fixed_dictionaries({f.name: arrow_values(f.type, f.name) for f in t})
    else:
        raise AssertionError(f"no values for {t}")
    return mostly(base, mostly(base, st.none()))


@st.composite
def arrow_tables(draw, column_types: dict, rows: st.SearchStrategy = mostly(st.integers(1, 4), st.just(0))) -> pa.Table:
    """A table of `column_types`' columns (each of a drawn type; mostly all of them) and drawn rows."""
    names = draw(mostly(st.just(sorted(column_types)),
                        st.lists(st.sampled_from(sorted(column_types)), unique=True, max_size=len(column_types))))
    count = draw(rows)
    columns = {}
    for name in names:
        kind = draw(column_types[name])
        values = draw(st.lists(arrow_values(kind, name), min_size=count, max_size=count))
        columns[name] = pa.array(values, kind)
    return pa.table(columns) if columns else pa.table({"x": pa.array([None] * count, pa.null())})


@st.composite
def prompt_tables(draw) -> pa.Table:
    """DAPO rows as Arrow infers their schema (when it can), or columns of drawn Arrow types."""
    if draw(st.booleans()):
        try:
            table = pa.Table.from_pylist(draw(prompt_rows.filter(bool)))
            pq.write_table(table, pa.BufferOutputStream())
            return table
        except (pa.ArrowException, TypeError, AttributeError, OverflowError, UnicodeEncodeError):
            pass  # rows of different shapes, empty objects, lone surrogates: no parquet file holds them
    return draw(arrow_tables(dapo_types))


@fast(120)
@given(table=prompt_tables())
@example(table=pa.table({"prompt": ["What is 6+7?"], "reward_model": [{"ground_truth": "13", "style": "rule"}]}))
@example(table=pa.table({"prompt": ["q"], "reward_model": [{"ground_truth": "1"}],  # a date past year 9999
                         "ability": pa.array([2**30], pa.date32())}))
def test_parquet_prompt_files_of_any_schema_load_or_name_the_bad_row(table):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "set.parquet")
        pq.write_table(table, path)
        load_or_error(path, len(table))


# ----------------------------------------------------------------------------- pools and snapshots


def _meta(kind: str, version) -> dict:
    return {"rayrep.kind": kind, "rayrep.schema_version": str(version)}


def _column_types(schema: pa.Schema) -> dict:
    """Each column: its own type most of the time, else any type."""
    return {f.name: mostly(st.just(f.type), arrow_types) for f in schema}


def _with_meta(table: pa.Table, meta: dict) -> pa.Table:
    return table.replace_schema_metadata(meta)


def _valid_answer_arrays(uid, prompt_ids, response_ids, logprobs, tool_mask=None):
    assert tool_mask is None or (tool_mask.dtype == np.bool_ and len(tool_mask) == len(response_ids))
    assert isinstance(uid, str)
    assert isinstance(prompt_ids, np.ndarray) and prompt_ids.dtype == np.int32
    assert isinstance(response_ids, np.ndarray) and response_ids.dtype == np.int32
    assert isinstance(logprobs, np.ndarray) and logprobs.dtype == np.float32 and len(logprobs) == len(response_ids)


def check_buffer_error(err: BufferFileError, *paths: Path) -> None:
    message = str(err)
    assert any(message.startswith(str(p)) for p in paths), message


metadata = mostly(
    st.just("ok"),
    st.fixed_dictionaries({}, optional={"rayrep.kind": st.sampled_from(["experience-pool", "buffer-snapshot", "x"]),
                                        "rayrep.schema_version": st.sampled_from(["1", "2", "x", " 1", "-1"]),
                                        "rayrep.evicted": st.sampled_from(["0", "3", "x", "-2", "1e3"])}),
)
small_uid = st.sampled_from(["q1", "q2", "q3"]) | st.text(utf8_char, max_size=6)
token_id = st.integers(0, 2**31 - 1)


@st.composite
def answer_tables(draw, schema: pa.Schema) -> pa.Table:
    """Answer rows as rayrep writes them (token ids and log-probs of equal lengths), then now
    and then one column dropped, nulled, of another type, or one row's log-probs cut short."""
    count = draw(mostly(st.integers(1, 4), st.just(0)))
    lengths = draw(st.lists(st.integers(0, 4), min_size=count, max_size=count))

    def rows(values):
        return draw(st.lists(values, min_size=count, max_size=count))

    columns = {
        "uid": rows(small_uid),
        "prompt_ids": rows(st.lists(token_id, max_size=3)),
        "response_ids": [draw(st.lists(token_id, min_size=n, max_size=n)) for n in lengths],
        "logprobs": [draw(st.lists(st.floats(width=32), min_size=n, max_size=n)) for n in lengths],
        "tool_mask": [draw(st.lists(st.booleans(), min_size=n, max_size=n)) for n in lengths],
        "reward": rows(st.floats(width=32)),
        "version": rows(st.integers(-(2**31), 2**31 - 1)),
        "source": rows(st.sampled_from(SOURCES)),
        "step": rows(st.integers(0, 2**31 - 1)),
        "temperature": rows(st.floats(width=32)),
        "advantage": rows(st.floats(width=32)),
        "verdict": rows(st.sampled_from(tuple(VERDICTS))),
        "bucket": rows(st.integers(-1, 16)),
        "retired": rows(st.booleans()),
        "length": lengths,
    }
    table = pa.table({f.name: pa.array(columns.get(f.name) or rows(st.text(utf8_char, max_size=6)), f.type)
                      for f in schema})
    name = draw(mostly(st.none(), st.sampled_from(schema.names)))
    if name is None or not count:
        return table
    position = table.schema.get_field_index(name)
    damage = draw(st.sampled_from(["drop", "null", "retype", "cut"]))
    if damage == "drop":
        return table.remove_column(position)
    if damage == "cut" and pa.types.is_list(table.schema.field(name).type):
        values = table.column(name).to_pylist()
        values[0] = values[0][:-1] if values[0] else [0]
        return table.set_column(position, name, pa.array(values, table.schema.field(name).type))
    kind = draw(arrow_types) if damage == "retype" else table.schema.field(name).type
    values = rows(arrow_values(kind)) if damage == "retype" else [None] + table.column(name).to_pylist()[1:]
    return table.set_column(position, name, pa.array(values, kind))


def buffer_tables(schema: pa.Schema) -> st.SearchStrategy:
    """Mostly rows as rayrep writes them, else columns of any type."""
    return mostly(answer_tables(schema), arrow_tables(_column_types(schema)))


@fast(150)
@given(table=buffer_tables(POOL_SCHEMA), meta=metadata)
@example(table=pa.table({"uid": ["q"], "prompt_ids": [[1]], "response_ids": [[1, 2]], "logprobs": [[-0.5, -0.25]],
                         "reward": [1.0], "version": [0]}), meta="ok")  # a valid pool
@example(table=pa.table({"uid": ["q"], "prompt_ids": [[1]], "response_ids": [["a"]], "logprobs": [[-0.5]],
                         "reward": [1.0], "version": [0]}), meta="ok")
@example(table=pa.table({"uid": ["q"], "prompt_ids": [[1]], "response_ids": [[1]], "logprobs": [[-0.5]],
                         "reward": ["high"], "version": [0]}), meta="ok")
@example(table=pa.table({"uid": ["q"], "prompt_ids": [[1]], "response_ids": [1], "logprobs": [[-0.5]],
                         "reward": [1.0], "version": [0]}), meta="ok")
def test_experience_pools_read_or_fail_naming_the_file(table, meta):
    meta = _meta("experience-pool", POOL_VERSION) if meta == "ok" else meta
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "pool.parquet")
        pq.write_table(_with_meta(table, meta), path)
        try:
            check_pool_file(path)
            pool = read_pool(path)
        except BufferFileError as err:
            check_buffer_error(err, path)
            return
    for uid, (prompt_ids, answers) in pool.items():
        for answer in answers:
            _valid_answer_arrays(uid, prompt_ids, *answer.arrays()[1:])
            assert isinstance(answer.reward, float) and isinstance(answer.version, int)
            assert answer.source == "pool"


@fast(150)
@given(answers=buffer_tables(ANSWER_SCHEMA), questions=buffer_tables(QUESTION_SCHEMA), meta=metadata)
@example(answers=pa.table({"uid": ["q"], "prompt_ids": [[1]], "response_ids": [[1, 2]], "logprobs": [[-0.5, -0.1]],
                           "reward": [1.0], "version": [0], "source": ["online"], "step": [3]}),
         questions=pa.table({"uid": ["q", "r"], "bucket": [2, -1], "retired": [False, True]}), meta="ok")  # valid
@example(answers=pa.table({"uid": ["q"], "prompt_ids": [[1]], "response_ids": [[1]], "logprobs": [[-0.5]],
                           "reward": [1.0], "version": [0]}),
         questions=pa.table({"uid": ["q"]}), meta="ok")
@example(answers=pa.table({"uid": ["q"], "prompt_ids": [[1]], "response_ids": [[1]], "logprobs": [[-0.5]],
                           "reward": [1.0], "version": [0], "source": [["pool"]]}),
         questions=pa.table({"uid": ["q"], "bucket": [1], "retired": [False]}), meta="ok")
def test_buffer_snapshots_read_or_fail_naming_the_file(answers, questions, meta):
    meta = _meta("buffer-snapshot", SNAPSHOT_VERSION) if meta == "ok" else meta
    with tempfile.TemporaryDirectory() as folder:
        directory = Path(folder)
        pq.write_table(_with_meta(answers, meta), directory / "answers.parquet")
        pq.write_table(_with_meta(questions, meta), directory / "questions.parquet")
        try:
            snapshot = read_snapshot(directory)
            entries, retired, evicted = snapshot.questions, snapshot.retired, snapshot.evicted
        except BufferFileError as err:
            check_buffer_error(err, directory / "answers.parquet", directory / "questions.parquet")
            return
    assert isinstance(evicted, int) and all(isinstance(uid, str) for uid in retired)
    assert [uid for uid, _ in entries] == sorted(uid for uid, _ in entries)
    for uid, entry in entries:
        assert isinstance(entry.bucket, int)
        assert len(entry.offsets) == len(entry) + 1 and entry.offsets[-1] == len(entry.tokens)
        _valid_answer_arrays(uid, entry.prompt_ids, entry.tokens, entry.logprobs, entry.tool_mask)
        assert set(entry.facts["source"].tolist()) <= set(range(len(SOURCES)))


# ----------------------------------------------------------------------------- verifier

# Model outputs built from the pieces that matter to answer extraction.
output_pieces = st.sampled_from([
    "\\boxed", "\\boxed{", "{", "}", "\\{", "\\}", "\\", " ", "\n", "x", "1", "42", "-7", "\\frac{1}{2}", "$", "\\(",
    "\\)", "\\[", "=", "^", "**", "9**9**9", "é", "∞", "The answer is ",
])
odd_pieces = st.sampled_from(["\x00", "\x1b", "\ud800", "\x7f"])
model_output = mostly(
    st.lists(output_pieces, max_size=40).map("".join),
    st.one_of(
        st.lists(output_pieces | odd_pieces | short_text, max_size=40).map("".join),
        st.builds(lambda piece, n: piece * n, output_pieces, st.integers(100, 100_000)),
        st.builds(lambda n: "\\boxed{" * n + "7" + "}" * n, st.integers(0, 200)),
    ),
)
ground_truth_text = mostly(st.integers(-999, 999).map(str) | st.sampled_from(["1/2", "\\frac{1}{2}", "x^2", "\\sqrt{2}"]),
                           text)


@fast(300, deadline_s=10)
@given(output=model_output)
@example(output="\\boxed{" * 200_000)
@example(output="{" * 200_000 + "\\boxed{1}")
def test_answer_extraction_takes_any_text(output):
    """The parent-side part (no sandbox): bounded, well-typed, never raises on a str."""
    item = completion_item(output, "text")
    if isinstance(item, Verdict):
        assert item.status in ("no_answer", "error") and item.correct is False
    else:
        kind, prediction = item
        assert kind in ("answer", "text") and isinstance(prediction, str)
        assert len(prediction) <= max(TAIL_CHARS, MAX_ANSWER_CHARS * 33 + 33 * 8)
    content = last_boxed_content(output, MAX_ANSWER_CHARS)
    assert content is None or (content in output and len(content) <= MAX_ANSWER_CHARS)


WALL_LIMIT_PER_ITEM_S = 10.0
"""The verifier's promise, per item: its 1 s hard limit, plus a generous allowance for
replacing a killed sandbox child on a loaded CI machine."""


@pytest.fixture(scope="module")
def warm_sandbox():
    return vm.default_sandbox().start()


@fast(20, deadline_s=120)
@given(outputs=st.lists(model_output, min_size=1, max_size=4), truth=ground_truth_text)
def test_the_verifier_scores_any_output_within_its_time_limit(warm_sandbox, outputs, truth):
    started = time.monotonic()
    verdicts = vm.verify_batch(outputs, [truth] * len(outputs))
    assert time.monotonic() - started < WALL_LIMIT_PER_ITEM_S * len(outputs)
    assert len(verdicts) == len(outputs)
    for verdict in verdicts:
        assert isinstance(verdict, Verdict) and isinstance(verdict.correct, bool)
        assert verdict.status in ("ok", "no_answer", "timeout", "error")
        assert verdict.correct is False or verdict.status == "ok"


@fast(8, deadline_s=60)
@given(n=st.integers(-10**6, 10**6), junk=st.lists(output_pieces, max_size=10).map("".join))
def test_a_boxed_right_answer_scores_one_after_any_junk(warm_sandbox, n, junk):
    """By hand: the last box that closes is the answer; an unclosed box before it does not count."""
    text = junk.replace("\\boxed", "") + f" \\boxed{{ \\boxed{{{n}}}"
    assert vm.score(text, str(n)) == 1.0
    assert vm.score(text, str(n + 1), style="dapo") == -1.0


# ----------------------------------------------------------------------------- config

FIELDS = {name: kind for name, kind, _ in config_fields()}
FLOAT_FIELDS = [name for name, kind in FIELDS.items() if kind is float]


def check_config(cfg: Config) -> None:
    """A config every component can use: it also holds no NaN or infinite number."""
    assert isinstance(cfg, Config)
    for name in FLOAT_FIELDS:
        value = cfg
        for part in name.split("."):
            value = getattr(value, part)
        assert math.isfinite(value), (name, value)


cli_value = st.one_of(
    st.integers(-10**12, 10**12).map(str), st.floats().map(repr), short_text,
    st.sampled_from(["nan", "inf", "-inf", "1e999", "NaN", "true", "yes", "0", "1", "-1", "", "a,b", "add2,mix3",
                     "math=32", "=", "grpo", "rlep", "exgrpo", "gpu", "disaggregated", "deepspeed", "cosine",
                     "seq-mean-token-sum", "9" * 5000]),
)


@fast(200)
@given(field=st.sampled_from(sorted(FIELDS)), value=cli_value)
@example(field="learner.lr", value="nan")
@example(field="verifier.timeout_s", value="inf")
def test_one_override_gives_a_config_or_an_error_naming_the_field(field, value):
    try:
        cfg = parse_cli([f"--{field}", value])
    except ConfigError as err:
        assert field in str(err), str(err)
        return
    check_config(cfg)


@fast(150)
@given(argv=st.lists(st.one_of(st.sampled_from(sorted(FIELDS)).map("--".__add__), cli_value,
                               st.sampled_from(["--preset", "--config", "--", "--=", "tiny-cpu", "x.toml", "--x.y"])),
                     max_size=6))
def test_any_command_line_gives_a_config_or_a_config_error(argv):
    try:
        check_config(parse_cli(argv))
    except ConfigError as err:
        assert str(err)


SECTIONS = sorted({name.split(".")[0] for name in FIELDS})


@st.composite
def config_data(draw):
    """Nested tables of real (and some unknown) sections and fields, with any values."""
    data = {}
    for section in draw(st.lists(st.sampled_from(SECTIONS) | short_text, unique=True, max_size=3)):
        names = [n.split(".", 1)[1] for n in FIELDS if n.startswith(section + ".")] or ["x"]
        data[section] = draw(st.one_of(
            st.dictionaries(st.sampled_from(names) | short_text, json_value | cli_value, max_size=3),
            json_value,
        ))
    return data


@fast(200)
@given(data=st.one_of(config_data(), json_value))
def test_from_dict_gives_a_config_or_a_config_error(data):
    try:
        check_config(from_dict(data))
    except ConfigError as err:
        assert str(err)


def toml_value(value) -> str:
    """`value` as TOML text (strings as JSON strings, which TOML reads the same for these)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else "inf" if value == math.inf else "-inf" if value == -math.inf else repr(value)
    if isinstance(value, (int, decimal.Decimal)):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)} = {toml_value(v)}" for k, v in value.items()) + "}"


toml_scalar = st.one_of(st.booleans(), st.integers(-2**63, 2**63 - 1), st.integers(), st.floats(), st.dates(),
                        st.datetimes(), st.text(utf8_char, max_size=10), st.sampled_from(["add2,mix3", "gpu"]))
toml_any = st.recursive(toml_scalar, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(utf8_char, max_size=5), inner, max_size=2), max_leaves=6)


@st.composite
def toml_documents(draw) -> str:
    lines = []
    for section in draw(st.lists(st.sampled_from(SECTIONS) | st.text(utf8_char, min_size=1, max_size=6),
                                 unique=True, max_size=3)):
        lines.append(f"[{json.dumps(section, ensure_ascii=False)}]")
        names = [n.split(".", 1)[1] for n in FIELDS if n.startswith(section + ".")] or ["x"]
        for key in draw(st.lists(st.sampled_from(names), unique=True, max_size=3)):
            lines.append(f"{json.dumps(key)} = {toml_value(draw(toml_any))}")
    return "\n".join(lines) + "\n"


@fast(200)
@given(document=st.one_of(toml_documents(), toml_documents(), st.text(any_char, max_size=200)))
@example(document="[run]\nsteps = " + "9" * 5000 + "\n")  # over Python's int-from-text digit limit
@example(document="[run]\nsteps = " + "[" * 5000 + "]" * 5000 + "\n")  # deeper than tomllib's recursion
@example(document="[learner]\nlr = nan\n")
@example(document="[learner]\nlr = 1" + "0" * 400 + "\n")  # an integer beyond float's range
def test_toml_config_files_give_a_config_or_an_error_naming_the_file_or_field(document):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "user.toml")
        path.write_bytes(document.encode("utf-8", "surrogatepass"))
        try:
            cfg = parse_cli(["--config", str(path)])
        except ConfigError as err:
            message = str(err)
            named = [str(path), "config field", *FIELDS, *SECTIONS]
            assert any(name in message for name in named), message
            return
    check_config(cfg)


@pytest.mark.parametrize(("document", "expected"), [
    ("[learner]\nlr = nan\n", "learner.lr: expected a finite number, got nan"),
    ("[run]\nsteps = " + "[" * 5000 + "]" * 5000 + "\n", "bad.toml: maximum recursion depth exceeded"),
])
def test_a_job_reports_a_bad_config_file_in_one_line(tmp_path, document, expected):
    """What a user sees: run_job's one line and exit status 2, no traceback, nothing started."""
    (tmp_path / "bad.toml").write_text(document, encoding="utf-8")
    from conftest import job_here

    done = job_here("grpo.py", "--config", "bad.toml", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"grpo.py: config error: {expected}", done.stderr
