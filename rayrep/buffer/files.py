"""Parquet files of the replay buffer: snapshots, and RLEP experience pools.

Both keep token ids and behaviour log-probs as arrays (int32 / float32 lists), never
only text: re-tokenizing text can drift from what the policy generated. Each file
carries a schema version in its metadata; a reader refuses a version it does not know.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rayrep.buffer.shard import SOURCES, Answer, QuestionAnswers

SNAPSHOT_VERSION = 1
POOL_VERSION = 1


class BufferFileError(ValueError):
    """A snapshot or pool file is missing, malformed, or of an unknown schema version."""


def _check_version(path: Path, table: pa.Table, kind: str, known: int) -> None:
    meta = table.schema.metadata or {}
    if meta.get(b"rayrep.kind", b"").decode() != kind:
        raise BufferFileError(f"{path}: not a rayrep {kind} file (metadata rayrep.kind = {meta.get(b'rayrep.kind')!r})")
    version = int(meta.get(b"rayrep.schema_version", b"0"))
    if version != known:
        raise BufferFileError(f"{path}: {kind} schema version {version}, this rayrep reads version {known}")


def _write_atomic(table: pa.Table, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    os.close(fd)
    try:
        pq.write_table(table, temp)
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


# ---------------------------------------------------------------------- snapshots

ANSWER_SCHEMA = pa.schema([
    ("uid", pa.string()),
    ("prompt_ids", pa.list_(pa.int32())),
    ("response_ids", pa.list_(pa.int32())),
    ("logprobs", pa.list_(pa.float32())),
    ("reward", pa.float32()),
    ("version", pa.int32()),
    ("source", pa.string()),
    ("step", pa.int32()),
])
QUESTION_SCHEMA = pa.schema([("uid", pa.string()), ("bucket", pa.int32()), ("retired", pa.bool_())])


def write_snapshot(parts: list[dict], directory: Path) -> Path:
    """Write shard exports (see `ReplayShard.export`) as one snapshot, independent of shard count."""
    questions = sorted((q for part in parts for q in part["questions"]), key=lambda q: q[0])
    retired = sorted(uid for part in parts for uid in part["retired"])
    evicted = sum(part["evicted"] for part in parts)
    columns: dict[str, list] = {name: [] for name in ANSWER_SCHEMA.names}
    for uid, entry in questions:
        for i in range(len(entry)):
            answer = entry.answer(i)
            columns["uid"].append(uid)
            columns["prompt_ids"].append(entry.prompt_ids)
            columns["response_ids"].append(answer.response_ids)
            columns["logprobs"].append(answer.logprobs)
            columns["reward"].append(answer.reward)
            columns["version"].append(answer.version)
            columns["source"].append(answer.source)
            columns["step"].append(answer.step)
    meta = {"rayrep.kind": "buffer-snapshot", "rayrep.schema_version": str(SNAPSHOT_VERSION), "rayrep.evicted": str(evicted)}
    answers = pa.table(columns, schema=ANSWER_SCHEMA.with_metadata(meta))
    question_rows = [(uid, entry.bucket, False) for uid, entry in questions] + [(uid, -1, True) for uid in retired]
    question_rows.sort()
    question_table = pa.table(
        {"uid": [r[0] for r in question_rows], "bucket": [r[1] for r in question_rows], "retired": [r[2] for r in question_rows]},
        schema=QUESTION_SCHEMA.with_metadata(meta),
    )
    directory.mkdir(parents=True, exist_ok=True)
    _write_atomic(answers, directory / "answers.parquet")
    _write_atomic(question_table, directory / "questions.parquet")
    return directory


def read_snapshot(directory: Path) -> tuple[list[tuple[str, QuestionAnswers]], list[str], int]:
    answers = _read(directory / "answers.parquet")
    questions = _read(directory / "questions.parquet")
    _check_version(directory / "answers.parquet", answers, "buffer-snapshot", SNAPSHOT_VERSION)
    _check_version(directory / "questions.parquet", questions, "buffer-snapshot", SNAPSHOT_VERSION)
    evicted = int((answers.schema.metadata or {}).get(b"rayrep.evicted", b"0"))
    entries: dict[str, QuestionAnswers] = {}
    pending: dict[str, list[Answer]] = {}
    for row in answers.to_pylist():
        uid = row["uid"]
        if uid not in entries:
            entries[uid] = QuestionAnswers(np.array(row["prompt_ids"], np.int32))
            pending[uid] = []
        pending[uid].append(Answer(np.array(row["response_ids"], np.int32), np.array(row["logprobs"], np.float32),
                                   row["reward"], row["version"], row["source"], row["step"]))
    for uid, answers_of in pending.items():
        entries[uid].extend(answers_of, cap=len(answers_of))
    retired = []
    for row in questions.to_pylist():
        if row["retired"]:
            retired.append(row["uid"])
        elif row["uid"] in entries:
            entries[row["uid"]].bucket = row["bucket"]
    return sorted(entries.items()), retired, evicted


# ---------------------------------------------------------------------- experience pools

POOL_SCHEMA = pa.schema([
    ("uid", pa.string()),
    ("prompt", pa.string()),
    ("ground_truth", pa.string()),
    ("data_source", pa.string()),
    ("prompt_ids", pa.list_(pa.int32())),
    ("response_ids", pa.list_(pa.int32())),
    ("logprobs", pa.list_(pa.float32())),
    ("text", pa.string()),
    ("reward", pa.float32()),
    ("length", pa.int32()),
    ("version", pa.int32()),
    ("source_checkpoint", pa.string()),
])


def write_pool(rows: list[dict], path: Path, source_checkpoint: str) -> Path:
    """Write an experience pool: one row per verified success (see POOL_SCHEMA).

    `rows` hold: uid, prompt (chat messages), ground_truth, data_source, prompt_ids,
    response_ids, logprobs, text, reward, version.
    """
    table = pa.table(
        {
            "uid": [r["uid"] for r in rows],
            "prompt": [json.dumps(list(r["prompt"])) for r in rows],
            "ground_truth": [r["ground_truth"] for r in rows],
            "data_source": [r["data_source"] for r in rows],
            "prompt_ids": [list(r["prompt_ids"]) for r in rows],
            "response_ids": [list(r["response_ids"]) for r in rows],
            "logprobs": [list(r["logprobs"]) for r in rows],
            "text": [r["text"] for r in rows],
            "reward": [float(r["reward"]) for r in rows],
            "length": [len(r["response_ids"]) for r in rows],
            "version": [int(r.get("version", 0)) for r in rows],
            "source_checkpoint": [source_checkpoint] * len(rows),
        },
        schema=POOL_SCHEMA.with_metadata({"rayrep.kind": "experience-pool", "rayrep.schema_version": str(POOL_VERSION)}),
    )
    _write_atomic(table, Path(path))
    return Path(path)


def read_pool(path: str | Path) -> dict[str, tuple[np.ndarray, list[Answer]]]:
    """question id -> (prompt ids, its stored successes) of a pool written by `write_pool`."""
    path = Path(path)
    table = _read(path)
    _check_version(path, table, "experience-pool", POOL_VERSION)
    pool: dict[str, tuple[np.ndarray, list[Answer]]] = {}
    for index, row in enumerate(table.to_pylist()):
        if len(row["response_ids"]) != len(row["logprobs"]):
            raise BufferFileError(f"{path}, row {index + 1}: {len(row['response_ids'])} token ids but {len(row['logprobs'])} log-probs")
        if row["uid"] not in pool:
            pool[row["uid"]] = (np.array(row["prompt_ids"], np.int32), [])
        pool[row["uid"]][1].append(
            Answer(np.array(row["response_ids"], np.int32), np.array(row["logprobs"], np.float32), row["reward"],
                   row["version"], "pool", 0)
        )
    return pool


def import_text_pool(path: str | Path, tokenizer, out_path: str | Path, reward: float = 1.0, max_response_tokens: int | None = None) -> tuple[Path, int]:
    """Convert a public RLEP pool (verl/DAPO rows with `reward_model.candidates`, text only)
    into a rayrep pool by tokenizing: the prompt with the chat template, each candidate as
    the policy would have emitted it (text then end-of-sequence).

    Text carries no behaviour log-probs: they are stored as NaN, and replay must recompute
    them (`algorithm.rlep.old_logprobs = "recompute"`, the default). Returns the written
    path and the number of candidates.
    """
    from rayrep.data import encode_prompts
    from rayrep.data.loaders import PromptFileError, load_prompts

    prompts = load_prompts(path)
    rows = []
    prompt_ids = encode_prompts(tokenizer, prompts, max_tokens=10**9)
    for number, (prompt, ids) in enumerate(zip(prompts, prompt_ids), start=1):
        candidates = (prompt.extra.get("reward_model") or {}).get("candidates")
        if not isinstance(candidates, list) or not all(isinstance(c, str) for c in candidates):
            raise PromptFileError(f"{path}, row {number}: field 'reward_model.candidates' must be a list of strings")
        for text in candidates:
            response = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            if max_response_tokens:
                response = response[:max_response_tokens]
            rows.append({
                "uid": prompt.uid, "prompt": prompt.messages, "ground_truth": prompt.ground_truth,
                "data_source": prompt.data_source, "prompt_ids": ids, "response_ids": response,
                "logprobs": [math.nan] * len(response), "text": text, "reward": reward, "version": 0,
            })
    return write_pool(rows, Path(out_path), source_checkpoint=f"imported:{Path(path).name}"), len(rows)
