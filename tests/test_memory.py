"""What a rank holds at peak during one step: the storages aten ops allocate, counted by
`fzero.accounting.LiveStorages` (it sees only allocations, their sizes and lifetimes, never
fzero's bookkeeping), on SimMesh.

- Stage 2 with `gather="on_use"` holds at most one unit's full gradients at once (its peak of
  gradient-shaped storages does not grow with the number of units K), where stage 1 holds all
  K units' until after backward (README, "Limits today").
- Stage 3 with `gather="on_use"` and the autograd engine frees each block's gathered parameters
  after its forward and gathers them again in backward: its forward holds about one unit where
  eager gathering holds all K, for the same bits and one more all-gather per re-gathered unit
  (the 3Ψ of proofs/communication.md).
- Full gradients, on transformer-like models of random depth and width (stages 2-3): the
  storages a rank holds of the units' per-leaf gradients and of what each unit's backward makes
  stay within the root unit's leaf gradients plus one unit's leaf gradients, its assembled
  buffer and the reduction's staging copy (proofs/stage3.md, section 7). The census identifies
  them by role, not size: autograd's own hooks on each unit's node say which storages are the
  leaves' gradients and which its backward made or returned.
- The census itself: it counts the new storages its `count` accepts, per `group`, each at its
  size at the latest op (a storage released by `resize_(0)` counts 0), and keeps every
  storage's life under a key that may be given after its birth.

Model-state bytes (what `fzero.accounting.estimate` predicts) are tests/test_accounting.py's.
"""

from __future__ import annotations

import contextlib
import math
import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fzero
from fzero import optim
from fzero.accounting import LiveStorages
from fzero.testing import examples
from fzero.testing.strategies import seed_per_case

