"""The OpenAI-compatible app: /v1/chat/completions and /v1/completions (streamed as SSE or not),
/v1/models, /health, /metrics, /tokenize, /detokenize, on one LLM's batched engine.

Handlers parse, render and tokenize on worker threads within bounds (server/prepare.py), hand the
request to the engine thread (server/bridge.py), and read its events; a client that goes away
aborts its request.
"""

from __future__ import annotations

import contextlib
import hmac
import itertools
import uuid
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deltaserve.engine import prompt_logprobs
from deltaserve.engine.sampling import SamplingParams
from deltaserve.errors import ConfigError, DeltaserveError
from deltaserve.server import logprobs as lp
from deltaserve.server.anthropic import CountTokensRequest, MessagesRequest, add_message_routes
from deltaserve.server.constraints import structured_of, tool_spec
from deltaserve.server.errors import ApiError, BodyLimit, context_overflow, error_response, install
from deltaserve.server.host import ModelHost
from deltaserve.server.images import image_prompt
from deltaserve.server.metrics import exposition, registry
from deltaserve.server.output import ChoiceOutput
from deltaserve.server.prepare import Preparer
from deltaserve.server.prompts import (
    add_token_routes,
    body_schema,
    chat_prompt,
    check_model,
    completion_prompts,
)
from deltaserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from deltaserve.server.reasoning import opens_think_block
from deltaserve.server.responses import ResponsesRequest, add_response_routes
from deltaserve.server.stream import Choices, ClientGone, StreamSpec, collect, response, sse

OPEN_PATHS = ("/health", "/v1/models")  # answer without the API key (and /v1/models/{id})


