"""The README's code runs as written: every ```python block, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_python_blocks_run():
    blocks = python_blocks(README.read_text())
    assert blocks, "README.md has no python block"
    namespace: dict = {"__name__": "readme"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"README.md python block {i}", "exec"), namespace)
    # the snippet trains on 4 ranks and gathers the same params on each
    full = namespace["full"]
    assert len(full) == 4 and all(set(f) == {"w", "head"} for f in full)
    assert namespace["log"], "mesh.record() recorded no collective"
