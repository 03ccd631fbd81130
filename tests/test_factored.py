"""Factored optimizer state ("rows" / "cols") and `fzero.optim.adafactor`.

- `field_shapes`: the canonical per-leaf form of each field kind;
- adafactor at stage 0 equals a per-leaf reference written here (torch tensors of the leaves'
  own shapes, the update rule of `adafactor`'s docstring), with `torch.equal`: the reference
  does the same floating-point operations in the same order, element by element; its exact sums
  are `math.fsum` of the exact float64 squares, and fzero's exact bins round the same exact sum
  correctly, so both are the same float64;
- stages 1-3 equal stage 0, bit for bit, for N in {1, 2, 3}, shards cutting leaves mid-row;
- `held_bytes` counts the factored fields as replicated.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fzero
from fzero import optim
from fzero._src.accounting import held_bytes
from fzero._src.tree import flatten_with_paths
from fzero.testing.strategies import examples
from tests.stage_harness import build, full_opt_state, make_loss, reaches_nothing

SHAPES = st.sampled_from([(), (5,), (1,), (3, 4), (2, 7), (1, 6), (5, 1), (2, 3, 4), (0, 3), (4, 0)])


@st.composite
def problems(draw):
    num = draw(st.integers(1, 5))
    tree: dict = {}
    for i in range(num):
        tree.setdefault(f"m{i % 2}", []).append(draw(SHAPES))
    role = [draw(st.sampled_from(["use", "use", "tied", "unused"])) for _ in range(num)]
    return dict(tree=tree, role=role, unit_mode=draw(st.sampled_from(["one", "per-module", "per-leaf"])),
                group_mode="none", steps=draw(st.integers(1, 3)), seed=draw(st.integers(0, 2**16)),
                n=draw(st.sampled_from([1, 2, 3])), engine=draw(st.sampled_from(["autograd", "func"])),
                hyper=dict(lr=draw(st.sampled_from([1e-2, 0.3])), weight_decay=draw(st.sampled_from([0.0, 0.1])),
                           relative_step=draw(st.booleans()), scale_parameter=draw(st.booleans()),
                           d=draw(st.sampled_from([1.0, 0.05]))))


# -- the reference: one leaf at a time ---------------------------------------------------------------


def _fsum_sq(t: torch.Tensor) -> float:
    return math.fsum(t.double().square().flatten().tolist())  # exact squares, correctly rounded sum


def ref_init(p):
    if p.dim() >= 2:
        return dict(t=0, rows=torch.zeros(p.shape[:-1]), cols=torch.zeros(p.shape[:-2] + p.shape[-1:]))
    return dict(t=0, v=torch.zeros_like(p))


def ref_update(p, g, s, lr, weight_decay, relative_step, scale_parameter, d, beta2_decay=-0.8, eps2=1e-3):
    """`adafactor`'s docstring, on the leaf `p` (written in place) with its state `s`."""
    e1 = torch.finfo(p.dtype).eps
    s["t"] += 1
    t = s["t"]
    w = t**beta2_decay
    n = max(1, p.numel())
    p_sq = _fsum_sq(p)
    if p.dim() >= 2:
        r, c = p.shape[-2:]
        sq = g.double().square()
        row_sq = [math.fsum(x) for x in sq.reshape(-1, c).tolist()]
        col_sq = [math.fsum(x) for x in sq.reshape(-1, r, c).transpose(1, 2).reshape(-1, r).tolist()]
        s["rows"].lerp_(torch.tensor([x / c for x in row_sq]).view(s["rows"].shape), w)
        s["cols"].lerp_(torch.tensor([x / r for x in col_sq]).view(s["cols"].shape), w)
        means = [max(math.fsum(x) / r, e1) for x in s["rows"].reshape(-1, r).tolist()]
        scale = torch.tensor(means).view(*p.shape[:-2], 1, 1)
        est = (s["rows"].unsqueeze(-1) * s["cols"].unsqueeze(-2)).div_(scale)  # (..., R, C)
    else:
        s["v"].lerp_(g * g, w)
        est = s["v"].clone()
    u = est.clamp_(min=e1 * e1).rsqrt_() * g
    rho = min(lr, 1 / math.sqrt(t)) if relative_step else lr
    alpha = rho * max(eps2, math.sqrt(p_sq / n)) if scale_parameter else rho
    alpha = alpha / max(1.0, math.sqrt(_fsum_sq(u) / n) / d)
    if weight_decay != 0:
        p.mul_(1 - lr * weight_decay)
    p.add_(u, alpha=-alpha)


