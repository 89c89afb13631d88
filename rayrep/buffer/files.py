"""Parquet files of the replay buffer: snapshots, and RLEP experience pools.

Both keep token ids and behaviour log-probs as arrays (int32 / float32 lists), never
only text: re-tokenizing text can drift from what the policy generated. Each file
carries a schema version in its metadata; a reader refuses a version it does not know.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
import math
import os
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rayrep.buffer.answers import FACTS, SOURCES, VERDICTS, Origins, PackedAnswers, QuestionAnswers, origin_id
from rayrep.config import InputError
from rayrep.types import Answer

SNAPSHOT_VERSION = 4
"""2: each answer's provenance (run, checkpoint, temperature, verdict) and the shard versions;
3: each answer's advantage (answer-level replay); 4: each answer's tool mask. Earlier versions
are read: their answers' provenance unknown, verdict correct (1), advantage unknown (1, 2), no
token written by a tool (1-3)."""
POOL_VERSION = 3
"""2: each answer's advantage; 3: its tool mask. Earlier pools are read, their advantages
unknown (1), no token written by a tool (1, 2)."""


class BufferFileError(InputError):
    """A snapshot or pool file is missing, malformed, or of an unknown schema version."""


def _check_version(path: Path, schema: pa.Schema, kind: str, known: int) -> int:
    """The file's schema version, which must be `known` or one this rayrep still reads (1
    up to `known`)."""
    meta = schema.metadata or {}
    if meta.get(b"rayrep.kind", b"").decode() != kind:
        raise BufferFileError(f"{path}: not a rayrep {kind} file (metadata rayrep.kind = {meta.get(b'rayrep.kind')!r})")
    raw = meta.get(b"rayrep.schema_version")
    if raw is None:
        raise BufferFileError(f"{path}: no rayrep.schema_version in the {kind} file's metadata")
    try:
        version = int(raw)
    except ValueError:
        raise BufferFileError(f"{path}: {kind} schema version {raw!r} is not a number") from None
    if not 1 <= version <= known:
        raise BufferFileError(f"{path}: {kind} schema version {version}, this rayrep reads versions 1 to {known}")
    return version


def _write_atomic(path: Path, schema: pa.Schema, tables) -> None:
    """Write `tables` (of `schema`) one after another as one Parquet file; `path` is replaced
    only by a complete file. Row groups stay small, so that readers can stream the file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    os.close(fd)
    try:
        with pq.ParquetWriter(temp, schema) as writer:
            for table in tables:
                writer.write_table(table, row_group_size=_ROWS_PER_CHUNK)
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)


def _read(path: Path) -> pa.Table:
    if not path.is_file():
        raise BufferFileError(f"{path}: no such file")
    try:
        return pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise BufferFileError(f"{path}: not a readable Parquet file ({err})") from None


def _open(path: Path, kind: str, known: int) -> pq.ParquetFile:
    if not path.is_file():
        raise BufferFileError(f"{path}: no such file")
    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise BufferFileError(f"{path}: not a readable Parquet file ({err})") from None
    _check_version(path, file.schema_arrow, kind, known)
    return file


def _row_batches(path: Path, file: pq.ParquetFile):
    """(number of rows before, table) of each row group, read one after the other."""
    first = 0
    for group in range(file.metadata.num_row_groups):
        try:
            table = file.read_row_group(group)
        except (pa.ArrowInvalid, OSError) as err:
            raise BufferFileError(f"{path}: not a readable Parquet file ({err})") from None
        yield first, table
        first += len(table)


# ---------------------------------------------------------------------- columns
# Token ids and log-probs go between numpy and Arrow as flat arrays plus offsets, never as
# Python lists: one Python object per token costs about 30 bytes, which made restoring a
# 100k-trajectory snapshot peak at 18x its raw size (a 1M one could not be restored here).

_MAX_LIST_VALUES = 2**31 - 1
"""Values one Arrow list array (int32 offsets) can hold; longer columns are chunked."""
_ROWS_PER_CHUNK = 65_536


