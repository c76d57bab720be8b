"""Run records: git commit, checkpoint fingerprint, device, library versions, flags."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

from deltaserve.checkpoint.fingerprint import checkpoint_fingerprint  # noqa: F401 (re-exported)


def git_commit() -> str:
    """HEAD (+ "-dirty"), or DELTASERVE_GIT_COMMIT where the checkout's .git is not the tree's own
    (the device machine receives a copy of the working tree with a stale .git)."""
    from deltaserve.env import env

    if env().git_commit:
        return env().git_commit
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
    if device == "vulkan":
        from deltaserve.vulkan.device import adapter_or_reason

        adapter, why = adapter_or_reason()
        info["name"] = why if adapter is None else \
            f"{adapter.info['device']} ({adapter.info['backend_type']}, {adapter.info['adapter_type']})"
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
