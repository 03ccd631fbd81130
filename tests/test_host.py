"""Host work of the forward (`from_module`'s `apply` with `LazyParams`, fzero/_src/module.py):

- each rank thread's skeleton copy registers its forward hooks once, on its first step; later
  steps register none, and the binding plan is built once per unit map (rebuilt, and the hooks
  extended, for a state with other units; every map gives the bits of `gather="eager"`);
- a forward that raises inside a unit leaves every parameter slot of the copy holding its meta
  placeholder, and the next step gives the bits of a step that never saw the error;
- a loss that runs the module twice on one `LazyParams` runs each unit's Function once per
  step (stage 3: the second forward gathers released units again) and gives the bits of
  `gather="eager"`;
- `apply` inside a module's forward binds into a second copy, not the running one;
- a donating step prepares its update before the agreement's host read (`Optimizer.prepare_`,
  which writes nothing; its `launch` gives `update_`'s bits) and launches it after the read
  where every leaf was used (else `update_`); an error of `prepare_` is raised after the verdict;
  `_replace(update_=...)` drops `prepare_`, so a wrapper's `update_` runs;
- the unit Function's direct C-level apply outside transforms gives `Function.apply`'s bits;
- stage 3 frees and re-gathers only where a unit has gathered storage of its own (not at N = 1
  with the optimizer offloaded and the held device shard in the compute dtype).
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
import torch.nn.functional as F
from torch import nn

import fzero
from fzero import from_module, units_by_prefix
from fzero._src import gathering as gathering_module
from fzero._src import unit as unit_module
from fzero._src.eager import eager
from fzero._src.stages import get_stage
from fzero.testing import examples, pytrees, world_sizes


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.fail = False  # set by a test: raise inside this unit's forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc(x))
        if self.fail:
            raise RuntimeError("block failed")
        return x + self.out(h)


class Net(nn.Module):
    """Blocks over an embedding whose weight the head reads too (tied across units: its home
    is the root), so units bind at the root and in submodule hooks."""

    def __init__(self, d: int = 8, blocks: int = 3, vocab: int = 11) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), tgt.flatten())


def _net():
    """`(Net(), params, apply, info)` from seed 0, one unit per block."""
    torch.manual_seed(0)
    model = Net()
    return (model, *from_module(model, units=units_by_prefix(model, "blocks")))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 11, (2, 5), generator=g), torch.randint(0, 11, (2, 5), generator=g)


def _copies(apply) -> list:
    """This thread's skeleton copies (`apply`'s per-thread state)."""
    local = next(c.cell_contents for c in apply._call.__closure__ if isinstance(c.cell_contents, threading.local))
    return local.__dict__.get("copies", [])


def _hooks(skeleton: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in skeleton.modules())


def _steps(model: nn.Module, stage: int, units, steps: int, gather: str = "on_use", loss=None, during=None):
    """`steps` steps of one rank (SimMesh(1)); `during(apply, k)` runs in the rank's thread after
    step k. Returns the final params (gathered) and the losses."""
    params, apply, info = from_module(model, units=units_by_prefix(model, "blocks"))
    loss = loss or (lambda p, b: apply(p, *b))
    mesh = fzero.SimMesh(1)

    def rank():
        step = fzero.train_step(loss, gather=gather)
        state = fzero.init(params, fzero.optim.adamw(1e-2), stage=stage, mesh=mesh,
                           units=units if units is not None else info.units)
        losses = []
        for k in range(steps):
            state, metrics = step(state, _batch())
            losses.append(metrics.loss)
            if during is not None:
                during(apply, k)
        return fzero.gather(state), losses

    return mesh.run(rank)[0], apply


def _equal(a, b) -> bool:
    (pa, la), (pb, lb) = a, b
    return (pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa) and len(la) == len(lb)
            and all(torch.equal(x, y) for x, y in zip(la, lb)))


@pytest.mark.parametrize("stage", [0, 3])
def test_hooks_are_registered_once_and_the_plan_is_cached(stage):
    torch.manual_seed(0)
    model = Net()
    seen = []

    def during(apply, k):
        (skel,) = _copies(apply)
        seen.append((_hooks(skel.module), skel.plan))

    got, _ = _steps(model, stage, None, 4, during=during)
    hooks, plans = zip(*seen)
    # a pre-hook and a hook on each of the 3 blocks, from the first step on, and the root's hook that
    # keeps a reassigned buffer's value (made once by from_module, copied with the skeleton)
    assert hooks == (2 * 3 + 1,) * 4
    assert all(p is plans[0] for p in plans)  # built once
    assert {b.unit for b in plans[0].root} == {"default"} and len(plans[0].hooked) == 3
    want, _ = _steps(model, stage, None, 4, gather="eager")
    assert _equal(got, want)


def test_a_forward_that_raises_inside_a_unit_leaves_the_placeholders_and_the_next_step_works():
    model, params, apply, info = _net()
    mesh = fzero.SimMesh(1)
    failing = {"on": False}

    def loss(p, b):
        for c in _copies(apply):
            c.module.blocks[1].fail = failing["on"]
        return apply(p, *b)

    def rank():
        step = fzero.train_step(loss)
        state = fzero.init(params, fzero.optim.adamw(1e-2), stage=3, mesh=mesh, units=info.units)
        state, _ = step(state, _batch())
        failing["on"] = True
        with pytest.raises(RuntimeError, match="block failed"):
            step(state, _batch())
        (skel,) = _copies(apply)
        assert skel.call is None
        slots = [p for m in skel.module.modules() for p in m._parameters.values() if p is not None]
        assert slots and all(p.is_meta for p in slots)  # no gathered leaf left bound
        failing["on"] = False
        state, metrics = step(state, _batch())
        return fzero.gather(state), [metrics.loss]

    got = mesh.run(rank)[0]
    (want_params, want_losses), _ = _steps(model, 3, None, 2)
    assert _equal(got, (want_params, want_losses[1:]))


def test_a_root_unit_whose_read_raises_leaves_the_placeholders(monkeypatch):
    """Two units bound at the root (their home is the root module): where reading the second
    raises (here: its gather), the first, already bound, is put back too -- every slot of the
    copy holds its meta placeholder -- and the next step gives the bits of a step that never
    saw the error."""

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Parameter(torch.randn(4, 4) / 2), nn.Parameter(torch.randn(4, 4) / 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x @ self.a @ self.b).square().mean()

    torch.manual_seed(0)
    model = Root()
    params, apply, info = from_module(model, units=lambda path: path)
    mesh = fzero.SimMesh(1)
    failing = {"on": False}
    read = gathering_module.Gathering.read

    def reading(self, unit):
        if failing["on"] and unit == "b":
            raise RuntimeError("read failed")
        return read(self, unit)

    monkeypatch.setattr(gathering_module.Gathering, "read", reading)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))

    def rank(fail):
        step = fzero.train_step(lambda p, b: apply(p, b))
        state = fzero.init(params, fzero.optim.adamw(1e-2), stage=3, mesh=mesh, units=info.units)
        if fail:
            failing["on"] = True
            with pytest.raises(RuntimeError, match="read failed"):
                step(state, x)
            failing["on"] = False
            (skel,) = _copies(apply)
            assert {b.unit for b in skel.plan.root} == {"a", "b"}
            slots = [p for m in skel.module.modules() for p in m._parameters.values() if p is not None]
            assert len(slots) == 2 and all(p.is_meta for p in slots)  # "a" was bound before "b" raised
        state, metrics = step(state, x)
        return fzero.gather(state), [metrics.loss]

    assert _equal(mesh.run(rank, [(True,)])[0], mesh.run(rank, [(False,)])[0])


def test_a_state_with_other_units_rebuilds_the_plan_and_gives_the_eager_bits():
    model, params, apply, info = _net()
    coarse = lambda path: "blocks" if path.startswith("blocks.") else "rest"  # noqa: E731
    mesh = fzero.SimMesh(1)

    def rank(gather):
        step = fzero.train_step(lambda p, b: apply(p, *b), gather=gather)
        fine = fzero.init(params, fzero.optim.adamw(1e-2), stage=3, mesh=mesh, units=info.units)
        wide = fzero.init(params, fzero.optim.adamw(1e-2), stage=3, mesh=mesh, units=coarse)
        seen = []
        for _ in range(2):  # alternate: each switch rebuilds the plan for that state's map
            for which in ("fine", "wide"):
                if which == "fine":
                    fine, _ = step(fine, _batch())
                else:
                    wide, _ = step(wide, _batch())
                if gather == "on_use":
                    (skel,) = _copies(apply)
                    seen.append(({b.unit for b in skel.plan.root},
                                 {b.unit for bs in skel.plan.hooked.values() for b in bs}, _hooks(skel.module)))
        return fzero.gather(fine), fzero.gather(wide), seen

    fine, wide, seen = mesh.run(rank, [("on_use",)])[0]
    want_fine, want_wide, _ = mesh.run(rank, [("eager",)])[0]
    assert _equal((fine, []), (want_fine, [])) and _equal((wide, []), (want_wide, []))
    blocks = {"blocks.0", "blocks.1", "blocks.2"}
    # the coarse unit's home is the ModuleList, which never runs: it binds at the root. The fine
    # map's 3 blocks keep their hooks (doing nothing for the coarse map); none is registered twice
    # (7: the root's hook keeping a reassigned buffer's value besides)
    assert seen == [({"default"}, blocks, 7), ({"blocks", "rest"}, set(), 7)] * 2


def test_a_loss_that_runs_the_module_twice_runs_each_unit_once(monkeypatch):
    model, params, apply, info = _net()
    mesh = fzero.SimMesh(1)
    runs = []
    run_unit = gathering_module.run_unit
    monkeypatch.setattr(gathering_module, "run_unit", lambda program, *a: runs.append(program.name) or
                        run_unit(program, *a))

    def rank(gather):
        step = fzero.train_step(lambda p, b: apply(p, *b) + apply(p, b[0].flip(1), b[1]), gather=gather)
        state = fzero.init(params, fzero.optim.adamw(1e-2), stage=3, mesh=mesh, units=info.units)
        losses = []
        for _ in range(2):
            state, metrics = step(state, _batch())
            losses.append(metrics.loss)
        return fzero.gather(state), losses

    got = mesh.run(rank, [("on_use",)])[0]
    assert sorted(runs) == sorted(["default", "blocks.0", "blocks.1", "blocks.2"] * 2)  # once per step each
    want = mesh.run(rank, [("eager",)])[0]
    assert _equal(got, want)


def test_apply_inside_apply_binds_a_second_copy():
    model, params, apply, info = _net()
    mesh = fzero.SimMesh(1)
    results = []

    def loss(p, b):
        def inside(mod, args):  # runs while the outer call is inside block 0 (its unit bound)
            if len(results) == 1:
                results.append(apply(p, *b))

        copies = _copies(apply)
        handle = copies[0].module.blocks[0].register_forward_pre_hook(inside) if copies else None
        try:
            out = apply(p, *b)
        finally:
            if handle is not None:
                handle.remove()
        results.append(out)
        return out

    def rank():
        step = fzero.train_step(loss)
        state = fzero.init(params, fzero.optim.adamw(1e-2), stage=0, mesh=mesh, units=info.units)
        state, _ = step(state, _batch())  # builds copy 0 (no nesting yet)
        state, _ = step(state, _batch())
        return len(_copies(apply))

    assert mesh.run(rank)[0] == 2  # the inner call ran in its own copy
    first, inner, outer = results
    assert torch.equal(inner, outer)  # the same forward on the same params: the same bits


# -- eager (fzero/_src/eager.py): no dynamo frame switch where dynamo is absent, the same graph
# breaks where it is ------------------------------------------------------------------------


def test_eager_calls_the_function_directly_without_dynamo():
    seen = []

    @eager
    def f(x):
        seen.append(torch._C._dynamo.eval_frame.get_eval_frame_callback())
        return x + 1

    assert torch.equal(f(torch.zeros(2)), torch.ones(2)) and seen == [None]
    assert f.__name__ == "f" and f.__wrapped__ is not None  # a plain wrapper, not dynamo's


def test_a_compiled_function_calling_collectives_traces_none_of_fzero():
    """Every collective is one graph break, as with `torch.compiler.disable`: the graphs hold the
    user's ops only (none from fzero/_src: the mesh's bookkeeping and SimMesh's exchange run
    eager, with dynamo's callback off), and the result has the eager bits (a backend that runs
    the captured graphs as they are)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    inside = []

    @eager
    def probe(x):
        inside.append(torch._C._dynamo.eval_frame.get_eval_frame_callback())
        return x

    mesh = fzero.SimMesh(1)

    def f(x):
        y = torch.sin(x)
        z = mesh.collective("all_reduce", y, arg="sum", tag="a")
        w = mesh.solo("all_gather", probe(z * 2), tag="b")
        return torch.cos(mesh.start("all_gather", w + 1, tag="c").wait())

    x = torch.randn(4)
    torch._dynamo.reset()
    compiled = torch.compile(f, backend=backend)
    got = mesh.run(lambda: [compiled(x) for _ in range(2)])[0]
    want = mesh.run(lambda: f(x))[0]
    assert all(torch.equal(g, want) for g in got)
    sources = [n.meta.get("stack_trace") or "" for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert sources and not any("fzero/_src" in s for s in sources)
    assert {len([n for n in gm.graph.nodes if n.op == "call_function"]) for gm in graphs} == {1}  # sin | *2 | +1 | cos
    assert inside and all(c is None for c in inside)  # probe ran with dynamo's callback off
    torch._dynamo.reset()


# -- the unit Function's per-call host work (fzero/_src/unit.py) ------------------------------


@examples(60)
@given(pytrees(max_leaves=12), world_sizes(4), st.sampled_from([1, 4]))
def test_bucket_views_are_the_slices_of_each_leaf(tree, n, align):
    """`views` (one as_strided per leaf) and `split_views` (one split per bucket, then a view per
    multi-dimensional leaf) are the views slicing each leaf out gives (same storage offset, shape
    and strides, same values), also of a buffer that is itself a view at an offset."""
    layout = fzero.layout.plan(tree, n, align=align)
    for b, spec in enumerate(layout.buckets):
        bucket = unit_module.Bucket.of(layout, b)
        for flat in (torch.arange(bucket.size, dtype=torch.float32), torch.arange(bucket.size + 3.0)[3:]):
            want = [flat[o : o + math.prod(s)].view(s) for o, s in zip(bucket.offsets, bucket.shapes)]
            for got in (bucket.views(flat), bucket.split_views(flat)):
                assert len(got) == len(want) == len(spec.leaves)
                for g, w in zip(got, want):
                    assert (g.shape, g.stride(), g.storage_offset()) == (w.shape, w.stride(), w.storage_offset())
                    assert g.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() and torch.equal(g, w)


def test_probes_share_zeros_but_each_is_its_own_autograd_leaf():
    """Probe.of hands every call new tensors over zeros made once: one probe's requires_grad is
    not another's, and `autograd.grad` over two probes of one shape gives each its own gradient
    (shared tensors would get the sum)."""
    layout = fzero.layout.plan({"a": torch.zeros(3), "b": torch.zeros(2, 2)}, 1, units=lambda p: p)
    mesh = fzero.SimMesh(1)
    programs = unit_module.unit_programs(layout, mesh, get_stage(0))
    p, q = (unit_module.Probe.of(programs[0], torch.device("cpu"), locate=True) for _ in range(2))
    assert p.used is not q.used and p.used.untyped_storage().data_ptr() == q.used.untyped_storage().data_ptr()
    assert torch.equal(p.used, torch.zeros(1)) and torch.equal(p.bad, torch.zeros(1))
    assert unit_module.Probe.of(programs[0], torch.device("cpu")).bad.shape == (0,)  # unlocated: no local check
    p.used.requires_grad_()
    assert not q.used.requires_grad
    q.used.requires_grad_()
    gp, gq = torch.autograd.grad((p.used * 2 + q.used * 3).sum(), [p.used, q.used])
    assert torch.equal(gp, torch.full((1,), 2.0)) and torch.equal(gq, torch.full((1,), 3.0))


def test_zeros_first_made_under_inference_mode_serve_a_training_step():
    unit_module._SHARED_ZEROS.clear()
    with torch.inference_mode():
        made = unit_module.shared_zeros((5,), torch.device("cpu"))
    assert not made.is_inference()
    t = unit_module.shared_zeros((5,), torch.device("cpu")).detach().requires_grad_()
    (g,) = torch.autograd.grad((t * 2).sum(), [t])
    assert torch.equal(g, torch.full((5,), 2.0))
    unit_module._SHARED_ZEROS.clear()


def test_entered_names_each_bucket_storage_once():
    """`_entered` reads one leaf per bucket: the set of storages is that of every leaf's."""
    tree = {"a": torch.zeros(3), "b": torch.zeros(2, 2), "c": torch.zeros(4, dtype=torch.float64), "d": torch.zeros(0)}
    layout = fzero.layout.plan(tree, 1)
    (program,) = unit_module.unit_programs(layout, fzero.SimMesh(1), get_stage(0))
    assert len(program.buckets) == 2
    flats = [torch.zeros(b.size, dtype=b.wire.compute) for b in program.buckets]
    outs = [v for b, f in zip(program.buckets, flats) for v in b.views(f)] + [torch.zeros(())]
    want = frozenset(t.untyped_storage()._cdata for t in outs[:-1])
    assert unit_module._entered(program, outs) == want and len(want) == 2


# -- the update prepared before the agreement's read (`update.prepare`, `Optimizer.prepare_`) ------

from fzero import optim  # noqa: E402
from fzero._src import agreement as agreement_module  # noqa: E402
from fzero._src.layout import ParamGroup, Segment  # noqa: E402

PREPARED = {
    "adamw": lambda impl: optim.adamw(1e-2, impl=impl),
    "adam_amsgrad_l2": lambda impl: optim.adam(1e-2, weight_decay=0.1, amsgrad=True, maximize=True, impl=impl),
    "sgd_nesterov": lambda impl: optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.1, impl=impl),
    "sgd_plain": lambda impl: optim.sgd(0.1, impl=impl),
}


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", PREPARED)
@pytest.mark.parametrize("impl", ["single", "foreach", "fused"])
@given(used=st.lists(st.booleans(), min_size=3, max_size=3), seed=st.integers(0, 2**16))
def test_prepare_writes_nothing_and_its_launch_is_update_(device, name, impl, used, seed):
    """`prepare_(s, p, ctx)` leaves param and state as they were (a skipped step keeps them), and
    its `launch(g)` gives `update_(g, s', p', ctx)`'s bits on copies (the same kernels on the same
    views), over two steps so that step counts and momentum buffers differ by leaf. Leaves of 4
    and 8 elements at 16-byte aligned offsets, so that "fused" runs on CUDA whatever its kernel."""
    opt = PREPARED[name](impl)
    g = torch.Generator().manual_seed(seed)
    segments = (Segment(0, 0, 0, 4), Segment(1, 0, 4, 12), Segment(2, 0, 12, 16))
    param = torch.randn(16, generator=g).to(device)
    state = opt.init(param, 3)
    for t, mask in enumerate((used, [True] * 3)):
        ctx = optim.UpdateContext(t, ParamGroup(), segments, (0, 1, 2), tuple(mask), leaf_numels=(4, 8, 4))
        grad = torch.randn(16, generator=g).to(device)
        p_ref, s_ref = param.clone(), type(state)(*(x.clone() for x in state))
        want = opt.update_(grad, s_ref, p_ref, ctx)
        before = param.clone(), [x.clone() for x in state]
        launch = opt.prepare_(state, param, ctx)
        assert torch.equal(param, before[0]) and all(torch.equal(x, y) for x, y in zip(state, before[1]))
        state = launch(grad)
        assert torch.equal(param, p_ref) and all(torch.equal(x, y) for x, y in zip(state, want))


