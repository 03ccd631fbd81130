"""Stages 1-3 equal stage 0 bit for bit, and stage 0 equals a serial reference, on SimMesh.

One property per world size N (1..8); each draw picks a pytree (nested dicts/lists, shapes not
divisible by N, smaller than N, 0-d, zero-size), units, parameter groups (weight-decay mask,
lr scale, frozen), an optimizer and its hyper-parameters, several steps with a different batch
per rank, tied leaves (used twice by the loss) and unused leaves (used by no rank), and one
stage s in {1, 2, 3} and one engine. It runs stage 0 and stage s and compares after every step,
with `torch.equal`:

- stage s's params, optimizer state (shards concatenated over ranks) and loss == stage 0's;
- stage 0's params == the serial reference: per-rank gradients from `torch.func.grad` on the
  plain pytree, reduced as `((g_0 * fl(1/N)) + g_1 * fl(1/N)) + ...` in rank order (the
  order SimMesh sums in), then `torch.optim` with `foreach=False`, param groups mirrored, and
  `p.grad = None` for unused and frozen leaves.

Why equality (not a tolerance) is right: proofs/stages.md.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
from fzero import optim
from fzero._src.tree import flatten_with_paths, unflatten

from fzero.testing.strategies import example_count


# -- draws ----------------------------------------------------------------------------------------

shapes = st.one_of(
    st.just(()),
    st.lists(st.integers(0, 7), min_size=1, max_size=3).map(tuple),
)


@st.composite
def problems(draw, n: int):
    num = draw(st.integers(1, 7))
    leaf_shapes = [draw(shapes) for _ in range(num)]
    # nest: leaves 0..num-1 go into a dict of lists
    tree: dict = {}
    for i, s in enumerate(leaf_shapes):
        key = f"m{i % 3}"
        tree.setdefault(key, []).append(s)
    role = [draw(st.sampled_from(["use", "use", "use", "tied", "unused"])) for _ in range(num)]
    unit_mode = draw(st.sampled_from(["one", "per-module", "per-leaf"]))
    group_mode = draw(st.sampled_from(["none", "nowd", "frozen", "both"]))
    opt_name = draw(st.sampled_from(["sgd", "sgd-momentum", "adam", "adamw", "amsgrad"]))
    lr = draw(st.sampled_from([1e-3, 3e-2, 0.1]))
    wd = draw(st.sampled_from([0.0, 0.01, 0.1]))
    steps = draw(st.integers(1, 3))
    stage = draw(st.sampled_from([1, 2, 3]))
    engine = draw(st.sampled_from(["autograd", "func"]))
    gather = draw(st.sampled_from(["eager", "on_use"]))
    seed = draw(st.integers(0, 2**16))
    return dict(tree=tree, role=role, unit_mode=unit_mode, group_mode=group_mode, opt=opt_name, lr=lr,
                wd=wd, steps=steps, stage=stage, engine=engine, gather=gather, seed=seed, n=n)


def build(pb):
    g = torch.Generator().manual_seed(pb["seed"])
    params = {k: [torch.randn(s, generator=g) for s in v] for k, v in pb["tree"].items()}
    paths, leaves, _ = flatten_with_paths(params)
    n = pb["n"]
    batches = [[torch.randn(3, generator=g) for _ in range(n)] for _ in range(pb["steps"])]
    units = {"one": None, "per-module": lambda p: p.split(".")[0], "per-leaf": lambda p: p}[pb["unit_mode"]]
    groups = []
    if pb["group_mode"] in ("nowd", "both"):
        groups.append(fzero.ParamGroup("nowd", match=lambda p: p.endswith(".0"), weight_decay=False, lr_scale=0.5))
    if pb["group_mode"] in ("frozen", "both"):
        groups.append(fzero.ParamGroup("frozen", match=lambda p: p.startswith("m2"), frozen=True))
    roles = dict(zip(paths, pb["role"]))
    return params, batches, units, tuple(groups), roles


def make_loss(roles):
    def loss_fn(params, c):
        paths, leaves, _ = flatten_with_paths(params)
        total = c[2] * 0.0
        for path, leaf in zip(paths, leaves):
            if roles[path] == "unused" or leaf.numel() == 0:
                continue
            x = leaf.reshape(-1)
            total = total + torch.tanh(x * c[0] + c[1]).square().mean()
            if roles[path] == "tied":
                total = total + (x * c[2]).sum() * 0.5
        return total
    return loss_fn


def fzero_opt(pb):
    lr, wd = pb["lr"], pb["wd"]
    return {
        "sgd": lambda: optim.sgd(lr, weight_decay=wd),
        "sgd-momentum": lambda: optim.sgd(lr, momentum=0.9, nesterov=True, weight_decay=wd),
        "adam": lambda: optim.adam(lr, weight_decay=wd),
        "adamw": lambda: optim.adamw(lr, weight_decay=wd),
        "amsgrad": lambda: optim.adamw(lr, weight_decay=wd, amsgrad=True),
    }[pb["opt"]]()


def torch_opt(pb, param_groups):
    lr, wd = pb["lr"], pb["wd"]
    cls, kw = {
        "sgd": (torch.optim.SGD, {}),
        "sgd-momentum": (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
        "adam": (torch.optim.Adam, {}),
        "adamw": (torch.optim.AdamW, {}),
        "amsgrad": (torch.optim.AdamW, {"amsgrad": True}),
    }[pb["opt"]]
    groups = [{"params": ps, "lr": lr * scale, "weight_decay": wd if decay else 0.0} for ps, scale, decay in param_groups]
    return cls(groups, lr=lr, weight_decay=wd, foreach=False, **kw)


# -- runs -----------------------------------------------------------------------------------------


def run_stage(pb, stage):
    params, batches, units, groups, roles = build(pb)
    mesh = fzero.SimMesh(pb["n"])
    opt = fzero_opt(pb)
    loss_fn = make_loss(roles)

    def rank_fn(*my_batches):
        state = fzero.init(params, opt, stage=stage, mesh=mesh, units=units, groups=groups)
        gather = "eager" if stage == 0 else pb["gather"]  # stage 0, the reference, gathers eagerly
        step = fzero.train_step(loss_fn, engine=pb["engine"], gather=gather)
        trace = []
        for c in my_batches:
            state, m = step(state, c)
            trace.append((fzero.gather(state), state.opt_state, m))
        return trace, state

    per_rank = [tuple(batches[t][r] for t in range(pb["steps"])) for r in range(pb["n"])]
    return mesh.run(rank_fn, per_rank)


def serial_reference(pb):
    """Per-rank grads, summed in rank order after * fl(1/N), then torch.optim (foreach=False)."""
    params, batches, units, groups, roles = build(pb)
    n = pb["n"]
    paths, leaves, spec = flatten_with_paths(params)
    # first match wins, except that any matching frozen group wins (fzero.ParamGroup's rule)
    group_of = [next((g for g in groups if g.frozen and g.match(p)), None)
                or next((g for g in groups if g.match(p)), fzero.ParamGroup()) for p in paths]
    tensors = [leaf.clone().requires_grad_(not grp.frozen) for leaf, grp in zip(leaves, group_of)]
    buckets: dict = {}
    for t, grp in zip(tensors, group_of):
        if not grp.frozen:
            buckets.setdefault(grp.name, ([], grp.lr_scale, grp.weight_decay))[0].append(t)
    opt = torch_opt(pb, list(buckets.values())) if buckets else None
    loss_fn = make_loss(roles)
    out = []
    for t in range(pb["steps"]):
        reduced = [None] * len(tensors)
        losses = []
        for r in range(n):
            tree = unflatten(spec, [x.detach() for x in tensors])
            g, loss = torch.func.grad_and_value(loss_fn)(tree, batches[t][r])
            losses.append(loss.item())
            g_leaves = flatten_with_paths(g)[1]
            for i, gi in enumerate(g_leaves):
                part = gi * (1.0 / n)
                reduced[i] = part.clone() if r == 0 else reduced[i] + part
        for i, (x, path) in enumerate(zip(tensors, paths)):
            used = roles[path] != "unused" and x.numel() > 0
            if x.requires_grad:
                x.grad = reduced[i] if used else None
        if opt is not None:
            opt.step()
        out.append(([x.detach().clone() for x in tensors], sum(losses) / n))
    return out


def assert_equal_leaves(a, b, what):
    la, lb = flatten_with_paths(a)[1], flatten_with_paths(b)[1]
    for i, (x, y) in enumerate(zip(la, lb)):
        assert x.dtype == y.dtype and x.shape == y.shape, f"{what}: leaf {i} {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}"
        assert torch.equal(x, y), f"{what}: leaf {i} differs: max |diff| {(x - y).abs().max().item()}"


def full_opt_state(states_per_rank, stage0_state):
    """Stage s's optimizer state per bucket, shards concatenated in rank order, "leaf" fields as is."""
    out = []
    for b, s0 in enumerate(stage0_state):
        if s0 is None:
            out.append(None)
            continue
        fields = []
        for k, field in enumerate(s0):
            parts = [st[b][k] for st in states_per_rank]
            fields.append(torch.cat(parts) if field.numel() > 0 and parts[0].shape != field.shape else parts[0])
        out.append(fields)
    return out


