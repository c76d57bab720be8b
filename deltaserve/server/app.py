"""The OpenAI-compatible app: /v1/chat/completions and /v1/completions (streamed as SSE or not),
/v1/models, /health, /metrics, /tokenize, /detokenize, on one LLM's batched engine.

Handlers validate and tokenize on the event loop, hand the request to the engine thread
(server/bridge.py), and read its events; a client that goes away aborts its request.
"""

from __future__ import annotations

import contextlib
import hmac
import itertools
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from deltaserve.engine.sampling import SamplingParams
from deltaserve.errors import DeltaserveError
from deltaserve.multimodal.inputs import message_images
from deltaserve.server import logprobs as lp
from deltaserve.server.errors import ApiError, BodyLimit, context_overflow, error_response, install
from deltaserve.server.host import ModelHost
from deltaserve.server.images import check_image_parts, image_prompt
from deltaserve.server.protocol import ChatCompletionRequest, CompletionRequest
from deltaserve.server.reasoning import opens_think_block
from deltaserve.server.stream import Choices, StreamSpec, collect, response, sse

OPEN_PATHS = ("/health", "/v1/models")  # answer without the API key
_ids = itertools.count()


def build_app(llm=None, served_name: str = "model", api_key: str | None = None,
              max_body_bytes: int = 4 << 20, *, load=None, idle_unload_s: float | None = None,
              on_first_load_failed=None, mirror=None) -> FastAPI:
    """The app on a loaded `llm`, or on `load()` run in the background once the server is up
    (then idle unload and reload are possible: `idle_unload_s`, None = never). mirror: the
    other ranks' command channel under `serve --tp` (distributed/serve.py)."""
    host = ModelHost(load, llm, idle_unload_s, on_first_load_failed, mirror)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await host.start()
        yield
        await host.stop()  # graceful: in-flight requests finish first

    app = FastAPI(title="deltaserve", docs_url=None, redoc_url=None, lifespan=lifespan)
    install(app)
    app.state.host, app.state.name = host, served_name

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        if api_key and request.url.path not in OPEN_PATHS and not _key_ok(request, api_key):
            return error_response(401, "missing or invalid API key", "invalid_api_key")
        return await call_next(request)

    @app.get("/health")
    async def health():
        status, what = host.health()
        if status != 200:
            return error_response(status, what)
        return {"status": what}

    @app.get("/v1/models")
    async def models():
        card = {"id": served_name, "object": "model", "created": 0, "owned_by": "deltaserve"}
        if host.max_model_len is not None:
            card["max_model_len"] = host.max_model_len
        if host.input_modalities is not None:  # llama-server's field: clients check it
            card["architecture"] = {"input_modalities": host.input_modalities}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(_metrics_text(host, served_name))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _json(request)
        text = body.get("prompt")
        if not isinstance(text, str):
            raise ApiError(400, "prompt: a string is required", param="prompt")
        async with host.use() as (llm, _):
            tokens = llm.tokenizer.encode(text)
            return {"tokens": tokens, "count": len(tokens), "max_model_len": llm.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _json(request)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ApiError(400, "tokens: a list of integers is required", param="tokens")
        async with host.use() as (llm, _):
            if any(not 0 <= t < llm.config.vocab_size for t in tokens):
                raise ApiError(400, "tokens: an id is outside the vocabulary", param="tokens")
            return {"prompt": llm.tokenizer.decode(tokens)}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        _check_model(body.model, served_name)
        async with host.use() as (llm, driver):
            try:
                messages = [{**m.model_dump(exclude_none=True), "content": m.template_content()}
                            for m in body.messages]
                sources = message_images(messages)
                if sources:
                    check_image_parts(llm, sources)  # before rendering: nothing spent yet
                kwargs = dict(body.chat_template_kwargs or {})
                text = llm.tokenizer.apply_chat_template(
                    messages, enable_thinking=bool(kwargs.pop("enable_thinking", True)), **kwargs)
            except (ValueError, DeltaserveError, TypeError) as exc:
                raise ApiError(400, f"messages: {exc}", param="messages") from exc
            images = None
            if sources:
                mode = (body.mm_processor_kwargs or {}).get("downsample_mode")
                ids, images = await image_prompt(llm, driver, text, sources, mode)
            else:
                ids = llm.tokenizer.encode(text)
            return await _complete(request, body, ids, "chat.completion", llm, driver,
                                   opens_think_block(text), images)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model, served_name)
        async with host.use() as (llm, driver):
            ids = (llm.tokenizer.encode(body.prompt) if isinstance(body.prompt, str)
                   else list(body.prompt))
            if any(not 0 <= t < llm.config.vocab_size for t in ids):
                raise ApiError(400, "prompt: a token id is outside the vocabulary",
                               param="prompt")
            return await _complete(request, body, ids, "text_completion", llm, driver)

    async def _complete(request: Request, body, ids: list[int], kind: str, llm, driver,
                        thinking: bool = False, images=None):
        num_lp, echo = body.num_logprobs(), getattr(body, "echo", False)
        if body.stream and body.token_limit() == 0:
            raise ApiError(400, "max_tokens: 0 (scoring the prompt) needs stream off",
                           param="max_tokens")
        prompt = body.prompt if kind == "text_completion" else None
        # the echoed prompt's text and teacher-forced logprobs (generated tokens get theirs from
        # the engine as it samples)
        head = _echo_text(prompt, ids, llm) if echo else ""
        head_lp = None
        if echo and num_lp is not None:
            head_lp = await driver.call_every_rank(lp.completion_logprobs, llm, ids, 0, num_lp)
        if body.token_limit() == 0:  # echo only: score the prompt, generate nothing
            if not echo:
                raise ApiError(400, "max_tokens: 0 needs echo (scoring the prompt)",
                               param="max_tokens")
            if len(ids) > llm.max_model_len:
                raise context_overflow(len(ids), llm.max_model_len, 0)
            outs = [("", "length", [], [])] * body.n
            return JSONResponse(_whole(rid_for(kind), kind, ids, outs, head, head_lp, num_lp,
                                       thinking, llm))
        choices = Choices(rid_for(kind), body.n, driver)
        await choices.submit(ids, _params(body, llm, len(ids), num_lp), images)
        if body.stream:  # headers wait for the first event: a failed prefill is still a 5xx
            first = await choices.next(request)
            choices.fail_on(first[1])
            spec = StreamSpec(kind, served_name, len(ids), bool(
                body.stream_options and body.stream_options.include_usage), thinking,
                llm.tokenizer.decode, num_lp or 0, (head, head_lp) if echo else None)
            return StreamingResponse(sse(request, choices, spec, first),
                                     media_type="text/event-stream")
        outs = await collect(choices, request)
        return JSONResponse(_whole(choices.rid, kind, ids, outs, head, head_lp, num_lp,
                                   thinking, llm))

    def _whole(rid, kind, ids, outs, head, head_lp, num_lp, thinking, llm) -> dict:
        """The whole response: each choice's text after the echoed prompt (if any), and its
        logprobs when asked (the prompt's part first)."""
        out = response(rid, kind, served_name, [(head + t, r) for t, r, _, _ in outs], len(ids),
                       sum(len(o) for _, _, o, _ in outs), thinking)
        if num_lp is not None:
            start = head_lp["text_offset"][-1] + len(head_lp["tokens"][-1]) if head_lp else 0
            for i, (_, _, out_ids, entries) in enumerate(outs):
                tail, _ = lp.step_logprobs(kind, llm.tokenizer.decode, out_ids, entries,
                                           num_lp, start)
                out["choices"][i]["logprobs"] = lp.joined(head_lp, tail)
        return out

    return app


