"""The trained policy behind OpenAI-compatible routes, as a Ray Serve application.

    GET  /v1/models             the one model: the checkpoint's name
    POST /v1/completions        text or token-id prompts; streaming with "stream": true
    POST /v1/chat/completions   messages rendered with the checkpoint's chat template
    GET  /health                200 once the engine answers (the one route that needs no API key)

Following a run (`jobs/serve.py --follow RUN_DIR`), each replica serves the run's newest
complete checkpoint and switches to each new one in place: vLLM pauses new work, lets the
requests in flight finish on the old weights, reloads the weights from the new folder and
resumes (`AsyncLLM.pause_generation(mode="wait")`, the worker's `reload_weights` through
rayrep's worker extension, `resume_generation`: public APIs). Requests that arrive meanwhile
wait in the engine; none is dropped. A Serve rolling update would instead build a new engine
per checkpoint (a minute on a GPU) and stop the old replica before its successor is up when
there is one replica; `user_config` changes are a lightweight update only through Serve's
declarative API (its dashboard), where `serve.run` gives every deployment a new code version
and restarts it.

Each replica owns one vLLM async engine (`AsyncLLMEngine`, vLLM's public API) with its core
in a process of its own, so that model steps never hold up the replica's event loop. Every
request is checked in full (`openai_api`) before the engine sees it; a bad one gets its 4xx
and the replica goes on serving. Replica count, autoscaling and per-replica concurrency come
from `ServeConfig`.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException

from rayrep.config import Config, InputError
from rayrep.library_output import library_log_env, route_library_output
from rayrep.models.adapter import is_adapter
from rayrep.run.layout import STATE_FILE, RunFolder
from rayrep.serve import openai_api as oai
from rayrep.serve import keys, metrics
from rayrep.generator.vllm_internals import EXTENSION_CLASS

api = FastAPI(title="rayrep policy server", docs_url=None, redoc_url=None)


class _RequireKey:
    """Every route, unknown ones included, but the health check (load balancers and probes
    ask it without credentials; it says nothing but "ok") needs one of the replica's keys
    (`keys.hold`, in its __init__: state of the keys module, which both import by name). A
    plain ASGI middleware: streamed answers pass through it untouched."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        held = keys.held()
        if scope["type"] == "http" and held and scope["path"] != "/health":
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if not keys.authorized(header, held):
                error = oai.APIError(401, "Missing or incorrect API key: send 'Authorization: Bearer <key>'.",
                                     code="invalid_api_key")
                response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Measured:
    """Every request counted by route and status, and timed to its last byte, into the
    replica's metrics (`rayrep.serve.metrics`; outermost, so refusals count too)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        recorder = metrics.held()
        if scope["type"] != "http" or recorder is None:
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), [500]

        async def measured_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                recorder.answered(scope["path"], status[0], time.perf_counter() - start)

        await self.app(scope, receive, measured_send)


api.add_middleware(_RequireKey)
api.add_middleware(_Measured)  # (added last: outermost)


@api.exception_handler(oai.APIError)
async def _api_error(_: Request, err: oai.APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


@api.exception_handler(HTTPException)
async def _http_error(_: Request, err: HTTPException) -> JSONResponse:
    # Unknown routes and wrong methods answer in the same error shape as everything else.
    return JSONResponse(oai.APIError(err.status_code, str(err.detail)).body(), status_code=err.status_code)


async def _last(stream: AsyncIterator):
    """The final output of a generation (FINAL_ONLY streams yield just that one)."""
    last = None
    async for output in stream:
        last = output
    return last


def served_context(cfg: Config, checkpoint: str) -> int:
    """Prompt + answer tokens the engine holds: `serve.max_model_len`, or the checkpoint's
    positions (after the config's overrides)."""
    from rayrep.models import config_overrides, read_model_config

    positions = config_overrides(cfg, checkpoint).get("max_position_embeddings") or getattr(
        read_model_config(checkpoint, local_only=True), "max_position_embeddings", 0)
    if cfg.serve.max_model_len and positions and cfg.serve.max_model_len > positions:
        raise InputError(f"serve.max_model_len={cfg.serve.max_model_len} exceeds the {positions} positions of "
                         f"the model at {checkpoint}")
    context = cfg.serve.max_model_len or positions
    if not context:
        raise InputError(f"model {checkpoint}: its config.json gives no max_position_embeddings; set serve.max_model_len")
    return context


def check_checkpoint(checkpoint: str) -> None:
    """A servable checkpoint folder: config, tokenizer and weights, or an InputError naming
    what is missing (before anything starts)."""
    from rayrep.models import read_model_config

    folder = Path(checkpoint)
    if not folder.is_dir():
        raise InputError(f"checkpoint {checkpoint}: no such folder")
    read_model_config(checkpoint, local_only=True)
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise InputError(f"checkpoint {checkpoint}: no weights (*.safetensors or *.bin) in the folder")
    if not (folder / "tokenizer.json").exists() and not (folder / "tokenizer_config.json").exists():
        raise InputError(f"checkpoint {checkpoint}: no tokenizer (tokenizer.json) in the folder")


def same_tensors(served: str | Path, new: str | Path) -> None:
    """Refuse (InputError) a checkpoint whose weights differ from the served one's in name or
    shape: it cannot be loaded in place. Reads the safetensors headers only."""
    from safetensors import safe_open

    def shapes(folder: Path) -> dict[str, tuple[int, ...]]:
        found = {}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), "pt") as weights:
                found.update({name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()})
        return found

    before, after = shapes(Path(served)), shapes(Path(new))
    if before != after:
        name = next(iter(sorted(set(before) ^ set(after))), None) or next(
            n for n in sorted(before) if before[n] != after[n])
        raise InputError(f"checkpoint {new}: tensor {name} is {after.get(name, 'missing')} where the served "
                         f"checkpoint {served} has {before.get(name, 'none')}; it cannot replace it in place")


