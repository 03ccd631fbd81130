"""Claims of README.md and docs/compile.md that a walk through the docs checked and no other test
pinned (tests/test_docs.py, tests/test_docs_claims.py and tests/test_docs_behaviour.py pin the rest).

- README.md, "Where things are": every function and class the public modules export has its own
  docstring, and the list of `fzero/_src/` modules is the package's.
- README.md, "The layers are public too": `LazyPool` and `fzero.testing.ddp` (torch only) import
  without hypothesis.
- A compiled loss under `train_step(..., engine="func")` is not compiled: the step calls
  `torch.func.grad_and_value` from eager code, and dynamo refuses `torch.func.grad` of a compiled
  function called from eager ("Unsupported functorch tracing attempt", pytorch#128711), so the
  loss runs eager (its bits are the uncompiled loss's), as docs/compile.md and docs/bad-input.md
  say; this pins what torch 2.13 does, so a torch that lifts the limit shows up here.
"""

from __future__ import annotations

import functools
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fzero
from fzero import optim

from .test_docs_claims import compiling

ROOT = Path(__file__).resolve().parents[1]


# -- README.md, "Where things are" ----------------------------------------------------------------


def _own_docstring(obj) -> bool:
    """Whether `obj` (a function or class) has a docstring written for it: a class's own
    `__doc__` (not one a dataclass or NamedTuple generates from the fields, `Name(a, b)`)."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    return bool(doc and doc.strip()) and not doc.startswith(f"{obj.__name__}(")


def test_every_exported_function_and_class_has_its_own_docstring():
    """README.md: "every function and class these export has its own docstring, e.g.
    `help(fzero.optim.adamw)` ...; constants such as `fzero.optim.IMPLS` have none" -- for
    `fzero` and the layer modules `fzero.layout`, `.collectives`, `.accounting`, `.checkpoint`,
    `.optim`, `.testing` (the lazy strategies names included)."""
    import fzero.testing

    modules = [fzero, fzero.layout, fzero.collectives, fzero.accounting, fzero.checkpoint, fzero.optim,
               fzero.testing]
    checked, missing = 0, []
    for mod in modules:
        for name in mod.__all__:
            obj = getattr(mod, name)
            if inspect.isfunction(obj) or inspect.isclass(obj):
                checked += 1
                if not _own_docstring(obj):
                    missing.append(f"{mod.__name__}.{name}")
    assert checked >= 50 and not missing, (checked, missing)
    assert isinstance(fzero.optim.IMPLS, tuple)  # a constant: no docstring of its own to ask for


def test_the_readme_lists_every_private_module():
    """README.md, "Where things are", names the files of `fzero/_src/` (`tree.py`, ... `errors.py`):
    every one it names exists and every module there is named (a new module is listed)."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Where things are"):]
    named = set(re.findall(r"`(\w+\.py)`", section))
    present = {p.name for p in (ROOT / "fzero/_src").glob("*.py")} - {"__init__.py"}
    assert named == present, {"named, absent": sorted(named - present), "present, not named": sorted(present - named)}


# -- README.md, fzero.testing without hypothesis ---------------------------------------------------


def test_lazy_pool_and_the_ddp_helpers_import_without_hypothesis():
    """README.md: "`import fzero.testing`, `Pool` and `LazyPool` need no hypothesis" and
    "`ddp_trajectory`, `fzero_trajectory` and `trajectory_differences` (`fzero.testing.ddp`, torch
    only)" (tests/test_docs_claims.py checks `Pool`): in an interpreter where hypothesis cannot
    be imported, both import and the strategies module stays unimported."""
    code = "\n".join([
        "import sys",
        "sys.modules['hypothesis'] = None  # any import of hypothesis now raises ImportError",
        "from fzero.testing import LazyPool",
        "from fzero.testing.ddp import ddp_trajectory, fzero_trajectory, trajectory_differences",
        "assert LazyPool.__name__ == 'LazyPool' and callable(ddp_trajectory) and callable(fzero_trajectory)",
        "assert callable(trajectory_differences) and 'fzero.testing.strategies' not in sys.modules",
        "print('ok')",
    ])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split() == ["ok"], out.stderr