def test_a_launch_checks_the_grad_before_it_writes():
    opt = optim.adamw(1e-2)
    param = torch.randn(8)
    state = opt.init(param, 1)
    ctx = optim.UpdateContext(0, ParamGroup(), (Segment(0, 0, 0, 8),), (0,), (True,))
    launch = opt.prepare_(state, param, ctx)
    before = param.clone()
    with pytest.raises(optim.OptimizerError, match=r"grad shard is torch.float64 on cpu but param shard is "
                                                   r"torch.float32"):
        launch(torch.randn(8, dtype=torch.float64))
    assert torch.equal(param, before)


def _counting(monkeypatch, opt):
    """`opt` whose `prepare_` and `update_` note their calls, and the agreement's read noted among them."""
    calls: list[str] = []
    agree = agreement_module.agree

    def prepare_(*args):
        calls.append("prepare_")
        return opt.prepare_(*args)

    def update_(*args):
        calls.append("update_")
        return opt.update_(*args)

    def read(*args):
        calls.append("read")
        return agree(*args)

    monkeypatch.setattr(agreement_module, "agree", read)
    return opt._replace(prepare_=prepare_, update_=update_), calls


@pytest.mark.parametrize("stage", [0, 3])
def test_a_donating_step_prepares_its_update_before_the_agreements_read(stage, monkeypatch):
    """Every bucket is prepared before the read and only launched after it where every leaf was
    used; a step where a leaf got no gradient runs `update_` for each bucket instead (its
    prepared launches are dropped). The bits are the pure step's either way."""
    opt, calls = _counting(monkeypatch, optim.adamw(1e-2))
    params = {"a": torch.randn(6), "b": torch.randn(5)}
    mesh = fzero.SimMesh(1)

    def loss(p, batch):
        x, use_b = batch
        return (p["a"][:5] * x).sum() + ((p["b"] * x).square().sum() if use_b else 0)

    def run(donate, xs):
        state = fzero.init(params, opt, stage=stage, mesh=mesh, units=lambda path: path)
        step = fzero.train_step(loss, donate=donate)
        for x in xs:
            state, _ = step(state, x)
        return fzero.gather(state)

    xs = [(torch.ones(5), True), (-torch.ones(5), False)]  # the second step: b gets no gradient
    (donated,) = mesh.run(lambda: run(True, xs))
    assert calls == ["prepare_", "prepare_", "read", "prepare_", "prepare_", "read", "update_", "update_"]
    calls.clear()
    (pure,) = mesh.run(lambda: run(False, xs))
    assert calls == ["read", "read"]  # the pure step prepares nothing
    assert all(torch.equal(donated[k], pure[k]) for k in params)


