"""The policy server: Ray Serve on a real local cluster, a real vLLM engine, real HTTP, and
the official `openai` client."""

import asyncio
import json
import time

import httpx
import openai
import pytest

from rayrep.cluster.placement import free_port
from rayrep.serve import openai_api as oai

QUESTION = "2+5=? Answer in \\boxed{}."
PROMPT = f"Q: {QUESTION}\nA: "  # the tiny policy's chat template around one user message
CAPS = {"serve.max_tokens": 48, "serve.max_n": 4, "serve.max_prompts": 4, "serve.max_request_bytes": 100_000}
KEYS = ["sk-rayrep-test-7f3a9c1e5b", "sk-rayrep-second-42d0e8"]
AUTH = {"Authorization": f"Bearer {KEYS[1]}"}
SERVED: dict = {}
"""What the server fixture made: its output folder ("out")."""


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_cfg, tiny_policy, tmp_path_factory):
    """The tiny policy served as "tiny" on a free port of the session's Ray cluster, with
    two API keys from a keys file; Serve stopped afterwards."""
    from ray import serve

    from rayrep.serve.app import build_app
    from rayrep.serve.keys import load_api_keys

    keys_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys_file.write_text(f"# the test's keys\n{KEYS[0]}\n\n  {KEYS[1]}  \n")
    out = SERVED["out"] = tmp_path_factory.mktemp("serve-out")
    try:
        for attempt in range(3):  # a port free a moment ago may be taken (by Ray's own workers) before the proxy binds it
            cfg = tiny_cfg.replace(**CAPS, **{"serve.port": free_port(), "serve.api_keys_file": str(keys_file),
                                              "logging.out_dir": str(out)})
            try:
                serve.start(http_options={"host": cfg.serve.host, "port": cfg.serve.port})
                break
            except RuntimeError as error:
                serve.shutdown()
                if "Failed to bind" not in str(error) or attempt == 2:
                    raise
        keys = load_api_keys(cfg.serve, environ={})
        assert keys == KEYS
        serve.run(build_app(cfg, tiny_policy, "tiny", keys), name="policy", route_prefix="/")
        yield f"http://{cfg.serve.host}:{cfg.serve.port}"
    finally:
        serve.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEYS[0], max_retries=0, timeout=120)


def test_every_route_but_health_needs_a_key(server):
    """401 in the OpenAI error shape without a key, with a wrong one, or another scheme, on
    every route (unknown ones too); /health answers anyone. The keys appear in no log."""
    import glob

    with httpx.Client(base_url=server, timeout=60) as http:
        assert http.get("/health").status_code == 200
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4}
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": f"Basic {KEYS[0]}"},
                        {"Authorization": "Bearer"}, {"Authorization": KEYS[0]}):
            for method, route in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                                  ("POST", "/v1/chat/completions"), ("GET", "/nowhere")):
                response = http.request(method, route, json=body, headers=headers)
                assert response.status_code == 401, (headers, route, response.text)
                assert response.json()["error"]["code"] == "invalid_api_key"
                assert response.headers["www-authenticate"] == "Bearer"
        for key in KEYS:  # either key of the file
            answer = http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="sk-wrong", max_retries=0).models.list()
    # Serve's logs (access lines, replicas') and the replica's library log in the output folder.
    logs = glob.glob("/tmp/ray/session_*/logs/serve/*") + glob.glob(f"{SERVED['out']}/**/*", recursive=True)
    assert any("serve" in path for path in logs)
    for path in logs:
        try:
            text = open(path, errors="ignore").read()
        except OSError:  # a folder
            continue
        assert not any(key in text for key in KEYS), path


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