def check(pb):
    ref = serial_reference(pb)
    zero = run_stage(pb, 0)
    other = run_stage(pb, pb["stage"])
    n = pb["n"]
    for t in range(pb["steps"]):
        z_params, z_opt, z_m = zero[0][0][t]
        ref_leaves, ref_loss = ref[t]
        assert_equal_leaves(z_params, unflatten(flatten_with_paths(z_params)[2], ref_leaves),
                            f"stage 0 vs serial reference, step {t}")
        assert z_m.loss.item() == ref_loss or (math.isnan(ref_loss) and math.isnan(z_m.loss.item()))
        for r in range(n):
            o_params, o_opt, o_m = other[r][0][t]
            assert_equal_leaves(o_params, z_params, f"stage {pb['stage']} vs stage 0, rank {r}, step {t}")
            assert torch.equal(o_m.loss, z_m.loss) and torch.equal(o_m.grad_norm, z_m.grad_norm)
            z_params_r = zero[r][0][t][0]
            assert_equal_leaves(z_params_r, z_params, f"stage 0 rank {r} vs rank 0, step {t}")
        merged = full_opt_state([other[r][0][t][1] for r in range(n)], z_opt)
        for b, (mo, zo) in enumerate(zip(merged, z_opt)):
            if zo is None:
                assert mo is None
                continue
            for k, (x, y) in enumerate(zip(mo, zo)):
                assert torch.equal(x, y), f"optimizer state bucket {b} field {k} differs at step {t}"


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8])
def test_stages_equal_stage0_and_serial_reference(n):
    @settings(max_examples=example_count(100 if n <= 4 else 40))
    @given(problems(n))
    def prop(pb):
        check(pb)

    prop()


