"""LLM: load a checkpoint once, then generate (batch of prompts or a stream), vLLM-shaped."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from deltaserve.checkpoint.hub import resolve_model_dir
from deltaserve.checkpoint.loader import load_text_model
from deltaserve.checkpoint.reader import read_json
from deltaserve.engine.outputs import CompletionOutput, RequestOutput, StreamEvent
from deltaserve.engine.sampling import SamplingParams, make_generator, sample
from deltaserve.engine.stopping import StopChecker
from deltaserve.env import env
from deltaserve.errors import RequestError
from deltaserve.tokenizer import StreamDecoder, Tokenizer

PREFILL_CHUNK_LEN = 2048  # bounds prefill activations; the state carries across chunks exactly

Prompt = str | list[int] | dict[str, Any]


class LLM:
    def __init__(
        self,
        model: str | Path | None = None,
        dtype: str = "auto",
        device: str = "cpu",
        max_model_len: int | None = None,
        revision: str | None = None,
    ) -> None:
        from deltaserve.checkpoint.default import default_model_dir

        env.cache_clear()  # an engine sees the environment as it is when it is built
        threads = env().num_threads
        if threads > 0:
            torch.set_num_threads(threads)
        self.model_dir = (
            default_model_dir() if model is None else resolve_model_dir(model, revision)
        )
        self.is_default_model = model is None
        self.tokenizer = Tokenizer(self.model_dir)
        t0 = time.perf_counter()
        self.model, self.config, self.raw_config = load_text_model(self.model_dir, dtype, device)
        self.load_s = time.perf_counter() - t0
        self.device = torch.device(device)
        limit = self.config.max_position_embeddings
        if max_model_len is not None and not 0 < max_model_len <= limit:
            raise RequestError(
                f"max_model_len must be in 1..{limit} for this model, got {max_model_len}"
            )
        self.max_model_len = max_model_len or limit
        self.generation_config = self._generation_config()

    def _generation_config(self) -> dict[str, Any]:
        path = self.model_dir / "generation_config.json"
        return read_json(path, "generation_config.json") if path.is_file() else {}

    @property
    def eos_token_ids(self) -> frozenset[int]:
        ids = set(self.config.eos_token_ids)
        eos = self.generation_config.get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return frozenset(int(i) for i in ids)

    def get_default_sampling_params(self) -> SamplingParams:
        """The checkpoint's generation_config.json sampling defaults, as vLLM applies them."""
        g = self.generation_config
        if g.get("do_sample") is False:
            return SamplingParams(temperature=0.0)
        return SamplingParams(
            temperature=float(g.get("temperature", 1.0)),
            top_k=int(g.get("top_k", 0) or 0),
            top_p=float(g.get("top_p", 1.0)),
            min_p=float(g.get("min_p", 0.0) or 0.0),
        )

    def encode_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return None, self._check_ids(list(prompt["prompt_token_ids"]))
            prompt = prompt.get("prompt", "")
        if isinstance(prompt, str):
            return prompt, self._check_ids(self.tokenizer.encode(prompt))
        if isinstance(prompt, list | tuple):
            return None, self._check_ids([int(t) for t in prompt])
        raise RequestError(
            f"a prompt must be text or a list of token ids, got {type(prompt).__name__}"
        )

    def _check_ids(self, ids: list[int]) -> list[int]:
        if not ids:
            raise RequestError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(ids)} tokens but the context limit is {self.max_model_len} "
                "(it must leave room for at least one generated token)"
            )
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise RequestError(
                f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})"
            )
        return ids

    def generate(
        self, prompts: Prompt | list[Prompt], sampling_params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """One output per prompt. Prompts run one after another (batching arrives with the scheduler)."""
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        params = sampling_params or self.get_default_sampling_params()
        encoded = [self.encode_prompt(p) for p in prompts]  # validate all before running any
        results = []
        for i, (text, ids) in enumerate(encoded):
            out = CompletionOutput(0, "", [])
            metrics: dict[str, float] = {}
            for event in self._run(ids, params, metrics):
                out.text += event.text
                out.token_ids.extend(event.token_ids)
                out.finish_reason, out.stop_reason = event.finish_reason, event.stop_reason
            results.append(RequestOutput(str(i), text, ids, [out], True, metrics))
        return results

    def stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        metrics: dict[str, float] | None = None,
    ) -> Iterator[StreamEvent]:
        """Yield text as it becomes decodable (never a split UTF-8 character); the last event is finished."""
        _, ids = self.encode_prompt(prompt)
        yield from self._run(
            ids,
            sampling_params or self.get_default_sampling_params(),
            metrics if metrics is not None else {},
        )

    def chat(
        self,
        messages: list[dict[str, Any]],
        sampling_params: SamplingParams | None = None,
        enable_thinking: bool = True,
    ) -> RequestOutput:
        prompt = self.tokenizer.apply_chat_template(messages, enable_thinking=enable_thinking)
        return self.generate(prompt, sampling_params)[0]

    def _prefill(self, ids: list[int], state) -> torch.Tensor:
        logits = None
        for start in range(0, len(ids), PREFILL_CHUNK_LEN):
            chunk = torch.tensor([ids[start : start + PREFILL_CHUNK_LEN]], device=self.device)
            logits = self.model(chunk, state)
        return logits[0]

    def _run(
        self, ids: list[int], params: SamplingParams, metrics: dict[str, float]
    ) -> Iterator[StreamEvent]:
        gen = make_generator(params, self.device)
        state = self.model.new_state(1)
        t0 = time.perf_counter()
        logits = self._prefill(ids, state)
        t1 = time.perf_counter()
        budget = self.max_model_len - len(ids)
        max_new = budget if params.max_tokens is None else min(params.max_tokens, budget)
        stops = StopChecker(params, self.eos_token_ids)
        detok = StreamDecoder(self.tokenizer, params.skip_special_tokens)
        num_new = 0
        while True:
            token = sample(logits, params, gen)
            num_new += 1
            ended = stops.token_stop(token)
            text, stop_str = ("", None) if ended else stops.add_text(detok.push(token))
            if stop_str is not None:
                ended = ("stop", stop_str)
            elif ended is None and num_new >= max_new:
                ended = ("length", None)
            if ended:
                text += _drain(stops, detok) if stop_str is None else ""
                break
            yield StreamEvent(text, (token,))
            logits = self.model(torch.tensor([[token]], device=self.device), state)[0]
        t2 = time.perf_counter()
        metrics.update(
            num_prompt_tokens=len(ids),
            num_generated_tokens=num_new,
            prefill_s=t1 - t0,
            decode_s=t2 - t1,
            prefill_tok_s=len(ids) / max(t1 - t0, 1e-9),
            decode_tok_s=(num_new - 1) / (t2 - t1) if num_new > 1 and t2 > t1 else 0.0,
        )
        yield StreamEvent(text, (token,), True, ended[0], ended[1])


def _drain(stops: StopChecker, detok: StreamDecoder) -> str:
    """At the end: text held back by the detokenizer or by a partial stop-string match."""
    text, stop_str = stops.add_text(detok.flush())
    return text if stop_str is not None else text + stops.finish()
