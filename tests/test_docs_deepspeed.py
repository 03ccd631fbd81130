"""docs/deepspeed.md, the page for DeepSpeed users, against the code: its ported script runs and
trains, and every fzero name and keyword its table gives exists."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch

import fzero

PAGE = Path(__file__).resolve().parents[1] / "docs" / "deepspeed.md"


def _table(text: str) -> str:
    return text.split("## The config, key by key", 1)[1].split("\n## ", 1)[0]


def test_the_ported_script_runs(tmp_path, monkeypatch):
    """The page's one python block, as written: it trains, saves, exports and loads the trained
    weights back into the module (its own assert compares them with the export); here also: the
    module's weights moved from their initial values."""
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert len(blocks) == 1, f"docs/deepspeed.md has {len(blocks)} python blocks, the test expects one"
    before: dict[str, torch.Tensor] = {}  # the module's weights as from_module sees them
    real = fzero.from_module

    def seen(module, **kw):
        before.update({k: v.detach().clone() for k, v in module.state_dict().items()})
        return real(module, **kw)

    monkeypatch.setattr(fzero, "from_module", seen)
    ns: dict = {"__name__": "deepspeed_page"}
    exec(compile(blocks[0], "docs/deepspeed.md python block", "exec"), ns)
    after = ns["model"].state_dict()
    assert before and set(before) == set(after)
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert moved == list(before), f"weights the page's training left as they were: {set(before) - set(moved)}"
    assert ns["val"] == ns["val"] and ns["val"] > 0  # a finite, positive cross-entropy


def _resolve(dotted: str):
    """`fzero.a.b` -> the object, importing submodules as needed."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, name in enumerate(parts[1:], 1):
        try:
            obj = getattr(obj, name)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[: i + 1]))
    return obj


def test_every_fzero_name_in_the_table_exists():
    names = sorted(set(re.findall(r"\bfzero(?:\.[A-Za-z_]\w*)+", _table(PAGE.read_text()))))
    assert len(names) > 15, names
    missing = []
    for name in names:
        try:
            _resolve(name)
        except (AttributeError, ImportError):
            missing.append(name)
    assert not missing, f"docs/deepspeed.md names what fzero does not have: {missing}"


def _top_level_keywords(text: str, fn: str) -> set[str]:
    """The keywords of every call of `fn` in `text` (`init(stage=..., precision=fzero.Precision(...))`:
    stage, precision; not those of the calls inside it)."""
    out = set()
    for m in re.finditer(rf"\b{fn}\(", text):
        depth, i = 1, m.end()
        while depth and i < len(text) and text[i] not in "`\n":
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            if depth == 1:
                k = re.match(r"(\w+)=", text[i:])
                if k and not text[i - 1].isalnum() and text[i - 1] != "_":
                    out.add(k.group(1))
            i += 1
    return out


def test_the_keyword_reader_skips_nested_calls():
    assert _top_level_keywords("`init(a=1, b=f(c=2), d=g(h(e=3)))`", "init") == {"a", "b", "d"}


@pytest.mark.parametrize("fn", ["init", "train_step", "from_module"])
def test_every_keyword_the_table_gives_is_taken(fn):
    """`init(stage=...)`, `train_step(clip_norm=c)`, ...: each keyword the table writes inside a
    call of `fn` is one of its parameters."""
    given = _top_level_keywords(_table(PAGE.read_text()), fn)
    assert given, f"the table names no keyword of {fn}"
    taken = set(inspect.signature(getattr(fzero, fn)).parameters)
    assert given <= taken, f"{fn} takes no {sorted(given - taken)} (it takes {sorted(taken)})"
