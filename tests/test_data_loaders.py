"""Prompt files in the verl / DAPO row format and the plain one: round trips, verl-written parquet, errors."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rayrep.data.arithmetic import arithmetic_prompts
from rayrep.data.loaders import PromptFileError, content_uid, load_prompts, save_prompts
from rayrep.types import Prompt


def dapo_row(question="What is 6+7?", answer="13", index=None, **fields):
    row = {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": question}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule"},
    }
    if index is not None:
        row["extra_info"] = {"index": index}
    row.update(fields)
    return row


def write_jsonl(path, rows, blank_lines=()):
    """Rows as JSON lines; a row given as a str is written verbatim (for broken lines)."""
    lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
    for position in sorted(blank_lines):
        lines.insert(position, "   ")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def core(prompts):
    return [(p.uid, p.messages, p.ground_truth, p.data_source) for p in prompts]


def mixed_prompts():
    return arithmetic_prompts("train", num_train=5, num_test=3, seed=1) + [
        Prompt(
            uid="chat-1",
            messages=(
                {"role": "system", "content": "Reason step by step."},
                {"role": "user", "content": "Solve x+2=5. Put the answer in \\boxed{}."},
            ),
            ground_truth="3",
            data_source="math_dapo",
            extra={"ability": "MATH", "reward_model": {"style": "rule"}},
        ),
        Prompt(uid="ünï-2", messages=({"role": "user", "content": "Was ist 2·3? ✓"},), ground_truth="6"),
    ]


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".json"])
def test_round_trip_keeps_uid_messages_ground_truth_and_source(tmp_path, suffix):
    prompts = mixed_prompts()
    path = save_prompts(prompts, tmp_path / "sub" / f"export{suffix}")
    assert path.exists() and not list(path.parent.glob(".*.tmp"))
    loaded = load_prompts(path)
    assert core(loaded) == core(prompts)
    assert loaded == prompts  # dataclass equality ignores extra
    # extra comes back as row fields, the uid added as extra_info.index; reward_model keys
    # other than the answer stay in extra; fields only some rows have do not leak into others
    # (parquet stores them as nulls)
    assert loaded[0].extra == {"level": prompts[0].extra["level"], "extra_info": {"index": prompts[0].uid}}
    assert loaded[-2].extra == {"ability": "MATH", "reward_model": {"style": "rule"},
                                "extra_info": {"index": "chat-1"}}
    assert loaded[-1].extra == {"extra_info": {"index": "ünï-2"}}
    assert loaded[-2].text.startswith("Solve x+2=5")
    # and a second round trip changes nothing
    again = load_prompts(save_prompts(loaded, tmp_path / f"again{suffix}"))
    assert core(again) == core(prompts)
    assert [p.extra for p in again] == [p.extra for p in loaded]


def test_saved_rows_are_in_the_verl_format(tmp_path):
    path = save_prompts(mixed_prompts()[-2:], tmp_path / "out.jsonl")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert rows[0] == {
        "data_source": "math_dapo",
        "prompt": [
            {"role": "system", "content": "Reason step by step."},
            {"role": "user", "content": "Solve x+2=5. Put the answer in \\boxed{}."},
        ],
        "ability": "MATH",
        "reward_model": {"ground_truth": "3", "style": "rule"},
        "extra_info": {"index": "chat-1"},
    }
    assert rows[1]["extra_info"] == {"index": "ünï-2"}


def test_plain_rows_load_as_verl_rows_do(tmp_path):
    """Hand-made rows with a `prompt` or `question` and an `answer` give the same prompts as
    the verl rows of the same questions; what else they carry stays in extra; they round-trip."""
    plain = write_jsonl(tmp_path / "plain.jsonl", [
        {"prompt": "What is 6+7?", "answer": "13"},
        {"question": "What is 2*3?", "answer": 6, "level": "easy"},
    ])
    (tmp_path / "verl").mkdir()  # the same file name: the data source (the file's stem) is the same
    verl = write_jsonl(tmp_path / "verl" / "plain.jsonl", [
        {"prompt": "What is 6+7?", "reward_model": {"ground_truth": "13"}},
        {"prompt": "What is 2*3?", "reward_model": {"ground_truth": "6"}},
    ])
    loaded = load_prompts(plain)
    assert core(loaded) == core(load_prompts(verl))
    assert [p.ground_truth for p in loaded] == ["13", "6"] and loaded[1].extra == {"level": "easy"}
    assert core(load_prompts(save_prompts(loaded, tmp_path / "out.parquet"))) == core(loaded)


@pytest.mark.parametrize(
    "row, message",
    [
        ({"question": "What is 2*3?"}, "field 'reward_model' is missing (a plain row gives the ground truth as 'answer')"),
        ({"answer": "6"}, "field 'prompt' is missing (a plain row gives the question as 'question' or 'prompt')"),
        ({"question": "  ", "answer": "6"}, "field 'question' is empty"),
        ({"question": "What is 2*3?", "answer": ""}, "field 'answer' is empty"),
        ({"question": "What is 2*3?", "answer": [6]}, "field 'answer' must be a string or a number, got list"),
    ],
)
def test_plain_rows_errors_name_their_field(tmp_path, row, message):
    path = write_jsonl(tmp_path / "plain.jsonl", [{"question": "What is 1+1?", "answer": "2"}, row])
    with pytest.raises(PromptFileError) as error:
        load_prompts(path)
    assert str(error.value) == f"{path}, row 2: {message}"


def test_jsonl_string_prompts_blank_lines_and_extra_fields(tmp_path):
    rows = [
        dapo_row("Compute 2+2.", "4", index="q-a", extra_info={"index": "q-a", "split": "train"}),
        {"prompt": "What is 5*5?", "reward_model": {"ground_truth": 25}, "level": 3},
        dapo_row(
            "Pick one.",
            "B",
            index="q-c",
            reward_model={"ground_truth": "B", "style": "rule", "candidates": ["A", "B"]},
        ),
    ]
    path = write_jsonl(tmp_path / "mixed_set.jsonl", rows, blank_lines=(0, 2))
    first, second, third = load_prompts(path)

    assert first.uid == "q-a"
    assert first.messages == ({"role": "user", "content": "Compute 2+2."},)
    assert first.extra == {"ability": "MATH", "extra_info": {"index": "q-a", "split": "train"},
                           "reward_model": {"style": "rule"}}

    # a plain string prompt is one user message; no data_source -> the file stem
    assert second.messages == ({"role": "user", "content": "What is 5*5?"},)
    assert second.ground_truth == "25"
    assert second.data_source == "mixed_set"
    assert second.extra == {"level": 3}
    assert second.uid == content_uid("mixed_set", second.messages, "25")

    assert third.extra["reward_model"] == {"style": "rule", "candidates": ["A", "B"]}
    assert third.ground_truth == "B"


def test_verl_style_parquet_with_nested_struct_columns(tmp_path):
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    schema = pa.schema([
        ("data_source", pa.string()),
        ("prompt", pa.list_(message)),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
        ("extra_info", pa.struct([("index", pa.int64()), ("split", pa.string())])),
    ])
    table = pa.Table.from_pydict(
        {
            "data_source": ["openai/gsm8k", "openai/gsm8k"],
            "prompt": [
                [{"role": "user", "content": "Natalia sold 48 clips..."}],
                [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Weng earns $12..."},
                ],
            ],
            "ability": ["math", "math"],
            "reward_model": [
                {"ground_truth": "72", "style": "rule"},
                {"ground_truth": "10", "style": "rule"},
            ],
            "extra_info": [{"index": 0, "split": "train"}, {"index": 1, "split": "train"}],
        },
        schema=schema,
    )
    path = tmp_path / "gsm8k_train.parquet"
    pq.write_table(table, path)

    first, second = load_prompts(path)
    assert (first.uid, second.uid) == ("0", "1")  # integer index, stringified
    assert first.messages == ({"role": "user", "content": "Natalia sold 48 clips..."},)
    assert second.messages[0] == {"role": "system", "content": "Be brief."}
    assert second.text == "Weng earns $12..."
    assert (first.ground_truth, second.ground_truth) == ("72", "10")
    assert first.data_source == "openai/gsm8k"
    assert first.extra == {"ability": "math", "extra_info": {"index": 0, "split": "train"},
                           "reward_model": {"style": "rule"}}


def test_parquet_with_string_prompts_and_integer_answers(tmp_path):
    table = pa.table({
        "prompt": ["What is 30+4?", "What is 1+1?"],
        "reward_model": [{"ground_truth": 34}, {"ground_truth": 2}],
    })
    path = tmp_path / "plain.parquet"
    pq.write_table(table, path)
    first, second = load_prompts(path)
    assert first.messages == ({"role": "user", "content": "What is 30+4?"},)
    assert (first.ground_truth, second.ground_truth) == ("34", "2")
    assert first.data_source == "plain"
    assert first.extra == {}


def test_numeric_ground_truth_becomes_a_string(tmp_path):
    path = write_jsonl(tmp_path / "n.jsonl", [dapo_row(answer=34, index=1), dapo_row(answer=2.5, index=2)])
    assert [p.ground_truth for p in load_prompts(path)] == ["34", "2.5"]


# ----------------------------------------------------------------------------- uids


def test_content_uid_is_stable_and_depends_on_content(tmp_path):
    rows = [
        {"data_source": "s", "prompt": "What is 6+7?", "reward_model": {"ground_truth": "13"}},
        {"data_source": "s", "prompt": "What is 6+8?", "reward_model": {"ground_truth": "14"}},
    ]
    a = load_prompts(write_jsonl(tmp_path / "a.jsonl", rows))
    b = load_prompts(write_jsonl(tmp_path / "b.jsonl", list(reversed(rows))))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    c = load_prompts(tmp_path / "c.parquet")
    assert a[0].uid == b[1].uid == c[0].uid
    assert a[1].uid == b[0].uid == c[1].uid
    assert a[0].uid != a[1].uid
    # a fixed value: the uid must not depend on the process (no builtin hash, no randomness)
    assert a[0].uid == content_uid("s", ({"role": "user", "content": "What is 6+7?"},), "13")
    # the first 16 hex digits of sha1('["s",[["user","x"]],"1"]')
    assert content_uid("s", ({"role": "user", "content": "x"},), "1") == "99c186c40b8a58dc"


@pytest.mark.parametrize(
    "changed",
    [
        {"data_source": "t"},
        {"prompt": "What is 6+7 ?"},
        {"prompt": [{"role": "system", "content": "What is 6+7?"}, {"role": "user", "content": "go"}]},
        {"reward_model": {"ground_truth": "13.0"}},
    ],
)
def test_content_uid_changes_with_any_part_of_the_question(tmp_path, changed):
    base = {"data_source": "s", "prompt": "What is 6+7?", "reward_model": {"ground_truth": "13"}}
    first, second = load_prompts(write_jsonl(tmp_path / "u.jsonl", [base, {**base, **changed}]))
    assert first.uid != second.uid


def test_duplicate_index_names_both_rows(tmp_path):
    rows = [dapo_row("q1", index="a"), dapo_row("q2", index="b"), dapo_row("q3", index="a")]
    path = write_jsonl(tmp_path / "dup.jsonl", rows, blank_lines=(1,))
    with pytest.raises(PromptFileError) as info:
        load_prompts(path)
    message = str(info.value)
    assert "dup.jsonl, row 4:" in message  # line 4: the blank line counts
    assert "row 1" in message and "'extra_info.index'" in message and "'a'" in message
    assert info.value.row == 4 and info.value.field == "extra_info.index"


def test_integer_and_string_index_of_the_same_value_collide(tmp_path):
    path = write_jsonl(tmp_path / "dup.jsonl", [dapo_row("q1", index=7), dapo_row("q2", index="7")])
    with pytest.raises(PromptFileError, match=r"row 2: field 'extra_info.index'.*row 1"):
        load_prompts(path)


def test_duplicate_question_without_index_names_both_rows(tmp_path):
    rows = [dapo_row("q1"), dapo_row("q2"), dapo_row("q1")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "dup.parquet")
    with pytest.raises(PromptFileError) as info:
        load_prompts(tmp_path / "dup.parquet")
    message = str(info.value)
    assert "dup.parquet, row 3:" in message and "row 1" in message and "'prompt'" in message


def test_save_rejects_duplicate_uids_and_empty_sets(tmp_path):
    p = mixed_prompts()[0]
    with pytest.raises(ValueError, match="share the uid"):
        save_prompts([p, p], tmp_path / "x.jsonl")
    with pytest.raises(ValueError, match="no prompts"):
        save_prompts([], tmp_path / "x.jsonl")
    with pytest.raises(ValueError, match="extension"):
        save_prompts([p], tmp_path / "x.csv")
    assert not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------- bad rows

GOOD = dapo_row("fine", "1")
BAD_ROWS = [
    # (row, field named in the error)
    ({k: v for k, v in GOOD.items() if k != "prompt"}, "prompt"),
    ({**GOOD, "prompt": None}, "prompt"),
    ({**GOOD, "prompt": 5}, "prompt"),
    ({**GOOD, "prompt": []}, "prompt"),
    ({**GOOD, "prompt": "   "}, "prompt"),
    ({**GOOD, "prompt": ["just text"]}, "prompt[0]"),
    ({**GOOD, "prompt": [{"role": "tool", "content": "x"}]}, "prompt[0].role"),
    ({**GOOD, "prompt": [{"content": "x"}]}, "prompt[0].role"),
    ({**GOOD, "prompt": [{"role": "user", "content": ["x"]}]}, "prompt[0].content"),
    ({**GOOD, "prompt": [{"role": "system", "content": "only a system message"}]}, "prompt"),
    ({k: v for k, v in GOOD.items() if k != "reward_model"}, "reward_model"),
    ({**GOOD, "reward_model": "13"}, "reward_model"),
    ({**GOOD, "reward_model": {"style": "rule"}}, "reward_model.ground_truth"),
    ({**GOOD, "reward_model": {"ground_truth": None}}, "reward_model.ground_truth"),
    ({**GOOD, "reward_model": {"ground_truth": ""}}, "reward_model.ground_truth"),
    ({**GOOD, "reward_model": {"ground_truth": ["1", "2"]}}, "reward_model.ground_truth"),
    ({**GOOD, "reward_model": {"ground_truth": {"value": "1"}}}, "reward_model.ground_truth"),
    ({**GOOD, "reward_model": {"ground_truth": True}}, "reward_model.ground_truth"),
    ({**GOOD, "data_source": 3}, "data_source"),
    ({**GOOD, "data_source": ""}, "data_source"),
    ({**GOOD, "extra_info": {"index": ""}}, "extra_info.index"),
    ({**GOOD, "extra_info": {"index": [1]}}, "extra_info.index"),
]


@pytest.mark.parametrize("bad_row, field", BAD_ROWS)
def test_bad_jsonl_row_names_file_line_and_field(tmp_path, bad_row, field):
    rows = [dapo_row("q1", index="a"), dapo_row("q2", index="b"), bad_row, dapo_row("q4", index="d")]
    path = write_jsonl(tmp_path / "train.jsonl", rows, blank_lines=(1, 1))  # bad row on line 5
    with pytest.raises(PromptFileError) as info:
        load_prompts(path)
    assert str(info.value).startswith(f"{path}, row 5: field '{field}' ")
    assert (info.value.row, info.value.field, info.value.path) == (5, field, str(path))
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "bad_row, field",
    [
        ({**GOOD, "prompt": []}, "prompt"),
        ({**GOOD, "reward_model": {"ground_truth": ""}}, "reward_model.ground_truth"),
        ({**GOOD, "reward_model": {"ground_truth": None}}, "reward_model.ground_truth"),
    ],
)
def test_bad_parquet_row_names_file_row_and_field(tmp_path, bad_row, field):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([GOOD, dapo_row("other"), bad_row]), path)
    with pytest.raises(PromptFileError, match=rf"train\.parquet, row 3: field '{field}'"):
        load_prompts(path)


def test_parquet_without_a_reward_model_column(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"]}), path)
    with pytest.raises(PromptFileError, match=r"train\.parquet, row 1: field 'reward_model' is missing"):
        load_prompts(path)


def test_invalid_json_line_and_non_object_row(tmp_path):
    path = write_jsonl(tmp_path / "broken.jsonl", [GOOD, '{"prompt": "x", '])
    with pytest.raises(PromptFileError, match=r"broken\.jsonl, row 2: invalid JSON"):
        load_prompts(path)
    path = write_jsonl(tmp_path / "list.jsonl", [GOOD, [1, 2]], blank_lines=(0,))
    with pytest.raises(PromptFileError, match=r"list\.jsonl, row 3: a row must be an object, got list"):
        load_prompts(path)


def test_json_file_errors(tmp_path):
    (tmp_path / "obj.json").write_text(json.dumps(GOOD))
    with pytest.raises(PromptFileError, match=r"obj\.json: .*list of rows"):
        load_prompts(tmp_path / "obj.json")
    (tmp_path / "rows.json").write_text(json.dumps([GOOD, {"prompt": "x"}]))
    with pytest.raises(PromptFileError, match=r"rows\.json, row 2: field 'reward_model' is missing"):
        load_prompts(tmp_path / "rows.json")
    (tmp_path / "bad.json").write_text("[{")
    with pytest.raises(PromptFileError, match=r"bad\.json: invalid JSON"):
        load_prompts(tmp_path / "bad.json")


# ----------------------------------------------------------------------------- bad files


def test_unknown_extension(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text("prompt,answer\n")
    with pytest.raises(PromptFileError, match=r"train\.csv: unknown prompt file extension '\.csv'"):
        load_prompts(path)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(PromptFileError, match=r"nowhere\.jsonl: file not found"):
        load_prompts(tmp_path / "nowhere.jsonl")
    (tmp_path / "folder.parquet").mkdir()
    with pytest.raises(PromptFileError, match=r"folder\.parquet: not a file"):
        load_prompts(tmp_path / "folder.parquet")


def test_empty_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n  \n\n")
    (tmp_path / "empty.json").write_text("[]")
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    for name in ("empty.jsonl", "empty.json", "empty.parquet"):
        with pytest.raises(PromptFileError, match=rf"{name}: no rows"):
            load_prompts(tmp_path / name)


def test_file_that_is_not_parquet(tmp_path):
    path = tmp_path / "fake.parquet"
    path.write_text('{"prompt": "x"}\n')
    with pytest.raises(PromptFileError, match=r"fake\.parquet: cannot read as parquet"):
        load_prompts(path)


def test_non_utf8_jsonl(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + '{"prompt": "caf\u00e9"}'.encode("latin-1") + b"\n")
    with pytest.raises(PromptFileError, match=r"latin\.jsonl: not UTF-8"):
        load_prompts(path)


# ----------------------------------------------------------------------------- scale


def test_dapo_sized_parquet_loads(tmp_path):
    """All 17k rows of a DAPO-Math-17k-sized file (how fast: bench/inputs.py)."""
    n = 17_000
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    table = pa.table({
        "data_source": pa.array(["math_dapo"] * n),
        "prompt": pa.array([[{"role": "user", "content": f"Question {i}: " + "x" * 300}] for i in range(n)],
                           pa.list_(message)),
        "ability": pa.array(["MATH"] * n),
        "reward_model": pa.array([{"ground_truth": str(i), "style": "rule"} for i in range(n)]),
        "extra_info": pa.array([{"index": f"{i:08x}-uuid"} for i in range(n)]),
    })
    path = tmp_path / "dapo-math-17k.parquet"
    pq.write_table(table, path)
    prompts = load_prompts(path)
    assert len(prompts) == n
    assert prompts[-1].uid == f"{n - 1:08x}-uuid" and prompts[-1].ground_truth == str(n - 1)
    assert prompts[123].messages == ({"role": "user", "content": "Question 123: " + "x" * 300},)


def test_prompt_file_error_is_a_plain_value_error_without_a_location():
    err = PromptFileError("a.jsonl: question id 'x' also appears in b.jsonl")
    assert str(err) == "a.jsonl: question id 'x' also appears in b.jsonl"
    assert (err.path, err.row, err.field) == (None, None, None)
    located = PromptFileError("is missing", path="data/train.jsonl", row=7, field="reward_model.ground_truth")
    assert str(located) == "data/train.jsonl, row 7: field 'reward_model.ground_truth' is missing"
    assert str(PromptFileError("file not found", path="x.parquet")) == "x.parquet: file not found"
