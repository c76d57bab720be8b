"""GGUF files under tensor parallelism (2 gloo processes against one), on the Qwen3.5-27B layout
reduced to 4 layers and a 256-wide hidden state (its heads kept: 24 / 4 attention, 16 key and 48
value GDN heads of 128, untied head, the MTP block):

- the 1-bit scenario: `make-checkpoint --format gguf-q1_0` (Q1_0 matrices, Q6_K head), given to
  `--model FILE.gguf` with no other input;
- Q4_K blocks of 256 over 128-wide value heads, so the GDN out_proj keeps the file's tiled
  column order (Linear.input_order) and each rank takes its runs of it.

TP=2 gives the TP=1 logits (fp32 rel-L2 <= 1e-5, exact kernels) and greedy tokens.
"""

from __future__ import annotations

import pytest

from deltaserve.checkpoint.gguf_synthetic import write_synthetic_gguf
from deltaserve.checkpoint.loader import load_text_model
from deltaserve.checkpoint.presets import Preset, preset
from deltaserve.distributed.group import TPGroup
from deltaserve.errors import CheckpointError
from tests.distributed.test_tp import assert_tp2_equals_tp1_exact

gguf = pytest.importorskip("gguf")


def reduced_27b() -> dict:
    cfg = dict(preset("qwen3.5-27b").config["text_config"])
    cfg.update(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
               layer_types=cfg["layer_types"][:4], architectures=["Qwen3_5ForCausalLM"])
    return cfg


@pytest.fixture(scope="module")
def q4_k_file(tmp_path_factory):
    """The reduced 27B as a checkpoint folder, then a GGUF of Q4_K blocks (the test writer of
    tests/quant, independent of the importer), the tokenizer beside it."""
    import shutil

    from deltaserve.checkpoint.writer import write_checkpoint
    from tests.quant.test_gguf_import import Q, write_gguf

    root = tmp_path_factory.mktemp("q27-q4k")
    src = root / "src"
    write_checkpoint(Preset("27b-reduced", reduced_27b(), 0), src, seed=1)
    path = root / "gguf" / "m.gguf"
    path.parent.mkdir()
    write_gguf(src, path, Q.Q4_K, Q.Q4_K)
    shutil.copy(src / "tokenizer.json", path.parent / "tokenizer.json")
    return path


def test_tp2_runs_the_27b_layouts_as_one_process(q4_k_file, tmp_path, monkeypatch) -> None:
    q1 = tmp_path / "q27-q1_0.gguf"
    summary = write_synthetic_gguf(reduced_27b(), q1, seed=3)
    # llama-quantize's Q1_0 types: the 31 matrices of 3 GDN + 1 attention layers, the MTP
    # block's 7 and its fc, the embedding in Q1_0; the head Q6_K; norms, conv, A and dt F32
    assert summary["types"] == {"Q1_0": 40, "Q6_K": 1, "F32": 30}
    got = assert_tp2_equals_tp1_exact([(str(q1), False), (str(q4_k_file), False)], tmp_path,
                                      monkeypatch)
    assert got[1]["counters"]["ffn"]["calls"] > 0


def test_file_order_runs_that_are_not_whole_blocks_are_refused(tmp_path) -> None:
    """Q1_0 over the tiny preset's 32-wide value heads: each rank's runs are 32 columns, not
    whole 128-blocks; refused before any weight is read."""
    path = tmp_path / "tiny.gguf"
    write_synthetic_gguf(preset("tiny").config, path)
    from deltaserve.quant.gguf_import import import_gguf

    import_gguf(path, tmp_path / "m")
    with pytest.raises(CheckpointError, match="runs of 32 columns are not whole blocks of 128"):
        load_text_model(tmp_path / "m", "float32", "cpu", TPGroup(0, 2, 0, "gloo"))
