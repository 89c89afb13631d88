"""The policy server: Ray Serve on a real local cluster, a real vLLM engine, real HTTP, and
the official `openai` client."""

import asyncio
import json

import httpx
import openai
import pytest

from rayrep.cluster.placement import free_port
from rayrep.serve import openai_api as oai

QUESTION = "2+5=? Answer in \\boxed{}."
PROMPT = f"Q: {QUESTION}\nA: "  # the tiny policy's chat template around one user message
CAPS = {"serve.max_tokens": 48, "serve.max_n": 4, "serve.max_prompts": 4, "serve.max_request_bytes": 100_000}


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_cfg, tiny_policy):
    """The tiny policy served as "tiny" on a free port of the session's Ray cluster; Serve
    stopped afterwards."""
    from ray import serve

    from rayrep.serve.app import build_app

    cfg = tiny_cfg.replace(**CAPS, **{"serve.port": free_port()})
    try:
        serve.start(http_options={"host": cfg.serve.host, "port": cfg.serve.port})
        serve.run(build_app(cfg, tiny_policy, "tiny"), name="policy", route_prefix="/")
        yield f"http://{cfg.serve.host}:{cfg.serve.port}"
    finally:
        serve.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def greedy_answer(policy: str, prompt: str, max_new_tokens: int) -> str:
    """The tiny policy's greedy answer, by transformers: what the server must say at T=0."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_models_names_the_checkpoint(client):
    (model,) = client.models.list().data
    assert model.id == "tiny"
    assert model.model_extra["max_model_len"] == 256  # the tiny policy's positions


def test_completions_chat_and_streaming_answer_with_the_policy(client, tiny_policy):
    expected = greedy_answer(tiny_policy, PROMPT, 32)
    assert "\\boxed{" in expected  # the policy answers in the task's format

    completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=32, temperature=0)
    assert completion.choices[0].text == expected
    assert completion.usage.prompt_tokens == len(PROMPT)  # the tiny tokenizer: one token per character
    assert completion.usage.completion_tokens > 0

    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=32, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == expected  # rendered with the checkpoint's chat template

    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=32, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == chat.usage.completion_tokens


def test_streamed_completions_keep_each_prompts_answers_apart(client):
    prompts = [PROMPT, "Q: 63-5=? Answer in \\boxed{}.\nA: "]
    whole = client.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=24, temperature=0)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    texts: dict[int, str] = {}
    finished = {}
    for chunk in client.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=24, temperature=0,
                                           stream=True):
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.finish_reason:
            finished[choice.index] = choice.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert sorted(finished) == [0, 1, 2, 3]
    assert texts[0] != texts[2]  # two questions, two answers


def test_sampling_is_seeded_and_bounded(client):
    def ask(seed):
        return [c.text for c in client.completions.create(model="tiny", prompt=PROMPT, n=4, max_tokens=24,
                                                          temperature=1.0, seed=seed).choices]

    assert ask(7) == ask(7)
    stopped = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=32, temperature=0, stop=["{"])
    assert "{" not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"
    long = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
    assert long.usage.completion_tokens == 3 and long.choices[0].finish_reason == "length"


BAD_REQUESTS = [
    # (route, body, status, code or param it must name)
    ("completions", b'{"model": "tiny", "prompt": ', 400, "invalid_json"),
    ("completions", b"[1, 2]", 400, "invalid_json"),
    ("completions", {"model": "gpt-4", "prompt": PROMPT}, 404, "model_not_found"),
    ("completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 49}, 400, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": "1+" * 200, "max_tokens": 8}, 400, "context_length_exceeded"),
    ("completions", {"model": "tiny", "prompt": "1+" * 200}, 400, "context_length_exceeded"),
    ("completions", {"model": "tiny", "prompt": PROMPT, "temperature": "hot"}, 400, "temperature"),
    ("completions", {"model": "tiny", "prompt": PROMPT, "temperature": 2.5}, 400, "temperature"),
    ("completions", {"model": "tiny", "prompt": PROMPT, "n": 1.5}, 400, "n"),
    ("completions", {"model": "tiny", "prompt": PROMPT, "n": 5}, 400, "n"),
    ("completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": True}, 400, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": 5}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": [PROMPT] * 5}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": [1, 2, 99999]}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("completions", {"model": "tiny"}, 400, "missing_required_parameter"),
    ("completions", {"model": "tiny", "prompt": PROMPT, "stream": "yes"}, 400, "stream"),
    ("completions", {"model": "tiny", "prompt": PROMPT, "logprobs": 5}, 400, "unsupported_parameter"),
    ("completions", {"model": "tiny", "prompt": PROMPT, "frobnicate": 1}, 400, "frobnicate"),
    ("completions", {"model": "tiny", "prompt": "x" * 150_000}, 413, "request_too_large"),
    ("chat/completions", {"model": "tiny", "messages": "hello"}, 400, "messages"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": QUESTION}],
                          "max_completion_tokens": 100}, 400, "max_completion_tokens"),
]


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, client):
    with httpx.Client(base_url=f"{server}/v1", timeout=60) as http:
        for route, body, status, name in BAD_REQUESTS:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            response = http.post(f"/{route}", content=content, headers={"Content-Type": "application/json"})
            assert response.status_code == status, (route, body if len(content) < 300 else "(large)", response.text)
            error = response.json()["error"]
            assert name in (error["code"], error["param"]), (name, error)
            assert error["message"] and error["type"] == "invalid_request_error"
            # ... and the next good request is answered.
            good = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
            assert good.choices[0].text
        assert http.get("/completions").status_code == 405  # wrong method, same error shape
        assert http.get("/nowhere").json()["error"]["message"]


def test_the_official_client_sees_errors_as_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUESTION}], max_tokens=1000)


def test_64_concurrent_requests_all_succeed(server):
    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300) as aclient:
            return await asyncio.gather(*(
                aclient.completions.create(model="tiny", prompt=f"Q: {i}+{i}=? Answer in \\boxed{{}}.\nA: ",
                                           max_tokens=24, temperature=0)
                for i in range(64)))

    answers = asyncio.run(main())
    assert len(answers) == 64
    assert all(a.choices[0].finish_reason in ("stop", "length") and a.choices[0].text for a in answers)
    assert len({a.id for a in answers}) == 64


def test_request_rules_without_a_server(tiny_cfg):
    caps = tiny_cfg.serve
    request = oai.parse_chat({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                      {"type": "text", "text": "b"}]}],
                              "stop": "x", "user": "someone"}, caps)
    assert request.messages == ({"role": "user", "content": "ab"},)
    assert request.sampling.stop == ("x",) and request.sampling.max_tokens is None
    for body, param in [
        ({"model": "m", "prompt": "p", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": "m", "prompt": "p", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"model": "m", "prompt": "p", "top_p": 0}, "top_p"),
        ({"model": 3, "prompt": "p"}, "model"),
    ]:
        with pytest.raises(oai.APIError) as caught:
            oai.parse_completion(body, caps)
        assert caught.value.param == param and caught.value.status == 400
    # No max_tokens: as many as the context and the cap allow.
    assert oai.answer_tokens(None, 250, 256, 1024, "prompt") == 6
    assert oai.answer_tokens(None, 10, 256, 32, "prompt") == 32
    assert oai.answer_tokens(6, 250, 256, 1024, "prompt") == 6
    with pytest.raises(oai.APIError, match="257 tokens"):
        oai.answer_tokens(7, 250, 256, 1024, "prompt")