def _echo_text(prompt, ids: list[int], llm) -> str:
    return prompt if isinstance(prompt, str) else llm.tokenizer.decode(ids)


def _key_ok(request: Request, api_key: str) -> bool:
    given = request.headers.get("x-api-key") or ""
    auth = request.headers.get("authorization") or ""
    if auth.lower().startswith("bearer "):
        given = auth[7:].strip()
    return hmac.compare_digest(given.encode(), api_key.encode())


async def _json(request: Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, "the request body is not valid JSON", "invalid_json") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _check_model(name: str, served_name: str) -> None:
    if name != served_name:
        raise ApiError(404, f"The model `{name}` does not exist.", "model_not_found", "model")


def _params(body, llm, num_prompt: int, logprobs: int | None = None) -> list[SamplingParams]:
    """One SamplingParams per choice; with a seed, choice i samples with seed + i (reproducible,
    and the choices differ)."""
    limit = body.token_limit()
    room = llm.max_model_len - num_prompt
    if room < 1 or (limit is not None and limit > room):
        raise context_overflow(num_prompt, llm.max_model_len, limit or 1)
    default = llm.get_default_sampling_params()
    try:
        return [SamplingParams(
            temperature=default.temperature if body.temperature is None else body.temperature,
            top_p=default.top_p if body.top_p is None else body.top_p,
            top_k=default.top_k if body.top_k is None else max(body.top_k, 0),
            min_p=default.min_p if body.min_p is None else body.min_p,
            seed=None if body.seed is None else (body.seed + i) % 2**63, max_tokens=limit,
            stop=tuple(body.stop or ()), ignore_eos=body.ignore_eos, logprobs=logprobs)
            for i in range(body.n)]
    except (ValueError, DeltaserveError) as exc:
        raise ApiError(400, str(exc)) from exc


