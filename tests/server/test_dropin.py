"""What vLLM and llama-server clients count on: `model` optional and any served name accepted,
/v1/models/{id} (the openai client's models.retrieve), ids unique, --seed reproducible across
restarts, list-form text content, --chat-template and the model as `serve`'s positional."""

from __future__ import annotations

import re

import httpx
import pytest

from deltaserve.server.app import build_app
from tests.server.helpers import app_server, running_server

BODY = {"prompt": "The cat", "max_tokens": 6, "temperature": 1.0}


def test_model_is_optional_and_every_served_name_is_accepted(tiny_llm) -> None:
    from openai import NotFoundError, OpenAI

    app = build_app(tiny_llm, served_name="first", aliases=("second", "org/third"))
    with app_server(app) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="none")
        assert [m.id for m in client.models.list().data] == ["first", "second", "org/third"]
        assert client.models.retrieve("org/third").id == "org/third"
        with pytest.raises(NotFoundError):
            client.models.retrieve("other")
        greedy = {**BODY, "temperature": 0}
        texts = set()
        for model in (None, "first", "second", "org/third"):
            body = greedy if model is None else {**greedy, "model": model}
            out = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
            assert out["model"] == "first"
            texts.add(out["choices"][0]["text"])
        assert len(texts) == 1
        missing = httpx.post(f"{base}/v1/completions", json={**greedy, "model": "nope"},
                             timeout=60)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        chat = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert chat.status_code == 200 and chat.json()["id"].startswith("chatcmpl-")


def test_ids_are_unique_and_server_seed_replays_after_a_restart(tiny_llm) -> None:
    runs = []
    for _ in range(2):  # two servers: the same --seed, the same requests in the same order
        with app_server(build_app(tiny_llm, served_name="m", seed=11)) as base:
            outs = [httpx.post(f"{base}/v1/completions", json=BODY, timeout=60).json()
                    for _ in range(3)]
            runs.append(outs)
    texts = [[o["choices"][0]["text"] for o in run] for run in runs]
    assert texts[0] == texts[1]
    assert len(set(texts[0])) > 1  # each request draws from its own seed
    ids = [o["id"] for run in runs for o in run]
    assert len(set(ids)) == len(ids)
    with app_server(build_app(tiny_llm, served_name="m", seed=11)) as base:  # a request's own
        seeded = httpx.post(f"{base}/v1/completions", json={**BODY, "seed": 11}, timeout=60)
    assert seeded.json()["choices"][0]["text"] == texts[0][0]


def test_list_content_of_text_parts_is_one_string(tiny_llm) -> None:
    with app_server(build_app(tiny_llm, served_name="m")) as base:
        def prompt_tokens(content) -> int:
            out = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
                "messages": [{"role": "user", "content": content}], "max_tokens": 1})
            assert out.status_code == 200, out.text
            return out.json()["usage"]["prompt_tokens"]

        parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
        assert prompt_tokens(parts) == prompt_tokens("Hello\nworld")


def test_serve_takes_the_model_positionally_with_a_chat_template(tiny_dir, tiny_llm,
                                                                  tmp_path) -> None:
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant]{% endif %}")
    with running_server(str(tiny_dir), "--dtype", "float32", "--served-model-name", "tiny",
                        "--alias", "alias", "--chat-template", str(template)) as (base, proc):
        out = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "model": "alias", "messages": [{"role": "user", "content": "Hi there"}],
            "max_tokens": 1}).json()
        expected = tiny_llm.tokenizer.encode("[user] Hi there\n[assistant]")
        assert out["usage"]["prompt_tokens"] == len(expected)
        assert httpx.get(f"{base}/v1/models/tiny").json()["id"] == "tiny"
        bad = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "n": 0}, timeout=60)
        assert bad.status_code == 400
    log = proc.stdout.read()
    n_prompt = out["usage"]["prompt_tokens"]
    # the startup line naming what runs the model, one line per request, refusals too
    assert "serve: weights torch.float32, activations torch.float32, cpu: " in log
    assert "native CPU kernels (" in log or "torch's CPU ops" in log
    assert re.search(rf"serve: chatcmpl-[0-9a-f]{{32}}: 200, {n_prompt} prompt \+ 1 completion "
                     r"tokens, TTFT \d+\.\d+ s, total \d+\.\d+ s", log), log
    assert "serve: POST /v1/completions: 400 n: " in log


def test_log_level_and_disable_log_requests() -> None:
    import logging

    from deltaserve.server.main import _server_log

    _server_log("warning", log_requests=True)
    assert not logging.getLogger("deltaserve.server.requests").isEnabledFor(logging.INFO)
    _server_log("info", log_requests=False)
    assert logging.getLogger("deltaserve.server").isEnabledFor(logging.INFO)
    assert not logging.getLogger("deltaserve.server.requests").isEnabledFor(logging.INFO)
    _server_log("info", log_requests=True)
    assert logging.getLogger("deltaserve.server.requests").isEnabledFor(logging.INFO)