def build_app(llm=None, served_name: str = "model", api_key: str | None = None,
              max_body_bytes: int = 4 << 20, *, load=None, idle_unload_s: float | None = None,
              on_first_load_failed=None, mirror=None, max_prompt_chars: int | None = None,
              special_tokens_in_content: bool = False, aliases: tuple[str, ...] = (),
              seed: int | None = None, cors: dict | None = None,
              metrics_without_key: bool = False) -> FastAPI:
    """The app on a loaded `llm`, or on `load()` run in the background once the server is up
    (then idle unload and reload are possible: `idle_unload_s`, None = never). mirror: the
    other ranks' command channel under `serve --tp` (distributed/serve.py). max_prompt_chars:
    None = what the context can hold (server/prepare.py). special_tokens_in_content: special-token
    strings in messages become control tokens (default: plain text, chat.py). aliases: more
    model ids requests may name (responses name served_name). seed: requests without one sample
    from seed, seed + 1, ... in arrival order (vLLM's --seed: a restart replays the same draws).
    cors: CORSMiddleware's options (allow_origins, ...), or None for no CORS headers.
    metrics_without_key: /metrics answers without the API key (a scraper holding none)."""
    if api_key is not None and not api_key.strip():
        raise ConfigError("the API key is empty: give a key, or none to serve without one")
    host = ModelHost(load, llm, idle_unload_s, on_first_load_failed, mirror)
    prep = Preparer(max_prompt_chars)
    names = tuple(dict.fromkeys((served_name, *aliases)))
    seeds = None if seed is None else itertools.count(seed)
    open_paths = OPEN_PATHS + (("/metrics",) if metrics_without_key else ())
    metrics_registry = registry(host, served_name)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await host.start()
        yield
        await host.stop(app.state.drain_s)  # graceful: in-flight requests finish first
        prep.shutdown()

    app = FastAPI(title="deltaserve", docs_url=None, redoc_url=None, lifespan=lifespan)
    install(app)
    app.state.host, app.state.name, app.state.drain_s = host, served_name, 30.0
    app.openapi = lambda: _openapi(app)

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        path = request.url.path
        open_path = path in open_paths or path.startswith("/v1/models/")
        if api_key and not open_path and not _key_ok(request, api_key):
            return error_response(401, "missing or invalid API key", "invalid_api_key",
                                  path=path)
        return await call_next(request)

    if cors:  # added last, so outermost: preflights are answered before the key check
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, **cors)

    @app.get("/health")
    async def health():
        status, what = host.health()
        if status != 200:
            return error_response(status, what)
        return {"status": what}

    def card(name: str) -> dict:
        one = {"id": name, "object": "model", "created": 0, "owned_by": "deltaserve"}
        if host.max_model_len is not None:
            one["max_model_len"] = host.max_model_len
        if host.input_modalities is not None:  # llama-server's field: clients check it
            one["architecture"] = {"input_modalities": host.input_modalities}
        return one

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card(n) for n in names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id, names)
        return card(model_id)

    @app.get("/metrics")
    async def metrics(request: Request):
        body, content_type = exposition(metrics_registry, request.headers.get("accept"))
        return Response(body, media_type=content_type)

    add_token_routes(app, prep, host, names, special_tokens_in_content)

    @app.post("/v1/chat/completions", openapi_extra=body_schema(ChatCompletionRequest))
    async def chat(request: Request):
        body, size = await prep.body(request, ChatCompletionRequest)
        return await run_chat(request, body, size)

    async def count_chat(body, size: int) -> int:
        """The prompt tokens of a chat request (text only)."""
        check_model(body.model, names)
        async with host.use() as (llm, _):
            _, ids, sources = await prep.run(size, chat_prompt, prep, llm, body,
                                             special_tokens_in_content)
            if sources:
                raise ApiError(400, "counting tokens of images is not supported",
                               param="messages")
            return len(ids)

    async def run_chat(request: Request, body: ChatCompletionRequest, size: int):
        check_model(body.model, names)
        async with host.use() as (llm, driver):
            text, ids, sources = await prep.run(size, chat_prompt, prep, llm, body,
                                                special_tokens_in_content)
            images = None
            if sources:
                mode = (body.mm_processor_kwargs or {}).get("downsample_mode")
                ids, images = await image_prompt(llm, driver, text.text, sources, mode,
                                                 text.markers)
            return await _complete(request, body, [(None, ids)], "chat.completion", llm,
                                   driver, opens_think_block(text.plain), images)

    add_message_routes(app, prep, run_chat, count_chat)
    add_response_routes(app, prep, run_chat)

    @app.post("/v1/completions", openapi_extra=body_schema(CompletionRequest))
    async def completions(request: Request):
        body, size = await prep.body(request, CompletionRequest)
        check_model(body.model, names)
        async with host.use() as (llm, driver):
            prompts = await prep.run(size, completion_prompts, prep, llm, body.prompt)
            return await _complete(request, body, prompts, "text_completion", llm, driver)

    async def _complete(request: Request, body, prompts: list[tuple[str | None, list[int]]],
                        kind: str, llm, driver, thinking: bool = False, images=None):
        """prompts: (text or None, ids) each; body.n choices of each, choice p * n + i being
        prompt p's i-th (vLLM's order), all submitted together."""
        num_lp, echo, limit = body.num_logprobs(), getattr(body, "echo", False), \
            body.token_limit()
        longest = max(len(ids) for _, ids in prompts)
        if body.stream and limit == 0:
            raise ApiError(400, "max_tokens: 0 (scoring the prompt) needs stream off",
                           param="max_tokens")
        if limit == 0 and not echo:
            raise ApiError(400, "max_tokens: 0 needs echo (scoring the prompt)",
                           param="max_tokens")
        if limit == 0 and longest > llm.max_model_len:  # checked before any scoring
            raise context_overflow(longest, llm.max_model_len, 0)
        tools = tool_spec(body)  # the calls parsed from the output (None: no tools, or "none")
        if body.seed is None and seeds is not None:  # --seed: this request's draws
            body = body.model_copy(update={"seed": next(seeds) % 2**63})
        params = _params(body, llm, longest, tools, num_lp) if limit != 0 else None
        # echo with logprobs while generating: the engine's prefill scores the prompt (choice 0
        # of each prompt asks for it), one forward; a stream, or an engine that cannot, scores
        # it first with a forward of its own
        by_engine = echo and num_lp is not None and params is not None and not body.stream \
            and prompt_logprobs.unavailable(llm.engine) is None
        if by_engine:
            params[0] = replace(params[0], prompt_logprobs=num_lp)
        if params and params[0].structured_outputs is not None:  # compiled off the engine thread
            try:
                await prep.run(0, llm.engine.grammars.compile, params[0].structured_outputs)
            except DeltaserveError as exc:
                raise ApiError(400, str(exc), "invalid_constraint") from exc
        # the echoed prompts' text and teacher-forced logprobs (generated tokens get theirs from
        # the engine as it samples)
        heads = [await _echo_head(driver, llm, text, ids, None if by_engine else num_lp)
                 for text, ids in prompts] if echo else None
        heads = [heads[k // body.n] for k in range(len(prompts) * body.n)] if heads else None
        # the whole response's outputs (a stream makes its own): generated text's offsets count
        # from the end of the echoed prompt's last token
        ends = [lp.echo_end(llm.tokenizer.decode, prompts[k // body.n][1]) if echo else 0
                for k in range(len(prompts) * body.n)]
        outputs = [ChoiceOutput(kind, thinking, llm.tokenizer.decode, num_lp or 0,
                                num_lp is not None, end, tools) for end in ends]
        n_prompt = sum(len(ids) for _, ids in prompts)
        if limit == 0:  # echo only: score the prompt, generate nothing
            for out in outputs:
                out.finish_reason = "length"
            return JSONResponse(response(rid_for(kind), kind, served_name,
                                         [o.whole() for o in outputs], n_prompt, heads))
        choices = Choices(rid_for(kind), len(outputs), driver, request)
        await choices.submit([ids for _, ids in prompts for _ in range(body.n)],
                             params * len(prompts), images)
        if body.stream:  # headers wait for the first event: a failed prefill is still a 5xx
            first = await choices.next()
            choices.fail_on(first[1])
            spec = StreamSpec(kind, served_name, n_prompt, bool(
                body.stream_options and body.stream_options.include_usage), thinking,
                llm.tokenizer.decode, num_lp or 0, heads, num_lp is not None, tools)
            streamed = StreamingResponse(sse(choices, spec, first),
                                         media_type="text/event-stream")
            streamed.served_name, streamed.n_prompt = served_name, n_prompt  # for /v1/messages
            return streamed
        status = 500
        try:
            await collect(choices, outputs)
            if by_engine:
                heads = [(heads[k][0], lp.from_engine(
                    llm, prompts[k // body.n][1], outputs[k - k % body.n].prompt_logprobs, num_lp))
                    for k in range(len(outputs))]
            status = 200
        except ClientGone:  # aborted; the answer would go nowhere (nginx's 499)
            status = 499
            return Response(status_code=499)
        except ApiError as exc:
            status = exc.status
            raise
        finally:
            choices.abort()  # finished ids are ignored; one still running must not run on
            choices.close()
            choices.log(status, n_prompt, sum(len(o.token_ids) for o in outputs))
        return JSONResponse(response(choices.rid, kind, served_name,
                                     [o.whole() for o in outputs], n_prompt, heads))

    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema plus the request models the routes parse themselves."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        defs = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (ChatCompletionRequest, CompletionRequest, TokenizeRequest,
                      DetokenizeRequest, MessagesRequest, CountTokensRequest,
                      ResponsesRequest):
            one = model.model_json_schema(ref_template="#/components/schemas/{model}")
            defs.update(one.pop("$defs", {}))
            defs[model.__name__] = one
        app.openapi_schema = schema
    return app.openapi_schema


async def _echo_head(driver, llm, text: str | None, ids: list[int], num_lp: int | None
                     ) -> tuple[str, dict | None]:
    """An echoed prompt: its text, and its teacher-forced logprobs when asked."""
    head_lp = None if num_lp is None else await driver.call_every_rank(
        lp.completion_logprobs, llm, ids, 0, num_lp)
    return (text if text is not None else llm.tokenizer.decode(ids)), head_lp


def _key_ok(request: Request, api_key: str) -> bool:
    given = request.headers.get("x-api-key") or ""
    auth = request.headers.get("authorization") or ""
    if auth.lower().startswith("bearer "):
        given = auth[7:].strip()
    return hmac.compare_digest(given.encode(), api_key.encode())


def _params(body, llm, num_prompt: int, tools, logprobs: int | None = None
            ) -> list[SamplingParams]:
    """One SamplingParams per choice; with a seed, choice i samples with seed + i (reproducible,
    and the choices differ)."""
    limit = body.token_limit()
    room = llm.max_model_len - num_prompt
    if room < 1 or (limit is not None and limit > room):
        raise context_overflow(num_prompt, llm.max_model_len, limit or 1)
    default = llm.get_default_sampling_params()
    pick = lambda name: getattr(default, name) if getattr(body, name) is None \
        else getattr(body, name)  # noqa: E731
    structured = structured_of(body, tools)
    try:
        return [SamplingParams(
            temperature=pick("temperature"), top_p=pick("top_p"),
            top_k=default.top_k if body.top_k is None else max(body.top_k, 0),
            min_p=pick("min_p"), presence_penalty=pick("presence_penalty"),
            frequency_penalty=pick("frequency_penalty"),
            repetition_penalty=pick("repetition_penalty"),
            seed=None if body.seed is None else (body.seed + i) % 2**63, max_tokens=limit,
            stop=tuple(body.stop or ()), stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos, logprobs=logprobs,
            include_stop_str_in_output=body.include_stop_str_in_output,
            # a call's tags may be special tokens (Qwen3.5's are): kept for the parser (as vLLM)
            skip_special_tokens=body.skip_special_tokens and tools is None,
            logit_bias={int(k): v for k, v in (body.logit_bias or {}).items()} or None,
            min_tokens=body.min_tokens, bad_words=body.bad_words,
            allowed_token_ids=body.allowed_token_ids, structured_outputs=structured)
            for i in range(body.n)]
    except (ValueError, DeltaserveError) as exc:
        raise ApiError(400, str(exc)) from exc


def rid_for(kind: str) -> str:
    """Unique across restarts too (clients and logs key on them)."""
    return f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}"