def checkpoint_version(checkpoint: Path) -> tuple[str, int] | None:
    """What tells one checkpoint from another: its folder and when its run state was written
    (a resumed run saves its last step again, whole), or None if it is gone."""
    try:
        return str(checkpoint), (checkpoint / STATE_FILE).stat().st_mtime_ns
    except OSError:
        return None


def model_name(checkpoint: str) -> str:
    """The served model's default name: a run's checkpoint as <run>/<checkpoint>
    (runs/rlep-1/checkpoints/final -> rlep-1/final), any other folder by its own name."""
    path = Path(os.path.abspath(checkpoint))  # as named: `final` is a link to the last step's folder
    if path.parent.name == "checkpoints":
        return f"{path.parent.parent.name}/{path.name}"
    return path.name


class _Answer:
    """What one request's choices say, piece by piece (the whole answer, or each streamed part):
    the text, with echo the prompt before a choice's first piece; the log-probs, when asked
    for, with the character offsets running on across a choice's pieces."""

    def __init__(self, server: "PolicyServer", body, chat: bool, texts: list[str] | None, prompt_only: bool):
        self.server, self.body, self.chat, self.texts, self.prompt_only = server, body, chat, texts, prompt_only
        self.offsets: dict[int, int] = {}
        """Each choice's next character offset (completions' `text_offset`)."""

    def piece(self, index: int, prompt: int, output, c) -> tuple[str, dict | None, int]:
        """(text, logprobs payload or None, answer tokens) of choice `index`'s new piece `c`
        of engine output `output`, for prompt number `prompt`."""
        body, k = self.body, self.body.logprobs
        text, token_ids, steps = ("", [], []) if self.prompt_only else (c.text, list(c.token_ids), c.logprobs)
        positions = [] if k is None else self.server.token_logprobs(token_ids, steps, k)
        starts = index not in self.offsets
        if starts:
            self.offsets[index] = 0 if body.echo or self.texts is None else len(self.texts[prompt])
        if starts and body.echo:
            text = self.texts[prompt] + text
            if k is not None:
                positions = self.server.token_logprobs(output.prompt_token_ids, output.prompt_logprobs, k) + positions
        if k is None:
            return text, None, len(token_ids)
        if self.chat:
            return text, oai.chat_logprobs(positions), len(token_ids)
        logprobs = oai.completion_logprobs(positions, self.offsets[index])
        self.offsets[index] += sum(len(p.token) for p in positions)
        return text, logprobs, len(token_ids)

    def finish_reason(self, c) -> str | None:
        """Piece `c`'s finish reason; a prompt scored without an answer ends at its length."""
        return ("length" if c.finish_reason else None) if self.prompt_only else c.finish_reason