def test_completions_take_vllms_four_prompt_forms_as_one_batch(tiny_llm) -> None:
    """str, list[int], list[str], list[list[int]]: choice p * n + i is prompt p's i-th, each the
    text the prompt alone gives; echo and logprobs per prompt; usage counts every prompt."""
    texts = ["The cat", "A dog ran", "Hello"]
    ids = [tiny_llm.tokenizer.encode(t) for t in texts]
    greedy = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
    with app_server(build_app(tiny_llm, served_name="m")) as base:
        def post(**body) -> dict:
            out = httpx.post(f"{base}/v1/completions", json={**greedy, **body}, timeout=60)
            assert out.status_code == 200, out.text
            return out.json()

        alone = [post(prompt=t)["choices"][0]["text"] for t in texts]
        assert post(prompt=ids[1])["choices"][0]["text"] == alone[1]
        for batch in (texts, ids):
            out = post(prompt=batch, n=2)
            assert [c["index"] for c in out["choices"]] == list(range(6))
            assert [c["text"] for c in out["choices"]] == [a for a in alone for _ in range(2)]
            assert out["usage"]["prompt_tokens"] == sum(map(len, ids))
        echoed = post(prompt=texts[:2], echo=True, logprobs=1, max_tokens=2)["choices"]
        for choice, text, one in zip(echoed, texts, ids, strict=False):
            assert choice["text"].startswith(text)
            assert len(choice["logprobs"]["tokens"]) == len(one) + 2
        # n choices of each prompt: the prompt scored once (by choice 0's prefill), shown in each
        twice = post(prompt=texts[:2], echo=True, logprobs=1, max_tokens=2, n=2)["choices"]
        for k, choice in enumerate(twice):
            head = choice["logprobs"]["token_logprobs"][: len(ids[k // 2])]
            assert head[1:] == pytest.approx(echoed[k // 2]["logprobs"]["token_logprobs"][
                1: len(ids[k // 2])], abs=1e-6) and head[0] is None
        streamed = httpx.post(f"{base}/v1/completions", timeout=60, json={
            **greedy, "prompt": texts, "stream": True})
        parts = ["", "", ""]
        for line in streamed.text.splitlines():
            if line.startswith("data: {"):
                import json

                for c in json.loads(line[6:])["choices"]:
                    parts[c["index"]] += c["text"]
        assert parts == alone
        for bad, what in (([[]], "an empty prompt"), ([""], "an empty prompt"),
                          ([[10**9]], "outside the vocabulary")):
            out = httpx.post(f"{base}/v1/completions", json={**greedy, "prompt": bad},
                             timeout=60)
            assert out.status_code == 400 and what in out.json()["error"]["message"]


def test_tokenize_takes_prompt_content_and_messages_and_tokenizer_info(tiny_llm) -> None:
    with app_server(build_app(tiny_llm, served_name="m")) as base:
        def tok(**body) -> dict:
            out = httpx.post(f"{base}/tokenize", json=body, timeout=60)
            assert out.status_code == 200, out.text
            return out.json()

        ids = tiny_llm.tokenizer.encode("Hello world")
        assert tok(prompt="Hello world", add_special_tokens=False)["tokens"] == ids
        assert tok(content="Hello world", add_special=True)["tokens"] == ids
        pieces = tok(content="Hello world", with_pieces=True)["tokens"]
        assert [p["id"] for p in pieces] == ids and "".join(p["piece"] for p in pieces) == \
            "Hello world"
        assert "".join(tok(prompt="Hello world", return_token_strs=True)["token_strs"]) == \
            "Hello world"
        messages = [{"role": "user", "content": "Hi"}]
        chat = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "messages": messages, "max_tokens": 1}).json()
        assert tok(messages=messages)["count"] == chat["usage"]["prompt_tokens"]
        assert tok(messages=messages, add_generation_prompt=False)["count"] < \
            chat["usage"]["prompt_tokens"]
        for bad in ({}, {"prompt": "a", "content": "b"}, {"prompt": "a", "bogus": 1}):
            assert httpx.post(f"{base}/tokenize", json=bad, timeout=60).status_code == 400
        back = httpx.post(f"{base}/detokenize", json={"tokens": ids}, timeout=60).json()
        assert back == {"prompt": "Hello world", "content": "Hello world"}
        info = httpx.get(f"{base}/tokenizer_info", timeout=60).json()
        assert info["chat_template"] == tiny_llm.tokenizer.chat_template
        assert tiny_llm.tokenizer.encode(info["eos_token"])[0] in tiny_llm.eos_token_ids


def test_cors_only_when_asked_and_the_role_comes_first(tiny_llm) -> None:
    preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST"}
    with app_server(build_app(tiny_llm, served_name="m", api_key="k")) as base:
        out = httpx.options(f"{base}/v1/completions", headers=preflight, timeout=60)
        assert "access-control-allow-origin" not in out.headers
    cors = {"allow_origins": ["http://app.example"], "allow_methods": ["POST"],
            "allow_headers": ["*"], "allow_credentials": False}
    with app_server(build_app(tiny_llm, served_name="m", api_key="k", cors=cors)) as base:
        out = httpx.options(f"{base}/v1/completions", headers=preflight, timeout=60)
        assert out.status_code == 200
        assert out.headers["access-control-allow-origin"] == "http://app.example"
        stream = httpx.post(f"{base}/v1/chat/completions", timeout=60, headers={
            "Authorization": "Bearer k", "Origin": "http://app.example"}, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True,
            "n": 2})
        assert stream.headers["access-control-allow-origin"] == "http://app.example"
        import json

        chunks = [json.loads(x[6:]) for x in stream.text.splitlines() if x.startswith("data: {")]
        for i in range(2):  # each choice's first delta names the role
            first = next(c["choices"][0] for c in chunks if c["choices"][0]["index"] == i)
            assert first["delta"] == {"role": "assistant", "content": ""}
