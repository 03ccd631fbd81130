"""SimMesh's ranks run under the caller's thread-local torch modes (`fzero._src.mesh.ThreadModes`),
as DistMesh's rank runs in the caller's own thread: grad and inference mode, autocast (per
device type, with its cache setting), saved-tensor hooks, torch-function and torch-dispatch
modes. Before, each rank thread started from torch's defaults: a step under the caller's
`torch.autocast` was autocast on DistMesh and not on SimMesh, silently (found in review).

The reference is the same probe run in the caller's thread, under the same modes."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import fzero
from fzero import optim


@contextlib.contextmanager
def raw_autocast(device: str, dtype: torch.dtype):
    """Autocast on for `device` through torch's setters: `torch.autocast("cuda")` on a machine
    without CUDA warns and stays off, and what is checked here is only that the setting reaches
    the ranks."""
    before = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
    torch.set_autocast_enabled(device, True)
    torch.set_autocast_dtype(device, dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled(device, before[0])
        torch.set_autocast_dtype(device, before[1])


class Names(TorchFunctionMode):
    """Records the name of every torch function called under it."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


class Ops(TorchDispatchMode):
    """Records every aten op dispatched under it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _saved_hooks():
    packed = []
    return packed, torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t, lambda t: t)


def _saves(packed):
    """How many tensors the default saved-tensor hooks pack for `x * x` (0 without hooks)."""
    before = len(packed)
    x = torch.ones(2, requires_grad=True)
    (x * x).sum()
    return len(packed) - before


def _matmul_dtype():
    return (torch.ones(2, 2) @ torch.ones(2, 2)).dtype


# name: (modes to enter, probe run in the caller's thread and in every rank)
CASES = {
    "inference_mode": (torch.inference_mode, lambda: (torch.is_inference_mode_enabled(), torch.ones(1).is_inference())),
    "autocast_cpu": (lambda: torch.autocast("cpu", dtype=torch.bfloat16),
                     lambda: (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), _matmul_dtype())),
    "autocast_cpu_float16": (lambda: torch.autocast("cpu", dtype=torch.float16),
                             lambda: (torch.get_autocast_dtype("cpu"), _matmul_dtype())),
    "autocast_cache_off": (lambda: torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False),
                           lambda: torch.is_autocast_cache_enabled()),
    "autocast_cuda": (lambda: raw_autocast("cuda", torch.bfloat16),
                      lambda: (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))),
}


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_rank_sees_the_callers_modes(name, n):
    enter, probe = CASES[name]
    plain = probe()
    with enter():
        want = probe()
        got = fzero.SimMesh(n).run(probe)
    assert want != plain  # the mode shows in the probe
    assert got == [want] * n
    assert fzero.SimMesh(n).run(probe) == [plain] * n  # and is gone once the caller left it


@pytest.mark.parametrize("n", [1, 2])
def test_every_rank_sees_the_callers_saved_tensor_hooks(n):
    packed, hooks = _saved_hooks()
    with hooks:
        assert _saves(packed) == 2
        assert fzero.SimMesh(n).run(lambda: _saves(packed)) == [2] * n
    assert fzero.SimMesh(n).run(lambda: _saves(packed)) == [0] * n


@pytest.mark.parametrize("n", [1, 2])
def test_every_rank_runs_under_the_callers_torch_function_modes(n):
    with Names() as names:
        fzero.SimMesh(n).run(lambda r: torch.mul(torch.ones(1), r), [(r,) for r in range(n)])
    assert names.names.count("mul") == n


@pytest.mark.parametrize("n", [1, 2])
def test_every_rank_runs_under_the_callers_torch_dispatch_modes(n):
    """E.g. `fzero.accounting.LiveStorages` entered around `mesh.run` now sees the ranks' storages."""
    with Ops() as ops:
        fzero.SimMesh(n).run(lambda: torch.ones(3).cumsum(0))
    assert ops.ops.count("aten.cumsum.default") == n


def test_a_rank_leaves_the_modes_it_entered_itself_as_torch_does():
    """A rank that enters a mode of its own inside the caller's leaves it on the way out: the
    caller's are in force again for the rest of the rank's function."""
    def fn():  # grad mode was carried before; autocast was not
        with torch.autocast("cpu", dtype=torch.float16):
            inner = _matmul_dtype()
        with torch.enable_grad():
            grad = torch.is_grad_enabled()
        return inner, _matmul_dtype(), grad, torch.is_grad_enabled()

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        assert fn() == (torch.float16, torch.bfloat16, True, False)
        assert fzero.SimMesh(2).run(fn) == [(torch.float16, torch.bfloat16, True, False)] * 2


