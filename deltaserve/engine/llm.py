"""LLM: load a checkpoint once, then generate (batch of prompts or a stream), vLLM-shaped."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from deltaserve.checkpoint.hub import resolve_model_dir
from deltaserve.checkpoint.loader import load_text_model
from deltaserve.checkpoint.reader import read_json
from deltaserve.engine.args import EngineArgs
from deltaserve.engine.engine import Engine, EngineConfig
from deltaserve.engine.outputs import CompletionOutput, RequestOutput, StreamEvent
from deltaserve.engine.request import ImageInputs
from deltaserve.engine.sampling import SamplingParams
from deltaserve.engine.scheduler import SchedulerConfig
from deltaserve.env import env
from deltaserve.errors import CapacityError, ConfigError, RequestError
from deltaserve.multimodal.config import VISION_MODEL_TYPES
from deltaserve.multimodal.inputs import ImageLimits
from deltaserve.tokenizer import Tokenizer

Prompt = str | list[int] | dict[str, Any]


class LLM:
    def __init__(self, model: str | Path | None = None, *, engine_args: EngineArgs | None = None,
                 **kwargs: Any) -> None:
        """LLM(model, **options) with EngineArgs' field names (dtype="bfloat16", max_num_seqs=8,
        ...; an unknown one is a TypeError), or LLM(engine_args=EngineArgs(...))."""
        if engine_args is None:
            unknown = sorted(set(kwargs) - {f.name for f in fields(EngineArgs)})
            if unknown:
                raise TypeError(f"LLM() got unexpected keyword arguments: {', '.join(unknown)}")
            engine_args = EngineArgs(model=model, **kwargs)
        elif model is not None or kwargs:
            raise TypeError("LLM() takes engine_args or the options as keywords, not both")
        self.engine_args = args = engine_args
        from deltaserve.checkpoint.default import default_model_dir
        from deltaserve.distributed.group import init_tp
        from deltaserve.distributed.pipeline import init_pp

        env.cache_clear()  # an engine sees the environment as it is when it is built
        threads = env().num_threads
        if threads > 0:
            torch.set_num_threads(threads)
        self.model_dir = (default_model_dir() if args.model is None
                          else resolve_model_dir(args.model, args.revision, args.mmproj))
        self.is_default_model = args.model is None
        self.tokenizer = Tokenizer(self.model_dir)
        t0 = time.perf_counter()
        vulkan = args.device == "vulkan"  # the torch model stays on the host (vulkan/runtime)
        self.pp, device = init_pp(args.pipeline_parallel_size, "cpu" if vulkan else args.device,
                                  args.layer_split, args.tensor_parallel_size)
        self.tp = None
        if self.pp is None:
            self.tp, device = init_tp(args.tensor_parallel_size, device)
        self.model, self.config, self.raw_config = load_text_model(
            self.model_dir, "float32" if vulkan else args.dtype, device, self.tp, self.pp)
        if vulkan:
            self.model.vulkan = _vulkan_model(self.model, args.gpu_memory_limit_gb,
                                              half=args.dtype == "float16")
        self.load_s = time.perf_counter() - t0
        self.device = torch.device(device)
        limit = self.config.max_position_embeddings
        if args.max_model_len is not None and not 0 < args.max_model_len <= limit:
            raise RequestError(
                f"max_model_len must be in 1..{limit} for this model, got {args.max_model_len}"
            )
        vk_limit = self.model.vulkan.max_context() if vulkan else None
        if vk_limit is not None and vk_limit < limit:
            if args.max_model_len is not None and args.max_model_len > vk_limit:
                raise ConfigError(f"--device vulkan on {self.model.vulkan.dev.name} runs "
                                  f"contexts up to {vk_limit} tokens (llvmpipe's loop limit); "
                                  f"--max-model-len {args.max_model_len} is over it")
            limit = vk_limit
        self.max_model_len = args.max_model_len or limit
        vision = self.raw_config["model_type"] in VISION_MODEL_TYPES
        self.images = load_image_prompts(self, args.image_limits) if (
            vision and not vulkan) else None
        self.no_images_reason = (  # why an image request is refused
            "--device vulkan does not run the vision tower yet: images are refused (text runs)"
            if vision and vulkan else f"this model ({self.raw_config['model_type']}) takes no "
            "images")
        self.generation_config = self._generation_config()
        self._engine: Engine | None = None

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLM:
        return cls(engine_args=engine_args)

    @property
    def engine(self) -> Engine:
        """The batched engine (pools allocated on first use, kept: the prefix cache persists)."""
        if self._engine is None:
            self._engine = build_engine(self, self.engine_args)
        return self._engine

    def drop_engine(self) -> None:
        """Forget the engine (its pools, graphs and prefix cache); the next use builds a fresh one
        (the server does this after an engine failure)."""
        self._engine = None

    def _generation_config(self) -> dict[str, Any]:
        """generation_config.json of the checkpoint, or of EngineArgs.generation_config's folder;
        under "vllm" only its end-of-sequence ids (they say where the model stops, not how it
        samples)."""
        choice = self.engine_args.generation_config
        folder = self.model_dir if choice in ("auto", "vllm") else Path(choice)
        path = folder / "generation_config.json"
        config = read_json(path, "generation_config.json") if path.is_file() else {}
        if choice == "vllm":
            return {k: v for k, v in config.items() if k == "eos_token_id"}
        return config

    @property
    def eos_token_ids(self) -> frozenset[int]:
        ids = set(self.config.eos_token_ids)
        eos = self.generation_config.get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return frozenset(int(i) for i in ids)

    def get_default_sampling_params(self) -> SamplingParams:
        """The checkpoint's generation_config.json sampling defaults, as vLLM applies them."""
        g = self.generation_config
        penalties = {name: float(g.get(name) or default) for name, default in (
            ("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0))}
        if g.get("do_sample") is False:
            return SamplingParams(temperature=0.0, **penalties)
        return SamplingParams(
            temperature=float(g.get("temperature", 1.0)),
            top_k=int(g.get("top_k", 0) or 0),
            top_p=float(g.get("top_p", 1.0)),
            min_p=float(g.get("min_p", 0.0) or 0.0),
            **penalties,
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

    def encode_request(self, prompt: Prompt) -> tuple[str | None, list[int], ImageInputs | None]:
        """encode_prompt, plus images: {"prompt": text with one <|image_pad|> per image,
        "multi_modal_data": {"image": one or a list of paths, bytes, data: URLs, PIL images}}
        (vLLM's shape; "mm_processor_kwargs": {"downsample_mode": "4x"} picks the mode)."""
        if not (isinstance(prompt, dict) and prompt.get("multi_modal_data")):
            return (*self.encode_prompt(prompt), None)
        if self.images is None:
            raise RequestError(self.no_images_reason)
        data = prompt["multi_modal_data"]
        images = data.get("image") if isinstance(data, dict) else None
        if images is None:
            raise RequestError("multi_modal_data supports 'image' only")
        images = list(images) if isinstance(images, list | tuple) else [images]
        mode = (prompt.get("mm_processor_kwargs") or {}).get("downsample_mode")
        ids, inputs = self.images.encode(prompt.get("prompt"), images, mode, self._check_ids)
        return prompt.get("prompt"), ids, inputs

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
        self, prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, all prompts batched together by the engine (continuous
        batching); sampling_params: one for all, or one per prompt (as vLLM)."""
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        params = sampling_params or self.get_default_sampling_params()
        per_prompt = params if isinstance(params, list | tuple) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise RequestError(f"{len(per_prompt)} sampling params for {len(prompts)} prompts")
        encoded = [self.encode_request(p) for p in prompts]  # validate all before running any
        rids = [f"gen-{next(_ids)}" for _ in encoded]
        outs = {rid: CompletionOutput(0, "", []) for rid in rids}
        prompt_lps: dict[str, list] = {}
        metrics: dict[str, dict[str, float]] = {}
        try:
            for rid, (_, ids, images), p in zip(rids, encoded, per_prompt, strict=True):
                self.engine.add_request(rid, ids, p, images)
                metrics[rid] = {"t_start": time.perf_counter(), "num_prompt_tokens": len(ids)}
            done = 0
            while done < len(rids):
                for ev in self._step_timed(metrics):
                    out = outs[ev.request_id]
                    out.text += ev.text
                    out.token_ids.extend(ev.token_ids)
                    out.finish_reason, out.stop_reason = ev.finish_reason, ev.stop_reason
                    if ev.logprobs is not None:
                        out.logprobs = (out.logprobs or []) + [
                            {tok: lp, **dict(alts)} for tok, (lp, alts)
                            in zip(ev.token_ids, ev.logprobs, strict=True)]
                    if ev.prompt_logprobs is not None:
                        prompt_lps[ev.request_id] = ev.prompt_logprobs
                    done += ev.finished
        finally:
            for rid in rids:  # an exception (or Ctrl-C) must not leave requests holding slots
                self.engine.abort(rid)
        return [RequestOutput(str(i), text, ids, [outs[rid]], True, metrics[rid],
                              _prompt_dicts(ids, prompt_lps.get(rid)))
                for i, (rid, (text, ids, _)) in enumerate(zip(rids, encoded, strict=True))]

    def stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        metrics: dict[str, float] | None = None,
    ) -> Iterator[StreamEvent]:
        """Yield text as it becomes decodable (never a split UTF-8 character); the last event is finished."""
        _, ids, images = self.encode_request(prompt)
        rid = f"stream-{next(_ids)}"
        m = metrics if metrics is not None else {}
        self.engine.add_request(rid, ids, sampling_params or self.get_default_sampling_params(),
                                images)
        m.update(t_start=time.perf_counter(), num_prompt_tokens=len(ids))
        all_metrics = {rid: m}
        try:
            while True:
                for ev in self._step_timed(all_metrics):
                    yield StreamEvent(ev.text, ev.token_ids, ev.finished, ev.finish_reason,
                                      ev.stop_reason)
                    if ev.finished:
                        return
        finally:
            self.engine.abort(rid)

    def _step_timed(self, metrics: dict[str, dict[str, float]]):
        """One engine step; fills per-request prefill/decode timings (metrics[rid] must hold
        t_start and num_prompt_tokens, set when the request was added)."""
        events = self.engine.step()
        now = time.perf_counter()
        for ev in events:
            m = metrics.get(ev.request_id)
            if m is None:
                continue
            if "t_first" not in m:
                m["t_first"] = now
                m["prefill_s"] = now - m["t_start"]
            m["num_generated_tokens"] = m.get("num_generated_tokens", 0) + len(ev.token_ids)
            m["decode_s"] = now - m["t_first"]
            if ev.finished:
                _finish_metrics(m)
        return events

    def chat(
        self,
        messages: list[dict[str, Any]],
        sampling_params: SamplingParams | None = None,
        enable_thinking: bool = True,
    ) -> RequestOutput:
        return self.generate(self.chat_prompt(messages, enable_thinking), sampling_params)[0]

    def chat_prompt(self, messages: list[dict[str, Any]], enable_thinking: bool = True) -> Prompt:
        """Messages -> the rendered prompt, with their image parts as multi_modal_data."""
        from deltaserve.multimodal.inputs import message_images

        text = self.tokenizer.apply_chat_template(messages, enable_thinking=enable_thinking)
        images = message_images(messages)
        return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


_ids = itertools.count()


def _finish_metrics(m: dict[str, float]) -> None:
    n, new = m.get("num_prompt_tokens", 0), m.get("num_generated_tokens", 0)
    m["prefill_tok_s"] = n / max(m["prefill_s"], 1e-9)
    m["decode_tok_s"] = (new - 1) / m["decode_s"] if new > 1 and m["decode_s"] > 0 else 0.0
    for k in ("t_start", "t_first"):
        m.pop(k, None)


def load_image_prompts(llm: LLM, limits: ImageLimits):
    """The vision tower (fp32 on CPU, the weights' dtype on GPUs, like the language model) and
    the image front that turns image prompts into placeholder ids + embeddings."""
    from deltaserve.checkpoint.loader import activation_dtype
    from deltaserve.multimodal.inputs import ImagePrompts
    from deltaserve.multimodal.loader import load_vision_model

    dtype = activation_dtype(llm.model.dtype, llm.device)
    vision = load_vision_model(llm.model_dir, dtype, str(llm.device))
    token_id = int(llm.raw_config.get("image_token_id", 248056))
    return ImagePrompts(vision, llm.tokenizer, token_id, llm.model.act_dtype, limits)


DEFAULT_BATCHED_TOKENS = {False: 2048, True: 8192}  # LLM(max_num_batched_tokens=None): CPU, CUDA


def _default_batched_tokens(device: torch.device, plan_for, ranks_agree: bool = True
                            ) -> tuple[int, tuple]:
    """(tokens, plan_for(tokens)): 8192 on CUDA where its scratch leaves the KV cache that 2048
    leaves, else 2048 (a longer context beats a faster prefill of long prompts; cache/memory.plan
    cuts blocks to fit). ranks_agree=False (TP, PP): no fallback, which one rank's free memory
    would decide alone."""
    small, large = DEFAULT_BATCHED_TOKENS[False], DEFAULT_BATCHED_TOKENS[device.type == "cuda"]
    if large == small or not ranks_agree:
        return large, plan_for(large)
    try:
        planned = plan_for(large)
    except CapacityError:
        return small, plan_for(small)
    fallback = plan_for(small)
    return (large, planned) if planned[0] >= fallback[0] else (small, fallback)


def _vulkan_model(model, limit_gb: float | None, half: bool):
    """The model's weights uploaded to the Vulkan device (vulkan/runtime.py), dense ones as f16
    where `half`."""
    from deltaserve.cache.manager import KV_BLOCK_LEN
    from deltaserve.vulkan.device import VulkanDevice
    from deltaserve.vulkan.runtime import VulkanModel

    dev = VulkanDevice(None if limit_gb is None else int(limit_gb * 2**30))
    return VulkanModel(model, dev, KV_BLOCK_LEN, half)


def build_engine(llm: LLM, args: EngineArgs) -> Engine:
    """Pools sized for the model and the device's free memory (cache/memory.plan)."""
    from deltaserve.cache.manager import KV_BLOCK_LEN, PREFIX_GRANULARITY, CacheConfig
    from deltaserve.checkpoint.fingerprint import model_fingerprint
    from deltaserve.distributed.group import tag

    kv_dtype = None if args.kv_cache_dtype == "auto" else getattr(torch, args.kv_cache_dtype)
    stage = getattr(llm.model, "pp", None)
    batched_tokens, (num_blocks, report) = _plan(llm, args, kv_dtype,
                                                 ranks_agree=stage is None and llm.tp is None)
    if stage is not None:  # every rank's scheduler must see the same KV capacity
        num_blocks = stage.agree_min(num_blocks)
    vk = getattr(llm.model, "vulkan", None)
    if vk is not None:  # each layer's K (and V) pool is one storage binding
        num_blocks = min(num_blocks, vk.max_kv_blocks(args.max_num_seqs + 1) - 1)
    cache = CacheConfig(num_slots=args.max_num_seqs, num_blocks=num_blocks,
                        block_len=KV_BLOCK_LEN, prefix_granularity=PREFIX_GRANULARITY,
                        # off under PP: each stage would cache its own bytes, and every rank's
                        # scheduler must see the same hits
                        prefix_budget_bytes=0 if stage is not None else args.prefix_cache_bytes,
                        kv_dtype=kv_dtype, prefix_snapshots=args.prefix_snapshots)
    sched = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=batched_tokens,
                            max_prefill_chunk=batched_tokens, max_waiting=args.max_waiting)
    stage_tag = stage.plan.tag() if stage is not None else ""
    fingerprint = model_fingerprint(llm.model_dir, f"{llm.model.dtype}/{llm.model.act_dtype}/"
                                    f"{kv_dtype}{tag(llm.tp)}{stage_tag}"
                                    f"{'/vulkan' if vk is not None else ''}")
    overlap = env().overlap if env().overlap is not None else llm.model.device.type == "cuda"
    overlap = overlap and stage is None  # a pipeline step is synchronous (send/recv, broadcast)
    config = EngineConfig(scheduler=sched, cache=cache, greedy_head=args.greedy_head,
                          overlap=overlap, speculative=args.speculative_config)
    engine = Engine(llm.model, llm.tokenizer, llm.eos_token_ids, llm.max_model_len, config,
                    fingerprint, llm.model_dir)
    engine.memory_report = report if vk is None else vk.memory_report(engine.cache, report)
    return engine


def _plan(llm: LLM, args: EngineArgs, kv_dtype: torch.dtype | None, ranks_agree: bool
          ) -> tuple[int, tuple]:
    """(the step's token budget, cache/memory.plan's (KV blocks, report) for it)."""
    from deltaserve.cache.manager import KV_BLOCK_LEN
    from deltaserve.cache.memory import plan
    from deltaserve.engine.prefill_graph import graph_scratch_bytes

    mtp = args.speculative_config is not None and args.speculative_config.method == "mtp"

    def plan_for(batched_tokens: int):
        graph_bytes = 0 if mtp else graph_scratch_bytes(llm.model, batched_tokens, KV_BLOCK_LEN)
        return plan(llm.model, llm.max_model_len, num_slots=args.max_num_seqs,
                    kv_cache_bytes=args.kv_cache_bytes, block_len=KV_BLOCK_LEN,
                    max_batched_tokens=batched_tokens, kv_dtype=kv_dtype, graph_bytes=graph_bytes,
                    memory_share=args.gpu_memory_utilization)

    if args.max_num_batched_tokens is None:
        return _default_batched_tokens(llm.model.device, plan_for, ranks_agree)
    return args.max_num_batched_tokens, plan_for(args.max_num_batched_tokens)


def _prompt_dicts(ids: list[int], entries) -> list[dict[int, float] | None] | None:
    """The engine's prompt logprobs (engine/prompt_logprobs.py) in vLLM's shape."""
    if entries is None:
        return None
    return [None if e is None else {tok: e[0], **dict(e[1])}
            for tok, e in zip(ids, entries, strict=True)]
