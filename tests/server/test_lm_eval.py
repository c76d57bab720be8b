"""lm-evaluation-harness against a real server on loopback, as its users run it: the default
`local-completions` (tokenized requests through the server's own tokenizer, found at
/tokenizer_info; echo scoring) and `local-chat-completions`, on small local task files. The
loglikelihoods it reports equal the engine's teacher-forced values for the ids it sent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deltaserve.cache.sequence import prompt_logits
from deltaserve.server.app import build_app
from tests.server.helpers import app_server

lm_eval = pytest.importorskip("lm_eval")

DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "Rome", "a big city"],
     "label": 0},
    {"question": "def add(a, b):\n    return", "choices": ["a + b", "a - b"], "label": 0},
    {"question": "Water boils at", "choices": ["100 degrees", "0 degrees"], "label": 0},
]


def _tasks(folder: Path) -> Path:
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS), encoding="utf-8")
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
              "test_split: test\ndoc_to_text: \"{{question}}\"\n")
    (folder / "ds_mc.yaml").write_text(
        "task: ds_mc\n" + common + "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: label\nmetric_list:\n  - metric: acc\n", encoding="utf-8")
    (folder / "ds_gen.yaml").write_text(
        "task: ds_gen\n" + common + "output_type: generate_until\ndoc_to_target: \"x\"\n"
        "generation_kwargs:\n  until: [\"\\n\\n\"]\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n", encoding="utf-8")
    return folder


def _evaluate(folder: Path, model: str, base_url: str, task: str, **extra):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, model_args={"base_url": base_url, "model": "m",
                                                    "num_concurrent": 1, "max_retries": 1},
                           tasks=[task], task_manager=TaskManager(include_path=str(folder)),
                           log_samples=True, **extra)


def _teacher_forced(llm, ids: list[int], n_context: int) -> float:
    """Sum of the log-probabilities of ids[n_context:], the prompt run once from position 0."""
    logp = torch.log_softmax(prompt_logits(llm.model, ids[:-1]).float(), dim=-1)
    return sum(float(logp[i - 1, ids[i]]) for i in range(n_context, len(ids)))


def test_lm_eval_local_completions_scores_what_the_engine_scores(tiny_llm, tmp_path,
                                                                 monkeypatch) -> None:
    """lm-eval encodes context + " " + choice through the server's /tokenize, splits it after the
    context's ids and sends the ids; every loglikelihood it reports is the engine's for them."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    folder = _tasks(tmp_path)
    app = build_app(tiny_llm, served_name="m")
    sent: list[list[int]] = []

    @app.middleware("http")
    async def record(request, call_next):  # the ids lm-eval sends, as the server receives them
        if request.url.path == "/v1/completions":
            sent.extend(json.loads(await request.body())["prompt"])
        return await call_next(request)

    with app_server(app) as base:
        out = _evaluate(folder, "local-completions", f"{base}/v1/completions", "ds_mc")
    samples = out["samples"]["ds_mc"]
    assert len(samples) == len(DOCS)
    encode = tiny_llm.tokenizer.encode
    expected = []
    for sample in samples:
        doc = sample["doc"]
        n_context = len(encode(doc["question"]))
        for choice, resp in zip(doc["choices"], sample["resps"], strict=True):
            ids = encode(f"{doc['question']} {choice}")
            assert ids in sent
            want = _teacher_forced(tiny_llm, ids, n_context)
            assert float(resp[0][0]) == pytest.approx(want, abs=1e-4, rel=1e-5), choice
            expected.append(ids)
    assert sorted(map(tuple, sent)) == sorted(map(tuple, expected))  # one request per choice


def test_lm_eval_local_chat_completions_runs_to_the_end(tiny_llm, tmp_path, monkeypatch) -> None:
    import httpx

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    folder = _tasks(tmp_path)
    with app_server(build_app(tiny_llm, served_name="m")) as base:
        out = _evaluate(folder, "local-chat-completions", f"{base}/v1/chat/completions", "ds_gen",
                        apply_chat_template=True)
        samples = out["samples"]["ds_gen"]
        assert len(samples) == len(DOCS)
        for sample in samples:  # each answer is the server's greedy chat answer
            direct = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
                "model": "m", "messages": [{"role": "user", "content": sample["doc"]["question"]}],
                "max_tokens": 6, "temperature": 0, "stop": ["\n\n"]}).json()
            assert sample["resps"][0][0] == direct["choices"][0]["message"]["content"]
