"""Pipeline (layer-split) parallelism on CPU: 2 gloo processes against one, on the tiny model
(8 layers: GDN x3, attention, GDN x3, attention).

PP=2 must give the PP=1 logits (fp32 rel-L2 <= 1e-5) and greedy tokens on both paths (single
sequence: batch-2 prefill then decode; engine: three prompts, chunked prefill mixed with decodes),
for the even split (4+4, greedy-only head: the tokens travel back) and an uneven one (3+5, full
head: the logits travel back); each stage holds only its layers, ends and pools; splits that do
not cover the layers are refused before anything starts.
"""

from __future__ import annotations

import pytest
import torch

from deltaserve.cache.manager import CacheConfig, CacheManager
from deltaserve.checkpoint.loader import checkpoint_targets, load_text_model
from deltaserve.config import FULL
from deltaserve.distributed.group import TPGroup
from deltaserve.distributed.launch import spawn
from deltaserve.distributed.pipeline import PPLaunch, PPPlan, even_split, parse_split
from deltaserve.errors import ConfigError
from tests.distributed.test_tp import assert_same
from tests.distributed.tp_cases import assert_cli_generate_equals_one_process, pp_worker, reference


def test_pp2_equals_pp1_on_tiny(tiny_dir, tmp_path) -> None:
    cases = [(str(tiny_dir), True, None), (str(tiny_dir), False, (3, 5))]
    out = tmp_path / "pp2.pt"
    spawn(pp_worker, 2, cases, str(out))
    ranks = [torch.load(f"{out}.{r}") for r in (0, 1)]
    ref = reference([(str(tiny_dir), True), (str(tiny_dir), False)])
    for r, stages in enumerate([((0, 4, 4), (4, 8, 4)), ((0, 3, 3), (3, 8, 5))]):
        for rank in (0, 1):
            assert ranks[rank][r]["stage"] == stages[rank]  # each rank ran only its layers
            assert_same(ranks[rank][r], ref[r])  # every rank saw the same logits / tokens
    assert "single" in ranks[0][1]  # the uneven split's logits were compared on both paths


def test_each_stage_holds_only_its_layers_ends_and_pools(tiny_dir, tmp_path) -> None:
    """Built in this process (loading needs no process group): rank 0 of 3+5 holds layers 0-2
    and the embedding, rank 1 layers 3-7 and the head (tied: the embedding matrix; untied:
    lm_head, and then no embedding); the pools have only the stage's GDN and attention layers."""
    from tests.conftest import write_variant

    full, cfg, _ = load_text_model(tiny_dir, "float32", "cpu")
    whole = checkpoint_targets(full)
    untied_dir = write_variant(tmp_path / "untied", tie_word_embeddings=False)
    for model_dir, tied in ((tiny_dir, True), (untied_dir, False)):
        for rank, (start, stop) in enumerate(((0, 3), (3, 8))):
            launch = PPLaunch(TPGroup(rank, 2, rank, "gloo"), (3, 5))
            model = load_text_model(model_dir, "float32", "cpu", pp=launch)[0]
            names = set(checkpoint_targets(model))
            assert len(model.model.layers) == stop - start
            assert ("model.embed_tokens.weight" in names) == (rank == 0 or tied)
            assert ("lm_head.weight" in names) == (rank == 1 and not tied)
            if tied:  # the stage's layer i is the checkpoint's layer start + i
                for name, t in checkpoint_targets(model).items():
                    if name.startswith("model.layers."):
                        i, rest = name.split(".", 3)[2:]
                        assert torch.equal(t, whole[f"model.layers.{int(i) + start}.{rest}"])
            cache = CacheManager(model, CacheConfig(num_slots=2, num_blocks=4), "fp")
            types = cfg.layer_types[start:stop]
            assert [c is not None for c in cache.states.conv] == [t != FULL for t in types]
            assert [k is not None for k in cache.kv.k] == [t == FULL for t in types]


def test_bad_splits_are_refused() -> None:
    assert even_split(24, 2) == (12, 12) and even_split(8, 3) == (3, 3, 2)
    assert PPPlan.build(8, 1, 2, (3, 5)).start == 3
    with pytest.raises(ConfigError, match="covers 7 layers but the model has 8"):
        PPPlan.build(8, 0, 2, (3, 4))
    with pytest.raises(ConfigError, match="gives a stage no layers"):
        PPPlan.build(8, 0, 2, (0, 8))
    with pytest.raises(ConfigError, match="has 3 stages but the pipeline has 2"):
        PPPlan.build(8, 0, 2, (2, 3, 3))
    with pytest.raises(ConfigError, match="only 8 layers"):
        PPPlan.build(8, 0, 9)
    with pytest.raises(ConfigError, match="layer counts separated by commas"):
        parse_split("3;5")


def test_llm_refuses_mixing_and_a_split_without_stages(tiny_dir) -> None:
    from deltaserve import LLM
    from deltaserve.distributed.pipeline import init_pp

    with pytest.raises(ConfigError, match="mixing tensor and pipeline parallelism"):
        LLM(tiny_dir, tensor_parallel_size=2, pipeline_parallel_size=2)
    with pytest.raises(ConfigError, match="a split applies to 2 or more stages"):
        init_pp(1, "cpu", (8,))


@pytest.mark.parametrize("flags, message", [
    (["--pp", "2", "--pp-layers", "3,4"], "covers 7 layers but the model has 8"),
    (["--pp", "2", "--tp", "2"], "mixing tensor and pipeline parallelism"),
    (["--pp-layers", "3,5"], "--pp-layers 3,5 splits layers over --pp 2 ranks, but --pp is 1"),
])
def test_cli_refuses_bad_splits_before_any_process(tiny_dir, flags, message, capsys) -> None:
    """In this process: a split that passed the check would start ranks (and fail otherwise)."""
    from deltaserve.cli import main

    assert main(["generate", "--model", str(tiny_dir), "--prompt", "hi", *flags]) == 1
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_cli_generate_pp2_on_cpu_equals_pp1(tiny_dir, tiny_llm) -> None:
    """`deltaserve generate --pp 2 --device cpu` equals one process."""
    assert_cli_generate_equals_one_process(tiny_dir, tiny_llm, "--pp")