# -- docs/compile.md: a compiled loss under the func engine -----------------------------------------


def _params():
    g = torch.Generator().manual_seed(0)
    return {"layer.w": torch.randn(4, 3, generator=g), "layer.b": torch.randn(3, generator=g)}


def _math(w, b, x):
    return torch.tanh(x @ w + b).square().mean()


def _losses(engine, math, gather="on_use"):
    """One step's loss on each rank of a SimMesh(2), stage 3, the loss reading the leaves and
    calling `math` of them (docs/compile.md's pattern), and the graphs dynamo captured meanwhile."""
    from torch._dynamo.utils import counters

    mesh = fzero.SimMesh(2)
    xs = [(torch.randn(5, 4, generator=torch.Generator().manual_seed(r)),) for r in range(2)]

    def rank_fn(x):
        state = fzero.init(_params(), optim.adamw(1e-2), stage=3, mesh=mesh, units=lambda p: p.split(".")[0])
        step = fzero.train_step(lambda p, x: math(p["layer.w"], p["layer.b"], x), engine=engine, gather=gather)
        return step(state, x)[1].loss

    before = counters["stats"]["unique_graphs"]
    losses = mesh.run(rank_fn, xs)
    return losses, counters["stats"]["unique_graphs"] - before


@compiling
@pytest.mark.parametrize("gather", ["on_use", "eager"])
def test_a_compiled_loss_under_the_func_engine_runs_eager(gather):
    """engine="func": dynamo captures no graph of the compiled function (the default backend; with
    backend="eager" dynamo fails instead, an AssertionError in its fake-tensor code) and the loss
    has the uncompiled loss's bits; under engine="autograd" a compiled function of the same math
    captures a graph (backend "eager" there: dynamo's capture without inductor's compile time)."""
    torch._dynamo.reset()
    eager, _ = _losses("func", _math, gather)
    under_func, graphs = _losses("func", torch.compile(_math), gather)
    assert graphs == 0 and all(torch.equal(a, b) for a, b in zip(under_func, eager))
    under_autograd = torch.compile(lambda w, b, x: torch.tanh(x @ w + b).square().mean(), backend="eager")
    assert _losses("autograd", under_autograd, gather)[1] >= 1


@compiling
def test_a_directly_compiled_loss_under_the_func_engine_warns():
    """`train_step(torch.compile(loss_fn), engine="func")` warns, at the caller's line, that the loss
    runs eager (found in review: silent before); the autograd engine and an uncompiled loss do not
    warn. (A compiled function called inside a plain loss cannot be seen; docs/compile.md.)"""
    import warnings

    loss = lambda p, x: p["w"].sum()  # noqa: E731
    with pytest.warns(UserWarning, match=r'engine="func"\): the loss is not compiled; the step calls the function '
                                         r'torch.compile wrapped, eager') as caught:
        fzero.train_step(torch.compile(loss), engine="func")
    with pytest.warns(UserWarning, match="the loss is not compiled"):  # through a partial too
        fzero.train_step(functools.partial(torch.compile(lambda p, x, k: p["w"].sum() * k), k=2.0), engine="func")
    assert [w.filename for w in caught if "not compiled" in str(w.message)] == [__file__]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        fzero.train_step(torch.compile(loss), engine="autograd")
        fzero.train_step(loss, engine="func")


