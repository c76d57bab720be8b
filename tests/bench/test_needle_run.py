"""`deltaserve needle`: the retrieval-rate command on the shipped default model."""

from __future__ import annotations

import json

from deltaserve.cli import main


def test_needle_command_writes_a_record_and_succeeds_when_all_keys_are_found(tmp_path, capsys):
    out = tmp_path / "needle.json"
    rc = main(["needle", "--lengths", "512", "--depths", "0.2,0.8", "--keys", "2", "--out", str(out)])
    record = json.loads(out.read_text())
    assert rc == 0
    assert record["kind"] == "needle" and record["num_prompts"] == 4 and record["retrieved"] == 4
    assert [(c["context_len"], c["depth"], c["hits"]) for c in record["cells"]] == [
        (512, 0.2, 2), (512, 0.8, 2)]
    assert "512 tokens, depth 0.80: 2/2" in capsys.readouterr().err


def test_needle_command_rejects_bad_arguments_with_one_line(capsys):
    assert main(["needle", "--depths", "half"]) == 1
    assert "--depths takes comma-separated numbers" in capsys.readouterr().err
    assert main(["needle", "--depths", "1.5", "--lengths", "512"]) == 1
    assert "depth must be in [0, 1]" in capsys.readouterr().err
    assert main(["needle", "--lengths", "16"]) == 1
    assert "too short" in capsys.readouterr().err
    assert main(["needle", "--keys", "0"]) == 1
    assert "--keys must be at least 1" in capsys.readouterr().err
