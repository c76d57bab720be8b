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


def test_trace_command_on_an_image_file(reduced_dir, tmp_path, capsys) -> None:
    """A 900x500 photo-like file: overview + slices through both sides, every stage close."""
    import json

    import numpy as np
    from PIL import Image

    from deltaserve.cli import main

    pixels = np.random.default_rng(3).integers(0, 256, (500, 900, 3), dtype=np.uint8)
    path = tmp_path / "img.png"
    Image.fromarray(pixels).save(path)
    out = tmp_path / "rows.json"
    assert main(["trace", "--model", str(reduced_dir), "--image", str(path), "--mode", "4x",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert rows[0]["shape"][0] > 32 * 32  # more than one piece went through the tower
    assert max(r["rel"] for r in rows) <= 1e-5
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 20)
    assert main(["trace", "--model", str(reduced_dir), "--image", str(tmp_path / "bad.png")]) != 0
    assert main(["trace", "--model", str(reduced_dir), "--image", str(tmp_path / "no.png")]) != 0
    err = capsys.readouterr().err
    assert "cannot read image" in err and "Traceback" not in err