def rid_for(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{next(_ids)}"


def _metrics_text(host: ModelHost, name: str) -> str:
    """Prometheus text under vLLM's metric names (ours where vLLM has none or means otherwise)."""
    c, llm, driver = host.counters, host.llm, host.driver
    label = f'{{model_name="{name}"}}'
    running = waiting = num_open = 0
    kv_used = 0.0
    engine = host.engine_totals()
    if llm is not None:
        sched, usage = llm.engine.scheduler, llm.engine.cache.usage()
        running, waiting, num_open = sched.num_running, sched.num_waiting, driver.num_open
        kv_used = 1.0 - usage["blocks_free"] / max(1, usage["blocks_total"])
    lines = [
        f"vllm:num_requests_running{label} {running}",
        f"vllm:num_requests_waiting{label} {waiting}",
        f"vllm:kv_cache_usage_perc{label} {kv_used:.6f}",
        f"vllm:prompt_tokens_total{label} {c.prompt_tokens}",
        f"vllm:generation_tokens_total{label} {c.generation_tokens}",
        f"vllm:num_preemptions_total{label} {engine['preemptions']}",
        # lookups, not tokens (vLLM's prefix_cache_* count tokens): a hit restores a snapshot
        f"deltaserve:prefix_cache_hits_total{label} {engine['prefix_hits']}",
        f"deltaserve:prefix_cache_misses_total{label} {engine['prefix_misses']}",
        f"deltaserve:model_loaded{label} {int(host.state == 'ready')}",
        f"deltaserve:model_loads_total{label} {host.num_loads}",
        f"deltaserve:requests_open{label} {num_open}",
        f"deltaserve:requests_aborted_total{label} {c.aborted}",
        f"deltaserve:engine_steps_total{label} {c.num_steps}",
        # speculative decoding (spec/): verify steps, drafted and accepted tokens (vLLM's names)
        f"vllm:spec_decode_num_drafts_total{label} {engine['spec_drafts']}",
        f"vllm:spec_decode_num_draft_tokens_total{label} {engine['spec_draft_tokens']}",
        f"vllm:spec_decode_num_accepted_tokens_total{label} {engine['spec_accepted_tokens']}",
        f"deltaserve:spec_decode_acceptance_rate{label} "
        f"{engine['spec_accepted_tokens'] / max(1, engine['spec_draft_tokens']):.6f}",
    ]
    labels = f'model_name="{name}"'
    for metric, hist in (("vllm:time_to_first_token_seconds", c.ttft),
                         ("vllm:inter_token_latency_seconds", c.itl),
                         ("vllm:request_decode_time_seconds", c.decode),
                         ("vllm:e2e_request_latency_seconds", c.e2e)):
        lines.extend(hist.lines(metric, labels))
    for reason, count in sorted(c.finished.items()):
        lines.append(f'vllm:request_success_total{{model_name="{name}",finished_reason='
                     f'"{reason}"}} {count}')
    return "\n".join(lines) + "\n"
