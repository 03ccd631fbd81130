"""Gathering on use (`fzero._src.gathering`): when a step gathers its units, and what it frees.

On SimMesh, stage 3, from the collectives `mesh.record()` logs:

- with `gather="on_use"` each unit is gathered when the loss first uses it -- for `from_module`
  params when its block runs, for other pytrees at the first torch function that touches one
  of its placeholder leaves -- so the gathers follow use order, where `gather="eager"` follows
  declaration order; the results are the same bits (proofs/stages.md §1, step 1);
- a unit the loss never reads is never gathered (nor updated, as torch.optim skips `grad None`);
- a weight tied across two blocks (bound at the root) gives eager's results;
- nothing of a step outlives it (no reference cycle keeps its params mapping alive).

What on-use gathering does to memory (the release after forward, stage 2's per-unit reduction)
is tests/test_memory.py; a unit some ranks read and others do not, tests/test_stages.py.
"""

from __future__ import annotations

import pytest
import torch

import fzero
from fzero import optim


class _Reversed(torch.nn.Module):
    """Blocks declared 0..K-1 but run K-1..0: eager gathers in declaration order, on_use in use order."""

    def __init__(self, k: int = 4, d: int = 6) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(k))
        self.head = torch.nn.Linear(d, 3)

    def forward(self, x):  # (B, d) -> (B, 3)
        for blk in reversed(self.blocks):
            x = torch.tanh(blk(x))
        return self.head(x)


@pytest.mark.parametrize("engine", ["autograd", "func"])
def test_gather_on_use_gathers_each_unit_when_its_block_runs(engine):
    torch.manual_seed(0)
    model = _Reversed()
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, "blocks"))
    opt = optim.adamw(1e-2, weight_decay=0.1)
    mesh = fzero.SimMesh(3)

    def loss_fn(p, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(apply(p, x), y)

    def run(gather):
        def rank_fn(batch):
            state = fzero.init(params, opt, stage=3, mesh=mesh, units=info.units, groups=info.groups)
            step = fzero.train_step(loss_fn, engine=engine, gather=gather)
            with mesh.record() as log:
                for _ in range(3):
                    state, m = step(state, batch)
            order = [r.tag.split("/")[0] for r in log if r.op == "all_gather" and r.rank == mesh.rank]
            return fzero.gather(state), order[:5], m.loss

        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(3)]
        return mesh.run(rank_fn, [(b,) for b in batches])

    eager, on_use = run("eager"), run("on_use")
    assert eager[0][1] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "default"]
    assert on_use[0][1] == ["blocks.3", "blocks.2", "blocks.1", "blocks.0", "default"]  # use order (head last)
    for (pe, _, le), (po, _, lo) in zip(eager, on_use):
        assert torch.equal(le, lo)
        assert all(torch.equal(pe[k], po[k]) for k in pe)


def test_gather_on_use_never_gathers_a_unit_the_loss_does_not_read():
    params = {"a": torch.ones(5), "b": torch.ones(7), "c": torch.ones(3)}
    mesh, opt = fzero.SimMesh(2), optim.sgd(0.1)

    def rank_fn(c):
        state = fzero.init(params, opt, stage=3, mesh=mesh, units=lambda p: p)
        step = fzero.train_step(lambda p, x: (p["c"] * x).sum() + p["a"].sum(), gather="on_use")
        with mesh.record() as log:
            state, _ = step(state, c)
        return fzero.gather(state), [r.tag for r in log if r.op == "all_gather" and r.rank == mesh.rank]

    for full, tags in mesh.run(rank_fn, [(torch.full((3,), 2.0),), (torch.full((3,), 4.0),)]):
        assert tags == ["c/float32/default", "a/float32/default", "fzero.step/agree"]
        assert torch.equal(full["b"], params["b"])  # unused by every rank: skipped, as torch.optim skips None
        assert torch.equal(full["c"], torch.full((3,), 1 - 0.1 * 3.0))