def _list_array(values: np.ndarray, lengths: np.ndarray, value_type: pa.DataType) -> pa.ChunkedArray:
    """Rows of `lengths[i]` consecutive values, as an Arrow list column (chunked, depending only on the content)."""
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    chunks, start = [], 0
    while start < len(lengths) or not chunks:
        end = min(len(lengths), start + _ROWS_PER_CHUNK)
        while end > start + 1 and offsets[end] - offsets[start] > _MAX_LIST_VALUES:
            end = start + (end - start) // 2
        piece = pa.array(values[offsets[start] : offsets[end]], value_type)
        chunks.append(pa.ListArray.from_arrays(pa.array(offsets[start : end + 1] - offsets[start], pa.int32()), piece))
        start = end
    return pa.chunked_array(chunks, pa.list_(value_type))


def _column(table: pa.Table, name: str, path: Path, first_row: int = 0) -> pa.ChunkedArray:
    """Column `name`, without nulls, as its type in ANSWER_SCHEMA / QUESTION_SCHEMA."""
    if name not in table.column_names:
        raise BufferFileError(f"{path}: no column {name!r}")
    column = table.column(name)
    if column.null_count:
        row = first_row + int(np.nonzero(column.is_null().to_numpy())[0][0])
        raise BufferFileError(f"{path}, row {row + 1}: {name} is null")
    # As the schema's type: another writer's widths are fine (int64 ids, float64 rewards); a
    # value that does not fit (a string for a number, a scalar for a list, an overflow) is not.
    expected = _COLUMN_TYPES[name]
    try:
        return column.cast(expected)  # a safe cast: no overflow, no truncation
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as err:
        raise BufferFileError(f"{path}: column {name!r} is {column.type}, expected {expected} ({err})") from None


def _scalars(table: pa.Table, name: str, path: Path, dtype, first_row: int = 0) -> np.ndarray:
    return np.asarray(_column(table, name, path, first_row).to_numpy(), dtype)


