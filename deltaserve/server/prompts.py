"""Prompts as the server builds them (text, token-id batches, chat through the template) and the
tokenizer's own routes: /tokenize, /detokenize, /tokenizer_info."""

from __future__ import annotations

import json

from fastapi import Request

from deltaserve.chat import render_chat_text
from deltaserve.errors import DeltaserveError
from deltaserve.multimodal.inputs import message_images
from deltaserve.server.errors import ApiError
from deltaserve.server.images import check_image_parts
from deltaserve.server.prepare import Preparer
from deltaserve.server.protocol import DetokenizeRequest, TokenizeRequest


def body_schema(model) -> dict:
    """openapi_extra for a route that parses its own body (server/prepare.py) as `model`."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def add_token_routes(app, prep: Preparer, host, names: tuple[str, ...],
                     special_tokens_in_content: bool) -> None:
    """/tokenize (vLLM's prompt or messages, llama-server's content), /detokenize and vLLM's
    /tokenizer_info."""

    @app.post("/tokenize", openapi_extra=body_schema(TokenizeRequest))
    async def tokenize(request: Request):
        body, size = await prep.body(request, TokenizeRequest)
        check_model(body.model, names)
        async with host.use() as (llm, _):
            if body.messages is not None:  # the ids a chat request with them would run
                _, tokens, sources = await prep.run(size, chat_prompt, prep, llm, body,
                                                    special_tokens_in_content)
                if sources:
                    raise ApiError(400, "messages: /tokenize does not take images",
                                   param="messages")
            else:
                text = body.prompt if body.prompt is not None else body.content
                tokens = await prep.run(size, encode, prep, llm, text)
            out = {"tokens": tokens, "count": len(tokens), "max_model_len": llm.max_model_len}
            if body.return_token_strs or body.with_pieces:
                pieces = [llm.tokenizer.decode([t]) for t in tokens]
                if body.return_token_strs:
                    out["token_strs"] = pieces
                if body.with_pieces:  # llama-server's shape
                    out["tokens"] = [{"id": t, "piece": p} for t, p in zip(tokens, pieces,
                                                                           strict=True)]
            return out

    @app.post("/detokenize", openapi_extra=body_schema(DetokenizeRequest))
    async def detokenize(request: Request):
        body, size = await prep.body(request, DetokenizeRequest)
        check_model(body.model, names)
        async with host.use() as (llm, _):
            if any(not 0 <= t < llm.config.vocab_size for t in body.tokens):
                raise ApiError(400, "tokens: an id is outside the vocabulary", param="tokens")
            text = await prep.run(size, llm.tokenizer.decode, body.tokens)
            return {"prompt": text, "content": text}  # vLLM's key and llama-server's

    @app.get("/tokenizer_info")
    async def tokenizer_info_route():
        """vLLM's: what a client needs to tokenize as the server does (lm-eval's remote
        tokenizer reads eos_token and chat_template)."""
        async with host.use() as (llm, _):
            return tokenizer_info(llm)



def encode(prep: Preparer, llm, text: str) -> list[int]:
    """On a worker: the bound, then the tokenizer (which releases the GIL)."""
    prep.check_chars(llm, text, "prompt")
    return llm.tokenizer.encode(text)


def completion_prompts(prep: Preparer, llm, prompt) -> list[tuple[str | None, list[int]]]:
    """On a worker: (text or None, ids) of each prompt of a str, list[str], list[int] or
    list[list[int]] `prompt`."""
    batch = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) \
        else [prompt]
    out = []
    for one in batch:
        ids = encode(prep, llm, one) if isinstance(one, str) else list(one)
        if any(not 0 <= t < llm.config.vocab_size for t in ids):
            raise ApiError(400, "prompt: a token id is outside the vocabulary", param="prompt")
        out.append((one if isinstance(one, str) else None, ids))
    return out


def chat_prompt(prep: Preparer, llm, body, special_in_content: bool):
    """On a worker: (ChatText, prompt ids or None when images follow, image sources)."""
    try:
        messages = [{**m.model_dump(exclude_none=True), "content": m.template_content()}
                    for m in body.messages]
        sources = message_images(messages)
        if sources:
            check_image_parts(llm, sources)  # before rendering: nothing spent yet
        kwargs = dict(body.chat_template_kwargs or {})
        kwargs.setdefault("add_generation_prompt", getattr(body, "add_generation_prompt", True))
        if body.tools:  # the template describes them to the model
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
        for message in messages:  # assistant tool calls as the template takes them
            for call in message.get("tool_calls") or ():
                call_args = (call.get("function") or {}).get("arguments")
                if isinstance(call_args, str):
                    call["function"]["arguments"] = json.loads(call_args or "{}")
        text = render_chat_text(llm.tokenizer, messages, special_in_content,
                                enable_thinking=bool(kwargs.pop("enable_thinking", True)),
                                **kwargs)
    except (ValueError, DeltaserveError, TypeError, AttributeError) as exc:
        raise ApiError(400, f"messages: {exc}", param="messages") from exc
    prep.check_chars(llm, text.text, "messages")
    ids = None if sources else llm.tokenizer.encode_chat(text.text, text.markers)
    return text, ids, sources


def tokenizer_info(llm) -> dict:
    tok = llm.tokenizer
    config = tok.config or {}

    def text_of(value):  # tokenizer_config.json keeps a token as a string or {"content": ...}
        return value.get("content") if isinstance(value, dict) else value

    eos = [tok.decode([i]) for i in sorted(llm.eos_token_ids)]
    return {"tokenizer_class": config.get("tokenizer_class", "PreTrainedTokenizerFast"),
            "eos_token": text_of(config.get("eos_token")) or (eos[0] if eos else None),
            "bos_token": text_of(config.get("bos_token")),
            "pad_token": text_of(config.get("pad_token")),
            "eos_token_ids": sorted(llm.eos_token_ids), "vocab_size": llm.config.vocab_size,
            "model_max_length": llm.max_model_len, "chat_template": tok.chat_template}


def check_model(name: str | None, names: tuple[str, ...]) -> None:
    if name is not None and name not in names:
        raise ApiError(404, f"The model `{name}` does not exist.", "model_not_found", "model")