@compiling
def test_a_directly_compiled_loss_under_the_func_engine_leaves_dynamo_alone():
    """The step calls the function `torch.compile` wrapped: with backend="eager" the step runs
    (dynamo failed under torch.func.grad, a bare AssertionError), with the uncompiled loss's bits,
    and the function still compiles afterwards under engine="autograd", as the warning says to
    (found in review of torch.compile: dynamo, having failed on it, skipped its code for the rest
    of the process, and a fresh torch.compile of it captured no graph)."""
    from torch._dynamo.utils import counters

    def math(w, b, x):
        return torch.tanh(x @ w + b).square().mean()

    torch._dynamo.reset()
    whole = lambda p, x: math(p["layer.w"], p["layer.b"], x)  # noqa: E731
    with pytest.warns(UserWarning, match="the loss is not compiled"):
        compiled = torch.compile(whole, backend="eager")
        under_func, graphs = _losses_of("func", compiled)
    assert graphs == 0 and all(torch.equal(a, b) for a, b in zip(under_func, _losses_of("func", whole)[0]))
    counters.clear()
    _losses_of("autograd", torch.compile(whole, backend="eager"))
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])


def _losses_of(engine, loss):
    """`_losses` for a loss given whole (the one `train_step` may see compiled)."""
    from torch._dynamo.utils import counters

    mesh = fzero.SimMesh(2)
    xs = [(torch.randn(5, 4, generator=torch.Generator().manual_seed(r)),) for r in range(2)]

    def rank_fn(x):
        state = fzero.init(_params(), optim.adamw(1e-2), stage=3, mesh=mesh, units=lambda p: p.split(".")[0])
        return fzero.train_step(loss, engine=engine)(state, x)[1].loss

    before = counters["stats"]["unique_graphs"]
    losses = mesh.run(rank_fn, xs)
    return losses, counters["stats"]["unique_graphs"] - before


@compiling
def test_a_compiled_model_under_the_func_engine_warns_until_a_step_ran():
    """`from_module(torch.compile(model))` with engine="func": each step of that train_step warns
    until one has run on this thread, naming the way out (found in review of torch.compile: the
    model ran eager with no word); engine="autograd" and an uncompiled model do not warn."""
    import warnings

    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())
    mesh = fzero.SimMesh(1)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))

    def steps(module, engine):
        params, apply, info = fzero.from_module(module)
        state = fzero.init(params, optim.sgd(0.1), stage=0, mesh=mesh, units=info.units)
        step = fzero.train_step(lambda p, x: apply(p, x).square().mean(), engine=engine)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                state, _ = step(state, x)
        return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]

    def rank():
        return steps(torch.compile(model, backend="aot_eager"), "func"), steps(model, "func"), steps(
            torch.compile(model, backend="aot_eager"), "autograd"), steps(
            torch.nn.Sequential(torch.compile(model, backend="aot_eager")), "func")

    compiled_func, plain_func, compiled_autograd, compiled_child = mesh.run(rank)[0]
    assert len(compiled_child) == 1 and "('0._orig_mod.0.bias', ...: " in compiled_child[0]  # a compiled submodule
    assert len(compiled_func) == 1 and re.search(
        r"engine=\"func\"\) over the params of a torch.compile'd model \('_orig_mod\.0\.bias', \.\.\.: .*"
        r"Compile with engine=\"autograd\", or pass the model uncompiled to from_module", compiled_func[0])
    assert plain_func == [] and compiled_autograd == []


@compiling
def test_a_fullgraph_loss_reading_params_on_use_gets_fzeros_note():
    """`torch.compile(loss, fullgraph=True)` reading flat-dict params on use: dynamo's `Unsupported`
    (its hint: remove the torch.compiler.disable) gets a note naming gather="eager", in a step and
    in `fzero.evaluate` at stage 3 (found in review of torch.compile: dynamo's words alone); with
    gather="eager" the same loss runs."""
    mesh = fzero.SimMesh(1)
    loss = torch.compile(lambda p, x: torch.tanh(x @ p["layer.w"] + p["layer.b"]).square().mean(), backend="eager",
                         fullgraph=True)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    unsupported = torch._dynamo.exc.Unsupported

    def rank():
        state = fzero.init(_params(), optim.sgd(0.1), stage=3, mesh=mesh, units=lambda p: p.split(".")[0])
        notes = []
        for call in (lambda: fzero.train_step(loss)(state, x), lambda: fzero.evaluate(loss)(state, x)):
            with pytest.raises(unsupported) as caught:
                call()
            notes.append(" ".join(getattr(caught.value, "__notes__", [])))
        fzero.train_step(loss, gather="eager")(state, x)
        return notes

    torch._dynamo.reset()
    for note in mesh.run(rank)[0]:
        assert re.search(r"fzero: a torch.compile\(\.\.\., fullgraph=True\) function read params on use .* Ignore "
                         r"dynamo's hint to remove torch.compiler.disable; pass gather='eager'", note), note


