"""What a step makes is gone after it: a census of live objects over the step's configurations.

A leak hunt (review): for each configuration a few steps run, each loss computing results that
save their own output (softmax, tanh, exp, GELU) in grad mode and dropping them, and after each
step -- between two barriers, on SimMesh's rank 0 while rank 1 waits -- nothing of the step may
live on: no `Gathering` nor `unit.Inflight` made in the run (the gathered units, reductions in
flight, the input state's buffers they hold), no tensor with a `grad_fn` (a graph), and the
tensors Python's collector can reach, and the bytes of their storages, the same after the third
step as after the last (a chain of states, or a cache that grows per step). Which is what a
stage-3 step with a dropped softmax broke before `gathering._Unpacking` kept saved outputs
detached (tests/test_step_edges.py); these are the guards for that class of bug.

Found in the hunt: a step whose backward raised (a custom Function's backward, torch's in-place
check, `DivergentPaths` in a unit's reduction, an out-of-memory error), caught, kept the part of
its graph torch's autograd engine had not run -- the loss's activations, the units' Function
contexts with the step's `Inflight`, in stage 3 the saved-tensor hooks' `Gathering` with its
gathered units and the input state's buffers -- until the next backward on the thread, and for
good after the last one: the engine leaves the nodes that were ready to run in the thread's
ready queue (`step.drop_unrun_backward` now pops them).
"""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref

import pytest
import torch
import torch.nn.functional as F

import fzero
from fzero import optim
from fzero._src.gathering import Gathering
from fzero._src.unit import Inflight

from . import prefetch_cases as cases

D, HIDDEN = 8, (8, 12)  # units "default", "blocks.0", "blocks.1"


# -- the census ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _made(freeze: bool = True):
    """Yield a list that gets `(thread id, weak reference)` for each `Gathering` and `Inflight`
    made in the body (SimMesh's ranks are threads of this process: one patch for all).

    With `freeze`, what the process held before is frozen out of the collector for the body
    (`gc.freeze`): the census counts what the body made, and each `gc.collect` no longer walks the
    whole suite's heap (a census took a second late in a full run; the counts compare rows of one
    body, so leaving the older objects out of every row changes no comparison). A pool worker's
    heap is small, and there `census_over_steps` does not freeze: with the freeze its census ran
    fast enough to meet a 4-byte tensor still held for a moment after a step (torch 2.11, once:
    56 tensors after the third step, 55 after the fourth and fifth)."""
    made: list[tuple[int, weakref.ref]] = []
    if freeze:
        gc.collect()
        gc.freeze()
    try:
        with pytest.MonkeyPatch.context() as mp:
            for cls in (Gathering, Inflight):
                def spy(self, *args, __init=cls.__init__, **kwargs):
                    __init(self, *args, **kwargs)
                    made.append((threading.get_ident(), weakref.ref(self)))

                mp.setattr(cls, "__init__", spy)
            yield made
    finally:
        if freeze:
            gc.unfreeze()


def _alive(made: list[tuple[int, weakref.ref]], thread: int | None = None) -> list[str]:
    """The classes of the tracked objects still alive (of one thread's, where given)."""
    return [type(r()).__name__ for t, r in made if r() is not None and thread in (None, t)]


def _census() -> tuple[int, int, int]:
    """After a collection: `(tensors the collector reaches, bytes of their distinct storages, how
    many of them have a grad_fn)`, of the objects made since `_made()` froze the older ones.
    Placeholders and watched leaves answer as plain tensors here."""
    gc.collect()
    tensors, graph, storages = 0, 0, {}
    with torch._C.DisableTorchFunctionSubclass():
        for o in gc.get_objects():
            if not issubclass(type(o), torch.Tensor):
                continue
            tensors += 1
            graph += o.grad_fn is not None
            with contextlib.suppress(RuntimeError, NotImplementedError):  # (a tensor without storage)
                st = o.untyped_storage()
                storages[st._cdata] = st.nbytes()
    return tensors, sum(storages.values()), graph


def _barrier(mesh) -> None:
    if mesh.world_size > 1:
        fzero.collectives.all_reduce(torch.zeros(1), mesh)


# -- configurations ----------------------------------------------------------------------------------


class _RaisingBackward(torch.autograd.Function):
    """The identity, whose backward raises (a custom Function's error, torch's in-place check)."""

    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        raise ValueError("refused in the backward")


def _dropped(logits: torch.Tensor) -> None:
    """Statistics computed in grad mode and dropped: each op saves its own output."""
    logits.softmax(-1)
    logits.tanh()
    logits.exp()
    F.gelu(logits)


def _nested():
    """`(params, apply, units)` of a model whose params are not a flat dict (on use: `FirstUse`)."""
    torch.manual_seed(0)
    params = {"w": torch.randn(11, D), "head": {"w": torch.randn(D, 11), "b": torch.zeros(11)}}

    def apply(p, x):
        return torch.tanh(p["w"][x]) @ p["head"]["w"] + p["head"]["b"]

    return params, apply, lambda path: path.split(".")[0]


