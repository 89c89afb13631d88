"""The OpenAI API as this server speaks it: requests checked into plain values, and the
response and error bodies. Pure Python (no Ray, no vLLM), so every rule is easy to read
and to test.

A request is checked strictly and completely before anything is generated: a field of
the wrong type, a value outside the operator's caps (`ServeConfig`), a field this server
does not know or does not support, each gets a 4xx answer with an OpenAI-style error body
that names the field (`param`). Unknown fields are refused rather than ignored, so that a
client never believes a setting took effect when it did not.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from rayrep.config import ServeConfig

# Fields a client may send and this server ignores, having no effect on the answer.
_IGNORED = frozenset({"user"})
# Fields this server knows but does not implement: refused unless they carry their default.
_UNSUPPORTED_DEFAULTS = {
    "best_of": (None, 1),
    "suffix": (None, ""), "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "response_format": (None, {"type": "text"}), "parallel_tool_calls": (None,),
}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream", "stream_options",
           "presence_penalty", "frequency_penalty"}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
MAX_TOP_LOGPROBS = 20
"""Most alternatives a request may ask for at each position (`logprobs`, `top_logprobs`)."""
ROLES = ("system", "user", "assistant")


class APIError(Exception):
    """A request the server refuses: HTTP `status` and the OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Sampling:
    """A request's sampling settings, within the operator's caps. `max_tokens` None: as many
    as the context and the cap allow."""

    max_tokens: int | None
    temperature: float
    top_p: float
    n: int
    stop: tuple[str, ...]
    seed: int | None
    presence_penalty: float
    frequency_penalty: float


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompts: tuple[str | tuple[int, ...], ...]
    """Each prompt as text or as token ids."""
    sampling: Sampling
    stream: bool
    include_usage: bool
    logprobs: int | None = None
    """Each token's log-prob and this many alternatives' (0-20); None: no log-probs."""
    echo: bool = False
    """The prompt before the answer, with its tokens' log-probs (max_tokens 0: only the prompt)."""


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[dict[str, str], ...]
    """{"role", "content"} with the content as one string."""
    sampling: Sampling
    stream: bool
    include_usage: bool
    logprobs: int | None = None
    """Each answer token's log-prob and this many alternatives' (`top_logprobs`); None: `logprobs` off."""
    echo: bool = False


# ---------------------------------------------------------------- checking requests


def read_json(body: bytes, limit: int) -> dict:
    """The request body as a JSON object, or the 4xx that says why not."""
    if len(body) > limit:
        raise APIError(413, f"The request body is {len(body)} bytes; this server takes at most {limit}.",
                       code="request_too_large")
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise APIError(400, f"The request body is not valid JSON ({err}).", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"The request body must be a JSON object, got {type(data).__name__}.", code="invalid_json")
    return data