def _lists(table: pa.Table, name: str, path: Path, dtype, first_row: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(values, int64 offsets [rows + 1]) of a list column."""
    column = _column(table, name, path, first_row)
    values = pc.list_flatten(column)
    if values.null_count:
        raise BufferFileError(f"{path}: column {name!r} holds null values")
    lengths = pc.list_value_length(column).to_numpy()
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return np.asarray(values.to_numpy(), dtype), offsets


def _read_answers(path: Path, kind: str, known: int) -> tuple[dict[str, QuestionAnswers], Origins, pa.Schema]:
    """Every answer row of a snapshot or pool file, grouped by question id in file order, and
    the names of their origins.

    Read in batches of rows, so that memory holds the result plus one batch. A column a file
    lacks takes its default: pools have no source and step columns (their answers come from
    a pool, at step 0), older files no provenance (unknown origin and temperature; verdict
    correct, since only successes were stored)."""
    file = _open(path, kind, known)
    entries: dict[str, QuestionAnswers] = {}
    origins: Origins = {}
    for first, table in _row_batches(path, file):
        tokens, offsets = _lists(table, "response_ids", path, np.int32, first)
        logprobs, logprob_offsets = _lists(table, "logprobs", path, np.float32, first)
        if not np.array_equal(offsets, logprob_offsets):
            row = int(np.nonzero(np.diff(offsets) != np.diff(logprob_offsets))[0][0])
            raise BufferFileError(f"{path}, row {first + row + 1}: {offsets[row + 1] - offsets[row]} token ids but "
                                  f"{logprob_offsets[row + 1] - logprob_offsets[row]} log-probs")
        rows = len(table)
        names = table.column_names
        tool_mask = None
        if "tool_mask" in names:
            tool_mask, mask_offsets = _lists(table, "tool_mask", path, np.bool_, first)
            if not np.array_equal(offsets, mask_offsets):
                row = int(np.nonzero(np.diff(offsets) != np.diff(mask_offsets))[0][0])
                raise BufferFileError(f"{path}, row {first + row + 1}: {offsets[row + 1] - offsets[row]} token ids but "
                                      f"a tool mask of {mask_offsets[row + 1] - mask_offsets[row]}")
        facts = np.zeros(rows, FACTS)
        facts["reward"] = _scalars(table, "reward", path, np.float32, first)
        facts["version"] = _scalars(table, "version", path, np.int32, first)
        facts["source"] = _indices(table, "source", SOURCES, path, first) if "source" in names else SOURCES.index("pool")
        facts["step"] = _scalars(table, "step", path, np.int32, first) if "step" in names else 0
        facts["temperature"] = _scalars(table, "temperature", path, np.float32, first) if "temperature" in names else np.nan
        facts["verdict"] = np.array(list(VERDICTS.values()), np.int8)[_indices(table, "verdict", tuple(VERDICTS), path, first)] \
            if "verdict" in names else VERDICTS["correct"]
        facts["advantage"] = _scalars(table, "advantage", path, np.float32, first) if "advantage" in names else np.nan
        if "run" in names or "source_checkpoint" in names:
            facts["origin"] = _origins(table, path, origins, first)
        batch = PackedAnswers(uids=[], counts=np.empty(0, np.int64), offsets=offsets, tokens=tokens,
                              logprobs=logprobs, facts=facts, tool_mask=tool_mask)
        prompts, prompt_offsets = _lists(table, "prompt_ids", path, np.int32, first)
        for uid, uid_rows in _rows_by_uid(_column(table, "uid", path, first).to_pylist()).items():
            entry = entries.get(uid)
            if entry is None:
                start, end = prompt_offsets[uid_rows[0]], prompt_offsets[uid_rows[0] + 1]
                entry = entries[uid] = QuestionAnswers(prompts[start:end])
            entry.extend_rows(batch, uid_rows, cap=len(entry) + len(uid_rows))
    pa.default_memory_pool().release_unused()  # Arrow's allocator keeps freed memory otherwise
    return entries, origins, file.schema_arrow


def _rows_by_uid(uids: list[str]) -> dict[str, range | list[int]]:
    """Row numbers of each uid, in file order (a range where they are consecutive, as written)."""
    rows: dict[str, list[int]] = {}
    for row, uid in enumerate(uids):
        rows.setdefault(uid, []).append(row)
    return {uid: range(r[0], r[-1] + 1) if r[-1] - r[0] + 1 == len(r) else r for uid, r in rows.items()}


# ---------------------------------------------------------------------- snapshots

ANSWER_SCHEMA = pa.schema([
    ("uid", pa.string()),
    ("prompt_ids", pa.list_(pa.int32())),
    ("response_ids", pa.list_(pa.int32())),
    ("logprobs", pa.list_(pa.float32())),
    ("tool_mask", pa.list_(pa.bool_())),
    ("reward", pa.float32()),
    ("version", pa.int32()),
    ("source", pa.string()),
    ("step", pa.int32()),
    ("temperature", pa.float32()),
    ("verdict", pa.string()),
    ("run", pa.string()),
    ("checkpoint", pa.string()),
    ("advantage", pa.float32()),
])
QUESTION_SCHEMA = pa.schema([("uid", pa.string()), ("bucket", pa.int32()), ("retired", pa.bool_())])
_COLUMN_TYPES = {f.name: f.type for schema in (ANSWER_SCHEMA, QUESTION_SCHEMA) for f in schema} | {"source_checkpoint": pa.string()}
"""What `_column` gives each column of a snapshot or pool, whatever the file holds."""


@dataclass
class Snapshot:
    """A buffer snapshot as read: its questions (id order), the retired ones, the evictions,
    the names of its answers' origins, and the writes its shards had taken (their versions'
    sum: the buffer's version)."""

    questions: list[tuple[str, QuestionAnswers]]
    retired: list[str]
    evicted: int
    origins: Origins
    version: int


def write_snapshot(parts: list[dict], directory: Path) -> Path:
    """Write shard exports (see `ReplayShard.export`) as one snapshot, independent of shard count."""
    questions, origins, version = _merged(parts)
    retired = sorted(uid for part in parts for uid in part["retired"])
    evicted = sum(part["evicted"] for part in parts)
    meta = {"rayrep.kind": "buffer-snapshot", "rayrep.schema_version": str(SNAPSHOT_VERSION), "rayrep.evicted": str(evicted),
            "rayrep.version": str(version)}
    schema = ANSWER_SCHEMA.with_metadata(meta)
    directory.mkdir(parents=True, exist_ok=True)
    _write_atomic(directory / "answers.parquet", schema,
                  (_answer_table(chunk, origins, schema) for chunk in _whole_questions(questions)))
    question_rows = [(uid, entry.bucket, False) for uid, entry in questions] + [(uid, -1, True) for uid in retired]
    question_rows.sort()
    question_table = pa.table(
        {"uid": [r[0] for r in question_rows], "bucket": [r[1] for r in question_rows], "retired": [r[2] for r in question_rows]},
        schema=QUESTION_SCHEMA.with_metadata(meta),
    )
    _write_atomic(directory / "questions.parquet", question_table.schema, [question_table])
    return directory


def write_pool_export(parts: list[dict], path: Path) -> Path:
    """Shard exports as one experience pool file: the snapshot's answer columns (token ids,
    log-probs, provenance), which `read_pool` reads; buckets and retirements are left out."""
    questions, origins, version = _merged(parts)
    schema = ANSWER_SCHEMA.with_metadata({"rayrep.kind": "experience-pool", "rayrep.schema_version": str(POOL_VERSION),
                                          "rayrep.version": str(version)})
    _write_atomic(path, schema, (_answer_table(chunk, origins, schema) for chunk in _whole_questions(questions)))
    return path


def _merged(parts: list[dict]) -> tuple[list[tuple[str, QuestionAnswers]], Origins, int]:
    """Shard exports' questions (in id order), their origins' names, and their versions' sum."""
    questions = sorted((q for part in parts for q in part["questions"]), key=lambda q: q[0])
    origins = {origin: names for part in parts for origin, names in part.get("origins", {}).items()}
    return questions, origins, sum(part.get("version", 0) for part in parts)


def _whole_questions(questions: list[tuple[str, QuestionAnswers]]) -> list[list[tuple[str, QuestionAnswers]]]:
    """Whole questions per table of about _ROWS_PER_CHUNK rows: memory holds one at a time,
    and the split depends on the content only (the same content, the same bytes)."""
    chunks, rows = [[]], 0
    for uid, entry in questions:
        if rows and rows + len(entry) > _ROWS_PER_CHUNK:
            chunks.append([])
            rows = 0
        chunks[-1].append((uid, entry))
        rows += len(entry)
    return chunks


def _answer_table(questions: list[tuple[str, QuestionAnswers]], origins: Origins, schema: pa.Schema) -> pa.Table:
    """One row per stored answer of the questions, oldest first (`origins`: the names of
    their origins)."""
    entries = [entry for _, entry in questions]
    counts = [len(entry) for entry in entries]

    def flat(name, dtype):
        return np.concatenate([getattr(entry, name) for entry in entries]) if entries else np.empty(0, dtype)

    answer_lengths = np.concatenate([np.diff(entry.offsets) for entry in entries]) if entries else np.empty(0, np.int64)
    prompts = [np.tile(entry.prompt_ids, len(entry)) for entry in entries]  # the schema repeats it on every row
    columns = {
        "uid": pa.array([uid for uid, entry in questions for _ in range(len(entry))], pa.string()),
        "prompt_ids": _list_array(np.concatenate(prompts) if prompts else np.empty(0, np.int32),
                                  np.repeat([len(entry.prompt_ids) for entry in entries], counts).astype(np.int64),
                                  pa.int32()),
        "response_ids": _list_array(flat("tokens", np.int32), answer_lengths, pa.int32()),
        "logprobs": _list_array(flat("logprobs", np.float32), answer_lengths, pa.float32()),
        "tool_mask": _list_array(flat("tool_mask", np.bool_), answer_lengths, pa.bool_()),
    }
    facts = flat("facts", FACTS)
    for name, array in _fact_columns(facts, origins).items():
        columns[name] = array
    return pa.table(columns, schema=schema)


def _fact_columns(facts: np.ndarray, origins: Origins) -> dict[str, pa.Array]:
    """Answers' facts (`FACTS` records) as the file columns reward, version, source, step,
    temperature, verdict, run and checkpoint (the strings dictionary-encoded: a few distinct
    values per file)."""
    origin_ids = np.unique(facts["origin"])
    names = [origins.get(int(o), ("", "")) for o in origin_ids]
    where = np.searchsorted(origin_ids, facts["origin"]).astype(np.int32)
    verdict_index = np.zeros(3, np.int32)  # code (-1, 0, 1) + 1 -> the verdict's place in VERDICTS
    for index, code in enumerate(VERDICTS.values()):
        verdict_index[code + 1] = index

    def strings(values: list[str], indices: np.ndarray) -> pa.Array:
        return pa.DictionaryArray.from_arrays(pa.array(indices, pa.int32()), pa.array(values, pa.string())).cast(pa.string())

    return {
        "reward": pa.array(np.ascontiguousarray(facts["reward"]), pa.float32()),
        "version": pa.array(np.ascontiguousarray(facts["version"]), pa.int32()),
        "source": strings(list(SOURCES), facts["source"].astype(np.int32)),
        "step": pa.array(np.ascontiguousarray(facts["step"]), pa.int32()),
        "temperature": pa.array(np.ascontiguousarray(facts["temperature"]), pa.float32()),
        "verdict": strings(list(VERDICTS), verdict_index[facts["verdict"].astype(np.int32) + 1]),
        "run": strings([run for run, _ in names], where),
        "checkpoint": strings([checkpoint for _, checkpoint in names], where),
        "advantage": pa.array(np.ascontiguousarray(facts["advantage"]), pa.float32()),
    }


def read_snapshot(directory: Path) -> Snapshot:
    _open(directory / "answers.parquet", "buffer-snapshot", SNAPSHOT_VERSION)
    questions = _read(directory / "questions.parquet")
    _check_version(directory / "questions.parquet", questions.schema, "buffer-snapshot", SNAPSHOT_VERSION)
    entries, origins, schema = _read_answers(directory / "answers.parquet", "buffer-snapshot", SNAPSHOT_VERSION)
    counters = {}
    for name in ("evicted", "version"):
        try:
            counters[name] = int((schema.metadata or {}).get(f"rayrep.{name}".encode(), b"0"))
        except ValueError:
            raise BufferFileError(f"{directory / 'answers.parquet'}: metadata rayrep.{name} is not a number") from None
    retired = []
    question_path = directory / "questions.parquet"
    columns = [_column(questions, name, question_path).to_pylist() for name in ("uid", "bucket", "retired")]
    for uid, bucket, is_retired in zip(*columns):
        if is_retired:
            retired.append(uid)
        elif uid in entries:
            entries[uid].bucket = bucket
    return Snapshot(sorted(entries.items()), retired, counters["evicted"], origins, counters["version"])


def _indices(table: pa.Table, name: str, known: tuple[str, ...], path: Path, first_row: int = 0) -> np.ndarray:
    """Each row's value of the string column `name` as its index in `known` (a few distinct
    values per file: looked up once each, through a dictionary encoding)."""
    encoded = _column(table, name, path, first_row).combine_chunks().dictionary_encode()
    values = encoded.dictionary.to_pylist()
    unknown = [value for value in values if value not in known]
    if unknown:
        row = first_row + int(np.flatnonzero(encoded.indices.to_numpy(zero_copy_only=False) == values.index(unknown[0]))[0])
        raise BufferFileError(f"{path}, row {row + 1}: unknown {name} {unknown[0]!r} (known: {', '.join(known)})")
    lookup = np.array([known.index(value) for value in values], np.int8)
    return lookup[encoded.indices.to_numpy(zero_copy_only=False)] if len(values) else np.empty(0, np.int8)


def _origins(table: pa.Table, path: Path, origins: Origins, first_row: int = 0) -> np.ndarray:
    """The origin id of each row's (run, checkpoint), each distinct pair named in `origins`
    (a pool file names only the checkpoint it was sampled from: `source_checkpoint`)."""
    if "run" in table.column_names:
        runs, checkpoints = _column(table, "run", path, first_row), _column(table, "checkpoint", path, first_row)
    else:
        checkpoints = _column(table, "source_checkpoint", path, first_row)
        runs = pa.chunked_array([pa.array([""] * len(table), pa.string())])
    joined = pc.binary_join_element_wise(runs, checkpoints, "\0").combine_chunks().dictionary_encode()
    ids = []
    for pair in joined.dictionary.to_pylist():
        run, checkpoint = pair.split("\0", 1)
        ids.append(origin_id(run, checkpoint))
        if ids[-1]:
            origins[ids[-1]] = (run, checkpoint)
    return np.array(ids, np.int64)[joined.indices.to_numpy(zero_copy_only=False)] if ids else np.zeros(len(table), np.int64)


# ---------------------------------------------------------------------- experience pools

POOL_SCHEMA = pa.schema([
    ("uid", pa.string()),
    ("prompt", pa.string()),
    ("ground_truth", pa.string()),
    ("data_source", pa.string()),
    ("prompt_ids", pa.list_(pa.int32())),
    ("response_ids", pa.list_(pa.int32())),
    ("logprobs", pa.list_(pa.float32())),
    ("tool_mask", pa.list_(pa.bool_())),
    ("text", pa.string()),
    ("reward", pa.float32()),
    ("length", pa.int32()),
    ("version", pa.int32()),
    ("source_checkpoint", pa.string()),
])


def write_pool(rows: list[dict], path: Path, source_checkpoint: str, checkers: dict[str, str] | None = None) -> Path:
    """Write an experience pool: one row per verified success (see POOL_SCHEMA).

    `rows` hold: uid, prompt (chat messages), ground_truth, data_source, prompt_ids,
    response_ids, logprobs, text, reward, version, and optionally tool_mask (an answer that
    called a tool; unsaid: none). `checkers`: the checker that judged each data source's
    answers (`pool_checkers`; unsaid: math-verify).
    """
    path = Path(path)
    for index, r in enumerate(rows):
        # Checked here too, not only on reading: a pool that cannot be read back is useless.
        if len(r["response_ids"]) != len(r["logprobs"]):
            raise BufferFileError(f"{path}, row {index + 1}: {len(r['response_ids'])} token ids "
                                  f"but {len(r['logprobs'])} log-probs")
        if r.get("tool_mask") is not None and len(r["tool_mask"]) != len(r["response_ids"]):
            raise BufferFileError(f"{path}, row {index + 1}: {len(r['response_ids'])} token ids "
                                  f"but a tool mask of {len(r['tool_mask'])}")
    token_lengths = np.array([len(r["response_ids"]) for r in rows], np.int64)
    prompt_lengths = np.array([len(r["prompt_ids"]) for r in rows], np.int64)

    def flat(key, dtype):
        return np.concatenate([np.asarray(r[key], dtype) for r in rows]) if rows else np.empty(0, dtype)

    table = pa.table(
        {
            "uid": [r["uid"] for r in rows],
            "prompt": [json.dumps(list(r["prompt"])) for r in rows],
            "ground_truth": [r["ground_truth"] for r in rows],
            "data_source": [r["data_source"] for r in rows],
            "prompt_ids": _list_array(flat("prompt_ids", np.int32), prompt_lengths, pa.int32()),
            "response_ids": _list_array(flat("response_ids", np.int32), token_lengths, pa.int32()),
            "logprobs": _list_array(flat("logprobs", np.float32), token_lengths, pa.float32()),
            "tool_mask": _list_array(np.concatenate([
                np.zeros(len(r["response_ids"]), np.bool_) if r.get("tool_mask") is None else np.asarray(r["tool_mask"], np.bool_)
                for r in rows]) if rows else np.empty(0, np.bool_), token_lengths, pa.bool_()),
            "text": [r["text"] for r in rows],
            "reward": [float(r["reward"]) for r in rows],
            "length": token_lengths.astype(np.int32),
            "version": [int(r.get("version", 0)) for r in rows],
            "source_checkpoint": [source_checkpoint] * len(rows),
        },
        schema=POOL_SCHEMA.with_metadata({"rayrep.kind": "experience-pool", "rayrep.schema_version": str(POOL_VERSION),
                                          "rayrep.checkers": json.dumps(checkers or {}, sort_keys=True)}),
    )
    _write_atomic(path, table.schema, [table])
    return Path(path)


def pool_checkers(path: str | Path) -> dict[str, str]:
    """{data_source: the checker that judged its successes} of a pool file, for every data
    source it holds; math-verify for those it does not name (pools written before the
    record, and pools whose writer used math-verify)."""
    path = Path(path)
    schema = _open(path, "experience-pool", POOL_VERSION).schema_arrow
    named = json.loads((schema.metadata or {}).get(b"rayrep.checkers", b"{}"))
    sources = pq.read_table(path, columns=["data_source"])["data_source"].unique().to_pylist()
    return {source: named.get(source, "math") for source in sources}


def check_pool_file(path: str | Path) -> None:
    """Fail now, naming the file, unless `path` is a readable experience pool of a known
    schema version (its rows are checked when it is read)."""
    _open(Path(path), "experience-pool", POOL_VERSION)


def read_pool(path: str | Path) -> dict[str, tuple[np.ndarray, list[Answer]]]:
    """question id -> (prompt ids, its stored successes) of a pool written by `write_pool`."""
    path = Path(path)
    entries, origins, _ = _read_answers(path, "experience-pool", POOL_VERSION)
    # Each question's answers are views of its flat arrays: one allocation per question.
    return {uid: (entry.prompt_ids, entry.packed(uid, origins).unpack()[uid]) for uid, entry in entries.items()}


@dataclass(frozen=True)
class ImportedPool:
    """What `import_text_pool` wrote."""

    path: Path
    candidates: int
    """Candidate answers stored."""
    questions: int
    """Rows (questions) in the imported file."""
    questions_without: int
    """Rows whose `reward_model.candidates` is null or empty: no successes to replay."""


def import_text_pool(path: str | Path, tokenizer, out_path: str | Path, reward: float = 1.0,
                     max_response_tokens: int | None = None) -> ImportedPool:
    """Convert a public RLEP pool (verl/DAPO rows with `reward_model.candidates`, text only)
    into a rayrep pool by tokenizing it (`text_pool_rows`). Text carries no behaviour
    log-probs: they are stored as NaN, and replay must recompute them
    (`algorithm.rlep.old_logprobs = "recompute"`, the default); a shared pool's import
    records the policy's own instead (`rayrep.pipelines.text_import.import_text`)."""
    rows, questions, without = text_pool_rows(path, tokenizer, reward, max_response_tokens)
    written = write_pool(rows, Path(out_path), source_checkpoint=f"imported:{Path(path).name}")
    return ImportedPool(written, len(rows), questions, without)


def text_pool_rows(path: str | Path, tokenizer, reward: float = 1.0, max_response_tokens: int | None = None
                   ) -> tuple[list[dict], int, int]:
    """The candidate answers of a text pool (verl/DAPO rows with `reward_model.candidates`)
    as pool rows (`write_pool`'s), tokenized: the prompt with the chat template, each
    candidate as the policy would have emitted it (text then end-of-sequence), log-probs NaN.
    Also the number of questions, and of those without candidates.

    As in the RLEP code's reader, a null `candidates` means the question has no successes:
    it is left out (and counted)."""
    from rayrep.data import encode_prompts
    from rayrep.data.loaders import PromptFileError, load_prompts

    prompts = load_prompts(path)
    rows, without = [], 0
    prompt_ids = encode_prompts(tokenizer, prompts, max_tokens=10**9)
    for number, (prompt, ids) in enumerate(zip(prompts, prompt_ids), start=1):
        # The loader drops null keys of `reward_model`: a null list arrives as a missing key.
        candidates = (prompt.extra.get("reward_model") or {}).get("candidates")
        if candidates is None:
            candidates = []
        if not isinstance(candidates, list) or not all(isinstance(c, str) for c in candidates):
            raise PromptFileError(f"{path}, row {number}: field 'reward_model.candidates' must be a list of strings "
                                  f"or null, got {type(candidates).__name__}")
        without += not candidates
        for text in candidates:
            response = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            if max_response_tokens:
                response = response[:max_response_tokens]
            rows.append({
                "uid": prompt.uid, "prompt": prompt.messages, "ground_truth": prompt.ground_truth,
                "data_source": prompt.data_source, "prompt_ids": ids, "response_ids": response,
                "logprobs": [math.nan] * len(response), "text": text, "reward": reward, "version": 0,
            })
    if not rows:
        raise PromptFileError(f"{path}: none of its {len(prompts)} questions has a candidate answer")
    return rows, len(prompts), without
