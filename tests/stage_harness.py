"""The stage-equivalence harness: problem draws, runs of one stage, the serial reference, asserts.

Imported by tests/test_stages.py (the property) and by any test that needs a drawn problem.

- `problems(n)`: a hypothesis strategy of problems for world size n (a dict: a pytree of leaf
  shapes, leaf roles "use" / "tied" / "unused", units, parameter groups, an optimizer and its
  hyper-parameters, steps, the stage s in {1, 2, 3}, the engine, the gather mode, a seed);
- `build(pb)`: the problem's params, per-step per-rank batches, units, groups and leaf roles;
  `make_loss(roles)`: its loss; `fzero_opt(pb)` / `torch_opt(pb, groups)`: its optimizer in
  fzero and in torch.optim (`foreach=False`);
- `run_stage(pb, stage)`: per rank, `(trace, final state)` of fzero at `stage` on SimMesh,
  `trace[t] = (gathered params, opt_state, Metrics)` after step t;
- `serial_reference(pb)`: per step, `(params leaves, mean loss)` of the serial reference:
  per-rank gradients from `torch.func.grad`, reduced as `((g_0 * fl(1/N)) + g_1 * fl(1/N)) + ...`
  in rank order, then torch.optim;
- `check(pb)`: stage 0 == the serial reference and stage s == stage 0, with `torch.equal`
  (`assert_equal_leaves`, `full_opt_state`). Why equality is right: proofs/stages.md.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import strategies as st

import fzero
from fzero import optim
from fzero._src.tree import flatten_with_paths, unflatten


# -- draws ----------------------------------------------------------------------------------------

shapes = st.one_of(
    st.just(()),
    st.lists(st.integers(0, 7), min_size=1, max_size=3).map(tuple),
)
# leaf 0 of every problem: more than one element (sides 2-7) and used, so that no problem is only
# corners (0-d, zero-size, one-element leaves) or trains nothing (that error: test_rank_agreement.py)
trained_shapes = st.lists(st.integers(2, 7), min_size=1, max_size=3).map(tuple)


@st.composite
def problems(draw, n: int):
    num = draw(st.integers(1, 7))
    leaf_shapes = [draw(trained_shapes)] + [draw(shapes) for _ in range(num - 1)]
    # nest: leaves 0..num-1 go into a dict of lists
    tree: dict = {}
    for i, s in enumerate(leaf_shapes):
        key = f"m{i % 3}"
        tree.setdefault(key, []).append(s)
    role = [draw(st.sampled_from(["use", "tied"]))] + [
        draw(st.sampled_from(["use", "use", "use", "tied", "unused"])) for _ in range(num - 1)]
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
    (pa, la, sa), (pb_, lb, sb) = flatten_with_paths(a), flatten_with_paths(b)
    assert pa == pb_ and sa == sb, f"{what}: trees differ: {pa} vs {pb_}"
    for i, (x, y) in enumerate(zip(la, lb)):
        assert x.dtype == y.dtype and x.shape == y.shape, f"{what}: leaf {i} {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}"
        assert torch.equal(x, y), f"{what}: leaf {i} differs: max |diff| {(x - y).abs().max().item()}"


def full_opt_state(states_per_rank, stage0_state):
    """Stage s's optimizer state per bucket, shards concatenated in rank order, "leaf" fields as is.
    Asserts first that every rank's state has stage 0's buckets, None where stage 0's is, and
    stage 0's fields per bucket: nothing a stage adds or drops goes uncompared."""
    out = []
    for r, st in enumerate(states_per_rank):
        assert len(st) == len(stage0_state), f"rank {r}: {len(st)} optimizer buckets, stage 0 {len(stage0_state)}"
        for b, s0 in enumerate(stage0_state):
            assert (st[b] is None) == (s0 is None), f"rank {r} bucket {b}: {st[b]!r} where stage 0 has {s0!r}"
            assert s0 is None or len(st[b]) == len(s0), f"rank {r} bucket {b}: {len(st[b])} fields, stage 0 {len(s0)}"
    for b, s0 in enumerate(stage0_state):
        if s0 is None:
            out.append(None)
            continue
        fields = []
        for k, field in enumerate(s0):
            parts = [st[b][k] for st in states_per_rank]
            if field.numel() > 0 and parts[0].shape != field.shape:
                fields.append(torch.cat(parts))
                continue
            for r, part in enumerate(parts[1:], 1):  # a field every rank holds whole: the same on each
                assert torch.equal(part, parts[0]), f"bucket {b} field {k}: rank {r}'s copy differs from rank 0's"
            fields.append(parts[0])
        out.append(fields)
    return out


def reaches_nothing(pb) -> bool:
    """Whether the problem has trainable leaves with elements but its loss reaches none of them:
    a step then raises `ConfigError` (torch's `loss.backward()` raises for such a loss)."""
    params, _, _, groups, roles = build(pb)
    paths, leaves, _ = flatten_with_paths(params)
    trainable = [p for p, x in zip(paths, leaves) if x.numel() > 0 and not any(g.frozen and g.match(p) for g in groups)]
    return bool(trainable) and all(roles[p] == "unused" for p in trainable)


def check(pb):
    if reaches_nothing(pb):
        for stage in (0, pb["stage"]):
            with pytest.raises(fzero.ConfigError, match="no rank's loss depends on any trainable param"):
                run_stage(pb, stage)
        return
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
        for b, (mo, zo) in enumerate(zip(merged, z_opt)):  # full_opt_state checked the structure
            for k, (x, y) in enumerate(zip(mo or (), zo or ())):
                assert x.dtype == y.dtype and x.shape == y.shape, f"optimizer state bucket {b} field {k} at step {t}"
                assert torch.equal(x, y), f"optimizer state bucket {b} field {k} differs at step {t}"


class PeakAtBackward(fzero.SimMesh):
    """A SimMesh that notes `census.peak` (a shared `fzero.accounting.LiveStorages`) when the first
    reduce-scatter starts: in a stage-3 step that is backward's first reduction, so
    `forward_peak` is the peak of the forward."""

    def __init__(self, world_size: int, census) -> None:
        super().__init__(world_size)
        self.census, self.forward_peak = census, None

    def collective(self, op, x, **kw):
        if op == "reduce_scatter" and self.forward_peak is None:
            self.forward_peak = self.census.peak
        return super().collective(op, x, **kw)

    def start(self, op, x, **kw):  # the step starts backward's reductions without waiting
        if op == "reduce_scatter" and self.forward_peak is None:
            self.forward_peak = self.census.peak
        return super().start(op, x, **kw)


def classifier_steps(mesh, params, units, loss, stage: int, d: int, steps: int = 2, **step_kw):
    """On one rank of `mesh`: `(gathered params, [loss per step])` after `steps` AdamW(1e-2)
    steps of `loss` at `stage`, on batches `(randn(2, 5, d), randint(0, 3, (2,)))` drawn from a
    generator seeded by the step and the rank."""
    state = fzero.init(params, optim.adamw(1e-2), stage=stage, mesh=mesh, units=units)
    step = fzero.train_step(loss, **step_kw)
    losses = []
    for t in range(steps):
        g = torch.Generator().manual_seed(10 * t + mesh.rank)
        state, m = step(state, (torch.randn(2, 5, d, generator=g), torch.randint(0, 3, (2,), generator=g)))
        losses.append(m.loss)
    return fzero.gather(state), losses