def parse_completion(data: dict, caps: ServeConfig) -> CompletionRequest:
    _check_fields(data, COMPLETION_FIELDS)
    prompt = _required(data, "prompt")
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif _is_token_list(prompt):
        prompts = [tuple(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(_is_token_list(p) for p in prompt):
        prompts = [tuple(p) for p in prompt]
    else:
        raise _type_error("prompt", "a string, a list of strings, a list of token ids or a list of such lists", prompt)
    if len(prompts) > caps.max_prompts:
        raise APIError(400, f"'prompt' holds {len(prompts)} prompts; this server takes at most {caps.max_prompts} "
                            "per request.", param="prompt")
    stream, include_usage = _stream(data)
    echo = data.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise _type_error("echo", "a boolean", echo)
    logprobs = data.get("logprobs")
    if isinstance(logprobs, bool):  # (some clients send false for "none")
        logprobs = None if logprobs is False else _integer(data, "logprobs", 0, MAX_TOP_LOGPROBS)
    else:
        logprobs = _integer(data, "logprobs", 0, MAX_TOP_LOGPROBS)
    return CompletionRequest(_model(data), tuple(prompts), _sampling(data, caps, "max_tokens", bool(echo)), stream,
                             include_usage, logprobs, bool(echo))


def parse_chat(data: dict, caps: ServeConfig) -> ChatRequest:
    _check_fields(data, CHAT_FIELDS)
    messages = _required(data, "messages")
    if not isinstance(messages, list) or not messages:
        raise _type_error("messages", "a non-empty list of messages", messages)
    checked = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _type_error(where, "an object with 'role' and 'content'", message)
        extra = sorted(set(message) - {"role", "content", "name"})
        if extra:
            raise APIError(400, f"Unrecognized field in {where}: '{extra[0]}'.", param=f"{where}.{extra[0]}")
        role = message.get("role")
        if role not in ROLES:
            raise APIError(400, f"{where}.role must be one of {', '.join(map(repr, ROLES))}, got {role!r}.",
                           param=f"{where}.role")
        checked.append({"role": role, "content": _message_text(message.get("content"), f"{where}.content")})
    if "max_tokens" in data and "max_completion_tokens" in data:
        raise APIError(400, "Set one of 'max_tokens' and 'max_completion_tokens', not both.", param="max_tokens")
    cap_field = "max_completion_tokens" if "max_completion_tokens" in data else "max_tokens"
    stream, include_usage = _stream(data)
    wanted = data.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise _type_error("logprobs", "a boolean", wanted)
    top = _integer(data, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise APIError(400, "'top_logprobs' needs 'logprobs' set to true.", param="top_logprobs")
    return ChatRequest(_model(data), tuple(checked), _sampling(data, caps, cap_field), stream, include_usage,
                       (top or 0) if wanted else None)


def answer_tokens(request_max: int | None, prompt_tokens: int, context: int, cap: int, param: str) -> int:
    """How many tokens a prompt of `prompt_tokens` may be answered with: the request's
    max_tokens, or else as many as the context and the operator's cap allow."""
    if prompt_tokens == 0:
        raise APIError(400, "The prompt is empty.", param=param)
    room = context - prompt_tokens
    wanted = 1 if request_max is None else request_max
    if room < wanted:
        raise APIError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                            f"{prompt_tokens + wanted} tokens ({prompt_tokens} in the prompt, {wanted} for the "
                            "completion). Please reduce the length of the prompt or of the completion.",
                       param=param, code="context_length_exceeded")
    return min(cap, room) if request_max is None else request_max


def _check_fields(data: dict, known: set[str]) -> None:
    for name in sorted(data):
        if name in known or name in _IGNORED:
            continue
        if name in _UNSUPPORTED_DEFAULTS:
            if data[name] not in _UNSUPPORTED_DEFAULTS[name]:
                raise APIError(400, f"'{name}' is not supported by this server.", param=name, code="unsupported_parameter")
            continue
        raise APIError(400, f"Unrecognized request argument supplied: {name}", param=name)


def _required(data: dict, name: str) -> Any:
    if name not in data or data[name] is None:
        raise APIError(400, f"Missing required parameter: '{name}'.", param=name, code="missing_required_parameter")
    return data[name]


def _model(data: dict) -> str:
    model = _required(data, "model")
    if not isinstance(model, str):
        raise _type_error("model", "a string", model)
    return model


def _type_error(param: str, expected: str, value: Any) -> APIError:
    shown = json.dumps(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return APIError(400, f"Invalid type for '{param}': expected {expected}, but got {shown}.",
                    param=param, code="invalid_type")


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _message_text(content: Any, param: str) -> str:
    """A message's content as one string: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise APIError(400, f"{param}[{j}] must be a text part ({{'type': 'text', 'text': ...}}); this "
                                    "server reads text only.", param=f"{param}[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise _type_error(param, "a string or a list of text parts", content)


def _number(data: dict, name: str, default: float, low: float, high: float, *, open_low: bool = False) -> float:
    value = data.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _type_error(name, "a number", value)
    if value > high or value < low or (open_low and value == low):
        bound = f"greater than {low}" if open_low else f"at least {low}"
        raise APIError(400, f"'{name}' must be {bound} and at most {high}, got {value}.", param=name,
                       code="invalid_value")
    return float(value)


def _integer(data: dict, name: str, low: int, high: int | None, cap_note: str = "") -> int | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(name, "an integer", value)
    if value < low or (high is not None and value > high):
        limit = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise APIError(400, f"'{name}' must be {limit}{cap_note}, got {value}.", param=name, code="invalid_value")
    return value


def _sampling(data: dict, caps: ServeConfig, max_tokens_field: str, echo: bool = False) -> Sampling:
    stop = data.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise _type_error("stop", "a string or a list of at most 4 strings", stop)
    if any(not s for s in stops):
        raise APIError(400, "'stop' strings must not be empty.", param="stop", code="invalid_value")
    return Sampling(
        # 0 with echo: the prompt's log-probs, nothing generated (how harnesses score a text).
        max_tokens=_integer(data, max_tokens_field, 0 if echo else 1, caps.max_tokens, " (the server's cap)"),
        temperature=_number(data, "temperature", 1.0, 0.0, caps.max_temperature),
        top_p=_number(data, "top_p", 1.0, 0.0, 1.0, open_low=True),
        n=_integer(data, "n", 1, caps.max_n, " (the server's cap)") or 1,
        stop=stops,
        seed=_integer(data, "seed", -(2**63), 2**63 - 1),
        presence_penalty=_number(data, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(data, "frequency_penalty", 0.0, -2.0, 2.0),
    )


def _stream(data: dict) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = data.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _type_error("stream", "a boolean", stream)
    options = data.get("stream_options")
    if options is None:
        return bool(stream), False
    if not stream:
        raise APIError(400, "'stream_options' is only allowed when 'stream' is true.", param="stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise _type_error("stream_options", "an object with 'include_usage'", options)
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise _type_error("stream_options.include_usage", "a boolean", include)
    return True, include


# ---------------------------------------------------------------- response bodies


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass(frozen=True)
class TokenLogprob:
    """One position of a text: its token (as text), the policy's log-prob of it (None for a
    prompt's first token, which nothing precedes), and the most likely tokens there, best
    first, with theirs."""

    token: str
    logprob: float | None
    top: tuple[tuple[str, float], ...] = ()


def _finite(logprob: float) -> float:
    return max(logprob, -9999.0)  # -inf is not JSON; the OpenAI API writes -9999 for it


def completion_logprobs(positions: list[TokenLogprob], text_offset: int) -> dict:
    """The completions API's `logprobs` of `positions`, the first starting at character
    `text_offset` of the prompt-and-answer text: tokens, their log-probs, at each position the
    token itself and the `logprobs` most likely ones, and the character offsets."""
    offsets = []
    for position in positions:
        offsets.append(text_offset)
        text_offset += len(position.token)
    return {
        "tokens": [p.token for p in positions],
        "token_logprobs": [None if p.logprob is None else _finite(p.logprob) for p in positions],
        "top_logprobs": [None if p.logprob is None else {p.token: _finite(p.logprob), **{t: _finite(lp) for t, lp in p.top}}
                         for p in positions],
        "text_offset": offsets,
    }


def chat_logprobs(positions: list[TokenLogprob]) -> dict:
    """The chat API's `logprobs`: each answer token with its log-prob, its UTF-8 bytes and the
    `top_logprobs` most likely tokens there."""
    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8"))}

    return {"content": [{**entry(p.token, p.logprob), "top_logprobs": [entry(t, lp) for t, lp in p.top]}
                        for p in positions]}


def completion_body(request_id: str, model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int,
                    chat: bool) -> dict:
    """The whole answer; `choices` hold "index", "text", "finish_reason" and, when asked
    for, "logprobs" (`completion_logprobs` / `chat_logprobs`)."""
    if chat:
        shaped = [{"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                   "logprobs": c.get("logprobs"), "finish_reason": c["finish_reason"]} for c in choices]
    else:
        shaped = [{"index": c["index"], "text": c["text"], "logprobs": c.get("logprobs"),
                   "finish_reason": c["finish_reason"]} for c in choices]
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": shaped, "usage": usage(prompt_tokens, completion_tokens)}


def chunk_body(request_id: str, model: str, index: int, text: str | None, finish_reason: str | None, chat: bool,
               first: bool = False, logprobs: dict | None = None) -> dict:
    """One streamed piece of choice `index`: new text and/or its finish reason, and when asked
    for, the new tokens' `logprobs`."""
    if chat:
        delta: dict = {"role": "assistant", "content": text or ""} if first else {}
        if text and not first:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}


def usage_chunk(request_id: str, model: str, prompt_tokens: int, completion_tokens: int, chat: bool) -> dict:
    """The last chunk of a stream that asked for usage: no choices, the token counts."""
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


def sse(payload: dict | str) -> str:
    """A server-sent event carrying `payload` (JSON, or the literal [DONE])."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"