def test_gather_on_use_on_nested_params_gathers_at_first_use():
    """Params that are not a flat dict get shape-correct placeholders; the first torch function
    that touches one gathers its unit. The blocks run in reverse, so the gathers do too."""
    params = {"blocks": [{"w": torch.full((3, 3), 0.1 * i), "b": torch.zeros(3)} for i in range(4)]}
    mesh, opt = fzero.SimMesh(2), optim.sgd(0.1)

    def loss_fn(p, x):  # (B, 3)
        for blk in reversed(p["blocks"]):
            x = torch.tanh(x @ blk["w"] + blk["b"])
        return x.square().mean()

    def run(gather):
        def rank_fn(x):
            state = fzero.init(params, opt, stage=3, mesh=mesh, units=lambda p: ".".join(p.split(".")[:2]))
            step = fzero.train_step(loss_fn, gather=gather)
            with mesh.record() as log:
                state, _ = step(state, x)
            return fzero.gather(state), [r.tag.split("/")[0] for r in log if r.op == "all_gather" and r.rank == mesh.rank]

        return mesh.run(rank_fn, [(torch.randn(2, 3, generator=torch.Generator().manual_seed(r)),) for r in range(2)])

    eager, on_use = run("eager"), run("on_use")
    assert eager[0][1][:4] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert on_use[0][1][:4] == ["blocks.3", "blocks.2", "blocks.1", "blocks.0"]
    fzero.testing.assert_trees_equal(eager[0][0], on_use[0][0])


def test_gather_on_use_frees_everything_after_the_step():
    """The release callbacks, the LazyParams and the autograd graph reference each other partly
    through C++ (invisible to Python's GC): the step must break that cycle, or every step would
    leak its gathered storages."""
    import gc
    import weakref

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, ""))
    mesh, opt, seen = fzero.SimMesh(2), optim.sgd(0.1), []

    def loss_fn(p, x):
        seen.append(weakref.ref(p))
        return apply(p, x).sum()

    def rank_fn(x):
        state = fzero.init(params, opt, stage=3, mesh=mesh, units=info.units)
        state, _ = fzero.train_step(loss_fn, gather="on_use")(state, x)
        return state

    gc.collect()
    mesh.run(rank_fn, [(torch.randn(2, 8),)] * 2)
    gc.collect()
    assert len(seen) == 2 and all(r() is None for r in seen)


def test_gather_on_use_weight_tied_across_blocks():
    """A weight shared by two blocks has its home in the ModuleList, whose forward never runs:
    it is bound at the root instead, and the results equal eager gathering."""
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.h = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
            self.h[1].weight = self.h[0].weight

        def forward(self, x):
            for blk in self.h:
                x = torch.tanh(blk(x))
            return x.sum()

    torch.manual_seed(0)
    model = Tied()
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, "h"))
    out = {}
    for gather in ("eager", "on_use"):
        mesh, opt = fzero.SimMesh(2), optim.sgd(0.1)

        def rank_fn(x):
            state = fzero.init(params, opt, stage=3, mesh=mesh, units=info.units)
            state, _ = fzero.train_step(lambda p, x: apply(p, x), gather=gather)(state, x)
            return fzero.gather(state)

        out[gather] = mesh.run(rank_fn, [(torch.randn(2, 4, generator=torch.Generator().manual_seed(r)),) for r in range(2)])
    assert all(torch.equal(out["eager"][0][k], out["on_use"][0][k]) for k in params)



class _Tripled(torch.autograd.Function):
    """The identity forward, three times the gradient backward: its gradient tells whether the
    leaf got the Function's (3 g) or none at all."""

    @staticmethod
    def forward(x):
        return x * 1.0

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g * 3.0


_W = torch.full((3, 3), 0.5)


class _ClosureRead(torch.autograd.Function):
    """A forward that reads a tensor that is no input of the Function: no gradient reaches it
    through the Function, whatever it is."""

    @staticmethod
    def forward(x, holder):
        return x @ holder["w"]

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g, None


