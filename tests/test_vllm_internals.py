"""What rayrep relies on vLLM (0.32) to do, each behaviour tested on a real engine of the
embedded tiny policy, in this process: the request loop that `rayrep.generator.vllm_internals`
drives by hand, the engine settings of `rayrep.generator.engine` (one wave, a group's prompt
prefilled once) and its log-probs. A vLLM upgrade that changes one of them fails here.
(The worker extension's weight loading: tests/test_learner_and_sync.py and test_serve.py.)"""

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.slow  # a vLLM engine


def first_prompts(cfg, llm, count: int, split: str = "train") -> list[list[int]]:
    from rayrep.data import encode_prompts, load_split

    return encode_prompts(llm.get_tokenizer(), load_split(cfg.data, split)[:count], cfg.data.max_prompt_tokens)


def loop_answers(llm, prompt_ids, streamed: bool, **sampling) -> dict[str, list]:
    """Every request's answers through a `RequestLoop`, by the name each was added under:
    [token ids, log-probs, finish reasons in the order they came] per answer."""
    from rayrep.generator.vllm_internals import RequestLoop

    loop = RequestLoop(llm, streamed=streamed)
    for position, ids in enumerate(prompt_ids):
        loop.add(f"q{position}", ids, seed=position, **sampling)
    answers: dict[str, list] = {}
    while loop.busy():
        for name, completions in loop.step():
            group = answers.setdefault(name, [[[], [], []] for _ in range(sampling["n"])])
            for completion in completions:
                tokens, logprobs, reasons = group[completion.index]
                assert len(completion.logprobs) == len(completion.token_ids)  # the sampled token's alone
                tokens.extend(completion.token_ids)
                logprobs.extend(completion.logprobs)
                reasons.append(completion.finish_reason)
    return answers


@pytest.fixture(scope="module")
def tiny_engine(tiny_cfg, tiny_policy):
    """The tiny policy in a vLLM engine as the generators build it, in this process."""
    from rayrep.generator.engine import make_engine

    return make_engine(tiny_cfg, tiny_policy)


SAMPLING = dict(n=4, temperature=1.0, top_p=1.0, max_tokens=24)


def test_the_request_loop_gives_what_llm_generate_gives(tiny_engine, tiny_cfg):
    """Requests added by name and stepped by hand: each reported under the name it was given,
    whole once done, with the answers, log-probs and finish reasons of `LLM.generate` (the
    public call) on the same prompts and seeds."""
    from vllm import SamplingParams
    from vllm.inputs import tokens_input

    prompt_ids = first_prompts(tiny_cfg, tiny_engine, 6)
    looped = loop_answers(tiny_engine, prompt_ids, streamed=False, **SAMPLING)
    outputs = tiny_engine.generate([tokens_input(ids) for ids in prompt_ids],
                                   [SamplingParams(seed=p, logprobs=0, **SAMPLING) for p in range(len(prompt_ids))],
                                   use_tqdm=False)
    assert sorted(looped) == sorted(f"q{p}" for p in range(len(prompt_ids)))
    for position, output in enumerate(outputs):
        for completion, (tokens, logprobs, reasons) in zip(output.outputs, looped[f"q{position}"]):
            assert tokens == list(completion.token_ids) and reasons == [completion.finish_reason]
            expected = [entry[token].logprob for entry, token in zip(completion.logprobs, completion.token_ids)]
            assert np.allclose(logprobs, expected, atol=1e-5)


def test_streamed_steps_add_up_to_the_whole_answers(tiny_engine, tiny_cfg):
    """Streamed, each step reports the tokens it added to each answer, the finish reason
    with the last of them: put together they are the answers reported whole."""
    prompt_ids = first_prompts(tiny_cfg, tiny_engine, 6)
    whole = loop_answers(tiny_engine, prompt_ids, streamed=False, **SAMPLING)
    streamed = loop_answers(tiny_engine, prompt_ids, streamed=True, **SAMPLING)
    assert sorted(streamed) == sorted(whole)
    for name, answers in whole.items():
        for (tokens, logprobs, (reason,)), (s_tokens, s_logprobs, s_reasons) in zip(answers, streamed[name]):
            assert s_tokens == tokens and np.allclose(s_logprobs, logprobs, atol=1e-5)
            assert len(s_reasons) > 1 and set(s_reasons[:-1]) == {None} and s_reasons[-1] == reason