def stepping(mesh, stage: int, settings: dict, init: dict | None = None, *, micro: int = 1, nested: bool = False,
             remat: bool = False, raising: tuple[str, ...] = (), nan_every: int = 0, autocast: bool = False,
             evaluate: bool = False, root: str | None = None):
    """On one rank: a function `one(i)` that runs step i of a model (`prefetch_cases.model`, or
    `_nested`) on this rank's batches, keeping the state in a closure: a step, then, for each of
    `raising`, a step whose loss raises in its forward ("forward", after reading the embedding
    and blocks.0, or the nested "w") or its backward ("backward"), caught. Every loss drops
    results saved in grad mode (`_dropped`); `nan_every` > 0 makes the loss of every
    `nan_every`-th call NaN, and such a step must be skipped (`on_nonfinite="skip"` or a loss
    scaler's overflow), no other; `autocast` runs the model under CPU bf16 autocast; `evaluate`
    runs `fzero.evaluate` before the step; `root` saves a checkpoint there and loads it back."""
    if nested:
        params, apply, units = _nested()
        groups = ()
    else:
        params, apply, info = cases.model(D, HIDDEN, remat=remat)
        units, groups = info.units, info.groups
    calls, poisoned = [0], []

    def loss(p, b):
        x, y, how = b
        calls[0] += 1
        if how == "forward":
            p["w"].tanh() if nested else apply(p, x, [0])
            raise ValueError("refused in the forward")
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            logits = apply(p, x).float()
        _dropped(logits)
        if nan_every and calls[0] % nan_every == 0:
            logits = logits * float("nan")
            poisoned.append(calls[0])
        out = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        if how == "backward":
            return out + _RaisingBackward.apply(logits.sum())
        return out

    state = [fzero.init(params, optim.adamw(1e-2), stage=stage, mesh=mesh, units=units, groups=groups, **(init or {}))]
    step = fzero.train_step(loss, micro_batches=micro, **settings)
    forward = fzero.evaluate(lambda p, b: apply(p, b[0]).softmax(-1))

    def one(i: int) -> None:
        x, y = cases.batch(mesh.rank + mesh.world_size * i)
        batch = lambda how: [(x, y, how)] * micro if micro > 1 else (x, y, how)  # noqa: E731
        if evaluate:
            forward(state[0], (x, y))
        if root is not None:
            fzero.checkpoint.save(state[0], root)
            state[0] = fzero.checkpoint.load(fzero.checkpoint.latest(root), state[0])
        poisoned.clear()
        state[0], metrics = step(state[0], batch(None))
        assert metrics.skipped == bool(poisoned), (i, metrics)  # a NaN step is skipped, and only it
        for how in raising:
            with pytest.raises(ValueError, match=f"refused in the {how}"):
                step(state[0], batch(how))

    return one


def census_over_steps(mesh, steps: int, *args, made: list | None = None, **kwargs
                      ) -> list[tuple[int, int, int, list[str]]]:
    """On one rank: run `stepping(mesh, *args, **kwargs)` `steps` times, with `_census()` and the
    tracked objects alive (`_alive`) before the first step and after each, taken between two
    barriers: on a SimMesh by rank 0 (rank 1 waits in the second while it counts), which returns
    the rows (the others []), with `made` the test thread's `_made()` list; on a DistMesh every
    rank counts its own process."""
    one = stepping(mesh, *args, **kwargs)
    rows = []
    counts = mesh.rank == 0 or not isinstance(mesh, fzero.SimMesh)
    with _made(freeze=False) if made is None else contextlib.nullcontext(made) as made:
        for i in range(-1, steps):  # -1: before the first step
            if i >= 0:
                one(i)
            _barrier(mesh)
            if counts:
                rows.append((*_census(), _alive(made)))
            _barrier(mesh)
    return rows


def _check(rows) -> None:
    """Nothing of a step lives on after it (see the module docstring): no tracked object and no
    tensor with a grad_fn more than before the first step (`rows[0]`: what the body held before
    it, without the older objects where `_made()` froze them), and from the third step on no tensor and no byte
    more."""
    (_, _, before, _), *after = rows
    for k, (_, _, graph, alive) in enumerate(after):
        assert alive == [], f"after step {k}: {alive} alive"
        assert graph <= before, f"after step {k}: {graph} tensors with a grad_fn alive, {before} before the first"
    # no more: a tensor alive at one census only (seen once after step 2 on torch 2.11 over gloo with 16 cores,
    # one fewer after each later step) is not one that piles up
    assert all(a <= b for a, b in zip(after[-1][:2], after[2][:2])), (
        f"tensors, bytes after step 2: {after[2][:2]}, after the last: {after[-1][:2]}")