from . import prefetch_cases as cases
from .stage_harness import PeakAtBackward


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

    Stage 1 reducing after backward (`accumulate="once"`: its default starts each unit's
    reduce-scatter in the unit's backward too, and on SimMesh that completes at once) keeps every
    unit's full gradient until after backward: >= K units, growing with K.
    Stage 2 reduce-scatters each unit when its backward is done -- the unit's Function runs
    right after the block's backward because it was created, on use, just before the block's
    forward -- so its peak does not grow with K: the per-leaf gradients, the assembled buffer,
    its fl(1/N) copy and SimMesh's reduction accumulator, all of one unit (< 5 units).

    With gather="eager" every unit's Function is created before the loss, the autograd engine
    runs them after every later node, and stage 2 then reduces only after the whole backward
    (README, "Limits today")."""
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
        sizes, on = {d * d * 4, d * 4, padded}, set()  # gradient-shaped sizes; the threads counting now
        census = LiveStorages(  # per thread (= SimMesh rank): gradient-shaped storages made while on
            count=lambda t: threading.get_ident() in on and t.untyped_storage().nbytes() in sizes,
            group=lambda t: threading.get_ident())

        class Probe(fzero.SimMesh):  # a rank's census runs from the end of its forward to the agreement
            def collective(self, op, x, **kw):
                if kw.get("tag") == "fzero.step/agree":
                    on.discard(threading.get_ident())
                return super().collective(op, x, **kw)

        mesh, opt = Probe(n), optim.sgd(0.1)

        def loss_fn(p, x):
            loss = apply(p, x)
            on.add(threading.get_ident())  # forward done: what this rank creates now is backward's
            return loss

        def rank_fn(x):
            state = fzero.init(params, opt, stage=stage, mesh=mesh, units=units)
            step = fzero.train_step(loss_fn, engine=engine, gather="on_use",
                                    accumulate="once" if stage == 1 else "each")
            with census:
                state, _ = step(state, x)
            return state

        mesh.run(rank_fn, [(torch.randn(2, d, generator=torch.Generator().manual_seed(r)),) for r in range(n)])
        assert len(census.peaks) == n, "the census must see every rank's thread"
        return max(census.peaks.values())

    for k in (6, 12):
        assert peak(1, k) >= k * unit, f"stage 1 should hold all {k} full unit gradients"
    p6, p12 = peak(2, 6), peak(2, 12)
    assert p6 == p12, f"stage 2's peak grew with K: {p6} B at K = 6, {p12} B at K = 12"
    assert p12 < 5 * unit, f"stage 2 held {p12} B of full gradients at once; one unit is {unit} B"


def test_gather_on_use_releases_each_unit_after_use_and_regathers_in_backward():
    """Stage 3, engine="autograd", gather="on_use": a block's gathered parameters are freed after
    its forward and gathered again when backward reaches it, but the forward's last, which stays
    gathered for its backward (the next thing the step runs). The census covers the forward (its
    peak is read at the first reduce-scatter, the start of backward): eager gathering holds all
    K units' parameters there, on-use gathering about one. The numbers stay the same bits, and
    the step moves one more all-gather per released unit that backward reads (up to 3Ψ instead
    of 2Ψ)."""
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

    def run(gather):
        census = LiveStorages()  # one shared census: the sum over ranks
        mesh = PeakAtBackward(n, census)  # notes the census's peak when backward starts

        def rank_fn(x):
            state = fzero.init(params, opt, stage=3, mesh=mesh, units=info.units)
            step = fzero.train_step(lambda p, x: apply(p, x), gather=gather)
            with census, mesh.record() as log:
                state, m = step(state, x)
            gathers = sum(1 for r in log if r.op == "all_gather" and r.rank == mesh.rank and r.tag.startswith("blocks"))
            return fzero.gather(state), m.loss, gathers

        out = mesh.run(rank_fn, [(torch.randn(1, d, generator=torch.Generator().manual_seed(r)),) for r in range(n)])
        return out, mesh.forward_peak

    (eager, peak_eager), (lazy, peak_lazy) = run("eager"), run("on_use")
    for (pe, le, ge), (pl, ll, gl) in zip(eager, lazy):
        assert torch.equal(le, ll) and all(torch.equal(pe[name], pl[name]) for name in pe)
        # forward gathers every block; backward re-gathers a block only when it reads a tensor saved
        # from the block's storage and the block was freed: every block but the first, whose input
        # needs no gradient, so its weight is not saved, and the last, kept from forward to backward
        assert ge == k and gl == 2 * k - 2
    print(f"forward peak: eager {peak_eager} B, on_use {peak_lazy} B, one unit {unit_bytes} B")
    assert peak_eager >= n * k * unit_bytes  # non-vacuous: eager holds every rank's K gathered units
    assert peak_eager - peak_lazy >= n * (k - 2) * unit_bytes, (peak_eager, peak_lazy, unit_bytes)


@pytest.mark.parametrize("n", [1, 2])
def test_init_holds_one_packed_bucket_at_a_time(n):
    """`fzero.init` packed every bucket at once and cloned the lot: twice the params' bytes per
    rank on top of the user's model, for a stage-3 model that barely fits (found in review). It
    now packs, keeps and drops one bucket at a time: a rank's peak during `init` is what it keeps
    (`held_bytes`, less the gradients' transient) plus one packed bucket and, at N > 1, rank 0's
    broadcast of it and the next rank's buffer of it. K equal buckets, stage 3."""
    k, d = 8, 64
    params = {f"blocks.{i}.w": torch.randn(d, d) for i in range(k)}
    bucket = d * d * 4
    mesh = fzero.SimMesh(n)
    census = LiveStorages(group=lambda t: threading.get_ident())  # per SimMesh rank

    def rank_fn():
        with census:
            state = fzero.init(params, optim.sgd(0.1), stage=3, mesh=mesh, units=lambda p: p.rsplit(".", 1)[0])
        return fzero.accounting.held_bytes(state).params, threading.get_ident()

    for kept, ident in mesh.run(rank_fn):
        assert kept == k * bucket // n
        assert census.peaks[ident] <= kept + (1 if n == 1 else 3) * bucket, (census.peaks[ident], kept, bucket)
    assert census.peak >= n * k * bucket // n  # non-vacuous: the census saw every rank's kept shards


def test_live_storages_counts_what_count_accepts_per_group_at_its_size_now():
    """The census the tests above rely on: `count` picks the storages, `group` splits `peaks`, a
    view is no new storage, and a storage counts its size at the latest op (after `resize_(0)`,
    0; once freed, nothing)."""
    census = LiveStorages(count=lambda t: t.untyped_storage().nbytes() >= 400, group=lambda t: t.dtype)
    with census:
        a = torch.zeros(100)  # 400 B: counted
        b = torch.zeros(10)  # 40 B: not counted
        c = torch.zeros(100, dtype=torch.float64)  # 800 B: counted, in another group
        v = a[:50]  # a view of a's storage: nothing new
        assert census.current == 1200 and census.peaks == {torch.float32: 400, torch.float64: 800}
        a.untyped_storage().resize_(0)
        torch.zeros(1)  # any op re-reads the sizes
        assert census.current == 800
        del c
        torch.zeros(1)
        assert census.current == 0
    assert census.peak == 1200 and census.peaks == {torch.float32: 400, torch.float64: 800}
    assert b.numel() == 10 and v.shape == (50,)


def _gradient_census(n: int, stage: int, d: int, hidden: tuple[int, ...], gather: str = "on_use"):
    """One AdamW step of `prefetch_cases.Tiny` on SimMesh(n): `(per-rank peak bytes of full-gradient
    storages, the per-rank results)`, from a `LiveStorages` history keyed `(thread, role)`.

    Roles, from autograd's hooks on the node of every unit the loss reads (`LazyParams.unit`):
    the node's pre-hook receives the unit's per-leaf gradients ("leaf"); every storage the rank
    makes while the node runs is "made" (its assembled `flat[N * S]`, the reduction's staging),
    except what the node returns, which its post-hook marks "result" (the reduced shard, the
    probes' reports). Everything else -- activations and their gradients, gathered params, the
    optimizer -- is "other". 0-d storages (the non-finite check's flags) are not counted."""
    on = threading.local()
    census = LiveStorages(count=lambda t: t.dim() > 0,
                          group=lambda t: (threading.get_ident(), "made" if getattr(on, "node", False) else "other"))
    hooked: set[int] = set()
    read = fzero.LazyParams.unit

    def pre(grad_outputs):
        for g in grad_outputs:
            if g is not None:
                census.relabel(g, (threading.get_ident(), "leaf"))
        on.node = True

    def post(grad_inputs, grad_outputs):
        on.node = False
        for g in grad_inputs:
            if g is not None:
                census.relabel(g, (threading.get_ident(), "result"))

    def hook(leaves):
        for t in leaves:
            node = t.grad_fn  # the unit's Function node
            if node is not None and id(node) not in hooked:
                hooked.add(id(node))
                node.register_prehook(pre)
                node.register_hook(post)

    def unit(self, name):  # gather="on_use": the loss reads each unit through LazyParams.unit
        leaves = read(self, name)
        hook(leaves.values())
        return leaves

    params, apply, info = cases.model(d, hidden)
    mesh = fzero.SimMesh(n)

    def loss(p, b):
        if isinstance(p, dict):  # gather="eager": every unit's leaves, already read
            hook(p.values())
        return torch.nn.functional.cross_entropy(apply(p, b[0]).flatten(0, 1), b[1].flatten())

    def rank_fn():
        state = fzero.init(params, optim.adamw(1e-2, weight_decay=0.1), stage=stage, mesh=mesh, units=info.units)
        with census:
            state, m = fzero.train_step(loss, gather=gather)(state, cases.batch(mesh.rank))
        return fzero.gather(state), [m.loss]

    with _patched(fzero.LazyParams, "unit", unit):
        out = mesh.run(rank_fn)
    peaks = census.peaks_of(lambda key: key[1] in ("leaf", "made"), key_group=lambda key: key[0])
    assert len(peaks) == n, "every rank's thread must hold gradients"
    return max(peaks.values()), out


@contextlib.contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _unit_sizes(n: int, d: int, hidden: tuple[int, ...]) -> dict[str, tuple[int, int]]:
    """`{unit: (L: bytes of its leaves' gradients, F: bytes of its assembled flat[N * S])}`, fp32."""
    params, _, info = cases.model(d, hidden)
    mesh = fzero.SimMesh(n)

    def rank_fn():
        state = fzero.init(params, optim.sgd(0.1), stage=3, mesh=mesh, units=info.units)
        layout = state.layout
        return {u: (sum(math.prod(ls.shape) * 4 for ls in layout.leaves if ls.unit == u),
                    sum(b.padded_numel * 4 for b in layout.buckets if b.unit == u)) for u in layout.units}

    return mesh.run(rank_fn)[0]


MODELS = st.tuples(st.integers(1, 5), st.sampled_from([4, 8]), st.lists(st.sampled_from([4, 8, 12, 20]),
                                                                         min_size=5, max_size=5))


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("stage", [2, 3])
def test_live_full_gradients_stay_within_the_root_unit_plus_one_unit_assembling(n, stage):
    """The live-storage oracle for gradients (proofs/stage3.md, section 7). Per rank, at any op of
    the step, the full-gradient storages (per-leaf gradients, and what a unit's backward makes
    but does not return) are at most `L_root + max_u (L_u + 2 F_u)`: the root unit's leaf
    gradients (its node runs last, so its head's and final norm's gradients wait through the
    whole backward), one unit's leaf gradients and its assembled buffer, and SimMesh's staging
    accumulator (one `flat[N * S]`, on the rank that completes the round). Independent of the
    depth. Lower bound, so the census is not vacuous: the largest block's gradients and its
    assembled buffer coexist. With gather="eager" (every node runs after the whole backward)
    every block's leaf gradients wait together: a rank holds at least their sum. Stages 2 and 3
    at N = 2 and 3, each case with its own draws (the first is hypothesis's simplest model, depth
    1; then one drawn)."""

    @seed_per_case(n, stage)
    @examples(2)
    @given(MODELS)
    def prop(model):
        depth, d, widths = model
        hidden = tuple(widths[:depth])
        sizes = _unit_sizes(n, d, hidden)
        root_l, _ = sizes["default"]
        bound = root_l + max(l + 2 * f for l, f in sizes.values())
        peak, out = _gradient_census(n, stage, d, hidden)
        blocks = [v for u, v in sizes.items() if u != "default"]
        assert peak <= bound, (peak, bound, sizes)
        assert peak >= max(l + f for l, f in blocks), (peak, sizes)
        want = fzero.SimMesh(n)
        for (pw, lw), (pg, lg) in zip(want.run(lambda: cases.train(want, 0, d, hidden, steps=1)), out):
            assert all(torch.equal(a, b) for a, b in zip(lw, lg)) and all(torch.equal(pw[k], pg[k]) for k in pw)
        eager, _ = _gradient_census(n, stage, d, hidden, gather="eager")
        assert eager >= sum(l for l, _ in blocks), (eager, sizes)

    prop()


def test_live_storages_history_counts_a_storage_under_its_final_key_for_its_whole_life():
    """`relabel` after birth moves a storage's whole life to its new key; `peaks_of` sums the
    selected keys' lives over the op counter (a death and a birth at one op: the dead one is
    gone), per `key_group`."""
    census = LiveStorages(group=lambda t: ("new", t.dtype))
    before = torch.ones(3)  # made before the census: never tracked
    with census:
        a = torch.zeros(100)  # 400 B
        b = torch.zeros(50)  # 200 B
        census.relabel(a, ("grad", torch.float32))  # its role is known later
        del a
        c = torch.zeros(25, dtype=torch.float64)  # 200 B, after a is gone
        assert census.relabel(c, ("grad", torch.float64)) and not census.relabel(before, "x")
        torch.zeros(1)
    grads = census.peaks_of(lambda key: key[0] == "grad", key_group=lambda key: key[1])
    assert grads == {torch.float32: 400, torch.float64: 200}
    assert census.peaks_of(lambda key: key[0] == "grad") == {None: 400}  # never both at once
    assert census.peaks_of(lambda key: True) == {None: 600}  # a and b
    assert b.numel() == 50 and c.numel() == 25


def test_inflight_make_room_closes_the_oldest_before_the_next_buffer_exists():
    """The unit's backward calls `make_room` before it assembles a bucket's gradient: with depth k
    at most k - 1 flights stay open then, so the new buffer and the open ones are k at most."""
    from fzero._src.mesh import Pending
    from fzero._src.stages import Flight
    from fzero._src.unit import Inflight

    waited = []

    class Seen(Pending):
        def __init__(self, k):
            super().__init__(torch.full((1,), float(k)))
            self.k = k

        def wait(self):
            waited.append(self.k)
            return super().wait()

    for depth, want in ((1, [0, 1, 2]), (2, [0, 1])):
        waited.clear()
        inflight = Inflight(depth)
        for k in range(4):
            inflight.make_room()
            assert len(inflight._flights) < depth
            inflight.add(Flight(Seen(k)))
        assert waited == want
        inflight.wait()
        assert waited == [0, 1, 2, 3]


class _OwnGradient(torch.autograd.Function):
    """`w -> w` whose backward returns the saved `w` itself as w's gradient: a gradient that shares
    storage with the unit's gathered params."""

    @staticmethod
    def forward(ctx, w):
        ctx.save_for_backward(w)
        return w.clone()

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        return w


def test_a_gradient_sharing_the_gathered_storage_releases_the_unit_after_it_is_read():
    """A unit's Function releases its gathered params when its backward starts -- unless an
    incoming gradient is (a view of) that storage, as `_OwnGradient`'s is: then only after the
    gradient is copied into the assembled buffer. Stage 3 (which frees; every unit released after
    use, as `from_module`'s `apply` does) equals stage 0 bit for bit; freeing first would read a
    freed storage."""
    g = torch.Generator().manual_seed(0)
    params = {"a.w": torch.randn(4, 4, generator=g), "b.w": torch.randn(4, 4, generator=g)}

    def loss(p, x):  # (B, 4) -> ()
        for unit in ("a", "b"):
            x = torch.tanh(x @ _OwnGradient.apply(p[f"{unit}.w"]))
            p.release(unit)
        return x.square().mean()

    def run(stage):
        mesh = fzero.SimMesh(2)

        def rank_fn(x):
            state = fzero.init(params, optim.sgd(0.1), stage=stage, mesh=mesh, units=lambda path: path[0])
            state, m = fzero.train_step(loss)(state, x)
            return fzero.gather(state), m.loss

        return mesh.run(rank_fn, [(torch.randn(3, 4, generator=torch.Generator().manual_seed(r)),) for r in range(2)])

    for (p0, l0), (p3, l3) in zip(run(0), run(3)):
        assert torch.equal(l0, l3) and all(torch.equal(p0[k], p3[k]) for k in p0)


# -- held_bytes by tier (fzero._src.accounting.TierSplit) ------------------------------------------


@pytest.mark.parametrize("where, params, ratio", [
    (None, None, 1.0), ("cpu", None, 1.0), ("cpu", None, 0.5), ("cpu", "cpu", 1.0), ("nvme", None, 1.0),
    ("nvme", "cpu", 1.0)])
def test_held_bytes_split_by_tier_from_the_layout(tmp_path, where, params, ratio):
    """Stage 3, bf16 policy, AdamW (m, v: fp32 [S]; a float32 step count per leaf), N = 2, a frozen
    bucket, S_b bucket b's shard; H: the trainable buckets with a host tier, D: the others. Each
    term from the layout, not from the tensors: params 2 S_b (bf16) for b in H, 4 S_b (fp32: the
    plain stage 3's shard is the master) for b in D and the frozen bucket, on the host with params
    offloaded, else on the device; masters 4 S_b for b in H on the host (in files for NVMe; D keeps
    none); moments 8
    S_b and step counts where the bucket's tier is (the moments in files for NVMe); gradients 4
    S_b for every trainable b on the device, and the update's copy of it for b in H on the host.
    The total is the one `held_bytes` always had; the tiers add up to it plus the host copies."""
    from fzero._src.accounting import held_bytes

    tree = {f"l{i}.w": torch.randn(6, 5) for i in range(4)}
    frozen = (fzero.ParamGroup("frozen", match=lambda p: p == "l3.w", frozen=True),)
    off = None if where is None else fzero.Offload(optimizer=where, params=params, ratio=ratio,
                                                    nvme_path=str(tmp_path) if where == "nvme" else None)
    mesh = fzero.SimMesh(2)
    opt = optim.adamw(1e-2)
    state = mesh.run(lambda: fzero.init(tree, opt, stage=3, mesh=mesh, units=lambda p: p.split(".")[0],
                                        groups=frozen, precision=fzero.Precision(torch.bfloat16), offload=off))[0]
    held = held_bytes(state, opt)
    S = {b.index: b.shard_numel for b in state.layout.buckets}
    leaves = {b.index: len(b.leaves) for b in state.layout.buckets}
    fz = [b.index for b in state.layout.buckets if b.group.frozen]
    train = [b for b in S if b not in fz]
    host = [b for b in train if state.info.host_tier(b) is not None]
    dev = [b for b in train if b not in host]
    assert len(fz) == 1 and len(host) == (0 if where is None else 2 if ratio < 1 else 3)
    params_bytes = sum(2 * S[b] for b in host) + sum(4 * S[b] for b in dev + fz)
    moments, steps = (lambda bs: sum(8 * S[b] for b in bs)), (lambda bs: sum(4 * leaves[b] for b in bs))
    d, h, f = held.tiers
    assert (d.params, h.params, f.params) == ((0, params_bytes, 0) if params else (params_bytes, 0, 0))
    masters = sum(4 * S[b] for b in host)  # on the host, or in files for NVMe
    assert (d.master, h.master, f.master) == ((0, 0, masters) if where == "nvme" else (0, masters, 0))
    assert d.optimizer_state == moments(dev) + steps(dev)
    assert h.optimizer_state == (moments(host) if where == "cpu" else 0) + steps(host)
    assert f.optimizer_state == (moments(host) if where == "nvme" else 0)
    assert (d.optimizer_leaf, h.optimizer_leaf, f.optimizer_leaf) == (steps(dev), steps(host), 0)
    assert (d.grads, h.grads, f.grads) == (held.grads, sum(4 * S[b] for b in host), 0)
    assert held.grads == sum(4 * S[b] for b in train)
    assert d.total + h.total + f.total == held.total + h.grads
    assert held_bytes(state).tiers.host.optimizer_leaf is None  # without the optimizer: not split off


def test_held_bytes_count_a_params_tensor_that_is_the_master_once():
    """Params offloaded without a narrower compute dtype (fp32 params, no policy): a trainable
    bucket's host shard is both `params[b]` and `master[b]` (one tensor). It counts once, as the
    master (4 S_b on the host), in `held_bytes` and in its tiers, as `estimate`'s host counts it;
    the frozen bucket's shard (no master) counts as params."""
    from fzero._src.accounting import held_bytes

    tree = {f"l{i}.w": torch.randn(6, 5) for i in range(3)}
    frozen = (fzero.ParamGroup("frozen", match=lambda p: p == "l2.w", frozen=True),)
    mesh = fzero.SimMesh(2)
    opt = optim.adamw(1e-2)
    state = mesh.run(lambda: fzero.init(tree, opt, stage=3, mesh=mesh, units=lambda p: p.split(".")[0],
                                        groups=frozen, offload=fzero.Offload(optimizer="cpu", params="cpu")))[0]
    S = {b.index: b.shard_numel for b in state.layout.buckets}
    fz = [b.index for b in state.layout.buckets if b.group.frozen]
    train = [b for b in S if b not in fz]
    assert len(fz) == 1 and all(state.params[b] is state.master[b] for b in train)
    held = held_bytes(state, opt)
    assert (held.params, held.master) == (sum(4 * S[b] for b in fz), sum(4 * S[b] for b in train))
    d, h, f = held.tiers
    assert (d.params, h.params, h.master) == (0, held.params, held.master)
    assert d.total + h.total + f.total == held.total + h.grads