def reference(pb):
    """Per-rank gradients reduced as `Σ_r fl(1/N) g_r` in rank order (the harness's serial
    reference), then `ref_update` per used leaf: `(leaves, states)`."""
    params, batches, _, _, roles = build(pb)
    n = pb["n"]
    paths, leaves, spec = flatten_with_paths(params)
    leaves = [x.clone() for x in leaves]
    states = [ref_init(x) for x in leaves]
    loss_fn = make_loss(roles)
    for t in range(pb["steps"]):
        reduced = [None] * len(leaves)
        for r in range(n):
            tree = optree_unflatten(spec, leaves)
            g = flatten_with_paths(torch.func.grad(loss_fn)(tree, batches[t][r]))[1]
            for i, gi in enumerate(g):
                part = gi * (1.0 / n)
                reduced[i] = part.clone() if r == 0 else reduced[i] + part
        for i, (x, path) in enumerate(zip(leaves, paths)):
            if roles[path] != "unused" and x.numel() > 0:
                ref_update(x, reduced[i], states[i], **pb["hyper"])
    return leaves, states


def optree_unflatten(spec, leaves):
    from fzero._src.tree import unflatten

    return unflatten(spec, list(leaves))


# -- fzero ------------------------------------------------------------------------------------------


def run_stage(pb, stage):
    params, batches, units, groups, roles = build(pb)
    mesh = fzero.SimMesh(pb["n"])

    def rank_fn(*mine):
        state = fzero.init(params, optim.adafactor(**pb["hyper"]), stage=stage, mesh=mesh, units=units)
        step = fzero.train_step(make_loss(roles), engine=pb["engine"])
        for c in mine:
            state, _ = step(state, c)
        return state, fzero.gather(state)

    return mesh.run(rank_fn, [tuple(batches[t][r] for t in range(pb["steps"])) for r in range(pb["n"])])


def per_leaf_state(state, opt_state):
    """Stage 0's full state -> per leaf path, `{field: tensor of the leaf's canonical shape}`
    through `field_shapes` (the mapping a checkpoint reads)."""
    layout, out = state.layout, {}
    for b, spec in enumerate(layout.buckets):
        s = opt_state[b]
        if s is None:
            continue
        shapes = [layout.leaves[i].shape for i in spec.leaves]
        kinds = optim.adafactor().spec(s)
        for field, kind, tensor in zip(s._fields, kinds, s):
            at = 0
            for k, (i, shape) in enumerate(zip(spec.leaves, optim.field_shapes(kind, shapes))):
                ls = layout.leaves[i]
                if kind == "shard":
                    block = tensor[ls.offset : ls.offset + ls.numel].view(shape)
                elif kind == "leaf":
                    block = tensor[k]
                else:
                    block = tensor[at : at + math.prod(shape)].view(shape)
                    at += math.prod(shape)
                    assert torch.equal(block, optim.leaf_blocks(kind, tensor, shapes)[k])
                out.setdefault(ls.path, {})[field] = block
            if kind in optim.FACTORED:
                assert at == tensor.numel()
                assert torch.equal(optim.join_blocks(kind, optim.leaf_blocks(kind, tensor, shapes), shapes), tensor)
    return out


@examples(50)
@given(pb=problems())
def test_adafactor_reference_and_stages(pb):
    if reaches_nothing(pb):  # a loss that reaches no trainable leaf: the step raises (tests/test_rank_agreement.py)
        with pytest.raises(fzero.ConfigError, match="no rank's loss depends on any trainable param"):
            run_stage(pb, 0)
        return
    ref_leaves, ref_states = reference(pb)
    runs = {s: run_stage(pb, s) for s in (0, 1, 2, 3)}
    s0, gathered0 = runs[0][0]
    got = flatten_with_paths(gathered0)
    by_path = per_leaf_state(s0, s0.opt_state)
    for path, x, y, rs in zip(got[0], got[1], ref_leaves, ref_states):
        assert torch.equal(x, y), f"stage 0 vs reference: {path} {list(x.shape)}: max |diff| {(x - y).abs().max()}"
        mine = by_path.get(path)
        if mine is None:  # a leaf of no bucket with state (never here: no frozen groups)
            continue
        assert mine["step"].item() == rs["t"], path
        for field in ("rows", "cols", "v"):
            if field in rs and mine[field].numel():
                assert torch.equal(mine[field], rs[field]), f"stage 0 vs reference: {path} field {field}"
    for stage in (1, 2, 3):
        states = [state for state, _ in runs[stage]]
        for r, (_, gathered) in enumerate(runs[stage]):
            for a, b in zip(flatten_with_paths(gathered)[1], got[1]):
                assert torch.equal(a, b), f"stage {stage} rank {r} params differ from stage 0"
        full = full_opt_state([s.opt_state for s in states], s0.opt_state)
        for b, (fa, fb) in enumerate(zip(full, s0.opt_state)):
            if fb is None:
                continue
            for field, x, y in zip(fb._fields, fa, fb):
                assert torch.equal(x, y), f"stage {stage}: bucket {b} field {field} differs from stage 0"
            for other in states[1:]:  # replicated fields: the same on every rank
                assert torch.equal(other.opt_state[b].rows, states[0].opt_state[b].rows)
                assert torch.equal(other.opt_state[b].cols, states[0].opt_state[b].cols)


