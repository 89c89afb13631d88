import pytest

from rayrep.data import encode_prompts, load_split, PromptTooLong
from rayrep.data.arithmetic import TEST_RESERVE, Level, arithmetic_prompts, make_splits, resolve_levels
from rayrep.config import DataConfig, load_preset
from rayrep.models.tokenizer import build_char_tokenizer
from rayrep.verifier.math import score


def test_splits_are_deterministic_disjoint_and_sized():
    train, test = make_splits(3000, 200, seed=7)
    again_train, again_test = make_splits(3000, 200, seed=7)
    assert [p.expression for p in train] == [p.expression for p in again_train]
    assert [p.expression for p in test] == [p.expression for p in again_test]
    assert len(train) == 3000 and len(test) == 200
    assert not {p.expression for p in train} & {p.expression for p in test}
    other_train, _ = make_splits(3000, 200, seed=8)
    assert [p.expression for p in other_train] != [p.expression for p in train]


def test_growing_train_split_keeps_the_test_split():
    _, small = make_splits(100, 50, seed=0)
    _, large = make_splits(5000, 50, seed=0)
    assert [p.expression for p in small] == [p.expression for p in large]


def test_splits_are_prefixes_and_train_ignores_the_test_size():
    train_a, test_a = make_splits(300, 64, seed=3)
    train_b, test_b = make_splits(2000, 500, seed=3)
    assert [p.expression for p in test_a] == [p.expression for p in test_b[:64]]
    assert [p.expression for p in train_a] == [p.expression for p in train_b[:300]]
    # A train split never holds a problem of any test split up to the reserve.
    _, largest_test = make_splits(0, TEST_RESERVE, seed=3)
    assert not {p.expression for p in train_b} & {p.expression for p in largest_test}


def test_a_larger_reserve_moves_the_train_split_past_a_larger_test_split():
    train, test = make_splits(500, 3000, seed=3, reserve=3000)
    again, _ = make_splits(500, 10, seed=3, reserve=3000)
    assert [p.expression for p in again] == [p.expression for p in train]  # the test size still does not matter
    assert len(test) == 3000 and not {p.expression for p in train} & {p.expression for p in test}
    default_train, _ = make_splits(500, 10, seed=3)
    assert [p.expression for p in default_train] != [p.expression for p in train]


def test_answers_follow_left_to_right_evaluation():
    train, _ = make_splits(2000, 10, seed=0, levels=("mix3", "sub2", "add3", "mul1"))
    for problem in train:
        parts = problem.expression.replace("+", " + ").replace("-", " - ").replace("*", " * ").split()
        value = int(parts[0])
        for op, operand in zip(parts[1::2], parts[2::2]):
            value = {"+": value + int(operand), "-": value - int(operand), "*": value * int(operand)}[op]
        assert problem.answer == value, problem


def test_levels_control_operands_and_digits():
    train, _ = make_splits(500, 10, seed=0, levels=("mix4",))
    for problem in train:
        operands = problem.expression.replace("-", "+").split("+")
        assert len(operands) == 4
        assert all(1 <= len(x) <= 2 for x in operands)
    with pytest.raises(ValueError, match="unknown arithmetic level"):
        resolve_levels(["add9"])
    with pytest.raises(ValueError, match="operands must be >= 2"):
        Level("bad", operands=1, min_digits=1, max_digits=1)


def test_small_levels_drop_out_instead_of_repeating():
    train, test = make_splits(400, 20, seed=0, levels=("add1", "add2"))
    assert len({p.expression for p in train + test}) == 420
    assert sum(p.level == "add1" for p in train + test) <= 100
    with pytest.raises(ValueError, match="too few distinct problems"):
        make_splits(150, 10, seed=0, levels=("add1",))


def test_worked_solution_is_verified_correct_and_a_wrong_one_is_not():
    train, _ = make_splits(40, 10, seed=0)
    for problem in train:
        solution = problem.solution()
        assert solution.endswith(f"\\boxed{{{problem.answer}}}")
        assert score(solution, str(problem.answer)) == 1.0
        assert score(f"\\boxed{{{problem.answer + 1}}}", str(problem.answer)) == 0.0


def test_prompts_ask_for_a_boxed_answer_and_have_stable_ids():
    prompts = arithmetic_prompts("test", 100, 20, seed=0)
    assert len(prompts) == 20
    assert all("\\boxed{}" in p.text for p in prompts)
    assert prompts[3].uid == "arith-test-3"
    assert prompts == arithmetic_prompts("test", 100, 20, seed=0)
    # drawn on their own, the test prompts are make_splits' test split
    assert prompts == [p.to_prompt("test", i) for i, p in enumerate(make_splits(100, 20, seed=0)[1])]
    with pytest.raises(ValueError, match="only 100 distinct problems, fewer than the 150 test questions"):
        arithmetic_prompts("test", 0, 150, seed=0, levels=("add1",))
    assert load_split(DataConfig(arithmetic_train_size=100, arithmetic_test_size=20), "test") == prompts


def test_encode_prompts_uses_the_chat_template_and_enforces_the_limit():
    tokenizer = build_char_tokenizer()
    prompts = arithmetic_prompts("test", 100, 5, seed=0)
    ids = encode_prompts(tokenizer, prompts, max_tokens=80)
    assert tokenizer.decode(ids[0]) == f"Q: {prompts[0].text}\nA: "
    with pytest.raises(PromptTooLong, match="arith-test-0.*more than data.max_prompt_tokens=5"):
        encode_prompts(tokenizer, prompts, max_tokens=5)


def test_prompt_files_replace_the_embedded_task(tmp_path):
    from rayrep.data.loaders import save_prompts

    path = save_prompts(arithmetic_prompts("train", 30, 5, seed=0), tmp_path / "train.jsonl")
    cfg = load_preset("tiny-cpu").replace(**{"data.train_files": (str(path),)})
    loaded = load_split(cfg.data, "train")
    assert [p.ground_truth for p in loaded] == [p.ground_truth for p in arithmetic_prompts("train", 30, 5, seed=0)]


def test_defaults_agree_between_task_config_and_tiny_policy():
    from rayrep.data.arithmetic import DEFAULT_LEVELS
    from rayrep.models import tiny_spec
    from rayrep.models.recipe import TinyPolicySpec

    assert DataConfig().arithmetic_levels == DEFAULT_LEVELS
    # The preset's tiny policy is the default build: one cached checkpoint serves both.
    assert tiny_spec(load_preset("tiny-cpu")) == TinyPolicySpec()