# The class comes after every module-level name its methods use: `serve.ingress` pickles it
# when it is defined, with the names bound at that moment.
@serve.deployment
@serve.ingress(api)
class PolicyServer:
    def __init__(self, cfg: Config, source: str, name: str, key_digests: tuple[bytes, ...] = (),
                 follow: bool = False):
        """Serve the checkpoint folder `source` as model `name`; with `follow`, `source` is a
        run's folder: serve its newest checkpoint as `<name>/<step-N>`, switch to each newer
        one, and answer to `name` too (whatever checkpoint is current)."""
        keys.hold(key_digests)  # (one replica per process: the middleware asks for this one's keys)
        metrics.hold(metrics.ServerMetrics(name))
        self.alias = name if follow else None
        self.version: tuple[str, int] | None = None
        """The checkpoint served, as `checkpoint_version` tells it (following a run)."""
        self.broken: str | None = None
        """Why this replica cannot answer (a weight reload that failed half-way), or None."""
        checkpoint = source
        if follow:
            newest = RunFolder(Path(source)).newest_checkpoint()
            if newest is None:
                raise InputError(f"run {source}: no complete checkpoint (checkpoints/step-<N>) to serve")
            checkpoint, self.version, name = str(newest), checkpoint_version(newest), self._following_name(newest)
        route_library_output()  # before the engine process starts: it inherits the file
        from transformers import AutoTokenizer

        from rayrep.generator.engine import configure_vllm_env, engine_args

        configure_vllm_env(cfg, in_process=False)
        from vllm import AsyncEngineArgs, AsyncLLMEngine

        self.cfg, self.caps, self.name = cfg, cfg.serve, name
        self.context = served_context(cfg, checkpoint)
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        self.vocab_size = len(self.tokenizer)
        tp = cfg.generator.tensor_parallel_size
        # With tensor parallelism the engine's GPUs are bundles 1.. of the replica's group. The
        # engine core runs in a process of its own, outside Ray: vLLM (0.32,
        # EngineArgs.create_engine_config) hands it this replica's placement group
        # (`ray.util.get_current_placement_group()` in a Ray actor, into ParallelConfig), so its
        # workers take these bundles rather than asking for a group of their own.
        kwargs = engine_args(cfg, checkpoint, bundles=list(range(1, tp + 1)), max_model_len=self.context)
        # A server keeps its GPU: no sleep mode, no GPU shared with a learner.
        kwargs.pop("enable_sleep_mode", None)
        kwargs["worker_extension_cls"] = EXTENSION_CLASS  # loads the checkpoints of a run it follows
        # Log-probs as the policy gives them (harnesses score texts with them), not after the
        # request's temperature and top-p as a training run's behaviour log-probs are.
        kwargs["logprobs_mode"] = "raw_logprobs"
        os.environ.pop("VLLM_RAY_PER_WORKER_GPUS", None)
        self.engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(**kwargs))
        self.checkpoint = checkpoint
        self.adapters_taken = 0
        self.adapter = self._adapter_of(checkpoint)
        """vLLM's request for the LoRA adapter served on the base (a LoRA run's checkpoint), or None."""
        if follow:  # (Serve runs __init__ on the replica's event loop)
            self.following = asyncio.get_running_loop().create_task(self._follow(RunFolder(Path(source))))

    def __del__(self):
        # Serve calls this when it stops the replica: the engine's core process goes with it.
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()

    # ------------------------------------------------------------ routes

    async def check_health(self) -> None:
        """Serve's health check: a replica whose reload failed is replaced (from the newest checkpoint)."""
        if self.broken:
            raise RuntimeError(self.broken)
        await self.engine.check_health()

    @api.get("/health")
    async def health(self) -> dict:
        await self.check_health()
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self) -> dict:
        """The checkpoint served; following a run, also the run's name, which always means the
        newest (its `root` names the checkpoint behind it now)."""
        model = {"object": "model", "created": 0, "owned_by": "rayrep", "max_model_len": self.context}
        listed = [{"id": self.name, **model}]
        if self.alias:
            listed.append({"id": self.alias, **model, "root": self.name})
        return {"object": "list", "data": listed}

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        body = oai.parse_completion(await self._json(request), self.caps)
        self._check_model(body.model)
        prompts = [self._prompt_ids(p) for p in body.prompts]
        texts = [p if isinstance(p, str) else self.tokenizer.decode(list(p)) for p in body.prompts]
        return await self._answer(body, prompts, "prompt", chat=False, texts=texts)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        body = oai.parse_chat(await self._json(request), self.caps)
        self._check_model(body.model)
        if not self.tokenizer.chat_template:
            raise oai.APIError(400, f"The model '{self.name}' has no chat template: use /v1/completions.",
                               param="messages")
        ids = self.tokenizer.apply_chat_template(list(body.messages), add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        return await self._answer(body, [list(ids)], "messages", chat=True)

    # ------------------------------------------------------------ checking

    async def _json(self, request: Request) -> dict:
        limit = self.caps.max_request_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:  # refused before the body is read
            raise oai.APIError(413, f"The request body is {declared} bytes; this server takes at most {limit}.",
                               code="request_too_large")
        return oai.read_json(await request.body(), limit)

    def _check_model(self, model: str) -> None:
        if self.broken:
            raise oai.APIError(503, f"This replica cannot answer: {self.broken}", kind="server_error")
        if model not in (self.name, self.alias):
            also = f" (and '{self.alias}', the run's newest checkpoint)" if self.alias else ""
            raise oai.APIError(404, f"The model '{model}' does not exist; this server serves '{self.name}'{also}.",
                               param="model", code="model_not_found")

    # ------------------------------------------------------------ following a run

    def _following_name(self, checkpoint: Path) -> str:
        """The model name of a followed run's checkpoint: `<run's name>/step-<N>`."""
        return f"{self.alias}/{checkpoint.name}"

    async def _follow(self, run: RunFolder) -> None:
        """Every `serve.follow_every_s`, switch to the run's newest complete checkpoint when it
        is not the one served. One that cannot replace it (other tensors) is passed over."""
        passed_over = None
        while not self.broken:
            await asyncio.sleep(self.caps.follow_every_s)
            newest = run.newest_checkpoint()
            version = None if newest is None else checkpoint_version(newest)
            if version is None or version in (self.version, passed_over):
                continue
            try:
                check_checkpoint(str(newest))
                same_tensors(self.checkpoint, newest)
            except InputError as err:
                print(f"not switching: {err}", flush=True)
                passed_over = version
                continue
            if not await self._switch(newest, version):
                passed_over = version

    def _adapter_of(self, checkpoint: str | Path):
        """vLLM's request for `checkpoint` if it is a LoRA adapter (a new name and serial each
        time: the engine keeps adapters by serial, and caches prompts by name), else None."""
        from rayrep.generator.engine import adapter_request

        if not is_adapter(checkpoint):
            return None
        self.adapters_taken += 1
        return adapter_request(str(checkpoint), f"{self.alias or self.name}-{self.adapters_taken}", self.adapters_taken)

    async def _switch(self, checkpoint: Path, version: tuple[str, int]) -> bool:
        """Load `checkpoint`'s weights in place (a LoRA run's: its adapter, on the same base): no
        new request is scheduled meanwhile, the ones in flight finish first (on the weights they
        started with), the caches are emptied. Returns whether it switched: an adapter that does
        not load leaves the one served as it was (False); weights that fail half way leave the
        replica unable to answer."""
        started = time.perf_counter()
        await self.engine.pause_generation(mode="wait", clear_cache=True)
        try:
            if self.adapter is not None:
                adapter = self._adapter_of(checkpoint)
                try:
                    await self.engine.add_lora(adapter)  # loaded now: a bad adapter fails here, not in a request
                except Exception as err:
                    print(f"not switching: the adapter of {checkpoint} does not load ({err})", flush=True)
                    return False
                await self.engine.remove_lora(self.adapter.lora_int_id)
                self.adapter = adapter
            else:
                await self.engine.collective_rpc("rayrep_load_folder", args=(str(checkpoint),))
        except Exception as err:  # the weights may be part old, part new: answer nothing more
            self.broken = f"reloading the weights of {checkpoint} failed ({err})"
            print(self.broken, flush=True)
            return False
        finally:
            await self.engine.resume_generation()
        self.checkpoint, self.version, self.name = str(checkpoint), version, self._following_name(checkpoint)
        print(f"serving {checkpoint} as {self.name!r} (switched in {time.perf_counter() - started:.1f} s)", flush=True)
        return True

    def _prompt_ids(self, prompt: str | tuple[int, ...]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise oai.APIError(400, f"Token id {bad} in 'prompt' is outside the vocabulary (0..{self.vocab_size - 1}).",
                               param="prompt", code="invalid_value")
        return list(prompt)

    # ------------------------------------------------------------ generating

    async def _answer(self, body: oai.CompletionRequest | oai.ChatRequest, prompts: list[list[int]], param: str,
                      chat: bool, texts: list[str] | None = None):
        """Generate for each prompt (`texts`: as the client wrote them, for echo) and answer,
        whole or streamed; with `logprobs`, each token's log-prob and its alternatives', and
        with `echo`, the prompt's before the answer (max_tokens 0: the prompt's alone)."""
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind

        s = body.sampling
        kind = RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY
        prompt_only = body.echo and s.max_tokens == 0  # the engine samples one token, dropped
        # One engine request per prompt, its n answers being choices p*n .. p*n + n-1. vLLM
        # samples n > 1 only at T > 0: greedy answers are asked for one by one.
        requests = []  # (first choice index, prompt index, prompt ids, sampling params)
        for p, ids in enumerate(prompts):
            limit = oai.answer_tokens(s.max_tokens, len(ids), self.context, self.caps.max_tokens, param)
            copies = s.n if s.temperature == 0 else 1
            try:
                params = SamplingParams(
                    n=s.n // copies, temperature=s.temperature, top_p=s.top_p, max_tokens=max(1, limit),
                    stop=list(s.stop), seed=s.seed, presence_penalty=s.presence_penalty,
                    frequency_penalty=s.frequency_penalty, output_kind=kind, logprobs=body.logprobs,
                    prompt_logprobs=body.logprobs if body.echo else None)
            except VLLMClientError as err:
                raise oai.APIError(400, str(err), param=getattr(err, "parameter", None)) from None
            requests += [(p * s.n + j, p, ids, params) for j in range(copies)]
        request_id = oai.new_id("chatcmpl" if chat else "cmpl")
        streams = [self._generate(ids, params, f"{request_id}-{i}") for i, (_, _, ids, params) in enumerate(requests)]
        answer = _Answer(self, body, chat, texts, prompt_only)
        prompt_tokens = sum(map(len, prompts))
        if body.stream:
            events = self._events(request_id, body, streams, requests, prompt_tokens, chat, answer,
                                  time.perf_counter())
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            finals = await asyncio.gather(*(_last(stream) for stream in streams))
        except VLLMClientError as err:
            raise oai.APIError(400, str(err), param=getattr(err, "parameter", None)) from None
        choices, completion_tokens = [], 0
        for (first, p, _, _), output in zip(requests, finals):
            for c in output.outputs:
                text, logprobs, tokens = answer.piece(first + c.index, p, output, c)
                completion_tokens += tokens
                choices.append({"index": first + c.index, "text": text, "logprobs": logprobs,
                                "finish_reason": answer.finish_reason(c)})
        choices.sort(key=lambda c: c["index"])
        # The engine's own time to the first token of each request (its stats), the soonest.
        firsts = [o.metrics.first_token_latency for o in finals if getattr(o.metrics, "first_token_latency", 0)]
        self._record(chat, prompt_tokens, completion_tokens, min(firsts) if firsts else None)
        return oai.completion_body(request_id, self.name, choices, prompt_tokens, completion_tokens, chat)

    def _record(self, chat: bool, prompt_tokens: int, completion_tokens: int, first_token_s: float | None) -> None:
        recorder = metrics.held()
        if recorder is not None:
            route = "/v1/chat/completions" if chat else "/v1/completions"
            recorder.generated(route, prompt_tokens, completion_tokens, first_token_s)

    def _generate(self, ids: list[int], params, request_id: str) -> AsyncIterator:
        from vllm.inputs import TokensPrompt

        return self.engine.generate(TokensPrompt(prompt_token_ids=ids), params, request_id, lora_request=self.adapter)

    def token_logprobs(self, token_ids, steps, top: int) -> list[oai.TokenLogprob]:
        """Each token of `token_ids` with its log-prob from `steps` (vLLM's per-position
        {token id: Logprob}; None at a prompt's first token) and the `top` most likely there."""
        positions = []
        for token_id, step in zip(token_ids, steps):
            token = self.tokenizer.decode([token_id])
            if step is None:
                positions.append(oai.TokenLogprob(token, None))
                continue
            ranked = sorted((lp.rank, t, lp.logprob) for t, lp in step.items() if lp.rank is not None and lp.rank <= top)
            positions.append(oai.TokenLogprob(token, step[token_id].logprob,
                                              tuple((self.tokenizer.decode([t]), lp) for _, t, lp in ranked)))
        return positions

    async def _events(self, request_id: str, body, streams: list[AsyncIterator], requests: list[tuple],
                      prompt_tokens: int, chat: bool, answer: "_Answer", started: float) -> AsyncIterator[str]:
        """The server-sent events of a streamed answer: the engine requests' outputs as they
        come (request r's answers are choices requests[r][0] + i), each choice's first chunk
        opening it (with echo, the prompt first), then usage (when asked) and [DONE]."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(r: int, stream: AsyncIterator) -> None:
            try:
                async for output in stream:
                    await queue.put((r, output))
            except Exception as err:  # reported in the stream: the status line has been sent
                await queue.put((r, err))
            finally:
                await queue.put((r, None))

        tasks = [asyncio.create_task(pump(r, stream)) for r, stream in enumerate(streams)]
        opened: set[int] = set()
        completion_tokens, first_token_s = 0, None
        try:
            running = len(tasks)
            while running:
                r, output = await queue.get()
                if output is None:
                    running -= 1
                    continue
                if isinstance(output, Exception):
                    error = oai.APIError(500, f"Generation failed: {output}", kind="server_error")
                    yield oai.sse(error.body())
                    return
                first, p = requests[r][0], requests[r][1]
                if first_token_s is None:
                    first_token_s = time.perf_counter() - started
                for c in output.outputs:
                    index = first + c.index
                    text, logprobs, tokens = answer.piece(index, p, output, c)
                    completion_tokens += tokens
                    yield oai.sse(oai.chunk_body(request_id, self.name, index, text, answer.finish_reason(c), chat,
                                                 first=index not in opened, logprobs=logprobs))
                    opened.add(index)
            if body.include_usage:
                yield oai.sse(oai.usage_chunk(request_id, self.name, prompt_tokens, completion_tokens, chat))
            yield oai.sse("[DONE]")
            self._record(chat, prompt_tokens, completion_tokens, first_token_s)
        finally:  # a client that went away: stop its generation
            for task in tasks:
                task.cancel()


# ---------------------------------------------------------------- building the application


def deployment_options(cfg: Config) -> dict:
    """Serve options of the policy deployment: replicas or autoscaling, per-replica
    concurrency, and the resources of one replica (its engine's GPUs on a GPU run)."""
    s = cfg.serve
    options: dict = {"max_ongoing_requests": s.max_ongoing_requests}
    if s.max_replicas > s.min_replicas:
        options["autoscaling_config"] = {"min_replicas": s.min_replicas, "max_replicas": s.max_replicas,
                                         "target_ongoing_requests": s.target_ongoing_requests}
    else:
        options["num_replicas"] = s.min_replicas
    actor = {"num_cpus": s.cpus_per_replica}
    tp = cfg.generator.tensor_parallel_size
    if cfg.placement.device == "gpu" and tp == 1:
        actor["num_gpus"] = 1
    elif cfg.placement.device == "gpu":
        # The replica and its engine's tensor-parallel workers on one node: vLLM starts one
        # Ray worker per GPU bundle of the replica's placement group.
        options["placement_group_bundles"] = [{"CPU": s.cpus_per_replica}] + [{"GPU": 1}] * tp
        options["placement_group_strategy"] = "STRICT_PACK"
    # vLLM's notices (the replica's and its engine process's) go to a log file, not the terminal.
    actor["runtime_env"] = {"env_vars": library_log_env(Path(cfg.logging.out_dir) / "serve")}
    options["ray_actor_options"] = actor
    return options


def build_app(cfg: Config, source: str, name: str, api_keys: list[str] = (), follow: bool = False):
    """The Serve application of the policy at checkpoint folder `source`, served as model
    `name`; with `follow`, `source` is a run whose newest checkpoint each replica serves (see
    `PolicyServer`). With `api_keys`, every route but /health asks for one (the replicas get
    their digests only)."""
    return PolicyServer.options(**deployment_options(cfg)).bind(cfg, source, name, keys.digests(list(api_keys)),
                                                                follow)