def test_field_shapes_canonical_form():
    shapes = [(3, 4), (5,), (2, 3, 4), ()]
    assert optim.field_shapes("rows", shapes) == ((3,), (0,), (2, 3), (0,))
    assert optim.field_shapes("cols", shapes) == ((4,), (0,), (2, 4), (0,))
    assert optim.field_shapes("leaf", shapes) == ((), (), (), ())
    assert optim.field_shapes("shard", shapes) == tuple(shapes)
    assert optim.field_numel("rows", shapes) == 9 and optim.field_numel("cols", shapes) == 12
    with pytest.raises(optim.OptimizerError, match="'row'"):
        optim.field_shapes("row", shapes)
    rows = torch.arange(9.0)
    blocks = optim.leaf_blocks("rows", rows, shapes)
    assert [tuple(b.shape) for b in blocks] == [(3,), (0,), (2, 3), (0,)]
    assert torch.equal(blocks[2], torch.arange(3.0, 9.0).view(2, 3))
    assert torch.equal(optim.join_blocks("rows", blocks, shapes), rows)
    with pytest.raises(optim.OptimizerError, match="has 9 elements"):
        optim.leaf_blocks("rows", torch.zeros(8), shapes)


def test_spec_of_accepts_factored_kinds_and_names_a_bad_one():
    from fzero._src.optim.base import spec_of

    opt = optim.adafactor()
    state = opt.init(torch.zeros(12), ((3, 4),))
    assert tuple(spec_of(opt, state)) == ("leaf", "rows", "cols", "shard")
    bad = optim.Optimizer(opt.init, opt.update, lambda s: type(s)("leaf", "row", "cols", "shard"), shaped=True)
    with pytest.raises(optim.OptimizerError, match="field 'rows' is 'row'"):
        spec_of(bad, state)


def test_init_needs_shapes_and_update_needs_leaf_shapes():
    opt = optim.adafactor()
    with pytest.raises(optim.OptimizerError, match="shapes, not their count"):
        opt.init(torch.zeros(12), 1)
    from fzero._src.layout import ParamGroup, Segment

    state = optim.init_state(opt, torch.zeros(12), [(3, 4)])
    ctx = optim.UpdateContext(0, ParamGroup(), (Segment(0, 0, 12, 0),), (0,), (True,))
    with pytest.raises(optim.OptimizerError, match="ctx.leaf_shapes"):
        opt.update(torch.ones(12), state, torch.zeros(12), ctx)


@pytest.mark.parametrize("stage", [0, 3])
def test_held_bytes_count_factored_fields_as_replicated(stage):
    """rows [3] + cols [4] of a (3, 4) leaf and the step [2], float32, on every rank; v[S]
    sharded like the params."""
    mesh = fzero.SimMesh(2)
    params = {"w": torch.randn(3, 4), "b": torch.randn(5)}

    def rank_fn():
        state = fzero.init(params, optim.adafactor(), stage=stage, mesh=mesh)
        return held_bytes(state, state.optimizer), state

    for held, state in mesh.run(rank_fn):
        replicated = 4 * (3 + 4 + 2)
        assert held.optimizer_leaf == replicated
        v = state.opt_state[0].v
        assert held.optimizer_state == replicated + v.numel() * 4
        assert v.numel() == state.layout.buckets[0].shard_numel * (1 if stage else 2)