def test_a_prepare_that_raises_raises_after_the_verdict(monkeypatch):
    """A schedule that fails at step 1 raises in `prepare_`; the step defers it to `update_`,
    after the verdict: a non-finite step 1 that is skipped raises nothing, and a finite one
    raises the schedule's error (as without `prepare_`)."""
    def lr(step):
        if step == 1:
            raise optim.OptimizerError("no lr at step 1")
        return 0.1

    mesh = fzero.SimMesh(1)
    params = {"a": torch.randn(4)}

    def rank_fn(x1):
        state = fzero.init(params, optim.sgd(lr), stage=0, mesh=mesh)
        step = fzero.train_step(lambda p, x: (p["a"] * x).sum(), donate=True, on_nonfinite="skip")
        state, _ = step(state, torch.ones(4))
        state, m = step(state, x1)
        return m.skipped

    assert mesh.run(lambda: rank_fn(torch.full((4,), math.nan))) == [True]
    with pytest.raises(optim.OptimizerError, match="no lr at step 1"):
        mesh.run(lambda: rank_fn(torch.ones(4)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", PREPARED)
@pytest.mark.parametrize("impl", ["single", "foreach", "fused"])
@given(seed=st.integers(0, 2**16))
def test_a_fused_launch_skips_on_its_flag_and_no_other_takes_one(device, name, impl, seed):
    """`Launch.skips` only for "fused": given `found_inf` 0, its launch gives the bits of the
    launch without one; given 1 it writes nothing (param and every state field as they were).
    "single" and "foreach" refuse a flag before they write. Over two steps, so that the second
    has momentum buffers and step counts to keep."""
    opt = PREPARED[name](impl)
    g = torch.Generator().manual_seed(seed)
    segments = (Segment(0, 0, 0, 4), Segment(1, 0, 4, 12), Segment(2, 0, 12, 16))
    ctx = optim.UpdateContext(0, ParamGroup(), segments, (0, 1, 2), (True,) * 3, leaf_numels=(4, 8, 4))
    param = torch.randn(16, generator=g).to(device)
    state = opt.init(param, 3)
    for _ in range(2):
        grad = torch.randn(16, generator=g).to(device)
        launch = opt.prepare_(state, param, ctx)
        assert launch.skips == (impl == "fused")
        before = param.clone(), [x.clone() for x in state]
        flag = torch.ones((), device=device)
        if impl != "fused":
            with pytest.raises(optim.OptimizerError, match="only torch's fused kernels"):
                launch(grad, flag)
        else:
            launch(grad, flag)
        assert torch.equal(param, before[0]) and all(torch.equal(x, y) for x, y in zip(state, before[1]))
        p_ref, s_ref = param.clone(), type(state)(*(x.clone() for x in state))
        want = opt.prepare_(s_ref, p_ref, ctx)(grad)
        state = opt.prepare_(state, param, ctx)(grad, torch.zeros((), device=device) if impl == "fused" else None)
        assert torch.equal(param, p_ref) and all(torch.equal(x, y) for x, y in zip(state, want))


def test_a_launch_whose_check_fails_is_not_launched_early_and_raises_after_the_verdict():
    """CPU "fused" at N = 2, stage 1: the shard cuts a leaf, which the launch's placement check
    refuses (`Launch.check`). Nothing is launched before the read: a NaN step is skipped and
    raises nothing; a finite one raises the check's error, as without the early launch."""
    mesh = fzero.SimMesh(2)
    params = {"a": torch.randn(6)}

    def rank_fn(x):
        state = fzero.init(params, optim.adamw(1e-2, impl="fused"), stage=1, mesh=mesh)
        state, m = fzero.train_step(lambda p, x: (p["a"] * x).sum(), donate=True, on_nonfinite="skip")(state, x)
        return m.skipped

    assert mesh.run(lambda: rank_fn(torch.full((6,), math.nan))) == [True, True]
    with pytest.raises(optim.OptimizerError, match="is cut by the shard"):
        mesh.run(lambda: rank_fn(torch.ones(6)))


_ROW_VALUES = st.sampled_from([0.0, 1.0, -2.5, 1e300, math.inf, -math.inf, math.nan])


@given(st.integers(1, 4).flatmap(lambda n: st.tuples(st.integers(0, 3), st.integers(0, 3)).flatmap(
    lambda sizes: st.tuples(st.just(sizes), st.lists(st.tuples(
        _ROW_VALUES, st.lists(st.sampled_from([0.0, 1.0]), min_size=sizes[0], max_size=sizes[0]),
        st.lists(st.sampled_from([0.0, 1.0]), min_size=sizes[1], max_size=sizes[1]), _ROW_VALUES,
        _ROW_VALUES, st.sampled_from([0.0, 1.0])), min_size=n, max_size=n)))))
def test_the_skip_flag_is_set_by_every_way_a_verdict_is_not_finite(case):
    """`skip_flag` over `agreement`'s rows `[loss, used[L], bad[B], ‖g‖², count, broken]`: 1 iff
    some rank's loss or ‖g‖² is not finite, a bucket is bad or the previous update broke (the
    count never matters), read from the device tensor the kernels read."""
    (num, nb), parts = case
    rows = [[loss, *used, *bad, sq, count, broken] for loss, used, bad, sq, count, broken in parts]
    want = any(not math.isfinite(r[0]) or not math.isfinite(r[1 + num + nb]) or any(x > 0 for x in r[1 + num : 1 + num + nb])
               or r[-1] != 0 for r in rows)
    flag = agreement_module.skip_flag(torch.tensor(rows, dtype=torch.float64), num, nb)
    assert flag.dtype == torch.float32 and flag.shape == () and flag.item() == float(want)


def _taken(calls: list[str], n: int) -> list[str] | None:
    """The notes so far, cleared (one rank: N = 1), or None (N > 1: the rank threads share them)."""
    if n != 1:
        return None
    taken = calls[:]
    calls.clear()
    return taken


def _launch_counting(monkeypatch, opt):
    """`_counting`'s notes, a launch noted "launch" (or "launch?" with a skip flag), the early
    read ("read") too."""
    opt, calls = _counting(monkeypatch, opt)
    prepare_, values = opt.prepare_, agreement_module.HostRead.values

    def counted(*args):
        launch = prepare_(*args)

        def run(grad, found_inf):
            calls.append("launch" if found_inf is None else "launch?")
            return launch.run(grad, found_inf)

        return optim.Launch(run, launch.check, launch.skips)

    def read(self):
        calls.append("read")
        return values(self)

    monkeypatch.setattr(agreement_module.HostRead, "values", read)
    return opt._replace(prepare_=counted, update_=opt.update_), calls


_ONE = torch.ones(5)
_EARLY_BATCHES = [(_ONE, _ONE), (torch.full((5,), math.nan), _ONE), (torch.full((5,), 1.5e19), _ONE), (_ONE, None),
                  (-_ONE, 2 * _ONE)]  # finite; NaN; float32 ‖g‖² overflows, exact ‖g‖² finite; b unused; finite
# 1.5e19: a shard of 3 or 5 such elements has a float32 ‖g‖² beyond 3.4e38 while g² (2.25e38) stays finite, as
# torch's CUDA AdamW kernel needs: at g = 1e20 it left exp_avg_sq and the params NaN (torch 2.11, H200), where the
# CPU kernel's exp_avg_sq was 1e37 (torch 2.13); the step then does what it does for any update that breaks params
_EARLY = ["prepare_", "prepare_", "launch?", "launch?", "read"]  # both buckets launched, flagged, then read
_EARLY_CALLS = [_EARLY, _EARLY,  # finite, then the raising NaN step (as after each step)
                _EARLY, _EARLY,  # NaN, skipped
                [*_EARLY, "update_", "update_"], _EARLY,  # overflow: flag 1, nothing written; update_ after the read
                ["prepare_", "prepare_", "read", "update_", "update_"], _EARLY,  # b unused: nothing early
                _EARLY, _EARLY]  # finite


def _early_run(mesh, stage, opt, calls, donate, precision=None):
    """`_EARLY_BATCHES` through `opt`, each step followed by a NaN step that raises: `(gathered
    params, [(loss, grad_norm, skipped)], the notes of each step and each raising step)`."""
    n, dev = mesh.world_size, mesh.device

    def loss(p, batch):
        x, y = batch
        return (p["a"][:5] * x.to(dev)).sum() + ((p["b"] * y.to(dev)).sum() if y is not None else 0)

    g = torch.Generator().manual_seed(5)
    params = {"a": torch.randn(6, generator=g).to(dev), "b": torch.randn(5, generator=g).to(dev)}
    state = fzero.init(params, opt, stage=stage, mesh=mesh, units=lambda path: path,
                       precision=precision or fzero.Precision())
    step = fzero.train_step(loss, donate=donate, on_nonfinite="skip")
    raising = fzero.train_step(loss, donate=donate)
    seen, per_step = [], []
    for batch in _EARLY_BATCHES:
        state, m = step(state, batch)
        seen.append((float(m.loss), float(m.grad_norm), m.skipped))
        per_step.append(_taken(calls, n))
        with pytest.raises(fzero.NonFiniteError, match="non-finite values"):  # leaves the state as it was
            raising(state, (_EARLY_BATCHES[1][0], _ONE))
        per_step.append(_taken(calls, n))
    return fzero.gather(state), seen, per_step


def _same_early_runs(donated, pure):
    for (got, seen, _), (want, seen_pure, _) in zip(donated, pure):
        assert repr(seen) == repr(seen_pure) and [s for _, _, s in seen] == [False, True, False, False, False]
        assert set(got) == {"a", "b"} and all(torch.equal(got[k], want[k]) for k in got)


@pytest.mark.parametrize("policy", ["fp32", "bf16"])
@pytest.mark.parametrize("stage, n", [(0, 1), (1, 1), (2, 1), (3, 1), (0, 2)])  # CPU "fused": leaves whole in the shard
def test_a_fused_donating_step_launches_its_update_before_the_read(stage, n, policy, monkeypatch):
    """With kernels that skip on a device flag ("fused") and nothing else for the verdict to decide,
    the donating step launches every bucket's update before the agreement's read, flagged: a
    finite step keeps what they wrote; a NaN step (skipped) keeps the state, as does one that
    raises; a step whose float32 ‖g‖² overflowed (flag 1: nothing written) but whose exact ‖g‖² is
    finite updates after the read through `update_`; a step where a leaf got no gradient launches
    nothing early. Every step's bits, metrics and skips are the pure step's. fp32 params, or bf16
    params with fp32 masters (the kernels update the masters)."""
    opt, calls = _launch_counting(monkeypatch, optim.adamw(1e-2, impl="fused"))
    mesh = fzero.SimMesh(n)
    precision = fzero.Precision(torch.bfloat16, torch.float32) if policy == "bf16" else None
    donated = mesh.run(lambda: _early_run(mesh, stage, opt, calls, True, precision))
    if n == 2:  # the ranks' notes interleave: count them (4 early steps and 5 raising ones, 2 buckets, 2 ranks)
        assert calls.count("launch?") == 36 and calls.count("update_") == 8, calls
        calls.clear()
    else:
        assert donated[0][2] == _EARLY_CALLS
    pure = mesh.run(lambda: _early_run(mesh, stage, opt, calls, False, precision))
    assert "launch?" not in calls and all("launch?" not in c for c in pure[0][2] if c is not None)
    _same_early_runs(donated, pure)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_donating_cuda_step_launches_its_update_before_the_read(stage, nccl_mesh, monkeypatch):
    """As above on CUDA with the default optimizer ("fused" there, element-wise: any shard), the
    read from pinned memory behind an event (`HostRead`) while the update runs."""
    opt, calls = _launch_counting(monkeypatch, optim.adamw(1e-2))
    donated = _early_run(nccl_mesh, stage, opt, calls, True)
    assert donated[2] == _EARLY_CALLS
    pure = _early_run(nccl_mesh, stage, opt, calls, False)
    assert all("launch?" not in c for c in pure[2])
    _same_early_runs([donated], [pure])


@given(rows=st.integers(1, 4).flatmap(lambda n: st.integers(0, 5).flatmap(lambda num: st.lists(
    st.lists(st.sampled_from([0.0, 1.0]), min_size=num + 4, max_size=num + 4), min_size=n, max_size=n).map(
        lambda r: (r, num)))))
def test_used_is_the_or_over_ranks_of_each_leafs_column(rows):
    """`_used`'s shortcut (every rank used every leaf) and its general path give the definition:
    leaf i is used iff some rank's column 1 + i is > 0."""
    rows, num = rows
    assert agreement_module._used(rows, num) == [any(r[1 + i] > 0 for r in rows) for i in range(num)]


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_units_apply_directly_outside_transforms_with_the_bits_of_function_apply(stage, monkeypatch):
    """Outside torch.func transforms the unit Function is applied through its C-level apply
    (`unit._DIRECT`, once per unit and step), under `engine="func"` through `Function.apply`;
    each gives the bits of a step that always takes `Function.apply`."""
    assert unit_module._DIRECT is not None  # torch 2.11 and 2.13 have the pieces
    model = Net()
    params, apply, info = from_module(model, units=units_by_prefix(model, "blocks"))
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 11, (2, 5), generator=g), torch.randint(0, 11, (2, 5), generator=g))
    mesh = fzero.SimMesh(1)
    direct = unit_module._DIRECT
    calls = []

    def run(engine):
        def rank_fn():
            state = fzero.init(params, optim.adamw(1e-2), stage=stage, mesh=mesh, units=info.units)
            step = fzero.train_step(lambda p, b: apply(p, *b), engine=engine, donate=True)
            for _ in range(2):
                state, m = step(state, batch)
            return fzero.gather(state), m.loss, len(state.layout.units)

        return mesh.run(rank_fn)[0]

    monkeypatch.setattr(unit_module, "_DIRECT", lambda *a: calls.append(1) or direct(*a))
    (*fast, units), (*fast_func, _) = run("autograd"), run("func")
    assert len(calls) == 2 * units  # the autograd engine's two steps only
    monkeypatch.setattr(unit_module, "_DIRECT", None)
    for (p1, l1), (p2, l2, _) in ((fast, run("autograd")), (fast_func, run("func"))):
        assert torch.equal(l1, l2) and all(torch.equal(p1[k], p2[k]) for k in p1)