class _Vmapped(_Tripled):
    """`_Tripled` whose forward reads its input inside `torch.vmap`."""

    @staticmethod
    def forward(x):
        return torch.vmap(lambda row: row * 1.0)(x)


class _Inference(_Tripled):
    """`_Tripled` whose forward reads its input under `torch.inference_mode()`."""

    @staticmethod
    def forward(x):
        with torch.inference_mode():
            return (x * 1.0).clone()


class _ListArg(_ClosureRead):
    """A tensor inside a list argument is no input of the Function to autograd either."""

    @staticmethod
    def forward(x, ws):
        return x @ ws[0][:, :1].T.expand(3, 3)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_custom_function_given_an_on_use_placeholder_in_grad_mode_raises(stage):
    """Before: with nested params and `gather="on_use"`, `Fn.apply(p["a"]["w"])` -- which does not
    go through torch's function dispatch, so `FirstUse` never swapped the placeholder -- built the
    Function on the placeholder: the forward's values were right (its ops swapped it), but `a.w`
    got no gradient through it and the step updated it without that path, silently. Now each
    placeholder views a 0-d root that requires grad, which the step differentiates too: a root
    that gets a gradient raises `ConfigError` naming the leaf, on every rank, before anything is
    updated -- also where the Function's forward reads it under `inference_mode` (under `vmap`
    its op raises: `Placeholder`), and for a frozen leaf (its backward may read what it saved: the placeholder's zeros). Where no
    gradient is asked of the placeholder -- a Function applied under `torch.no_grad()`, to a list
    holding it, or reading it from a closure, and `fzero.evaluate` -- it gives eager's bits, as
    do a view made by torch (`w.view_as(w)`) and the func engine (whose Function call goes through
    the dispatch)."""
    params = {"a": {"w": torch.full((3, 3), 0.1), "b": torch.zeros(3)}, "h": {"w": torch.full((3, 2), 0.2)}}
    mesh, opt = fzero.SimMesh(2), optim.sgd(0.1)
    batches = [(torch.randn(4, 3, generator=torch.Generator().manual_seed(r)),) for r in range(2)]
    holder: dict = {}

    def head(p, x, w):  # (B, 3) -> 0-d
        return (torch.tanh(x @ w + p["a"]["b"]) @ p["h"]["w"]).square().mean()

    def no_grad_apply(p, x):  # a statistic through the Function, then the leaf itself
        with torch.no_grad():
            s = _Tripled.apply(p["a"]["w"]).abs().sum()
        return head(p, x, p["a"]["w"]) * s

    losses = {
        "apply": lambda p, x: head(p, x, _Tripled.apply(p["a"]["w"])),
        "vmap inside": lambda p, x: head(p, x, _Vmapped.apply(p["a"]["w"])),
        "inference inside": lambda p, x: head(p, x, _Inference.apply(p["a"]["w"])),
        "view": lambda p, x: head(p, x, _Tripled.apply(p["a"]["w"].view_as(p["a"]["w"]))),
        "closure": lambda p, x: head(p, _ClosureRead.apply(x, holder.update(w=p["h"]["w"][:, :1].T.expand(3, 3))
                                                           or holder), p["a"]["w"]),
        "list": lambda p, x: head(p, _ListArg.apply(x, [p["h"]["w"]]), p["a"]["w"]),
        "no_grad": no_grad_apply,
    }

    def run(name, gather, engine="autograd", groups=()):
        def rank_fn(x):
            state = fzero.init(params, opt, stage=stage, mesh=mesh, units=lambda path: path.split(".")[0],
                               groups=groups)
            return fzero.gather(fzero.train_step(losses[name], gather=gather, engine=engine)(state, x)[0])

        return mesh.run(rank_fn, batches)

    frozen = (fzero.ParamGroup("frozen", match=lambda path: path == "a.w", frozen=True),)
    for name, groups in (("apply", ()), ("inference inside", ()), ("apply", frozen)):
        with pytest.raises(fzero.ConfigError, match=r"was applied in grad mode to the placeholder of \['a.w'\].*"
                                                    r"Fn.apply\(w.view_as\(w\)\).*Nothing was updated"):
            run(name, "on_use", groups=groups)
    with pytest.raises(fzero.ConfigError, match=r"aten.mul.Tensor received a placeholder leaf.*forward under vmap"):
        run("vmap inside", "on_use")  # vmap wraps the placeholder past the swap: its op raises (`Placeholder`)
    eager = run("apply", "eager")
    losses["plain"] = lambda p, x: head(p, x, p["a"]["w"])
    assert not torch.equal(eager[0]["a"]["w"], run("plain", "eager")[0]["a"]["w"])  # the Function's 3 g reached a.w
    for got in (run("view", "on_use"), run("apply", "on_use", "func")):
        for g, e in zip(got, eager):
            fzero.testing.assert_trees_equal(g, e)
    for name in ("closure", "list", "no_grad"):
        for g, e in zip(run(name, "on_use"), run(name, "eager")):
            fzero.testing.assert_trees_equal(g, e)

    def evaluated(gather):
        def rank_fn(x):
            state = fzero.init(params, opt, stage=stage, mesh=mesh, units=lambda path: path.split(".")[0])
            return fzero.evaluate(losses["apply"], gather=gather)(state, x)

        return mesh.run(rank_fn, batches)

    assert all(torch.equal(a, b) for a, b in zip(evaluated("on_use"), evaluated("eager")))


