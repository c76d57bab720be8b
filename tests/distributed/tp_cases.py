"""What the tensor-parallel tests run on every rank (and once at TP=1 as the reference): the
single-sequence path (batch-2 prefill, then teacher-forced decode) and the batched engine (three
prompts of different lengths, chunked prefill mixed with decodes), logits recorded at each step."""

from __future__ import annotations

from pathlib import Path

import torch

from deltaserve.cache.sequence import Sequence

PROMPT_LENS = (37, 90, 5)  # engine prompts: a chunk boundary at 64, a short one
DECODE_STEPS = 6


def prompt_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 248044, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_case(model_dir: Path, tp_size: int, greedy_head: bool = False, pp_size: int = 1,
             layer_split: tuple[int, ...] | None = None) -> dict:
    """Logits and tokens of both paths, fp32 on CPU (as pipeline stages with pp_size > 1)."""
    from deltaserve import LLM, SamplingParams

    llm = LLM(model_dir, dtype="float32", tensor_parallel_size=tp_size, max_num_seqs=4,
              max_num_batched_tokens=64, prefix_cache_bytes=0, greedy_head=greedy_head,
              pipeline_parallel_size=pp_size, layer_split=layer_split)
    model, out = llm.model, {}
    if not greedy_head:
        ids = torch.tensor([prompt_ids(40, 1), prompt_ids(40, 2)])
        seqs = [Sequence(model, 40), Sequence(model, 40)]
        steps = [torch.stack([s.forward(ids[b, :34], all_logits=True)  # prefill [2, 34, V]
                              for b, s in enumerate(seqs)])]
        steps += [torch.stack([s.forward(ids[b, t : t + 1], all_logits=True)
                               for b, s in enumerate(seqs)]) for t in range(34, 40)]
        out["single"] = torch.cat(steps, dim=1)
    recorded: list[torch.Tensor] = []
    runner = llm.engine.runner
    execute = runner.execute

    def spy(*args, **kwargs):  # every step's output, whichever executor ran it
        result = execute(*args, **kwargs)
        recorded.append(result.tensor.clone())
        return result

    runner.execute = spy
    params = SamplingParams(temperature=0, max_tokens=DECODE_STEPS, ignore_eos=True)
    prompts = [prompt_ids(n, 10 + i) for i, n in enumerate(PROMPT_LENS)]
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    out["tokens"] = [r.outputs[0].token_ids for r in results]
    out["engine"] = recorded
    if llm.tp is not None:
        out["counters"] = model.tp.comm.report()
    if model.pp is not None:
        out["stage"] = (model.pp.plan.start, model.pp.plan.stop, len(model.model.layers))
    return out


def tp_worker(rank: int, cases: list[tuple[str, bool]], tp_size: int, result_path: str) -> None:
    """One rank of a spawned run over cases (model dir, greedy head); rank 0 saves the results."""
    out = [run_case(Path(model_dir), tp_size, greedy) for model_dir, greedy in cases]
    if rank == 0:
        torch.save(out, result_path)


def pp_worker(rank: int, cases: list[tuple[str, bool, tuple[int, ...] | None]],
              result_path: str) -> None:
    """One of 2 pipeline ranks over cases (model dir, greedy head, layer split or None = even);
    every rank saves its results (all must see the same logits: the last stage broadcasts)."""
    out = [run_case(Path(model_dir), 1, greedy, 2, split) for model_dir, greedy, split in cases]
    torch.save(out, f"{result_path}.{rank}")


def reference(cases: list[tuple[str, bool]], threads: int = 1) -> list[dict]:
    """The cases at TP=1 in this process, with each rank's thread count: on the 0.8B shape fp32
    logits of 1 vs 2 threads already differ by 1.2e-5 (GEMM blocking), a TP=2 rank uses 1."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return [run_case(Path(model_dir), 1, greedy) for model_dir, greedy in cases]
    finally:
        torch.set_num_threads(before)


def write_08b_shape(out: Path, num_layers: int = 4) -> Path:
    """Every tensor shape of Qwen3.5-0.8B (flat text config), `num_layers` of its 24 layers
    (3 GDN + 1 attention for 4): the real shapes split, at a sixth of the compute."""
    from deltaserve.checkpoint.presets import Preset, preset
    from deltaserve.checkpoint.writer import write_checkpoint

    base = preset("qwen3.5-0.8b")
    cfg = dict(base.config["text_config"])
    cfg.update(num_hidden_layers=num_layers, layer_types=cfg["layer_types"][:num_layers],
               architectures=["Qwen3_5ForCausalLM"])
    write_checkpoint(Preset("0.8b-shape", cfg, 0, generation_config=base.generation_config),
                     out, seed=0)
    return out


def compress_worker(rank: int, model_dir: str, result_path: str) -> None:
    """Counters of the compressed all-reduce on planted inputs, then the gate of compressed FFN
    reductions against exact ones on the tiny model."""
    from deltaserve import LLM
    from deltaserve.distributed.comm import Comm, Compression
    from deltaserve.distributed.gate import compression_gate
    from deltaserve.distributed.group import init_group

    init_group(2, "cpu")
    x = torch.randn(64, generator=torch.Generator().manual_seed(rank)) * 100
    exact = Comm(2, torch.device("cpu"), Compression()).all_reduce(x.clone(), "ffn")
    out: dict = {"exact": exact}
    for scaling in ("none", "dynamic"):
        planted = x.clone()
        if rank == 0:
            planted[3] = 110_677.0  # llama.cpp's overflow: > 65,504, the largest fp16
        comm = Comm(2, torch.device("cpu"), Compression("fp16", ("ffn",), scaling))
        exact_planted = Comm(2, torch.device("cpu"), Compression()).all_reduce(planted.clone())
        out[scaling] = {"ffn": comm.all_reduce(planted.clone(), "ffn"),
                        "attn": comm.all_reduce(planted.clone(), "attn"),
                        "exact": exact_planted}
        bad = x.clone()
        if rank == 1:
            bad[5] = float("nan")
        out[scaling]["nan"] = comm.all_reduce(bad, "ffn")
        out[scaling]["report"] = comm.report()
    llm = LLM(Path(model_dir), dtype="float32", tensor_parallel_size=2, prefix_cache_bytes=0)
    out["gate"] = compression_gate(llm, Compression("fp16"), max_prompts=1)
    if rank == 0:
        torch.save(out, result_path)


def assert_cli_generate_equals_one_process(tiny_dir: Path, tiny_llm, flag: str) -> None:
    """`deltaserve generate FLAG 2 --device cpu` starts its own 2 ranks; rank 0 alone prints the
    same tokens as one process."""
    import json
    import subprocess
    import sys

    from deltaserve import SamplingParams

    prompt = "The capital of France is"
    cmd = [sys.executable, "-m", "deltaserve", "generate", "--model", str(tiny_dir), "--prompt",
           prompt, "--max-tokens", "8", "--temperature", "0", "--json", "--dtype", "float32",
           "--device", "cpu", flag, "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1  # one JSON object: the other rank's stdout is dropped
    one = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8))[0]
    assert json.loads(lines[0])["token_ids"] == one.outputs[0].token_ids
    assert len(one.outputs[0].token_ids) == 8