def policy_logprobs(policy: str, ids: list[int]):
    """log-softmax of the tiny policy's logits at each position of `ids`, by transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def test_logprobs_and_echo_are_the_policys_own(client, tiny_policy):
    """A harness's scoring call (echo, max_tokens 0, logprobs) returns the prompt's token
    log-probs; an answer's log-probs, echoed or streamed, and the chat API's, are the
    policy's own (transformers' forward pass on the same checkpoint, fp32 round-off)."""
    import pytest as _pytest
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_policy)
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    scored = client.completions.create(model="tiny", prompt=PROMPT, echo=True, max_tokens=0, logprobs=3, temperature=0)
    (choice,) = scored.choices
    lp = choice.logprobs
    assert choice.text == PROMPT and "".join(lp.tokens) == PROMPT and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and lp.text_offset == list(range(len(PROMPT)))
    reference = policy_logprobs(tiny_policy, ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [float(reference[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert lp.token_logprobs[1:] == _pytest.approx(expected, abs=2e-3)
    for i in range(1, len(ids)):
        top = lp.top_logprobs[i]
        assert lp.tokens[i] in top and 3 <= len(top) <= 4  # the token itself and the 3 most likely
        assert max(top.values()) == _pytest.approx(float(reference[i - 1].max()), abs=2e-3)

    answer = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, logprobs=2, temperature=0)
    (choice,) = answer.choices
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text and lp.text_offset[0] == len(PROMPT)
    answer_ids = tokenizer.encode(choice.text, add_special_tokens=False)
    whole = policy_logprobs(tiny_policy, ids + answer_ids)
    expected = [float(whole[len(ids) + i - 1, t]) for i, t in enumerate(answer_ids)]
    assert lp.token_logprobs == _pytest.approx(expected, abs=2e-3)
    assert all(max(top.values()) == _pytest.approx(lp_, abs=1e-5) for top, lp_ in zip(lp.top_logprobs, lp.token_logprobs))
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, logprobs=2, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + choice.text
    assert echoed.choices[0].logprobs.token_logprobs[len(ids):] == _pytest.approx(lp.token_logprobs, abs=1e-5)

    streamed = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, logprobs=2, temperature=0,
                                              stream=True))
    tokens = [t for chunk in streamed for t in chunk.choices[0].logprobs.tokens]
    values = [v for chunk in streamed for v in chunk.choices[0].logprobs.token_logprobs]
    offsets = [o for chunk in streamed for o in chunk.choices[0].logprobs.text_offset]
    assert "".join(tokens) == choice.text and values == _pytest.approx(lp.token_logprobs, abs=1e-5)
    assert offsets == lp.text_offset

    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=16, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(entry.token for entry in content) == chat.choices[0].message.content
    chat_ids = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
    reply_ids = tokenizer.encode(chat.choices[0].message.content, add_special_tokens=False)
    whole = policy_logprobs(tiny_policy, list(chat_ids) + reply_ids)
    expected = [float(whole[len(chat_ids) + i - 1, t]) for i, t in enumerate(reply_ids)]
    assert [entry.logprob for entry in content] == _pytest.approx(expected, abs=2e-3)
    assert all(len(entry.top_logprobs) == 2 and entry.bytes == list(entry.token.encode()) for entry in content)


def test_metrics_reach_rays_prometheus_endpoint(server, client):
    """Requests, their statuses and latency, time to first token and tokens in and out, per
    deployment and route, on the node's metrics endpoint (where Serve's own are)."""
    import re
    import time

    from conftest import metrics_endpoint

    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stream=True))
    with httpx.Client(base_url=server, timeout=60) as http:
        assert http.get("/v1/models").status_code == 401
    endpoint = metrics_endpoint()
    wanted = {
        "requests": r'rayrep_serve_requests_total\{[^}]*deployment="tiny"[^}]*route="/v1/completions"[^}]*status="200"[^}]*\} (\S+)',
        "refused": r'rayrep_serve_requests_total\{[^}]*route="/v1/models"[^}]*status="401"[^}]*\} (\S+)',
        "latency": r'rayrep_serve_request_seconds_count\{[^}]*route="/v1/completions"[^}]*\} (\S+)',
        "first token": r'rayrep_serve_first_token_seconds_count\{[^}]*route="/v1/completions"[^}]*\} (\S+)',
        "tokens in": r'rayrep_serve_prompt_tokens_total\{[^}]*route="/v1/completions"[^}]*\} (\S+)',
        "tokens out": r'rayrep_serve_completion_tokens_total\{[^}]*route="/v1/completions"[^}]*\} (\S+)',
    }
    deadline, found = time.monotonic() + 90, {}
    while time.monotonic() < deadline:  # workers report to the node's agent every few seconds
        text = httpx.get(endpoint, timeout=30).text
        found = {name: float(m.group(1)) for name, rule in wanted.items() if (m := re.search(rule, text))}
        if len(found) == len(wanted) and found["requests"] >= 2 and found["first token"] >= 2:
            break
        time.sleep(2)
    assert set(found) == set(wanted), sorted(set(wanted) - set(found))
    assert found["refused"] >= 1 and found["tokens in"] >= 2 * len(PROMPT) and found["tokens out"] >= 2
    # Every serving series the Grafana dashboard queries is one the server exports.
    from test_deploy import dashboard_series

    served = set(re.findall(r"^(ray_rayrep_serve_\w+)\{", text, re.M))
    assert {name for name in dashboard_series() if name.startswith("ray_rayrep_serve_")} <= served


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
    ("completions", {"model": "tiny", "prompt": PROMPT, "best_of": 3}, 400, "unsupported_parameter"),
    ("completions", {"model": "tiny", "prompt": PROMPT, "logprobs": 21}, 400, "logprobs"),
    ("completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),  # 0 only with echo
    ("completions", {"model": "tiny", "prompt": PROMPT, "echo": "yes"}, 400, "echo"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "top_logprobs": 2},
     400, "top_logprobs"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "logprobs": 3},
     400, "logprobs"),
    ("completions", {"model": "tiny", "prompt": PROMPT, "frobnicate": 1}, 400, "frobnicate"),
    ("completions", {"model": "tiny", "prompt": "x" * 150_000}, 413, "request_too_large"),
    ("chat/completions", {"model": "tiny", "messages": "hello"}, 400, "messages"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": QUESTION}],
                          "max_completion_tokens": 100}, 400, "max_completion_tokens"),
]


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, client):
    with httpx.Client(base_url=f"{server}/v1", timeout=60, headers=AUTH) as http:
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
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEYS[1], max_retries=0, timeout=300) as aclient:
            return await asyncio.gather(*(
                aclient.completions.create(model="tiny", prompt=f"Q: {i}+{i}=? Answer in \\boxed{{}}.\nA: ",
                                           max_tokens=24, temperature=0)
                for i in range(64)))

    answers = asyncio.run(main())
    assert len(answers) == 64
    assert all(a.choices[0].finish_reason in ("stop", "length") and a.choices[0].text for a in answers)
    assert len({a.id for a in answers}) == 64


HARNESS_TASK = """dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
doc_to_text: "Q: {{{{question}}}}=? Answer in \\\\boxed{{}}.\\nA: "
metadata:
  version: 1.0