def test_requests_aborted_by_the_engines_ids_leave_it_idle(tiny_engine, tiny_cfg):
    """Aborting requests of n > 1 answers part way by the ids `add` returned leaves nothing
    in the engine, and it samples a new request as a fresh engine would."""
    from rayrep.generator.vllm_internals import RequestLoop

    prompt_ids = first_prompts(tiny_cfg, tiny_engine, 4)
    before = loop_answers(tiny_engine, prompt_ids[:1], streamed=False, **SAMPLING)
    loop = RequestLoop(tiny_engine, streamed=True)
    ids = [loop.add(f"stopped{p}", ids, seed=p, **SAMPLING) for p, ids in enumerate(prompt_ids)]
    list(loop.step())
    assert loop.busy()
    loop.abort(ids)
    assert not loop.busy()
    assert loop_answers(tiny_engine, prompt_ids[:1], streamed=False, **SAMPLING) == before


def test_a_steps_answers_run_in_one_wave_and_each_group_prefills_its_prompt_once(tiny_engine, tiny_cfg):
    """A step's 64 questions x 8 answers all start in the engine's first step (one wave, not
    vLLM's CPU default of 256 sequences at a time), and the answers of a group reuse their
    prompt's keys and values from the prefix cache but for its last, partial block (vLLM's
    CPU default of 128-token blocks shares none of a 34-token prompt). Counted by the engine
    itself: its steps, and each answer's cached prompt tokens."""
    from vllm import SamplingParams
    from vllm.inputs import tokens_input

    from rayrep.generator.engine import CPU_BLOCK_SIZE

    algo = tiny_cfg.algorithm
    prompt_ids = first_prompts(tiny_cfg, tiny_engine, algo.prompts_per_step)
    assert tiny_engine.reset_prefix_cache()  # (the tests before asked some of these prompts)
    engine, tokens = tiny_engine.llm_engine, 8
    for position, ids in enumerate(prompt_ids):  # every answer exactly `tokens` long
        engine.add_request(f"wave-{position}", tokens_input(ids), SamplingParams(
            n=algo.group_size, max_tokens=tokens, min_tokens=tokens, seed=position, detokenize=False))
    first = engine.step()  # each answer of a group reports itself, under its group's name
    cached: dict[str, list[int]] = {}
    for output in first:
        cached.setdefault(output.request_id, []).append(output.num_cached_tokens)
    steps = 1
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    # One wave: the first step gave every answer its first token, then one step per token.
    assert len(first) == algo.prompts_per_step * algo.group_size and steps == tokens
    # By hand: the first answer of a group computes its prompt; each other answer finds the
    # prompt's whole blocks cached, all but the last token (which it must compute).
    for position, ids in enumerate(prompt_ids):
        shared = (len(ids) - 1) // CPU_BLOCK_SIZE * CPU_BLOCK_SIZE
        assert sorted(cached[f"wave-{position}"]) == [0] + [shared] * (algo.group_size - 1), position
        assert shared >= len(ids) - CPU_BLOCK_SIZE


def test_vllm_logprobs_match_transformers(tiny_engine, tiny_policy, tiny_cfg):
    """The same checkpoint in vLLM: sampled tokens' log-probs equal a transformers forward pass."""
    from transformers import AutoModelForCausalLM

    from rayrep.generator.engine import sample

    llm = tiny_engine
    prompt_ids = first_prompts(tiny_cfg, llm, 8, "test")
    groups = sample(llm, prompt_ids, n=2, temperature=1.0, top_p=1.0, max_tokens=48)
    model = AutoModelForCausalLM.from_pretrained(tiny_policy).eval()
    for group in groups:
        for rollout in group:
            assert len(rollout.logprobs) == len(rollout.response_ids) > 0
            ids = torch.tensor([rollout.prompt_ids.tolist() + rollout.response_ids.tolist()])
            with torch.no_grad():
                logits = model(ids).logits[0, len(rollout.prompt_ids) - 1 : -1]
            expected = torch.log_softmax(logits.float(), -1).gather(1, torch.from_numpy(rollout.response_ids.astype(np.int64))[:, None])[:, 0]
            assert torch.allclose(torch.from_numpy(rollout.logprobs.copy()), expected, atol=1e-3), (rollout.text,)