# -- bad steps ------------------------------------------------------------------------------------


def _nan_setup(stage, on_nonfinite):
    params = {"a": torch.ones(5), "b": torch.ones(3)}
    mesh = fzero.SimMesh(3)
    opt = optim.adamw(0.1)

    def loss_fn(p, c):
        return (p["a"] * c).sum() + p["b"].sum()

    def rank_fn(c):
        state = fzero.init(params, opt, stage=stage, mesh=mesh)
        step = fzero.train_step(loss_fn, on_nonfinite=on_nonfinite)
        new, m = step(state, c)
        return state, new, m

    batches = [torch.ones(5), torch.tensor([1.0, float("nan"), 1, 1, 1]), torch.ones(5)]
    return mesh, rank_fn, batches


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_nonfinite_gradient_raises_naming_rank_and_leaf(stage):
    mesh, rank_fn, batches = _nan_setup(stage, "raise")
    match = r"rank\(s\) \[1\] \(rank 1: non-finite local gradient in bucket\(s\) \['default/float32/default'\]\); " \
            r"the reduced gradient is non-finite in 'a'\."
    with pytest.raises(fzero.NonFiniteError, match=match):
        mesh.run(rank_fn, [(c,) for c in batches])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_nonfinite_step_skipped_leaves_state_unchanged(stage):
    mesh, rank_fn, batches = _nan_setup(stage, "skip")
    for before, after, m in mesh.run(rank_fn, [(c,) for c in batches]):
        assert m.skipped and after.step == before.step == 0
        assert all(torch.equal(x, y) for x, y in zip(before.params, after.params))
        assert after is before


