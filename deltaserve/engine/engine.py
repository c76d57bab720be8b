"""The batched engine: requests in, one scheduler plan and one batched forward per step, tokens out.

step() = plan = scheduler.schedule(); logits = runner.execute(plan); sample per request;
scheduler.update(plan, sampled); stop checks (EOS, stop ids and strings, length) end requests.
With overlap (engine/overlap.py, on by default on CUDA) a greedy decode step is launched before the
previous one's tokens are read back, and step() returns the previous step's outputs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from deltaserve.cache.manager import CacheConfig, CacheManager
from deltaserve.engine import prompt_logprobs
from deltaserve.engine.processors import (
    NO_TOKEN,
    Processor,
    Staged,
    Staging,
    processed_rows,
    stage,
)
from deltaserve.engine.request import ImageInputs, Request, Status
from deltaserve.engine.runner import ModelRunner
from deltaserve.engine.sampling import SamplingParams, make_generator, sample_rows
from deltaserve.engine.scheduler import Scheduler, SchedulerConfig
from deltaserve.engine.step import StepLogits
from deltaserve.engine.stopping import StopChecker
from deltaserve.errors import RequestError
from deltaserve.spec.config import SpeculativeConfig
from deltaserve.tokenizer import StreamDecoder


@dataclass(frozen=True, slots=True)
class EngineConfig:
    scheduler: SchedulerConfig = SchedulerConfig()
    cache: CacheConfig = CacheConfig()
    # greedy-only contract: the head yields argmax tokens, logits never exist; a request that
    # samples (or, later, asks for logprobs) is refused before any state changes
    greedy_head: bool = False
    overlap: bool = False  # launch greedy decode steps ahead of reading back tokens (overlap.py)
    # draft-and-verify decoding for greedy requests (spec/); None = off. Steps run unoverlapped.
    speculative: SpeculativeConfig | None = None


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one step produced for one request: new text and token(s), and whether it ended."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (non-finite logits)
    stop_reason: int | str | None = None
    # with params.logprobs: per token in token_ids, (its logprob, ((alternative id, logprob), ...))
    logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]], ...] | None = None
    # with params.prompt_logprobs, on the request's first output: per prompt position the same
    # (None for the first): engine/prompt_logprobs.py
    prompt_logprobs: tuple | None = None


@dataclass(slots=True)
class _Live:
    params: SamplingParams
    gen: torch.Generator | None
    stops: StopChecker
    detok: StreamDecoder
    max_new: int
    t_added: float
    t_first: float | None = None
    proc: Processor | None = None  # penalties, bias, bans, grammar (processors.py)
    prompt_lps: dict = field(default_factory=dict)  # position -> entry (prompt_logprobs.py)
    prompt_sent: bool = False


class Engine:
    def __init__(self, model, tokenizer, eos_ids: frozenset[int], max_model_len: int,
                 config: EngineConfig, fingerprint: str, model_dir=None) -> None:
        """model_dir: the checkpoint folder (the MTP drafter reads its mtp.* block there)."""
        self.model, self.tokenizer, self.eos_ids = model, tokenizer, eos_ids
        self.model_dir = model_dir
        self.max_model_len, self.config = max_model_len, config
        self.cache = CacheManager(model, config.cache, fingerprint)
        self.scheduler = Scheduler(config.scheduler, self.cache)
        spec = config.speculative  # its narrow interface to the runner: hidden rows, rollback
        self.runner = ModelRunner(model, self.cache, config.greedy_head,
                                  config.scheduler.max_prefill_chunk,
                                  keep_hidden=spec is not None and spec.needs_hidden,
                                  rollback=spec.rollback if spec is not None else "recompute")
        self.spec = None
        if spec is not None:
            from deltaserve.spec.verify import Speculator

            self.spec = Speculator(spec, self)
        self._live: dict[str, _Live] = {}
        self._pending = None  # overlap.InFlight: a launched step not read back yet
        self.host_buffers: list = [None, None]  # overlap: tokens read back, steps alternate
        self.copy_events: list = [None, None]  # overlap: recorded after each read-back
        self.num_steps = 0
        self.memory_report = None  # cache/memory.MemoryReport, set by whoever sized the pools
        self._grammars = None  # structured/grammar.Grammars, built for the first constraint
        self._why: dict[str, str] = {}  # why a processed request failed (its stop_reason)
        self._staging = None  # processors.Staging: processing planned on the host, on first use

    @property
    def grammars(self):
        if self._grammars is None:
            from deltaserve.structured.grammar import Grammars

            self._grammars = Grammars(self.tokenizer, self.model.cfg.vocab_size, self.eos_ids)
        return self._grammars

    def processor(self, params: SamplingParams, prompt_ids: list[int]) -> Processor | None:
        """The request's logits processing, None when nothing changes its logits (a schema the
        grammar engine cannot compile, an id outside the vocabulary: RequestError)."""
        if not params.processes_logits:
            return None
        think = (self.tokenizer.token_id("<think>"), self.tokenizer.token_id("</think>"))
        grammars = self.grammars if params.structured_outputs is not None else None
        return Processor(params, prompt_ids, self.eos_ids, self.model.cfg.vocab_size,
                         self.model.device, self.tokenizer, grammars, think)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    images: ImageInputs | None = None) -> None:
        """images: the prompt's image placeholders and the embeddings they take (multimodal/)."""
        if self.config.greedy_head and not params.greedy:
            raise RequestError("this engine runs the greedy-only head (no logits are computed): "
                               f"temperature must be 0, got {params.temperature}")
        if self.config.greedy_head and params.logprobs is not None:
            raise RequestError("this engine runs the greedy-only head (no logits are computed): "
                               "logprobs are not available")
        why = prompt_logprobs.unavailable(self) if params.prompt_logprobs is not None else None
        if why is not None:
            raise RequestError(f"prompt_logprobs: {why}")
        if self.config.greedy_head and params.processes_logits:
            raise RequestError("this engine runs the greedy-only head (no logits are computed): "
                               "penalties, logit_bias, token bans, min_tokens and structured "
                               "outputs are not available")
        budget = self.max_model_len - len(prompt_ids)
        if budget < 1:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens but the context limit is "
                               f"{self.max_model_len}")
        max_new = budget if params.max_tokens is None else min(params.max_tokens, budget)
        # everything that can fail comes before the scheduler holds the request: a refused
        # request leaves nothing behind
        gen = make_generator(params, self.model.device)
        stops = StopChecker(params, self.eos_ids)
        detok = StreamDecoder(self.tokenizer, params.skip_special_tokens)
        if images is not None:
            _check_images(images, prompt_ids, self.model)
        proc = self.processor(params, prompt_ids)
        self.scheduler.add(Request(request_id, list(prompt_ids), max_new, images=images,
                                   full_prefill=params.prompt_logprobs is not None))
        max_new = self.scheduler.get(request_id).max_new_tokens  # capped to what the KV pool holds
        self._live[request_id] = _Live(params, gen, stops, detok, max_new, time.perf_counter(),
                                       proc=proc)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._pending is not None

    def live(self, request_id: str) -> _Live | None:
        """The engine's record of a running request (None once it ended or was aborted)."""
        return self._live.get(request_id)

    def abort(self, request_id: str) -> bool:
        self._live.pop(request_id, None)
        if self.spec is not None:
            self.spec.forget(request_id)
        return self.scheduler.abort(request_id) is not None

    def park(self, request_id: str) -> None:
        self.scheduler.park(request_id)

    def resume(self, request_id: str) -> None:
        self.scheduler.resume(request_id)

    def step(self) -> list[StepOutput]:
        if self.config.overlap and self.spec is None:
            return self._step_overlapped()
        plan = self.scheduler.schedule()
        return [] if plan.is_empty else self._run(plan)

    def _run(self, plan) -> list[StepOutput]:
        """Execute, sample, record and emit one plan, waiting for its results."""
        start = time.perf_counter()
        if self.spec is not None:
            plan = self.spec.draft(plan)
        reqs = {c.request_id: self.scheduler.get(c.request_id) for c in plan.chunks}
        key_ids = {rid: reqs[rid].key_ids for rid in
                   {c.request_id for c in plan.chunks if len(c.token_ids) > 1 and not c.num_draft}}
        images = {rid: r.images for rid, r in reqs.items() if r.images is not None}
        want = prompt_logprobs.wanted(self, plan)
        logits = self.runner.execute(plan, key_ids, images=images, hidden=bool(want))
        if want:
            prompt_logprobs.record(self, plan, logits.hidden, want)
        sampled, failed = self._sample(logits)
        lps = self._logprobs(logits, sampled)
        if self.spec is not None:
            sampled.update(self.spec.verify(plan, logits, failed))
        errors = [self.fail(rid) for rid in sorted(failed)]
        self.scheduler.update(plan, sampled)  # chunks of the failed (now aborted) are ignored
        if self.spec is not None:
            self.spec.observe(plan, logits)
            self.spec.timed(sum(len(t) if isinstance(t, tuple) else 1 for t in sampled.values()),
                            time.perf_counter() - start)
        self.num_steps += 1
        return errors + [self.emit(rid, token, lps.get(rid)) if isinstance(token, int)
                         else self._emit_tokens(rid, token) for rid, token in sampled.items()]

    def _emit_tokens(self, rid: str, tokens: tuple[int, ...]) -> StepOutput:
        """A verify chunk's accepted tokens as one output; a stop inside drops the rest."""
        num_before = len(self.scheduler.get(rid).output_ids) - len(tokens)
        text = ""
        for j, token in enumerate(tokens):
            out = self.emit(rid, token, None, num_before + j + 1)
            text += out.text
            if out.finished:
                break
        return replace(out, text=text, token_ids=tuple(tokens[: j + 1]))

    def _step_overlapped(self) -> list[StepOutput]:
        """Launch this step if it can run ahead (overlap.can_overlap), then read back and emit the
        previous one; a step that cannot run ahead runs once the previous one is emitted."""
        from deltaserve.engine import overlap

        pending, self._pending = self._pending, None
        plan = self.scheduler.schedule()
        ahead = None
        if not plan.is_empty and overlap.can_overlap(self, plan, pending):
            ahead = overlap.launch(self, plan, pending)
        outs = overlap.resolve(self, pending) if pending is not None else []
        if ahead is not None and ahead.logits is not None:  # processed rows: their tokens now
            overlap.finish(self, ahead)
        if ahead is None and not plan.is_empty:
            plan = overlap.patched(self, plan) if pending is not None else plan
            outs += self._run(plan) if plan.chunks else []
        self._pending = ahead
        return outs

    def fail(self, rid: str, why: str | None = None) -> StepOutput:
        """Non-finite logits: the request ends with an error (never NaN text), its slot and blocks
        go back, and its state never entered the prefix cache (the runner saw to that)."""
        if why is not None:
            self._why[rid] = why
        self.scheduler.abort(rid)
        self._live.pop(rid, None)
        if self.spec is not None:
            self.spec.forget(rid)
        return StepOutput(rid, "", (), True, "error", self._why.pop(rid, "non-finite logits"))

    def _sample(self, logits: StepLogits) -> tuple[dict[str, int], frozenset[str]]:
        """(tokens of the requests that sample, requests whose logits went non-finite or whose
        distribution was not valid). Greedy rows: one argmax, copied to the host together with
        the finiteness flags; sampling rows: the filters on all rows together, one draw each from
        its own generator. Rows of requests with logits processing are copies, processed first."""
        if logits.are_tokens:  # the greedy head already chose
            tokens = logits.tensor.tolist()
            return {rid: tokens[row] for rid, row in logits.rows.items()}, frozenset()
        procs = [rid for rid in logits if self._live[rid].proc is not None]
        processed = self._processed(logits, procs) if procs else {}
        greedy = [rid for rid in logits if self._live[rid].params.greedy]
        plain = [rid for rid in greedy if rid not in processed]
        heads = []
        if plain:
            rows = [logits.rows[rid] for rid in plain]
            table = logits.tensor
            if rows != list(range(table.shape[0])):
                table = table[torch.tensor(rows, device=table.device)]
            heads.append(table.argmax(-1))
        chosen = [rid for rid in greedy if rid in processed]
        if chosen:  # a row with nothing left (every logit -inf) is caught by its max below
            table = torch.stack([processed[rid] for rid in chosen])
            heads += [table.argmax(-1), torch.isfinite(table.amax(-1)).long()]
        head = None if not heads else heads[0] if len(heads) == 1 else torch.cat(heads)
        failed, tokens = logits.failed_with(head)
        if chosen:
            tokens, ok = tokens[: len(plain) + len(chosen)], tokens[len(plain) + len(chosen):]
            failed = failed | {rid for rid, good in zip(chosen, ok, strict=True) if not good}
        out = {rid: t for rid, t in zip(plain + chosen, tokens, strict=True) if rid not in failed}
        rest = [rid for rid in logits if rid not in out and rid not in failed]
        if rest:
            rows_t = torch.stack([processed.get(rid, logits[rid]) for rid in rest])
            drawn = sample_rows(rows_t, [self._live[r].params for r in rest],
                                [self._live[r].gen for r in rest])
            out.update((rid, t) for rid, t in zip(rest, drawn, strict=True) if t is not None)
            failed = failed | {rid for rid, t in zip(rest, drawn, strict=True) if t is None}
        for rid in procs:  # the grammar and the counts see the token
            if rid in out and not self._live[rid].proc.accept(out[rid]):
                failed = failed | {rid}
                self._why[rid] = "the grammar refused the sampled token"
            elif rid in failed and rid in processed:
                self._why[rid] = NO_TOKEN
        return {rid: out[rid] for rid in logits if rid in out and rid not in failed}, failed

    def _processed(self, logits: StepLogits, rids: list[str]) -> dict[str, torch.Tensor]:
        """The processed rows (fp32 copies) of the requests with logits processing; grammar
        masks are filled first, on the host, while a GPU may still be computing the logits."""
        rows, _ = self.process_rows(logits.tensor, [logits.rows[rid] for rid in rids],
                                    [self._live[rid].proc for rid in rids])
        return dict(zip(rids, rows, strict=True))

    def process_rows(self, table: torch.Tensor, rows: list[int],
                     procs: list) -> tuple[torch.Tensor, torch.Tensor]:
        """processors.process with the engine's grammars and staging buffers."""
        s = self.stage_rows(table, rows, procs)
        return processed_rows(table, s, procs), s.index

    def stage_rows(self, table: torch.Tensor, rows: list[int], procs: list) -> Staged:
        """processors.stage with the engine's grammars and staging buffers."""
        if self._staging is None:
            self._staging = Staging(pin=table.device.type == "cuda")
        return stage(table, rows, procs, self._grammars, self._staging)

    def _logprobs(self, logits: StepLogits, sampled: dict[str, int]) -> dict[str, tuple]:
        """For requests that asked: log_softmax of their raw logits rows, the sampled token's
        value and the top alternatives (one batched pass over the asking rows)."""
        want = [rid for rid in sampled if self._live[rid].params.logprobs is not None]
        if not want:
            return {}
        logp = torch.log_softmax(torch.stack([logits[rid] for rid in want]).float(), dim=-1)
        chosen = torch.tensor([sampled[rid] for rid in want], device=logp.device)
        token_lp = logp.gather(1, chosen[:, None])[:, 0].tolist()
        k = max(self._live[rid].params.logprobs for rid in want)
        vals, idxs = (logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long()))
        vals, idxs = vals.tolist(), idxs.tolist()
        out = {}
        for i, rid in enumerate(want):
            k_r = self._live[rid].params.logprobs
            out[rid] = ((token_lp[i], tuple(zip(idxs[i][:k_r], vals[i][:k_r], strict=True))),)
        return out

    def emit(self, rid: str, token: int, lp: tuple | None = None,
             num_generated: int | None = None) -> StepOutput:
        """One sampled token out: stop checks, text, and the request's end if it ended.
        num_generated: tokens generated so far counting this one (overlap: output_ids may hold
        a placeholder beyond it)."""
        live, req = self._live[rid], self.scheduler.get(rid)
        plp = prompt_logprobs.take(live, len(req.prompt_ids))
        num_generated = len(req.output_ids) if num_generated is None else num_generated
        live.t_first = live.t_first or time.perf_counter()
        # before min_tokens nothing stops it (EOS and stop ids are masked; stop strings unmatched)
        early = live.proc is not None and live.proc.num_out < live.params.min_tokens
        ended = None if early else live.stops.token_stop(token)
        text, stop_str = ("", None) if ended else live.stops.add_text(live.detok.push(token),
                                                                       match=not early)
        if stop_str is not None:
            ended = ("stop", stop_str)
        elif ended is None and num_generated >= live.max_new:
            ended = ("length", None)
        if not ended:
            return StepOutput(rid, text, (token,), logprobs=lp, prompt_logprobs=plp)
        if stop_str is None:  # text held back by the detokenizer or a partial stop match
            tail, hit = live.stops.add_text(live.detok.flush())
            text += tail if hit is not None else tail + live.stops.finish()
        self.scheduler.finish(rid, ended[0])
        del self._live[rid]
        if self.spec is not None:
            self.spec.forget(rid)
        return StepOutput(rid, text, (token,), True, ended[0], ended[1], lp, plp)

    def export_prefix_cache(self, path) -> int:
        from deltaserve.cache.snapshot_io import export_snapshots

        if self.cache.prefix is None:
            raise RequestError("the prefix cache is off (prefix_cache_bytes=0)")
        return export_snapshots(self.cache.prefix, path)

    def import_prefix_cache(self, path) -> int:
        from deltaserve.cache.snapshot_io import import_snapshots

        if self.cache.prefix is None:
            raise RequestError("the prefix cache is off (prefix_cache_bytes=0)")
        return import_snapshots(self.cache.prefix, path)

    def request_status(self, request_id: str) -> Status | None:
        try:
            return self.scheduler.get(request_id).status
        except KeyError:
            return None


def _check_images(images: ImageInputs, prompt_ids: list[int], model) -> None:
    """Positions inside the prompt and ascending, one embedding row of the model's width each."""
    positions, num_prompt = images.positions, len(prompt_ids)
    if any(not 0 <= p < num_prompt for p in positions) or list(positions) != sorted(set(positions)):
        raise RequestError("image positions must be distinct prompt positions in ascending order")
    expected = (len(positions), model.cfg.hidden_size)
    if tuple(images.embeds.shape) != expected or len(images.key_ids) != num_prompt:
        raise RequestError(f"image embeddings have shape {list(images.embeds.shape)}; the prompt "
                           f"needs {list(expected)}")
