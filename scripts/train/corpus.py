"""The training corpus: the Python standard library's sources, plus chat pairs derived from them.

Every machine with Python has this data offline. The file list and hashes go into a manifest so a
run can be reproduced (or checked) on another machine; the split is by path hash, so it does not
depend on which other files exist.
"""

from __future__ import annotations

import ast
import hashlib
import os
import platform
import random
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

HELDOUT_MODULUS = 50  # ~2% of files are held out
MAX_FILE_BYTES = 400_000  # generated tables and test data blobs are not prose or code worth learning
EOS = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class SourceFile:
    rel_path: str
    sha256: str
    num_bytes: int
    split: str  # train | heldout
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(rel_path: str) -> str:
    digest = int(hashlib.sha256(rel_path.encode()).hexdigest()[:8], 16)
    return "heldout" if digest % HELDOUT_MODULUS == 0 else "train"


def stdlib_files(root: Path | None = None) -> list[SourceFile]:
    """Every UTF-8 `.py` file of the standard library (not site-packages), in sorted path order."""
    root = root or stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            data = path.read_bytes()
            if len(data) > MAX_FILE_BYTES or b"\0" in data:
                continue
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                continue  # a few test files are deliberately in other encodings
            rel = path.relative_to(root).as_posix()
            sha = hashlib.sha256(data).hexdigest()
            out.append(SourceFile(rel, sha, len(data), split_of(rel), text))
    return out


_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "config-3.11-x86_64-linux-gnu"}


def file_document(f: SourceFile) -> str:
    return f"# {f.rel_path}\n{f.text}"


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The same text CHAT_TEMPLATE renders (a test checks the two agree)."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def chat_documents(f: SourceFile, rng: random.Random) -> list[str]:
    """Question/answer pairs from one module's documented functions: explain it, or write it."""
    try:
        tree = ast.parse(f.text)
    except (SyntaxError, ValueError):
        return []
    module = f.rel_path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
    docs, lines = [], f.text.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        # slicing lines once: ast.get_source_segment re-splits the whole file on every call
        source = "\n".join(lines[node.lineno - 1 : node.end_lineno])
        if not doc or not source or len(source) > 2000 or len(doc) < 20:
            continue
        signature = f"{node.name}({ast.unparse(node.args)})"
        summary = doc.strip().splitlines()[0].rstrip(".")
        if rng.random() < 0.5:
            q = f"What does `{signature}` in the `{module}` module do?"
            a = doc.strip()
        else:
            q = f"Write a Python function `{signature}`: {summary}."
            a = f"```python\n{textwrap.dedent(source)}\n```"
        turns = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        docs.append(render_chat(turns))
    return docs


def manifest(files: list[SourceFile]) -> dict:
    return {
        "source": f"Python standard library (.py files, UTF-8, <= {MAX_FILE_BYTES} bytes)",
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "heldout_rule": f"int(sha256(rel_path)[:8], 16) % {HELDOUT_MODULUS} == 0",
        "num_files": len(files),
        "num_bytes": sum(f.num_bytes for f in files),
        "files": [[f.rel_path, f.sha256, f.num_bytes, f.split] for f in files],
    }