class _SavesOnly(torch.autograd.Function):
    """`x * 2`, whose backward scales by `1 + w.sum()` of a `w` it saved and returns no gradient
    for: its backward reads `w` after the loss returned."""

    @staticmethod
    def forward(x, w):
        return x * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        return g * (1 + w.sum()), None


def test_a_placeholder_read_where_the_swap_does_not_reach_raises():
    """Outside the loss call nothing swaps an on-use placeholder for the gathered leaf, and it
    holds zeros: a custom Function's backward reading a placeholder it saved (and gave no
    gradient), a `torch.utils.checkpoint` recompute reading one from a closure, code that kept one
    past the step. Before, each read the zeros silently (found in review: gradient norms 2.30
    against eager's 4.12, and a checkpointed closure's loss off by 1e-3); now the placeholder is a
    tensor subclass whose torch functions raise `ConfigError` there, while eager gives the bits
    it always gave, and its repr still prints."""
    import torch.utils.checkpoint as checkpoint

    params = {"a": {"w": torch.full((3, 3), 0.1), "b": torch.zeros(3)}, "h": {"w": torch.full((3, 2), 0.2)}}
    mesh, kept = fzero.SimMesh(1), []

    def head(p, x, w):
        return (torch.tanh(x @ w + p["a"]["b"]) @ p["h"]["w"]).square().mean()

    def keeps(p, x):
        kept.append(p["h"]["w"])
        return head(p, x, p["a"]["w"])

    losses = {
        "saves only": lambda p, x: (torch.tanh(_SavesOnly.apply(x @ p["a"]["w"], p["a"]["w"]) + p["a"]["b"])
                                    @ p["h"]["w"]).square().mean(),
        "checkpointed closure": lambda p, x: checkpoint.checkpoint(lambda x: head(p, x, p["a"]["w"]), x,
                                                                   use_reentrant=False),
        "kept": keeps,
    }
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))

    def run(name, gather):
        def rank_fn():
            state = fzero.init(params, optim.sgd(0.1), stage=0, mesh=mesh, units=lambda path: path.split(".")[0])
            return fzero.gather(fzero.train_step(losses[name], gather=gather)(state, x)[0])

        return mesh.run(rank_fn)[0]

    for name in ("saves only", "checkpointed closure"):
        run(name, "eager")
        with pytest.raises(fzero.ConfigError, match="received a placeholder leaf where fzero's swap for the gathered "
                                                    "leaf does not reach.*w.view_as\\(w\\)"):
            run(name, "on_use")
    run("kept", "on_use")
    assert repr(kept[-1]) == "<fzero on-use placeholder of shape (3, 2)>"  # its metadata is the leaf's
    assert (kept[-1].shape, kept[-1].dtype, kept[-1].device, kept[-1].numel(), len(kept[-1])) == (
        (3, 2), torch.float32, torch.device("cpu"), 6, 3)
    with pytest.raises(fzero.ConfigError, match="torch.Tensor.sum received a placeholder leaf"):
        kept[-1].sum()
    # a torch.func transform given a placeholder as its input wraps it past the swap: its ops raise, with either
    # engine (before: they read zeros, silently); a view made by torch passes the leaf
    losses["vmap"] = lambda p, x: head(p, x, p["a"]["w"]) + torch.vmap(torch.sum)(p["a"]["w"]).sum()
    losses["vmap view"] = lambda p, x: head(p, x, p["a"]["w"]) + torch.vmap(torch.sum)(p["a"]["w"].view_as(
        p["a"]["w"])).sum()
    for engine in ("autograd", "func"):
        with pytest.raises(fzero.ConfigError, match="aten.sum.dim_IntList received a placeholder leaf.*vmap\\(f\\)\\(w\\)"):
            mesh.run(lambda: fzero.train_step(losses["vmap"], engine=engine)(fzero.init(
                params, optim.sgd(0.1), stage=0, mesh=mesh), x))
        on_use, eager = [mesh.run(lambda: fzero.gather(fzero.train_step(losses["vmap view"], gather=g, engine=engine)(
            fzero.init(params, optim.sgd(0.1), stage=0, mesh=mesh), x)[0]))[0] for g in ("on_use", "eager")]
        fzero.testing.assert_trees_equal(on_use, eager)
    # a placeholder returned as it is comes back as the leaf, as eager returns it (before: the placeholder)
    got = mesh.run(lambda: fzero.evaluate(lambda p, x: p["a"]["w"])(fzero.init(params, optim.sgd(0.1), stage=0,
                                                                              mesh=mesh), x))[0]
    assert type(got) is torch.Tensor and torch.equal(got, params["a"]["w"])