def test_nonfinite_loss_on_one_rank_raises_everywhere():
    params = {"a": torch.ones(4)}
    mesh = fzero.SimMesh(2)
    opt = optim.sgd(0.1)

    def rank_fn(scale):
        state = fzero.init(params, opt, stage=3, mesh=mesh)
        step = fzero.train_step(lambda p, c: p["a"].sum() * 0 + c)
        return step(state, scale)

    with pytest.raises(fzero.NonFiniteError, match=r"rank 0: non-finite loss"):
        mesh.run(rank_fn, [(torch.tensor(float("inf")),), (torch.tensor(1.0),)])


def test_loss_error_on_one_rank_stops_every_rank():
    params = {"a": torch.ones(4)}
    mesh = fzero.SimMesh(3)
    opt = optim.sgd(0.1)

    def loss_fn(p, c):
        if c.shape != (4,):
            raise ValueError(f"batch of shape {list(c.shape)} rejected")
        return (p["a"] * c).sum()

    def rank_fn(c):
        state = fzero.init(params, opt, stage=3, mesh=mesh)
        return fzero.train_step(loss_fn)(state, c)

    with pytest.raises(ValueError, match="rejected") as info:
        mesh.run(rank_fn, [(torch.ones(4),), (torch.ones(5),), (torch.ones(4),)])
    assert any("rank 1" in note for note in info.value.__notes__)


def test_state_misuse_errors():
    """The step reads stage, mesh and optimizer from the state, so they cannot disagree; what is
    left to get wrong: a state handed to another rank (it would update another rank's elements),
    a loss that is not a 0-d float, a stage that does not exist."""
    params = {"a": torch.arange(4.0)}
    mesh, opt = fzero.SimMesh(2), optim.sgd(0.1)

    def rank_fn():
        state = fzero.init(params, opt, stage=3, mesh=mesh)
        with pytest.raises(fzero.FzeroError, match="0-d floating tensor"):
            fzero.train_step(lambda p, c: p["a"])(state, None)
        return state

    states = mesh.run(rank_fn)
    swapped = [(states[1],), (states[0],)]
    with pytest.raises(fzero.FzeroError, match=r"belongs to rank 1 of SimMesh.* runs on rank 0"):
        mesh.run(lambda s: fzero.gather(s), swapped)
    with pytest.raises(fzero.FzeroError, match=r"belongs to rank 1 of SimMesh.* runs on rank 0"):
        mesh.run(lambda s: fzero.train_step(lambda p, c: p["a"].sum())(s, None), swapped)
    with pytest.raises(fzero.ConfigError, match="stage must be 0, 1, 2 or 3"):
        mesh.run(lambda: fzero.init(params, opt, stage=4, mesh=mesh))
    with pytest.raises(fzero.ConfigError, match="gather must be one of"):
        fzero.train_step(lambda p, c: p, gather="lazy")


# -- memory: stage 2 keeps at most one unit's full gradient alive ------------------------------------


class _GradCensus(torch.utils._python_dispatch.TorchDispatchMode):
    """Peak, per thread (= SimMesh rank), of the bytes of live storages whose size is one of
    `sizes` (gradient-shaped: a unit's per-leaf gradients and its assembled flat[N * S]), created
    by aten ops on a thread while it is in `on`. Independent of fzero's bookkeeping: it sees only
    allocations, their sizes and their lifetimes (weak references)."""

    def __init__(self, sizes: set) -> None:
        super().__init__()
        from torch.multiprocessing.reductions import StorageWeakRef

        self.sizes, self._ref, self.on = sizes, StorageWeakRef, set()
        self.live: dict[int, dict] = {}
        self.peak: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import threading

        out = func(*args, **(kwargs or {}))
        me = threading.get_ident()
        if me not in self.on:
            return out
        live = {k: (r, n) for k, (r, n) in self.live.get(me, {}).items() if not r.expired()}
        ins = {a.untyped_storage()._cdata for a in args if isinstance(a, torch.Tensor) and a.device.type != "meta"}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.untyped_storage().nbytes() in self.sizes:
                st = t.untyped_storage()
                if st._cdata not in ins:  # a new storage, not a view
                    live.setdefault(st._cdata, (self._ref(st), st.nbytes()))
        self.live[me] = live
        self.peak[me] = max(self.peak.get(me, 0), sum(n for _, n in live.values()))
        return out


