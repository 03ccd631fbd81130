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


def _modules():
    import importlib
    import pkgutil

    import fzero

    names = ["fzero"] + [m.name for m in pkgutil.walk_packages(fzero.__path__, "fzero.")]
    return [importlib.import_module(n) for n in names if not n.endswith(("_worker", "__main__"))]


def test_every_docstring_example_runs():
    """Every `>>>` example in fzero's docstrings runs and prints what it shows (examples that need
    torchrun are written as plain code blocks, without prompts)."""
    import doctest

    import torch

    import fzero

    attempted = 0
    for mod in _modules():
        result = doctest.testmod(mod, extraglobs={"fzero": fzero, "torch": torch}, report=True,
                                 optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        assert result.failed == 0, f"{mod.__name__}: {result.failed} docstring example(s) failed (printed above)"
        attempted += result.attempted
    assert attempted >= 20, attempted


def test_every_test_the_docs_name_exists():
    """docs/, proofs/, README.md and BENCHMARKS.md name tests as `tests/file.py::test_name`; a
    following `::other` means the file named last before it, in its paragraph or table row: each
    must exist there, and a `::other` with no file before it is refused too (found in review: such
    a name was never checked, and one in README had come to follow another file's name)."""
    root = README.parent
    missing = []
    for doc in [README, root / "BENCHMARKS.md", *sorted((root / "docs").glob("*.md")),
                *sorted((root / "proofs").glob("*.md"))]:
        last = None
        for k, line in enumerate(doc.read_text().splitlines(), 1):
            if not line.strip() or line.startswith("|"):  # a paragraph or a table row starts afresh
                last = None
            for m in re.finditer(r"(tests/[\w/]+\.py)(?:::(\w+))?|`::(\w+)", line):  # a file, with a test or not
                last = m.group(1) or last
                name = m.group(2) or m.group(3)
                if name is None:
                    continue
                if last is None:
                    missing.append(f"{doc.name}:{k}: ::{name} follows no tests/ file")
                elif not (root / last).is_file():
                    missing.append(f"{doc.name}:{k}: {last} (no such file)")
                elif f"def {name}(" not in (root / last).read_text():
                    missing.append(f"{doc.name}:{k}: {last}::{name}")
    assert not missing, missing


def test_the_proofs_index_lists_the_tests_each_proof_names():
    """Each row of proofs/README.md lists the test files its proof names, and no other: the index
    had fallen behind four proofs (found in review of the docs)."""
    root = README.parent / "proofs"
    rows = [line for line in (root / "README.md").read_text().splitlines() if re.match(r"\| \[\w+\.md\]", line)]
    assert len(rows) == len(list(root.glob("*.md"))) - 1, len(rows)
    apart = {}
    for line in rows:
        name, tests = re.match(r"\| \[(\w+\.md)\]", line).group(1), line.split("|")[3]
        named = set(re.findall(r"tests/(test_\w+\.py)", (root / name).read_text()))
        listed = set(re.findall(r"tests/(test_\w+\.py)", tests))
        if named != listed:
            apart[name] = (sorted(named - listed), sorted(listed - named))
    assert not apart, apart
