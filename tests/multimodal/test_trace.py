"""`run_trace`: the table behind `deltaserve trace`."""

from __future__ import annotations

from deltaserve.multimodal.trace import format_table, run_trace


def test_run_trace_rows_and_table(reduced_dir) -> None:
    rows = run_trace(reduced_dir, (8, 12), "16x", seed=1)
    assert [r["name"] for r in rows][:2] == ["embeddings", "layers.0"]
    assert rows[4]["name"] == "vit_merger" and rows[4]["shape"] == [24, 64]  # after layers.2
    assert rows[-1]["name"] == "projector" and rows[-1]["shape"] == [6, 32]
    assert all(set(r) == {"name", "shape", "max_abs", "rel"} for r in rows)
    assert max(r["rel"] for r in rows) <= 1e-5
    table = format_table(rows).splitlines()
    assert len(table) == len(rows) + 1 and table[-1].startswith("projector        6x32")


def test_run_trace_takes_several_pieces(reduced_dir) -> None:
    rows = run_trace(reduced_dir, [(4, 4), (8, 4)], "4x")
    assert "vit_merger" not in [r["name"] for r in rows]
    assert rows[-1]["shape"] == [(16 + 32) // 4, 32]


def test_trace_command(reduced_dir, tmp_path, capsys) -> None:
    import json

    from deltaserve.cli import main

    out = tmp_path / "rows.json"
    assert main(["trace", "--model", str(reduced_dir), "--image-size", "112", "168",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "projector" in printed and "post_layernorm" in printed
    rows = json.loads(out.read_text())
    assert rows[-1]["shape"] == [8 * 12 // 16, 32] and rows[-1]["rel"] <= 1e-5
    assert main(["trace", "--model", str(reduced_dir), "--image-size", "100", "168"]) != 0
    assert "multiples of 14" in capsys.readouterr().err