@compiling
def test_under_the_func_engine_only_torch_compiles_own_wrappers_are_taken_off():
    """engine="func" calls the function `torch.compile` wrapped, inside a `functools.partial`
    too (backend="eager": it runs, where dynamo's AssertionError stopped it), but a decorator
    around a compiled function is kept and runs: `functools.wraps` copies the compiled function's
    attributes onto it (found in review: `torch.autocast(...)(compiled)` lost its autocast, a
    user's wrapper its factor, silently); over nested params on use, a loss the step uncompiles
    is not refused (no compiled code meets a placeholder)."""
    import warnings

    torch._dynamo.reset()
    mesh = fzero.SimMesh(1)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))

    def math(p, x, k=1.0):
        return torch.tanh(x @ p["layer.w"] + p["layer.b"]).square().mean() * k

    def nested(p, x):
        return torch.tanh(x @ p["layer"]["w"] + p["layer"]["b"]).square().mean()

    compiled = torch.compile(math, backend="aot_eager")

    @functools.wraps(compiled)
    def tenfold(p, x):
        return 10.0 * compiled(p, x)

    cases = {
        "partial": (functools.partial(torch.compile(math, backend="eager"), k=3.0), functools.partial(math, k=3.0)),
        "autocast": (torch.autocast("cpu", dtype=torch.bfloat16)(compiled),
                     torch.autocast("cpu", dtype=torch.bfloat16)(math)),
        "wraps": (tenfold, lambda p, x: 10.0 * math(p, x)),
        "nested": (torch.compile(nested, backend="eager"), nested),
    }

    def rank():
        out = {}
        for name, (given, plain) in cases.items():
            params = _params() if name != "nested" else {"layer": {"w": _params()["layer.w"], "b": _params()["layer.b"]}}
            state = fzero.init(params, optim.sgd(0.1), stage=3, mesh=mesh, units=lambda p: p.split(".")[0])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # the "not compiled" warning, tested above
                out[name] = [fzero.train_step(f, engine="func")(state, x)[1].loss for f in (given, plain)]
        return out

    for name, (given, plain) in mesh.run(rank)[0].items():
        assert torch.equal(given, plain), (name, given, plain)


@compiling
def test_the_func_engines_warning_says_what_the_step_calls():
    """The warning's words follow what the step does: a partial of a decorator around a compiled
    function runs through the decorator (it said the step called the function torch.compile
    wrapped); a `torch.compiler.disable`d loss is no compiled loss (it was warned of as one); a
    method compiled in its class keeps its `self` and runs (found in review: "missing 1 required
    positional argument")."""
    import warnings

    torch._dynamo.reset()
    compiled = torch.compile(lambda p, x: p["w"].sum() * x, backend="aot_eager")

    @functools.wraps(compiled)
    def wrapper(p, x):
        return compiled(p, x)

    class Model:
        @torch.compile(backend="eager")
        def loss(self, p, x):
            return (p["w"] * x).sum()

    with pytest.warns(UserWarning, match="it runs eager through a wrapper around the compiled function"):
        fzero.train_step(functools.partial(wrapper), engine="func")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        fzero.train_step(torch.compiler.disable(lambda p, x: p["w"].sum()), engine="func")
    mesh = fzero.SimMesh(1)

    def rank():
        state = fzero.init({"w": torch.ones(3)}, optim.sgd(0.1), stage=0, mesh=mesh)
        with pytest.warns(UserWarning, match="the step calls the function torch.compile wrapped"):
            step = fzero.train_step(Model().loss, engine="func")
        return step(state, torch.tensor(2.0))[1].loss

    assert float(mesh.run(rank)[0]) == 6.0
