"""Behaviour the docs state that no other test file covers.

- `import fzero.testing` needs no hypothesis (README.md, "The layers are public too"): `Pool` and
  its errors import only torch; the strategies module, and hypothesis with it, is imported on the
  first read of one of its names.
- A compiled loss that reads nested params' on-use placeholders raises `ConfigError` naming the
  leaf and the way out (docs/compile.md); before, dynamo stopped inside `FirstUse` with torch's
  `InternalTorchDynamoError` (NameError: '___tuple_iterator_getitem').
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import fzero
from fzero import optim


def test_fzero_testing_imports_without_hypothesis():
    """In a fresh interpreter where hypothesis cannot be imported: `Pool` and its errors are there,
    the strategies module is not imported, and reading a strategy raises the ImportError."""
    code = "\n".join([
        "import sys",
        "sys.modules['hypothesis'] = None  # any import of hypothesis now raises ImportError",
        "import fzero.testing as t",
        "assert t.Pool.__name__ == 'Pool' and issubclass(t.PoolError, RuntimeError) and t.WorkerError",
        "assert 'fzero.testing.strategies' not in sys.modules",
        "try:",
        "    t.assert_trees_equal",
        "except ImportError as e:",
        "    print('ImportError:', e)",
    ])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert ("ImportError: fzero.testing.assert_trees_equal needs hypothesis: pip install 'fzero[test]'"
            in out.stdout), out.stdout


def test_fzero_testing_names_are_the_strategies_modules():
    """With hypothesis installed every name of `__all__` resolves, the lazy ones to the objects of
    `fzero.testing.strategies`, and an unknown name is an AttributeError."""
    import fzero.testing as t
    from fzero.testing import strategies

    for name in t.__all__:
        value = getattr(t, name)
        if hasattr(strategies, name):
            assert value is getattr(strategies, name), name
    assert set(t.__all__) <= set(dir(t))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        t.nope  # noqa: B018


# -- a compiled loss over nested params, on use ---------------------------------------------------

TORCH_213 = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)
COMPILE_MARKS = [
    # torch's own warnings under the suite's warnings-as-errors (as in tests/test_compile.py)
    pytest.mark.filterwarnings("ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
                               ":DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning"),
    pytest.mark.skipif(not TORCH_213, reason="torch.compile is tested on torch 2.13 only (docs/compile.md)"),
]


def compiling(test):
    for mark in COMPILE_MARKS:
        test = mark(test)
    return test


def _nested():
    g = torch.Generator().manual_seed(0)
    return {"layer": {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)},
            "head": {"w": torch.randn(3, 2, generator=g)}}


def _loss(p, x):
    return (torch.tanh(x @ p["layer"]["w"] + p["layer"]["b"]) @ p["head"]["w"]).square().mean()


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 4, generator=g),) for _ in range(n)]


def _init(params, stage, mesh):
    return fzero.init(params, optim.sgd(0.1), stage=stage, mesh=mesh, units=lambda p: p.split(".")[0])


@compiling
@pytest.mark.parametrize("stage", [0, 3])
def test_a_compiled_loss_over_nested_on_use_params_raises_config_error(stage):
    """`train_step(torch.compile(loss))` with nested params and gather="on_use": refused before
    the compiled loss runs, on every rank, naming the leaves and the way out; `fzero.evaluate` of
    the compiled function too. The way out then compiles in the
    same process: raised inside the compiled code (as before), the error made dynamo skip the
    loss's code for good, and `train_step(torch.compile(loss), gather="eager")` captured no graph
    and ran eager, silently (found in review of torch.compile)."""
    from torch._dynamo.utils import counters

    mesh, params, compiled = fzero.SimMesh(2), _nested(), torch.compile(_loss)
    match = (r"gather='on_use' with params that are not a flat dict: compiled code \(torch.compile\) would be "
             r"handed placeholders of the params leaves \('head\.w', 'layer\.b', 'layer\.w'\).*use gather='eager' "
             r"with a compiled loss, or flat-dict params")

    def rank_fn(x):
        state = _init(params, stage, mesh)
        with pytest.raises(fzero.ConfigError, match=match):
            fzero.train_step(compiled)(state, x)
        with pytest.raises(fzero.ConfigError, match=match):  # every stage: placeholders on use at each (found in
            fzero.evaluate(compiled)(state, x)  # review: stages 0-2 were refused from inside the compiled code)
        return True

    torch._dynamo.reset()
    assert mesh.run(rank_fn, _batches(2)) == [True, True]
    counters.clear()
    mesh1 = fzero.SimMesh(1)
    mesh1.run(lambda: fzero.train_step(torch.compile(_loss), gather="eager")(_init(params, stage, mesh1),
                                                                              _batches(1)[0][0]))
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])
    counters.clear()
    mesh1.run(lambda: fzero.evaluate(torch.compile(_loss), gather="eager")(_init(params, stage, mesh1), _batches(1)[0][0]))
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])


@compiling
def test_a_compiled_function_inside_the_loss_reading_a_placeholder_raises_config_error():
    """A compiled function called inside a plain loss (which fzero cannot see before it runs)
    that reads a placeholder raises `ConfigError` from inside the compiled code, on every rank,
    naming the leaf read, the way out, and that dynamo skips that function's code for the rest
    of the process (a new process or torch._dynamo.reset() first)."""
    mesh, params, inner = fzero.SimMesh(2), _nested(), torch.compile(_loss)
    match = (r"gather='on_use' with params that are not a flat dict: compiled code \(torch.compile\) reads the "
             r"placeholder of \['layer\.w'\].*use gather='eager' with a compiled loss, or flat-dict params.*"
             r"dynamo does not compile the function that raised this again in this process.*torch._dynamo.reset\(\)")

    def rank_fn(x):
        with pytest.raises(fzero.ConfigError, match=match):
            fzero.train_step(lambda p, x: inner(p, x))(_init(params, 3, mesh), x)
        return True

    torch._dynamo.reset()
    try:
        assert mesh.run(rank_fn, _batches(2)) == [True, True]
    finally:
        torch._dynamo.reset()  # (the skipped code of _loss is not this file's other tests' to inherit)


@compiling
def test_nested_on_use_params_still_run_under_a_compiled_step():
    """The check reads only compiled code's reads: `torch.compile(step)` around a step whose loss
    is not compiled (the step runs eager, a disabled region) gives the eager step's bits."""
    mesh, params = fzero.SimMesh(2), _nested()

    def rank_fn(x):
        out = []
        for step in (fzero.train_step(_loss), torch.compile(fzero.train_step(_loss))):
            state, m = step(_init(params, 3, mesh), x)
            out.append((fzero.gather(state), m.loss))
        return out

    for (eager, loss_e), (compiled, loss_c) in mesh.run(rank_fn, _batches(2)):
        assert torch.equal(loss_e, loss_c)
        assert all(torch.equal(a, b) for a, b in zip(
            [eager["layer"]["w"], eager["layer"]["b"], eager["head"]["w"]],
            [compiled["layer"]["w"], compiled["layer"]["b"], compiled["head"]["w"]]))