@pytest.mark.parametrize("n, policy, hooked", [(1, "fp32", False), (1, "bf16", True), (2, "fp32", True)])
def test_stage3_frees_and_regathers_only_where_a_unit_has_gathered_storage(n, policy, hooked, monkeypatch):
    """Stage 3 installs its saved-tensor hooks (free after use, gather again in backward) only
    where some unit holds storage of its own: not at N = 1 with each held shard in its compute
    dtype (every unit reads its held tensor itself), but with a bf16 compute copy, or at N = 2."""
    made = []
    unpacking = gathering_module._Unpacking
    monkeypatch.setattr(gathering_module, "_Unpacking", lambda g: made.append(1) or unpacking(g))
    model = Net()
    params, apply, info = from_module(model, units=units_by_prefix(model, "blocks"))
    precision = fzero.Precision(torch.bfloat16, torch.float32) if policy == "bf16" else fzero.Precision()
    batch = (torch.randint(0, 11, (2, 5)), torch.randint(0, 11, (2, 5)))
    mesh = fzero.SimMesh(n)

    def rank_fn():
        state = fzero.init(params, optim.adamw(1e-2), stage=3, mesh=mesh, units=info.units, precision=precision)
        fzero.train_step(lambda p, b: apply(p, *b), donate=True)(state, batch)

    mesh.run(rank_fn)
    assert len(made) == (n if hooked else 0)


