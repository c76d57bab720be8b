"""Writes a calibration text for `deltaserve quantize --format int4 --calibration FILE`, disjoint from
the quality gate's prompts (scripts/gate/make_prompts.py): other language-reference topics from
pydoc_data and other CPython sources, so the gate does not score text the encoder was tuned on.

    python scripts/gate/make_calibration.py /tmp/calibration.txt
"""

import itertools
import pydoc_data.topics as topics
import sys
import sysconfig
from pathlib import Path

TOPICS = ("class", "function", "if", "for", "while", "try", "lambda", "numbers", "types")
SOURCES = ("string.py", "bisect.py", "shlex.py", "heapq.py")


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code = [(stdlib / s).read_text()[:6000] for s in SOURCES]  # a few 1,000 tokens each
    prose = [topics.topics[t] for t in TOPICS]
    parts = [p for pair in itertools.zip_longest(code, prose) for p in pair if p]
    out = Path(sys.argv[1])
    out.write_text("\n\n".join(parts), encoding="utf-8")
    print(f"{sum(map(len, parts))} characters -> {out}")


if __name__ == "__main__":
    main()
