r"""Writing a new fzero optimizer: Signum (sign-SGD with momentum) as a pure (init, update, spec).

    m <- beta * m + (1 - beta) * g          per element, "shard" state m[S]
    p <- p - lr * sign(m)                   only on used leaves, never on padding

The recipe: state is a NamedTuple of tensors; `spec` names each field "shard" ([S], sharded like
the params) or "leaf" ([len(ctx.leaves)], replicated); `update` clones what it changes and
applies torch ops to the runs of segments whose leaves got a gradient (`fzero.optim.runs`);
`lr=` hands the schedule to the step, which compares its value across ranks each step.

What `update` sees is one flat 1-d piece per bucket, never a leaf: at stage 0 the whole bucket
(every leaf whole, padding at its end), at stages 1-3 this rank's shard, which may cut a leaf
between ranks (`ctx.segments` say which leaf elements sit where). An update that needs a whole
leaf (Muon's orthogonalisation, Shampoo, a per-leaf norm) gets it from
`fzero.optim.whole_leaves(ctx, grad)`, which every rank calls; a per-leaf statistic is a sum of
per-leaf partial sums through `ctx.leaf_sum` (lamb). Computed from the piece, such an update is
silently wrong at stages 1-3
(`tests/test_optimizer_protocol.py::test_whole_leaves_gives_a_muon_like_update_the_full_leaf_bit_for_bit`).
A float sum of partial sums rounds by where the shards cut a leaf, so stages 1-3 keep stage 0's
bits only where the sum is exact: `fzero.optim.leaf_sums_of_squares(ctx, x)` gives each leaf's
sum of squares exactly, whatever the cuts (lamb's norms,
`tests/test_optimizer_protocol.py::test_leaf_sums_of_squares_are_exact_wherever_the_shards_cut`).
Keep everything the
optimizer carries in the state NamedTuple, a step count too (a "leaf" field, one entry per leaf,
not a 0-d tensor): a closure or an attribute is neither checkpointed nor per rank, and `update`
runs once per bucket and rank, not once per step. A "leaf" field is replicated: every rank must
write every entry alike, the entries of leaves its shard does not touch too (a checkpoint keeps
rank 0's copy, and nothing compares the ranks'): make each entry from a collective
(`ctx.leaf_sum`, `leaf_sums_of_squares`), not from `whole_leaves`, which returns only the
leaves this rank touches. Return tensors of the input's shapes, dtypes
and device, and the input's NamedTuple class: fzero checks the fields' shapes at `fzero.init`
and every update's result, raising `OptimizerError` naming the bucket and the field. A pure
`update` must not write its inputs: fzero reads their version counters and refuses a write
(the state is then lost), but a write through `.data` moves no counter and goes unseen. Leave
the padding after the last segment as it is (zeros): a NaN written there stops the step with
`OptimizerError`.

The example checks the shard-wise optimizer against the same rule applied leaf by leaf, on
N = 3 ranks' shards of a small pytree, one leaf unused.

Run:  python examples/custom_optimizer.py
"""

import argparse
from typing import NamedTuple

import torch

import fzero.optim as fo
from fzero import layout as L


class SignumState(NamedTuple):
    momentum: torch.Tensor  # m[S]


def signum(lr=1e-3, beta: float = 0.9) -> fo.Optimizer:
    schedule = fo.as_schedule(lr)
    beta = fo.check_hyper("beta", beta, 0.0, 1.0, hi_open=True)

    def init(param, num_leaves):
        return SignumState(torch.zeros_like(param))

    def spec(state):
        return SignumState("shard")

    def update(grad, state, param, ctx):
        fo.check_shards("signum", grad, param, state, spec(state), ctx)  # (fzero never updates a frozen group)
        eta = fo.group_lr(schedule, ctx)  # fl(lr(step) * group.lr_scale)
        p, m = param.clone(), state.momentum.clone()
        for start, stop, used in fo.runs(ctx, ctx.used):  # runs of consecutive used / unused leaves
            if used:
                m[start:stop].mul_(beta).add_(grad[start:stop], alpha=1 - beta)
                p[start:stop].add_(torch.sign(m[start:stop]), alpha=-eta)
        return p, SignumState(m)

    # lr=: the schedule, which each train step reads at its step to compare across ranks (a
    # schedule that differs only in what fzero.init cannot describe stops the step that differs)
    return fo.Optimizer(init, update, spec, lr=schedule)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # no options; --help says so
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 5, generator=gen), "b": torch.randn(5, generator=gen), "s": torch.randn((), generator=gen)}
    grads = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
    used_leaf = {"b": True, "s": False, "w": True}  # "s" got no gradient this step
    world = 3
    layout = L.plan(params, world)  # one bucket: leaves b, s, w (flatten order), padded to 3 * S
    opt = signum(0.1)
    assert opt.lr(0) == 0.1  # the schedule the step compares across ranks
    bucket = layout.buckets[0]
    used = tuple(used_leaf[layout.leaves[i].path] for i in bucket.leaves)
    p_shards = L.shard(layout, L.pack(layout, params))[0]  # (N, S)
    g_shards = L.shard(layout, L.pack(layout, grads))[0]
    new = []
    for r in range(world):
        ctx = fo.UpdateContext(0, bucket.group, layout.segments(0, r), bucket.leaves, used)
        p, _ = opt.update(g_shards[r], opt.init(p_shards[r], len(bucket.leaves)), p_shards[r], ctx)
        new.append(p)
    out = L.unpack(layout, L.unshard(layout, [torch.stack(new)]))
    for k, v in params.items():  # the same rule leaf by leaf
        want = v - 0.1 * torch.sign(0.1 * grads[k]) if used_leaf[k] else v
        assert torch.equal(out[k], want.float()), k
        print(f"{k:2s} {tuple(v.shape)!s:8s} used={used_leaf[k]!s:5s} max |dp| = {(out[k] - v).abs().max().item():.3f}")
    print("signum on 3 shards == signum leaf by leaf")


if __name__ == "__main__":
    main()