"""


HARNESS_RUN = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager
model_args, tasks, include = json.loads(sys.argv[1])
out = lm_eval.simple_evaluate(model="local-completions", model_args=model_args, tasks=tasks, log_samples=True,
                              task_manager=TaskManager(include_path=include, include_defaults=False), bootstrap_iters=0)
samples = {task: [{key: s[key] for key in ("doc_id", "doc", "resps")} for s in out["samples"][task]] for task in tasks}
print(json.dumps({"results": out["results"], "samples": samples}, default=str))
"""
"""lm-evaluation-harness's `simple_evaluate` in its own environment (`make test` builds it:
requirements/harness.txt); the results and each sample's responses as JSON, the last line."""


def test_an_evaluation_harness_scores_and_answers_through_the_server(server, tiny_policy, tmp_path):
    """lm-evaluation-harness's OpenAI-compatible backend (`local-completions`, a client nobody
    here wrote) runs a small local multiple-choice task and a generation task against the
    server, offline: each choice's log-likelihood it reports is the policy's own (transformers
    on the checkpoint), its accuracy follows from them, and its greedy answers are the policy's."""
    import json
    import os
    import subprocess
    from pathlib import Path

    from transformers import AutoTokenizer

    python = Path(__file__).resolve().parents[1] / ".venv-harness" / "bin" / "python"
    assert python.exists(), f"{python}: the harness's environment is missing; `make test` builds it"
    sums = [(2, 5), (3, 4), (12, 9), (7, 8)]
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{b}", "answer": 0,
                                        "choices": [f"\\boxed{{{a + b + d}}}" for d in (0, 1, -1)]}) + "\n"
                            for a, b in sums))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    task = HARNESS_TASK.format(data=data)
    (tasks / "choice.yaml").write_text(
        f"task: rayrep_sums_choice\n{task}output_type: multiple_choice\ndoc_to_choice: choices\n"
        "doc_to_target: answer\ntarget_delimiter: ''\nmetric_list:\n  - metric: acc\n")
    (tasks / "answer.yaml").write_text(
        f"task: rayrep_sums_answer\n{task}output_type: generate_until\ndoc_to_target: '{{{{choices[answer]}}}}'\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 32\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    model_args = {"model": "tiny", "base_url": f"{server}/v1/completions", "tokenizer": tiny_policy,
                  "tokenizer_backend": "huggingface", "max_length": 256, "max_retries": 1}
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OPENAI_API_KEY": KEYS[0]}  # the harness sends OPENAI_API_KEY as the bearer key
    done = subprocess.run([str(python), "-c", HARNESS_RUN,
                           json.dumps([model_args, ["rayrep_sums_choice", "rayrep_sums_answer"], str(tasks)])],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])

    tokenizer = AutoTokenizer.from_pretrained(tiny_policy)
    right = 0
    choice_samples = sorted(out["samples"]["rayrep_sums_choice"], key=lambda s: s["doc_id"])
    assert len(choice_samples) == len(sums)
    for sample, (a, b) in zip(choice_samples, sums):
        context = f"Q: {a}+{b}=? Answer in \\boxed{{}}.\nA: "
        # The harness moves the context's trailing space to the front of each continuation.
        start = len(tokenizer.encode(context.rstrip(), add_special_tokens=False))
        expected = []
        for choice in sample["doc"]["choices"]:
            ids = tokenizer.encode(context + choice, add_special_tokens=False)
            reference = policy_logprobs(tiny_policy, ids)
            expected.append(sum(float(reference[i - 1, ids[i]]) for i in range(start, len(ids))))
        reported = [float(resp[0][0]) for resp in sample["resps"]]
        assert reported == pytest.approx(expected, abs=2e-2)
        right += max(range(len(expected)), key=expected.__getitem__) == 0
    assert out["results"]["rayrep_sums_choice"]["acc,none"] == pytest.approx(right / len(sums))

    answer_samples = sorted(out["samples"]["rayrep_sums_answer"], key=lambda s: s["doc_id"])
    assert len(answer_samples) == len(sums)
    for sample, (a, b) in zip(answer_samples, sums):
        expected = greedy_answer(tiny_policy, f"Q: {a}+{b}=? Answer in \\boxed{{}}.\nA: ", 32).split("\n")[0]
        assert sample["resps"][0][0] == expected