@pytest.mark.parametrize("op", ["@", "-", "/", "**"])
def test_an_operand_torch_refuses_beside_a_placeholder_is_torchs_type_error(op):
    """A reflected operator whose other operand torch refuses (`x @ w` with `x` a str: a batch
    dict unpacked as `x, y = batch` on one rank). torch's Python-level reflected operators
    (`__rmatmul__`, `__rsub__`, ...) turn the leaf's TypeError into NotImplemented, and torch then
    asked the placeholder, whose error blamed fzero's swap ("received a placeholder leaf ... use
    gather='eager'"); now the loss raises Python's TypeError naming the operand, as with eager
    gathering and as torch does without fzero (found in review)."""
    params, mesh = {"a": {"w": torch.ones(3, 3)}}, fzero.SimMesh(1)
    loss = {"@": lambda w: "x" @ w, "-": lambda w: "x" - w, "/": lambda w: "x" / w, "**": lambda w: "x" ** w}[op]
    with pytest.raises(TypeError) as plain:
        loss(torch.ones(3, 3))
    for gather in ("eager", "on_use"):
        with pytest.raises(TypeError) as info:
            mesh.run(lambda: fzero.train_step(lambda p, b: loss(p["a"]["w"]).sum(), gather=gather)(
                fzero.init(params, optim.sgd(0.1), stage=3, mesh=mesh), None))
        text = str(info.value)  # "... for ** or pow(): 'str' and ..." for **
        assert text.startswith(f"unsupported operand type(s) for {op}") and ": 'str' and '" in text, (gather, text)
    plain = str(plain.value)
    assert plain.startswith(f"unsupported operand type(s) for {op}") and "'str' and 'Tensor'" in plain, plain
