"""Writes a calibration text for `deltaserve quantize --format int4 --calibration FILE`, disjoint from
the quality gate's prompts (scripts/gate/make_prompts.py): other language-reference topics from
pydoc_data and other CPython sources, so the gate does not score text the encoder was tuned on.

    python scripts/gate/make_calibration.py /tmp/calibration.txt
"""

import pydoc_data.topics as topics
import sys
from pathlib import Path

TOPICS = ("class", "function", "if", "for", "while", "try", "lambda", "numbers", "types")
SOURCES = ("string.py", "bisect.py", "shlex.py", "heapq.py")


def main() -> None:
    stdlib = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    parts = [topics.topics[t] for t in TOPICS] + [(stdlib / s).read_text() for s in SOURCES]
    out = Path(sys.argv[1])
    out.write_text("\n\n".join(parts), encoding="utf-8")
    print(f"{sum(map(len, parts))} characters -> {out}")


if __name__ == "__main__":
    main()