def adapter_step(run, step: int, tiny_cfg, tiny_policy: str, seed: int):
    """A LoRA run's step checkpoint, as a run writes it (the adapter in PEFT's format beside the
    base's tokenizer, then its run state): rank 8 on every projection, A and B both random
    (PEFT's `init_lora_weights=False`), so that it moves the policy's log-probs."""
    import dataclasses

    import torch
    from peft import get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from rayrep.models.adapter import lora_config, write_adapter

    torch.manual_seed(seed)
    config = dataclasses.replace(lora_config(tiny_cfg.replace(**{"learner.lora_rank": 8}), tiny_policy),
                                 init_lora_weights=False)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_policy), config)
    folder = run / "checkpoints" / f"step-{step}"
    write_adapter(folder, {k: v * 0.3 for k, v in get_peft_model_state_dict(model).items()}, config, with_tokenizer=True)
    (folder / "run_state.json").write_text("{}")
    return folder


def test_a_lora_run_is_served_as_its_base_with_its_adapter_and_followed_adapter_by_adapter(
        server, tiny_cfg, tiny_policy, tmp_path):
    """`jobs/serve.py --follow` on a LoRA run: the replica serves the base with the newest
    checkpoint's adapter (vLLM's LoRA API), its log-probs PEFT's own (transformers loads the
    adapter folder), and switches to each newer adapter in place, the base weights untouched.
    A second application on the fixture's Serve instance, under /lora."""
    from ray import serve
    from transformers import AutoTokenizer

    from rayrep.serve.app import build_app

    run = tmp_path / "lora-run"
    first = adapter_step(run, 1, tiny_cfg, tiny_policy, seed=1)
    ids = AutoTokenizer.from_pretrained(str(first)).encode(PROMPT, add_special_tokens=False)
    cfg = tiny_cfg.replace(**CAPS, **{"serve.follow_every_s": 0.2, "logging.out_dir": str(tmp_path)})

    def served() -> tuple[str, list[float]]:
        scored = httpx.post(f"{server}/lora/v1/completions", timeout=120, json={
            "model": "lora-run", "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0}).json()
        return scored["model"], scored["choices"][0]["logprobs"]["token_logprobs"][1:]

    def own(folder) -> list[float]:
        reference = policy_logprobs(str(folder), ids)  # transformers + peft, from the adapter folder
        return [float(reference[i - 1, ids[i]]) for i in range(1, len(ids))]

    base = own(tiny_policy)
    serve.run(build_app(cfg, str(run), "lora-run", follow=True), name="lora", route_prefix="/lora")
    try:
        name, logprobs = served()
        assert name == "lora-run/step-1" and logprobs == pytest.approx(own(first), abs=2e-3)
        assert logprobs != pytest.approx(base, abs=2e-2)  # the adapter moved them
        second = adapter_step(run, 2, tiny_cfg, tiny_policy, seed=2)
        deadline = time.monotonic() + 60
        while served()[0] != "lora-run/step-2":
            assert time.monotonic() < deadline, "the server did not switch to step-2's adapter"
            time.sleep(0.2)
        name, logprobs = served()
        assert logprobs == pytest.approx(own(second), abs=2e-3)
        assert logprobs != pytest.approx(own(first), abs=2e-2)
    finally:
        serve.delete("lora")


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


def test_keys_and_exposure_rules_without_a_server(tiny_cfg, tmp_path):
    """Keys from the file and the environment; a bad keys file named with its line (never the
    key); no non-loopback address without a key unless explicitly allowed; the header check."""
    from rayrep.config import InputError
    from rayrep.serve.keys import KEY_ENV, authorized, check_exposure, digests, load_api_keys

    serve = tiny_cfg.serve
    assert load_api_keys(serve, environ={}) == []
    assert load_api_keys(serve, environ={KEY_ENV: " sk-env \n"}) == ["sk-env"]
    keys_file = tmp_path / "keys"
    keys_file.write_text("sk-one\n# a comment\nsk two\n")
    with pytest.raises(InputError, match=rf"{keys_file}, line 3: a key has whitespace") as caught:
        load_api_keys(tiny_cfg.replace(**{"serve.api_keys_file": str(keys_file)}).serve, environ={})
    assert "two" not in str(caught.value)
    keys_file.write_text("# nothing but a comment\n\n")
    with pytest.raises(InputError, match="no key in the file"):
        load_api_keys(tiny_cfg.replace(**{"serve.api_keys_file": str(keys_file)}).serve, environ={})
    with pytest.raises(InputError, match="missing.*cannot be read"):
        load_api_keys(tiny_cfg.replace(**{"serve.api_keys_file": str(tmp_path / "missing")}).serve, environ={})

    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert check_exposure(tiny_cfg.replace(**{"serve.host": host}).serve, []) is None
    exposed = ".".join(["0"] * 4)  # every address of the machine
    for host in (exposed, "10.1.2.3", "my-head-node"):
        with pytest.raises(InputError, match=rf"serve.host={host} .* no API key: set serve.api_keys_file or {KEY_ENV}"):
            check_exposure(tiny_cfg.replace(**{"serve.host": host}).serve, [])
        assert check_exposure(tiny_cfg.replace(**{"serve.host": host}).serve, ["sk-1"]) is None
    allowed = tiny_cfg.replace(**{"serve.host": exposed, "serve.allow_unauthenticated": True}).serve
    assert "without an API key" in check_exposure(allowed, [])

    held = digests(["sk-1", "sk-2"])
    assert authorized("Bearer sk-2", held) and authorized("bearer sk-1", held)
    for header in (None, "", "Bearer", "Bearer ", "Bearer sk-3", "Basic sk-1", "sk-1"):
        assert not authorized(header, held), header
    assert not authorized("Bearer sk-1", ())


def test_the_serve_job_refuses_an_exposed_address_without_a_key_before_starting(tmp_path, monkeypatch):
    """`jobs/serve.py` on an address other machines reach, no key: refused before anything
    starts (a dry run, which would otherwise print the deployment); with a key it goes on,
    and never prints the key."""
    from conftest import job_here

    from rayrep.serve.keys import KEY_ENV

    monkeypatch.delenv(KEY_ENV, raising=False)
    exposed = ".".join(["0"] * 4)
    args = ("--dry-run", "--serve.host", exposed, "--logging.out_dir", str(tmp_path))
    refused = job_here("serve.py", *args)
    assert refused.returncode != 0
    assert f"serve.host={exposed} makes the server reachable from other machines" in refused.stdout + refused.stderr
    assert "would serve" not in refused.stdout
    keyed = job_here("serve.py", *args, env={KEY_ENV: "sk-job-key-123"})
    assert keyed.returncode == 0, keyed.stderr[-2000:]
    assert "would serve" in keyed.stdout and "1 API key(s)" in keyed.stdout
    assert "sk-job-key-123" not in keyed.stdout + keyed.stderr


def test_the_serve_job_follows_a_run_folder_and_refuses_a_checkpoint_there(short_run_dir, tiny_policy, tmp_path):
    """`jobs/serve.py --follow`: a run's folder is served as the run's newest checkpoint under
    the run's name (a dry run says so); a checkpoint folder given instead is refused in one line."""
    from conftest import job_here

    def job(*args: str):
        return job_here("serve.py", "--dry-run", *args, "--logging.out_dir", str(tmp_path))

    followed = job("--follow", str(short_run_dir))
    assert followed.returncode == 0, followed.stderr[-2000:]
    assert f"would serve {short_run_dir}'s checkpoints, now {short_run_dir}/checkpoints/step-2, as 'seed-0'" \
        in followed.stdout
    refused = job("--follow", tiny_policy)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1].endswith(
        f"--follow {tiny_policy}: a checkpoint, not a run's folder; serve it with --checkpoint")


def seven_b_run(folder, tiny_policy):
    """A run folder as the RLEP preset writes it, with one complete checkpoint whose config
    is Qwen2.5-Math-7B's (bf16); its weights are a stand-in: a dry run reads none."""
    import shutil
    from pathlib import Path

    from rayrep.cluster.memory import KNOWN_SHAPES
    from rayrep.config import load_preset

    run = Path(folder) / "rlep-7b"
    checkpoint = run / "checkpoints" / "step-20"
    checkpoint.mkdir(parents=True)
    (run / "config.json").write_text(load_preset("qwen2.5-math-7b-rlep").to_json())
    config = {**KNOWN_SHAPES["Qwen/Qwen2.5-Math-7B"], "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
              "torch_dtype": "bfloat16", "rope_theta": 10000.0, "rms_norm_eps": 1e-6}
    (checkpoint / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        shutil.copy(Path(tiny_policy) / name, checkpoint / name)
    (checkpoint / "run_state.json").write_text("{}")
    return run, checkpoint


def test_a_checkpoint_is_served_with_its_runs_settings_and_what_cannot_fit_is_refused(tiny_policy, tmp_path):
    """A checkpoint of a run trained with the 7B preset (or that run, followed) is served as
    the run ran: on a GPU, in bf16, with its engine settings, and the dry run prints a memory
    plan that fits one 80 GB GPU. The same folder outside a run takes its own dtype and this
    machine's device (a CPU here), where a KV cache too small for one context is refused,
    naming the knob; fields on the command line go on top of either."""
    import shutil
    from pathlib import Path

    from conftest import job_here

    run, checkpoint = seven_b_run(tmp_path, tiny_policy)

    def job(*args: str):
        return job_here("serve.py", "--dry-run", *args, "--logging.out_dir", str(tmp_path))

    # Outside a run: the same folder, copied; its own dtype, this machine's device (no GPU
    # here), the preset's CPU KV cache.
    loose = Path(tmp_path) / "loose"
    shutil.copytree(checkpoint, loose)
    followed = [job("--checkpoint", str(checkpoint)), job("--follow", str(run))]
    # A smaller GPU, told on the command line: the plan refuses before anything starts.
    small = job("--checkpoint", str(checkpoint), "--placement.gpu_memory_gib", "12")
    on_cpu = job("--checkpoint", str(loose))
    refused = job("--checkpoint", str(loose), "--generator.cpu_kv_cache_gib", "0.1")
    for served in followed:
        assert served.returncode == 0, served.stderr[-2000:]
        assert "(context 4096 tokens, no API key; gpu, bfloat16)" in served.stdout
        assert "'num_gpus': 1" in served.stdout
        assert "memory plan per GPU (80 GiB; sampling only" in served.stdout
        assert "sequences of 4,096" in served.stdout and served.stdout.rstrip().endswith("fits")
    assert small.returncode == 2 and "the server's memory plan does not fit" in small.stderr
    assert on_cpu.returncode == 0 and "(context 4096 tokens, no API key; cpu, bfloat16)" in on_cpu.stdout
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "a 4,096-token context of" in refused.stderr and "needs 0.22 GiB of KV cache (bfloat16), more than " \
        "generator.cpu_kv_cache_gib=0.1" in refused.stderr


def test_gpu_replicas_the_cluster_cannot_place_are_refused(tiny_cfg):
    """Serve would wait forever for a replica no GPU can take: two one-GPU replicas on one GPU,
    or any on a cluster without GPUs, are refused; an autoscaling cluster of unknown size is
    left to grow."""
    from rayrep.config import InputError
    from rayrep.serve.settings import check_replicas_fit

    gpu = tiny_cfg.replace(**{"placement.device": "gpu", "serve.min_replicas": 2, "serve.max_replicas": 2})
    with pytest.raises(InputError, match=r"serve.min_replicas=2 x generator.tensor_parallel_size=1 needs 2 GPU\(s\), "
                                         r"and the cluster has 1"):
        check_replicas_fit(gpu, 1.0)
    check_replicas_fit(gpu, 2.0)
    check_replicas_fit(gpu, 0.0, grows=True)
    check_replicas_fit(tiny_cfg, 0.0)  # CPU replicas take no GPU