def test_an_optimizer_whose_update_is_replaced_drops_its_prepare():
    """`_replace(update_=...)` (a wrapper of the in-place update) drops `prepare_`, whose launch
    would run the old update's kernels: a donating step then runs the new `update_` and returns
    its bits. A replacement that names both keeps the given `prepare_`; other fields keep it."""
    base = optim.sgd(0.1)
    calls = []

    def doubled(g, s, p, ctx):
        calls.append(1)
        return base.update_(2 * g, s, p, ctx)

    wrapped = base._replace(update_=doubled)
    assert wrapped.prepare_ is None and base._replace(shaped=False).prepare_ is base.prepare_
    assert base._replace(update_=doubled, prepare_=base.prepare_).prepare_ is base.prepare_
    mesh = fzero.SimMesh(1)
    a = torch.randn(4)

    def rank_fn():
        state = fzero.init({"a": a}, wrapped, stage=0, mesh=mesh)
        state, _ = fzero.train_step(lambda p, x: (p["a"] * x).sum(), donate=True)(state, torch.ones(4))
        return fzero.gather(state)["a"]

    (got,) = mesh.run(rank_fn)
    assert calls == [1] and torch.equal(got, a.clone().add_(torch.full((4,), 2.0), alpha=-0.1))



def test_stage3_at_n1_with_the_optimizer_offloaded_reads_its_held_shards_without_hooks(monkeypatch):
    """With the optimizer offloaded (bf16 compute, fp32 master on the host) the step
    differentiates a stand-in of the master and each unit reads the held device shard beside
    it, already in the compute dtype: at N = 1 no unit has gathered storage, so no saved-tensor
    hooks (`step._reads_held` asks the tensor the unit reads, not the stand-in)."""
    made = []
    unpacking = gathering_module._Unpacking
    monkeypatch.setattr(gathering_module, "_Unpacking", lambda g: made.append(1) or unpacking(g))
    model = Net()
    params, apply, info = from_module(model, units=units_by_prefix(model, "blocks"))
    batch = (torch.randint(0, 11, (2, 5)), torch.randint(0, 11, (2, 5)))
    mesh = fzero.SimMesh(1)

    def rank_fn():
        state = fzero.init(params, optim.adamw(1e-2), stage=3, mesh=mesh, units=info.units,
                           precision=fzero.Precision(torch.bfloat16, torch.float32),
                           offload=fzero.Offload(optimizer="cpu"))
        fzero.train_step(lambda p, b: apply(p, *b), donate=True)(state, batch)

    mesh.run(rank_fn)
    assert made == []