def _problem():
    g = torch.Generator().manual_seed(3)
    params = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}
    batch = torch.randn(5, 4, generator=g)
    return params, batch


def _loss(p, x):
    return torch.tanh(x @ p["w"] + p["b"]).square().mean()


@pytest.mark.parametrize("stage", [0, 3])
def test_evaluate_and_a_step_under_the_callers_autocast_equal_the_plain_loss_under_it(stage):
    """At N = 1, `fzero.evaluate` and a train step's loss under the caller's CPU bf16 autocast are
    bit for bit the plain loss under it, computed in the caller's thread (on one rank the step's
    loss is the rank's loss); without the caller's autocast they would be the fp32 loss."""
    params, batch = _problem()
    mesh = fzero.SimMesh(1)

    def rank():
        state = fzero.init(params, optim.sgd(0.1), stage=stage, mesh=mesh)
        out = fzero.evaluate(_loss)(state, batch)
        _, metrics = fzero.train_step(_loss)(state, batch)
        return out, metrics.loss

    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _loss(params, batch)
        [(out, loss)] = mesh.run(rank)
    assert not torch.equal(want, _loss(params, batch))  # autocast changes this loss's bits
    assert torch.equal(out, want)
    assert torch.equal(loss, want.to(torch.float64))


# -- process-wide state a rank changes inside `fn` -----------------------------------------------
# Each process of a DistMesh has its own; SimMesh's ranks are threads of one process, which switch
# at every collective. Before, a rank's change reached the others mid-program (found in review):
# `random.seed(rank)` on each rank, then after a collective rank 0 drew from rank 1's stream; a
# `warnings.catch_warnings()` spanning a collective restored another rank's filters, so after
# `mesh.run` a rank's `simplefilter("ignore")` stayed on for the process and a rank's warning went
# into another rank's record; a default dtype set and restored around a collective stayed float64.


def test_each_rank_has_its_own_python_and_numpy_random_streams():
    import random

    np = pytest.importorskip("numpy")  # (matplotlib, of the test extra, brings it)
    mesh = fzero.SimMesh(2)

    def fn():
        random.seed(mesh.rank)
        np.random.seed(mesh.rank)
        first = (random.random(), float(np.random.rand()))
        fzero.collectives.all_reduce(torch.zeros(1), mesh)  # the other rank runs here
        return first, (random.random(), float(np.random.rand()))

    before = random.getstate(), np.random.get_state()[1].copy()
    got = mesh.run(fn)
    for r, (first, second) in enumerate(got):
        py, npr = random.Random(r), np.random.RandomState(r)
        assert first == (py.random(), float(npr.rand())) and second == (py.random(), float(npr.rand())), (r, got)
    assert random.getstate() == before[0] and (np.random.get_state()[1] == before[1]).all()  # the caller's back


def test_a_ranks_warnings_filters_and_record_are_its_own():
    import warnings

    mesh = fzero.SimMesh(2)
    filters = list(warnings.filters)

    def fn():
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            warnings.warn(f"mine-{mesh.rank}")
            fzero.collectives.all_reduce(torch.zeros(1), mesh)  # the other rank enters and leaves its own
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # and leaves it on past the collective
            fzero.collectives.all_reduce(torch.zeros(1), mesh)
        return [str(w.message) for w in seen]

    assert mesh.run(fn) == [["mine-0"], ["mine-1"]]
    assert warnings.filters == filters  # no rank's "ignore" left on for the process
    with pytest.warns(UserWarning, match="still heard"):
        warnings.warn("still heard")


def test_at_one_rank_a_warning_shown_once_per_place_is_shown_once():
    """`ProcessState`: at N = 1 the turn comes back to the same rank, and its warnings registry is
    the process's own, so a warning under the "default" action (once per place) is shown once in
    three collectives, as in one process. (A mutant saving and restoring the state at every
    collective, the cost the self-pass saves, showed it three times.)"""
    import warnings

    mesh = fzero.SimMesh(1)

    def fn():
        for _ in range(3):
            warnings.warn("once per place", UserWarning)
            fzero.collectives.all_reduce(torch.zeros(1), mesh)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        mesh.run(fn)
    assert [str(w.message) for w in seen] == ["once per place"]


def test_a_default_dtype_set_and_restored_around_a_collective_is_the_ranks_own():
    mesh = fzero.SimMesh(2)

    def fn():
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        fzero.collectives.all_reduce(torch.zeros(1), mesh)
        torch.set_default_dtype(old)
        fzero.collectives.all_reduce(torch.zeros(1), mesh)
        return torch.zeros(1).dtype

    assert mesh.run(fn) == [torch.float32, torch.float32] and torch.get_default_dtype() == torch.float32