SKIP = dict(on_nonfinite="skip")
OFFLOAD = fzero.Offload(optimizer="cpu", params="cpu")
FP16 = dict(precision=fzero.Precision(torch.float16, torch.float32), loss_scale=fzero.DynamicLossScale())
CONFIGS = {  # id -> (world size, stage, step settings, init settings, stepping's keywords)
    "s0-donate-once-clip": (2, 0, dict(donate=True, accumulate="once", clip_norm=0.1), None, dict(micro=2)),
    "s1-eager-bf16": (2, 1, dict(gather="eager"), dict(precision=fzero.Precision(torch.bfloat16, torch.float32)), {}),
    "s2-func-each-offload": (2, 2, dict(engine="func"), dict(offload=fzero.Offload(optimizer="cpu")), dict(micro=2)),
    "s3-prefetch-persist-cap": (2, 3, dict(prefetch=1, persist_bytes=2000, max_live_bytes=20000), None, {}),
    "s3-remat-evaluate-checkpoint": (2, 3, {}, None, dict(remat=True, evaluate=True)),
    "s3-nested-on-use": (2, 3, {}, None, dict(nested=True, raising=("forward",))),
    "s3-fp16-overflow-donate": (2, 3, dict(donate=True), FP16, dict(nan_every=2)),
    "s3-offload-params-skip": (2, 3, dict(prefetch=1, **SKIP), dict(offload=OFFLOAD), dict(nan_every=2)),
    "s3-raising": (2, 3, dict(prefetch=1), None, dict(raising=("forward", "backward"))),
    "s0-func-raising": (2, 0, dict(engine="func"), None, dict(raising=("backward",))),
    "s0-cast-ahead-n1": (1, 0, dict(cast_ahead=True), None, dict(autocast=True)),
    "s3-cast-ahead-n1": (1, 3, dict(cast_ahead=True), None, dict(autocast=True)),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_step_leaves_nothing_behind(name, tmp_path):
    """SimMesh, 5 steps of each configuration (see the module docstring for what is counted): no
    `Gathering` or `Inflight` of the run and no graph alive after any step, and no tensor nor
    byte more after the fifth than after the third. "raising" ones catch a step whose loss raises
    in its forward, then one whose backward raises, after each step (before
    `drop_unrun_backward`: the second's graph, and in stage 3 its `Gathering`, stayed alive)."""
    n, stage, settings, init, kwargs = CONFIGS[name]
    mesh = fzero.SimMesh(n)
    root = str(tmp_path / "ckpt") if "checkpoint" in name else None
    with _made() as made:
        rows = mesh.run(lambda: census_over_steps(mesh, 5, stage, settings, init, made=made, root=root, **kwargs))[0]
    _check(rows)


# -- a step whose backward raised ------------------------------------------------------------------


def raise_in_backward(mesh, stage: int, engine: str, made: list):
    """On one rank: one step whose backward raises (`_RaisingBackward` on the logits, beside the
    cross entropy: the engine runs it first and leaves the cross entropy's node ready), caught.
    Returns, on rank 0 (None elsewhere), how many tensors with a grad_fn are alive before the step
    and once both ranks have caught its error, and which tracked objects (`made`: the test
    thread's `_made()` list) are alive then."""
    params, apply, info = cases.model(D, HIDDEN)

    def loss(p, b):
        logits = apply(p, b[0])
        _dropped(logits)
        return F.cross_entropy(logits.flatten(0, 1), b[1].flatten()) + _RaisingBackward.apply(logits.sum())

    state = fzero.init(params, optim.adamw(1e-2), stage=stage, mesh=mesh, units=info.units)
    step = fzero.train_step(loss, engine=engine)
    counts = []
    for i in range(2):  # 0: before the step
        if i:
            with pytest.raises(ValueError, match="refused in the backward"):
                step(state, cases.batch(mesh.rank))
        _barrier(mesh)
        if mesh.rank == 0:
            counts.append(_census()[2])
        _barrier(mesh)
    return (counts, _alive(made)) if mesh.rank == 0 else None


@pytest.mark.parametrize("stage, engine", [(0, "autograd"), (3, "autograd"), (0, "func")])
def test_a_step_whose_backward_raised_lets_go_of_its_graph(stage, engine):
    """SimMesh(2): once the error reaches the caller, the step's graph, its `Inflight` and, in
    stage 3, its `Gathering` are freed. Before, torch's engine kept the nodes it had not run in
    the thread's ready queue, holding all of it until the next backward on the thread."""
    mesh = fzero.SimMesh(2)
    with _made() as made:
        (before, after), alive = mesh.run(lambda: raise_in_backward(mesh, stage, engine, made))[0]
    assert after <= before, f"{after} tensors with a grad_fn alive after the step, {before} before"
    assert alive == [], alive


def census_over_gloo(mesh, root: str):
    """On a pool worker: the raising stage-3 census, with prefetch at its default (1 on a
    DistMesh), a checkpoint saved and loaded each step (`root`: one folder for every rank)."""
    return census_over_steps(mesh, 5, 3, {}, None, raising=("forward", "backward"), evaluate=True, root=root)


@pytest.mark.dist
def test_over_gloo_a_step_leaves_nothing_behind(dist2, tmp_path):
    """DistMesh (gloo, 2 workers: the thread that steps lives on after the steps), stage 3 with
    asynchronous prefetch, a forward and a backward that raise after each step, an evaluation
    and a checkpoint: the census of `test_a_step_leaves_nothing_behind` on every rank."""
    root = str(tmp_path / "ckpt")
    for rows in dist2.run(census_over_gloo, [(root,), (root,)], timeout=120):
        _check(rows)