class _Blocks(torch.nn.Module):
    def __init__(self, k: int, d: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(k))

    def forward(self, x):  # (1, d) -> ()
        for blk in self.blocks:
            x = torch.tanh(blk(x))
        return x.square().mean()


@pytest.mark.parametrize("model_kind", ["module", "pytree"])
@pytest.mark.parametrize("engine", ["autograd", "func"])
def test_stage2_holds_at_most_one_unit_of_full_gradients(engine, model_kind):
    """K blocks of Linear(d, d), one unit each, gather="on_use". Gradient-shaped storages are the
    (d, d) weight gradients (d*d*4 B), the (d,) bias gradients (d*4 B; activations are (2, d))
    and a unit's assembled flat[N * S].
    A rank's census runs from the end of its forward to the step's agreement collective.

    Stage 1 keeps every unit's full gradient until after backward: >= K units, growing with K.
    Stage 2 reduce-scatters each unit when its backward is done -- the unit's Function runs
    right after the block's backward because it was created, on use, just before the block's
    forward -- so its peak does not grow with K: the per-leaf gradients, the assembled buffer,
    its fl(1/N) copy and SimMesh's reduction accumulator, all of one unit (< 5 units).

    With gather="eager" every unit's Function is created before the loss, the autograd engine
    runs them after every later node, and stage 2 then reduces only after the whole backward
    (README, "Limits today")."""
    import threading

    n, d = 3, 16
    unit = (d * d + d) * 4
    padded = -(-(d * d + d) // n) * n * 4  # bytes of one unit's flat[N * S], fp32

    def peak(stage, k):
        torch.manual_seed(0)
        model = _Blocks(k, d)
        if model_kind == "module":  # from_module: flat-dict params, apply binds each block in a hook
            params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, "blocks"))
            units = info.units
        else:  # a nested pytree and a plain loss: placeholders swapped at first use
            params = {"blocks": [{"w": blk.weight.detach(), "b": blk.bias.detach()} for blk in model.blocks]}
            units = lambda path: ".".join(path.split(".")[:2])  # noqa: E731

            def apply(p, x):  # (2, d) -> ()
                for blk in p["blocks"]:
                    x = torch.tanh(x @ blk["w"].t() + blk["b"])
                return x.square().mean()
        census = _GradCensus({d * d * 4, d * 4, padded})

        class Probe(fzero.SimMesh):  # a rank's census runs from the end of its forward to the agreement
            def collective(self, op, x, *, arg=None, tag=None):
                if tag == "fzero.step/agree":
                    census.on.discard(threading.get_ident())
                return super().collective(op, x, arg=arg, tag=tag)

        mesh, opt = Probe(n), optim.sgd(0.1)

        def loss_fn(p, x):
            loss = apply(p, x)
            census.on.add(threading.get_ident())  # forward done: what this rank creates now is backward's
            return loss

        def rank_fn(x):
            state = fzero.init(params, opt, stage=stage, mesh=mesh, units=units)
            step = fzero.train_step(loss_fn, engine=engine, gather="on_use")
            with census:
                state, _ = step(state, x)
            return state

        mesh.run(rank_fn, [(torch.randn(2, d, generator=torch.Generator().manual_seed(r)),) for r in range(n)])
        assert len(census.peak) == n, "the census must see every rank's thread"
        return max(census.peak.values())

    for k in (6, 12):
        assert peak(1, k) >= k * unit, f"stage 1 should hold all {k} full unit gradients"
    p6, p12 = peak(2, 6), peak(2, 12)
    assert p6 == p12, f"stage 2's peak grew with K: {p6} B at K = 6, {p12} B at K = 12"
    assert p12 < 5 * unit, f"stage 2 held {p12} B of full gradients at once; one unit is {unit} B"


# -- stage 3 gathers a unit when the loss uses it -----------------------------------------------------


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


