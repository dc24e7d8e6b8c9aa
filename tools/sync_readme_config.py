"""Rewrite README.md's configuration table from lightcc.common.config.KNOBS (one source)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lightcc.common.config import markdown_table  # noqa: E402


def main() -> int:
    path = REPO / "README.md"
    text = path.read_text(encoding="utf-8")
    pattern = re.compile(r"\| variable \| default \| unit \| meaning \|\n(?:\|.*\|\n)+")
    if not pattern.search(text):
        print("README.md: configuration table not found", file=sys.stderr)
        return 1
    path.write_text(pattern.sub(markdown_table() + "\n", text, count=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
