"""The quality gate: its divergence and collapse measures, and the command end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch

from deltaserve.bench.gate import collapse, js_divergence
from deltaserve.checkpoint.default import default_model_dir
from deltaserve.cli import main
from deltaserve.quant.convert import quantize_checkpoint


def test_js_divergence_is_zero_for_equal_and_ln2_for_disjoint_distributions() -> None:
    torch.manual_seed(0)
    a = torch.randn(5, 50)
    assert js_divergence(a, a).abs().max().item() < 1e-6
    hot = torch.full((2, 4), -1e9)
    other = hot.clone()
    hot[:, 0], other[:, 1] = 0.0, 0.0
    assert js_divergence(hot, other).tolist() == pytest.approx([math.log(2)] * 2, rel=1e-5)
    b = a + torch.randn(5, 50)
    assert (js_divergence(a, b) - js_divergence(b, a)).abs().max().item() < 1e-6


def test_collapse_markers_find_runs_and_repeats() -> None:
    assert collapse("abc", [1, 2, 3, 4, 5]) == {"token_run": 1, "char_run": 1, "repeat_4gram_frac": 0.0}
    c = collapse("aaaaab", [7, 7, 7, 1, 2, 3, 4, 1, 2, 3, 4])
    assert c["token_run"] == 3 and c["char_run"] == 5 and c["repeat_4gram_frac"] == pytest.approx(1 / 8)


def small_prompts(tmp_path):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps({"prompts": [
        {"id": "code", "category": "code", "text": "import os\n\n\ndef main(argv):\n"},
        {"id": "prose", "category": "prose", "text": "The committee approved the budget, but"},
    ]}))
    return str(path)


def test_a_model_passes_the_exact_gate_against_itself(tmp_path, capsys) -> None:
    out = tmp_path / "g.json"
    assert main(["gate", "--prompts", small_prompts(tmp_path), "--thresholds", "exact",
                 "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["passed"] and record["summary"]["mean_agreement"] == 1.0
    assert record["summary"]["js_max"] < 1e-9 and "gate: PASS" in capsys.readouterr().err


def test_one_bit_weights_fail_the_gate_on_the_built_in_prompts(tmp_path, capsys) -> None:
    """Post-training 1-bit destroys the trained model: the gate must say so (exit 3)."""
    quantize_checkpoint(default_model_dir(), "q1", tmp_path / "q1")
    out = tmp_path / "g.json"
    assert main(["gate", "--model", str(tmp_path / "q1"), "--out", str(out)]) == 3
    record = json.loads(out.read_text())
    assert not record["passed"] and len(record["prompts"]) == 10
    assert {p["category"] for p in record["prompts"]} == {
        "prose", "code", "finance", "book", "engineering", "multilingual"}
    assert record["summary"]["js_mean"] > 0.1 and "mean agreement" in record["failures"][0]
    assert "gate: FAIL" in capsys.readouterr().err


def test_bad_gate_inputs_are_clear_errors(tmp_path, capsys) -> None:
    assert main(["gate", "--prompts", str(tmp_path / "missing.json")]) == 1
    assert "cannot read gate prompts" in capsys.readouterr().err
    (tmp_path / "empty.json").write_text('{"prompts": []}')
    assert main(["gate", "--prompts", str(tmp_path / "empty.json")]) == 1
    assert "holds no prompts" in capsys.readouterr().err
    assert main(["gate", "--thresholds", str(tmp_path / "nope.json")]) == 1
    assert "cannot read gate thresholds" in capsys.readouterr().err
