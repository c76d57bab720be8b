"""Run records: git commit, checkpoint fingerprint, device, library versions, flags."""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from pathlib import Path

import torch


def git_commit() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha or "unknown") + ("-dirty" if dirty else "")


def checkpoint_fingerprint(model_dir: Path) -> str:
    """sha256 over config.json and every safetensors header (names, shapes, dtypes, offsets) + sizes.

    Cheap (no tensor data read) yet changes whenever the file layout or config changes.
    """
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(min(header_len, 100_000_000)))
        h.update(str(f.stat().st_size).encode())
    return h.hexdigest()[:16]


def device_info(device: str) -> dict[str, object]:
    info: dict[str, object] = {
        "device": device,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["name"] = torch.cuda.get_device_name(torch.device(device))
        return info
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["name"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        info["name"] = platform.processor()
    info["cpus"] = os.cpu_count()
    return info


def flags() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(("DELTASERVE_", "OMP_", "MKL_"))}