class _LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Peak of the bytes held by storages created while entered, re-read at every op (so a storage
    shrunk by `resize_(0)` counts 0 from then on). Shared by all SimMesh rank threads: the peak of
    the sum over ranks. Independent of fzero: it sees only allocations and storage sizes."""

    def __init__(self) -> None:
        super().__init__()
        from torch.multiprocessing.reductions import StorageWeakRef

        self._ref, self.live, self.peak, self.active = StorageWeakRef, {}, 0, True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.active:
            return out
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                self.live.setdefault(st._cdata, self._ref(st))  # weak: never keeps a storage alive
        self.live = {k: r for k, r in self.live.items() if not r.expired()}
        sizes = (torch.UntypedStorage._new_with_weak_ptr(r.cdata) for r in self.live.values())
        self.peak = max(self.peak, sum(st.nbytes() for st in sizes if st is not None))
        return out


def test_gather_on_use_releases_each_unit_after_use_and_regathers_in_backward():
    """Stage 3, engine="autograd", gather="on_use": a block's gathered parameters are freed after
    its forward and gathered again when backward reaches it. The census covers the forward (it
    stops at the first reduce-scatter, the start of backward): eager gathering holds all K units'
    parameters there, on-use gathering about one. The numbers stay the same bits, and the step
    moves one more all-gather per released unit that backward reads (up to 3Ψ instead of 2Ψ)."""
    k, n, d = 6, 2, 64

    class Blocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(k))

        def forward(self, x):  # (1, d)
            for blk in self.blocks:
                x = torch.tanh(blk(x))
            return x.square().mean()

    torch.manual_seed(0)
    model = Blocks()
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, "blocks"))
    opt = optim.sgd(0.1)
    unit_bytes = (d * d + d) * 4  # one block's gathered flat[N * S] (N divides d*d + d)
    census = None

    class StopAtBackward(fzero.SimMesh):
        def collective(self, op, x, *, arg=None, tag=None):
            if op == "reduce_scatter":
                census.active = False
            return super().collective(op, x, arg=arg, tag=tag)

    def run(gather):
        nonlocal census
        mesh, census = StopAtBackward(n), _LiveBytes()

        def rank_fn(x):
            state = fzero.init(params, opt, stage=3, mesh=mesh, units=info.units)
            step = fzero.train_step(lambda p, x: apply(p, x), gather=gather)
            with census, mesh.record() as log:
                state, m = step(state, x)
            gathers = sum(1 for r in log if r.op == "all_gather" and r.rank == mesh.rank and r.tag.startswith("blocks"))
            return fzero.gather(state), m.loss, gathers

        out = mesh.run(rank_fn, [(torch.randn(1, d, generator=torch.Generator().manual_seed(r)),) for r in range(n)])
        return out, census.peak

    (eager, peak_eager), (lazy, peak_lazy) = run("eager"), run("on_use")
    for (pe, le, ge), (pl, ll, gl) in zip(eager, lazy):
        assert torch.equal(le, ll) and all(torch.equal(pe[name], pl[name]) for name in pe)
        # forward gathers every block; backward re-gathers a block only when it reads a tensor saved
        # from the block's storage: every block but the first, whose input needs no gradient, so
        # its weight is not saved
        assert ge == k and gl == 2 * k - 1
    print(f"forward peak: eager {peak_eager} B, on_use {peak_lazy} B, one unit {unit_bytes} B")
    assert peak_eager >= n * k * unit_bytes  # non-vacuous: eager holds every rank's K gathered units
    assert peak_eager - peak_lazy >= n * (k - 2) * unit_bytes, (peak_eager, peak_lazy, unit_bytes)


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


# -- review fixes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("gather", ["eager", "on_use"])
def test_leaf_used_by_some_ranks_only_is_reduced_on_every_rank(gather):
    """DDP with find_unused_parameters: a leaf used on rank 0 only still gets rank 1's zero
    contribution and is updated. In stages 2-3 the unit's reduce-scatter runs in its backward,
    which every rank now runs (the unit's anchor), so all stages agree. With gather="on_use" a
    unit only rank 0 reads is gathered (stage 3) and reduced only there: every rank must read the
    same units in the same order, and otherwise every rank stops with CollectiveMismatch."""
    if gather == "on_use":
        mesh, opt = fzero.SimMesh(2), optim.sgd(0.1)

        def fails(r):
            state = fzero.init({"a": torch.ones(4), "b": torch.ones(4)}, opt, stage=3, mesh=mesh, units=lambda p: p)
            loss = lambda p, r: p["a"].sum() + (p["b"].sum() if r == 0 else 0)  # noqa: E731
            fzero.train_step(loss, gather="on_use")(state, r)

        with pytest.raises(fzero.CollectiveMismatch, match="tag='b/float32/default'"):
            mesh.run(fails, [(0,), (1,)])
        return
    params = {"a": torch.ones(4), "b": torch.ones(4)}
    finals = {}
    for stage in range(4):
        mesh, opt = fzero.SimMesh(3), optim.adamw(0.1)

        def rank_fn(r):
            state = fzero.init(params, opt, stage=stage, mesh=mesh, units=lambda p: p)
            loss = lambda p, r: p["a"].sum() + (p["b"].square().sum() if r == 0 else 0)  # noqa: E731
            state, _ = fzero.train_step(loss, gather=gather)(state, r)
            return fzero.gather(state)

        finals[stage] = mesh.run(rank_fn, [(r,) for r in range(3)])
    assert not torch.equal(finals[0][0]["b"], params["b"])  # updated: rank 0 used it
    for stage in (1, 2, 3):
        for r in range(3):
            assert all(torch.equal(finals[stage][r][k], finals[0][0][k]) for k in params)


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


def test_frozen_group_wins_wherever_it_stands():
    model = torch.nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    params, apply, info = fzero.from_module(model)
    nowd = fzero.ParamGroup("nowd", match=lambda p: p.endswith("bias"), weight_decay=False)
    mesh, opt = fzero.SimMesh(1), optim.sgd(0.1)

    def rank_fn():
        state = fzero.init(params, opt, stage=1, mesh=mesh, groups=[nowd, *info.groups])
        state, _ = fzero.train_step(lambda p, x: apply(p, x).sum())(state, torch.ones(1, 3))
        return fzero.gather(state)

    (final,) = mesh.run(rank_fn)
    assert torch.equal(final["bias"], params["bias"]) and not torch.equal(final["weight"], params["weight"])


def test_init_rejects_other_shape_same_numel_and_one_tensor_twice():
    mesh, opt = fzero.SimMesh(2), optim.sgd(0.1)
    with pytest.raises(fzero.LayoutError, match=r"at leaf 'w'.*same count, other shape or dtype"):
        mesh.run(lambda shape: fzero.init({"w": torch.ones(shape)}, opt, stage=3, mesh=mesh), [((2, 3),), ((3, 2),)])
    w = torch.ones(3)
    with pytest.raises(fzero.LayoutError, match="'a' and 'b' are the same tensor"):
        mesh.run(lambda: fzero.init({"a": w, "b": w}, opt, stage=0, mesh=mesh))


def test_units_of_different_dtypes_all_stages_agree():
    """bf16, fp32 and fp64 units in one model (each unit's anchor is fp32, whatever its dtype)."""
    params = {"a": torch.ones(4, dtype=torch.bfloat16), "b": torch.ones(3), "c": torch.ones(2, dtype=torch.float64)}
    finals = []
    for stage in range(4):
        mesh, opt = fzero.SimMesh(2), optim.adamw(0.1)

        def rank_fn(x):
            state = fzero.init(params, opt, stage=stage, mesh=mesh, units=lambda p: p)
            loss = lambda p, x: (p["a"].float() * x).sum() + p["b"].sum() + p["c"].sum().float()  # noqa: E731
            state, _ = fzero.train_step(loss)(state, x)
            return fzero.gather(state)

        finals.append(mesh.run(rank_fn, [(torch.full((4,), 1.0 + r),) for r in range(2)])[0])
    for final in finals:
        assert {k: v.dtype for k, v in final.items()} == {k: v.dtype for k, v in params.items()}
        assert all(torch.equal(final[k], finals[0][k]) for k in params)
    assert not torch.equal(finals[0]["a"], params["a"])
