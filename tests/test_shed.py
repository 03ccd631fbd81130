"""Shedding: an offloaded bucket's reduced gradient shard leaves the device in the backward.

With optimizer offload and one micro-batch, each offloaded bucket's reduced shard is copied to
the host as soon as its unit's backward has it (`offload.early_copies`); where nothing reads it
on the device afterwards but the agreement's norm, the norm is taken then (`norms.shard_norm`)
and the shard's memory freed (`offload.shed`), so the device holds one bucket's gradient at a
time. These tests check, on SimMesh (the CPU standing in for the device, the same code):
- every offloaded shard is shed, and its storage holds 0 bytes after the step;
- the run is bitwise the run without offload (params, loss, gradient norm), with and without a
  precision policy and clipping;
- where the shard is read again on the device (accumulation over micro-batches; a 16-bit
  gradient added in float32) nothing is shed, and the bits are the same;
- the rare paths that read gradients after the agreement read the shed shards' values (their
  host copies): a NaN raises the same `NonFiniteError`, or is skipped, as without offload, and a
  float32 norm that overflows is decided by the exact float64 path on the same values.
"""

from __future__ import annotations

import threading

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given
from torch.utils._python_dispatch import TorchDispatchMode

import fzero
from fzero import optim
from fzero._src import offload as offload_mod
from fzero._src.norms import shard_norm, shard_squares, sum_of_squares
from fzero.testing import examples

from .stage_harness import assert_equal_leaves

POLICIES = {"none": fzero.Precision(), "bf16/fp32": fzero.Precision(torch.bfloat16, torch.float32)}


class NoShedReads(TorchDispatchMode):
    """Raise at the first op that reads or writes the values of a shed tensor (a tensor of
    `numel > 0` whose storage holds fewer bytes than its first element needs): on the CPU such a
    read is a segmentation fault that kills the test process, on CUDA a silent read of freed
    memory. Ops that read no values are allowed: views, `detach`, `record_stream`, and the
    factories that read only sizes and dtype (`*_like`, `new_*`)."""

    ALLOWED = frozenset([torch.ops.aten.detach.default, torch.ops.aten.alias.default,
                         torch.ops.aten.record_stream.default])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if func not in self.ALLOWED and not func.is_view and not name.endswith("_like") and not name.startswith("new_"):
            gone = [tuple(t.shape) for t in _tensors((*args, *kwargs.values())) if _shed(t)]
            if gone:
                raise AssertionError(f"{func} reads a shed tensor of shape {gone}")
        return func(*args, **kwargs)


def _tensors(values):
    """The tensors among an op's arguments, also inside lists (the foreach ops')."""
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from (t for t in v if isinstance(t, torch.Tensor))


def _shed(t):
    return (isinstance(t, torch.Tensor) and t.layout == torch.strided and t.numel() > 0
            and t.untyped_storage().nbytes() < (t.storage_offset() + 1) * t.element_size())


def test_the_detector_catches_a_read_of_a_shed_tensor():
    """`NoShedReads` flags a value read of a shed tensor, and lets views and metadata through."""
    x = torch.randn(5)
    offload_mod.shed(x)
    with NoShedReads():
        assert x.view(5, 1).shape == (5, 1) and torch.zeros_like(x).shape == (5,) and x.detach().numel() == 5
        for read in (lambda: x + 1, lambda: x.to(torch.float64), lambda: torch._foreach_norm([x])):
            with pytest.raises(AssertionError, match="reads a shed tensor"):
                read()


def _tree(dtype=torch.float32):
    gen = torch.Generator().manual_seed(7)
    return {f"l{i}.w": (torch.randn(6, 6, generator=gen) / 3).to(dtype) for i in range(3)}


def _tanh_loss(p, x):
    for i in range(3):
        x = torch.tanh(x @ p[f"l{i}.w"])
    return x.float().square().mean()


def _run(monkeypatch, n, stage, params, off, *, policy="none", micro=1, clip=None, loss=_tanh_loss,
         dtype=torch.float32, batch_scale=1.0, on_nonfinite="raise", steps=2, tree=None, init=None, step=None,
         after=None):
    """Two steps of stage `stage` at world size `n`, with `off` (an Offload or None); returns per
    rank (gathered params, losses, grad norms, skipped flags) and the shed tensors per rank: each
    as (numel, storage bytes after the step). Every rank runs under `NoShedReads`. `tree`, `init`,
    `step`: other params, and more keywords for `fzero.init` and `fzero.train_step`; `after(rank,
    t, state)` runs after step t."""
    tree = _tree(dtype) if tree is None else tree
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(4, 6, generator=gen) * batch_scale for _ in range(n)]
    mesh = fzero.SimMesh(n)
    shed_log: dict[int, list[torch.Tensor]] = {}
    original = offload_mod.shed

    def spy(x):
        shed_log.setdefault(threading.get_ident(), []).append(x)
        return original(x)

    def rank_fn(x):
        with NoShedReads():
            state = fzero.init(tree, optim.adamw(1e-2), stage=stage, mesh=mesh, units=lambda p: p.split(".")[0],
                               precision=POLICIES[policy], offload=off, **(init or {}))
            train = fzero.train_step(loss, micro_batches=micro, clip_norm=clip, on_nonfinite=on_nonfinite,
                                     **{"donate": True, **(step or {})})
            seen = []
            for t in range(steps):
                batch = (x + t).to(POLICIES[policy].param_dtype or dtype)
                state, met = train(state, batch if micro == 1 else [batch, batch.flip(0)])
                seen.append((met.loss, met.grad_norm, met.skipped))
                if after is not None:
                    after(mesh.rank, t, state)
            return fzero.gather(state), seen, threading.get_ident()

    with monkeypatch.context() as m:  # set once, here: monkeypatch is not thread-safe
        m.setattr(offload_mod, "shed", spy)
        out = mesh.run(rank_fn, [(x,) for x in xs])
    return [(p, seen, [(t.numel(), t.untyped_storage().nbytes()) for t in shed_log.get(ident, [])])
            for p, seen, ident in out]


def _assert_same(got, want, what):
    for (gp, gs, _), (wp, ws, _) in zip(got, want):
        assert_equal_leaves(gp, wp, what)
        for (gl, gn, gk), (wl, wn, wk) in zip(gs, ws):
            assert _same(gl, wl) and _same(gn, wn) and gk == wk, (what, gl, wl, gn, wn)


def _same(a, b):
    """Equal, or both NaN (a skipped step's metrics)."""
    return torch.equal(a, b) or bool(a.isnan() and b.isnan())


CASES = [(2, None), (3, None), (3, "cpu")]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("stage, params", CASES)
@pytest.mark.parametrize("policy, clip", [("none", None), ("bf16/fp32", None), ("none", 1e-3)])
def test_every_offloaded_shard_is_shed_and_the_bits_are_unchanged(monkeypatch, n, stage, params, policy, clip):
    """3 buckets (one per unit), 2 steps: 6 shards shed per rank, each holding no memory after the
    step; bitwise the run without offload (clipping that clips: the host rescales its copy)."""
    off = fzero.Offload(optimizer="cpu", params=params)
    got = _run(monkeypatch, n, stage, params, off, policy=policy, clip=clip)
    want = _run(monkeypatch, n, stage, None, None, policy=policy, clip=clip)
    _assert_same(got, want, f"stage {stage} n={n} params={params} {policy} clip={clip}")
    for _, _, shed in got:
        assert len(shed) == 6 and all(numel == 36 // n and nbytes == 0 for numel, nbytes in shed), shed
    assert all(not shed for _, _, shed in want)


@pytest.mark.parametrize("what", ["micro", "bf16 grads"])
def test_nothing_is_shed_where_the_device_reads_the_shard_again(monkeypatch, what):
    """Two micro-batches (no early copy: the update reads their sum), or bfloat16 params without a
    policy (the bf16 shard is added in float32 by `accumulate`, a device read): nothing is shed,
    and the run is bitwise the run without offload."""
    kw = dict(micro=2) if what == "micro" else dict(dtype=torch.bfloat16)
    got = _run(monkeypatch, 2, 3, None, fzero.Offload(optimizer="cpu"), **kw)
    want = _run(monkeypatch, 2, 3, None, None, **kw)
    _assert_same(got, want, what)
    assert all(not shed for _, _, shed in got)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("stage, params", CASES)
def test_a_nan_in_shed_shards_raises_as_without_offload(monkeypatch, n, stage, params):
    """A NaN in the batch: the step raises the same NonFiniteError (naming the same leaves) as
    without offload; the shards it names were shed (their values come from the host copies)."""
    nan = float("nan")
    errors = []
    for off in (fzero.Offload(optimizer="cpu", params=params), None):
        with pytest.raises(fzero.NonFiniteError) as info:
            _run(monkeypatch, n, stage, params, off, batch_scale=nan, steps=1)
        errors.append(str(info.value))
    assert errors[0] == errors[1]
    assert "l0.w" in errors[0]


@pytest.mark.parametrize("n", [1, 2])
def test_a_skipped_nan_step_with_shed_shards(monkeypatch, n):
    """on_nonfinite="skip": the NaN step is skipped, as without offload, bitwise."""
    off = fzero.Offload(optimizer="cpu")
    got = _run(monkeypatch, n, 3, None, off, batch_scale=float("nan"), on_nonfinite="skip")
    want = _run(monkeypatch, n, 3, None, None, batch_scale=float("nan"), on_nonfinite="skip")
    _assert_same(got, want, "skip")
    assert all(all(k for _, _, k in seen) for _, seen, _ in got)
    assert all(len(shed) == 6 for _, _, shed in got)


def _huge_loss(p, x):
    """Gradient 1e20 per element of every leaf (the loss is linear in them, and finite): a float32
    norm of each 36-element bucket, sqrt(36 * 1e40), overflows (1e40 > 3.4e38 already squared),
    so the agreement takes the exact float64 path."""
    return sum((p[f"l{i}.w"].float() * 1e20).sum() for i in range(3)) + 0 * x.sum()


@pytest.mark.parametrize("n", [1, 2])
def test_an_overflowing_norm_of_shed_shards_is_decided_exactly(monkeypatch, n):
    """The exact path reads the shed shards' values (host copies copied back): a finite norm, the
    same bits as without offload."""
    off = fzero.Offload(optimizer="cpu")
    got = _run(monkeypatch, n, 3, None, off, loss=_huge_loss)
    want = _run(monkeypatch, n, 3, None, None, loss=_huge_loss)
    _assert_same(got, want, "overflow")
    norm = got[0][1][0][1]
    assert torch.isfinite(norm) and norm > 1e20
    assert all(len(shed) == 6 for _, _, shed in got)


DEVICES = [torch.device("cpu"), pytest.param(torch.device("cuda"), marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))]


@examples(20)
@given(sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=5),
       dtypes=st.lists(st.sampled_from([torch.float32, torch.bfloat16, torch.float64]), min_size=5, max_size=5),
       known=st.sets(st.integers(0, 4)), seed=st.integers(0, 2**16))
@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_a_norm_taken_at_the_copy_is_the_agreements(device, sizes, dtypes, known, seed):
    """`shard_norm(x)` (taken in the backward, before `x` is shed) is the norm `shard_squares`
    takes of `x` among the other shards, so `sum_of_squares` with some norms known is bitwise
    the one that reads every shard."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, generator=g).to(device, d) for n, d in zip(sizes, dtypes)]
    taken = {k: shard_norm(xs[k]) for k in known if k < len(xs)}
    assert torch.equal(sum_of_squares(xs, device, taken), sum_of_squares(xs, device))
    assert torch.equal(shard_squares(xs, device, taken), shard_squares(xs, device))


# -- the configurations shedding meets ----------------------------------------------------------

POLICIES["fp16/fp32"] = fzero.Precision(torch.float16, torch.float32)


def _tokens_loss(p, x):
    """`normalize="tokens"`: the summed loss and this micro-batch's token count (its rows)."""
    for i in range(3):
        x = torch.tanh(x @ p[f"l{i}.w"])
    return x.float().square().sum(), x.shape[0]


def _extras_tree():
    """`_tree` with an unused leaf in unit l1 (its bucket's slice gets no gradient) and a frozen
    leaf in unit l2 (its own bucket, never shed)."""
    gen = torch.Generator().manual_seed(11)
    return {**_tree(), "l1.unused": torch.randn(5, generator=gen), "l2.frozen": torch.randn(4, generator=gen)}


FROZEN = (fzero.ParamGroup("frozen", match=lambda p: p.endswith("frozen"), frozen=True),)


def _frozen_loss(p, x):
    return _tanh_loss(p, x) + p["l2.frozen"].sum() * 0


def _saved(root):
    def save(rank, t, state):  # right after the step, while the shed shards may still be alive
        fzero.checkpoint.save(state, root / f"t{t}")  # one root for every rank (checkpoint.save checks)

    return save


# (name, world size, stage, params offload, Offload keywords, _run keywords, shed per rank per step)
CONFIGS = [
    ("nvme", 2, 3, None, dict(optimizer="nvme"), {}, 3),
    ("ratio 0.5: the first bucket stays on the device", 2, 3, None, dict(ratio=0.5), {}, 2),
    ("tokens + clip", 2, 3, None, {}, dict(loss=_tokens_loss, clip=1e-3, step=dict(normalize="tokens")), 3),
    ("donate=False", 2, 3, None, {}, dict(step=dict(donate=False)), 3),
    ("eager gather", 2, 3, None, {}, dict(step=dict(gather="eager")), 3),
    ("prefetch", 2, 3, "cpu", {}, dict(step=dict(prefetch=1)), 3),
    ("frozen + unused leaves", 2, 3, "cpu", {}, dict(tree=_extras_tree(), loss=_frozen_loss,
                                                     init=dict(groups=FROZEN)), 3),
    ("fp16/fp32, a scale that overflows first", 2, 3, None, {},
     dict(policy="fp16/fp32", init=dict(loss_scale=fzero.DynamicLossScale(init_scale=2.0**100, hysteresis=1))), 3),
    ("bf16 params, accumulated in bf16: 16-bit shards", 2, 3, None, {},
     dict(dtype=torch.bfloat16, step=dict(accum_dtype=torch.bfloat16)), 3),
    ("stage 2, N=3, tokens", 3, 2, None, {}, dict(loss=_tokens_loss, step=dict(normalize="tokens")), 3),
    ("two buckets in unit l1 (bucket_bytes)", 3, 3, None, {},
     dict(tree=_extras_tree(), loss=_frozen_loss, init=dict(groups=FROZEN, bucket_bytes=64)), 4),
]


@pytest.mark.parametrize("name, n, stage, params, extra, kw, per_step", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_shedding_in_each_configuration(monkeypatch, tmp_path, name, n, stage, params, extra, kw, per_step):
    """Each configuration: every offloaded trainable bucket's shard is shed in each step (and no
    other), no op reads a shed tensor (`NoShedReads`), and the run is bitwise the run without
    offload -- a checkpoint saved right after each step included (the state holds no gradient)."""
    extra = {**extra, "nvme_path": str(tmp_path)} if extra.get("optimizer") == "nvme" else extra
    off = fzero.Offload(**{"optimizer": "cpu", "params": params, **extra})
    got = _run(monkeypatch, n, stage, params, off, after=_saved(tmp_path / "got"), **kw)
    want = _run(monkeypatch, n, stage, None, None, after=_saved(tmp_path / "want"), **kw)
    _assert_same(got, want, name)
    for _, _, shed in got:
        assert len(shed) == 2 * per_step and all(nbytes == 0 for _, nbytes in shed), (name, shed)
    if "loss_scale" in kw.get("init", {}):  # the overflow was seen: the first step skipped
        assert got[0][1][0][2], "the first step's scaled gradient overflows fp16: skipped"


# -- gloo: the shards are shed after a real asynchronous reduce-scatter --------------------------


def gloo_steps(mesh, stage, params, policy, offloaded):
    """Two steps on `mesh` (a gloo DistMesh in a worker, or SimMesh), under `NoShedReads`: the
    gathered params, the metrics, and the storage bytes of each shed tensor after the steps.
    On DistMesh a unit's reduce-scatter is still in flight when the next unit's backward starts,
    so the shard is copied and shed when its flight is closed (`Inflight.make_room`, `wait`)."""
    shed, original = [], offload_mod.shed
    offload_mod.shed = lambda x: (shed.append(x), original(x))[1]  # a worker's module: put back below
    try:
        with NoShedReads():
            off = fzero.Offload(optimizer="cpu", params=params) if offloaded else None
            state = fzero.init(_tree(), optim.adamw(1e-2), stage=stage, mesh=mesh, units=lambda p: p.split(".")[0],
                               precision=POLICIES[policy], offload=off)
            step = fzero.train_step(_tanh_loss, clip_norm=1e-3, donate=True)
            seen = []
            for t in range(2):
                x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * mesh.rank + t))
                state, met = step(state, x.to(POLICIES[policy].param_dtype or torch.float32))
                seen.append((met.loss, met.grad_norm))
            return fzero.gather(state), seen, [t.untyped_storage().nbytes() for t in shed]
    finally:
        offload_mod.shed = original


@pytest.mark.dist
@pytest.mark.parametrize("stage, params, policy", [(2, None, "none"), (3, "cpu", "bf16/fp32")])
def test_shedding_on_gloo_is_the_simmesh_run(dist2, stage, params, policy):
    """gloo, 2 ranks: 6 shards shed per rank (3 buckets, 2 steps), no read of one, and bitwise the
    SimMesh run and the run without offload (clipping that clips: the host rescales)."""
    args = [(stage, params, policy, True)] * 2
    got = dist2.run(gloo_steps, args)
    sim = fzero.SimMesh(2)
    want = sim.run(lambda *a: gloo_steps(sim, *a), args)
    plain = dist2.run(gloo_steps, [(stage, params, policy, False)] * 2)
    for (gp, gs, shed), (wp, ws, _), (pp, ps, none) in zip(got, want, plain):
        assert_equal_leaves(gp, wp, "gloo vs SimMesh")
        assert_equal_leaves(gp, pp, "gloo: offload vs none")
        assert all(torch.equal(a, b) and torch.equal(a, c) for g, w, p in zip(gs, ws, ps) for a, b, c in zip(g, w, p))
        assert shed == [0] * 6 and none == []


@pytest.mark.parametrize("n", [1, 2])
def test_a_step_after_a_caught_nonfinite_error(n):
    """A NaN step raises `NonFiniteError`; the caught exception's frames keep that step's shed
    shards (and their early entries) alive while the next, finite step runs on the same state:
    its own shards are found by their own entries, shed, and the run is bitwise the run without
    offload."""
    def rank_fn(mesh, off, x):
        with NoShedReads():
            state = fzero.init(_tree(), optim.adamw(1e-2), stage=3, mesh=mesh, units=lambda p: p.split(".")[0],
                               offload=off)
            step = fzero.train_step(_tanh_loss, donate=True)
            with pytest.raises(fzero.NonFiniteError) as caught:
                step(state, x * float("nan"))
            stale = len(state.info.tier.early) if off is not None else 3  # the NaN step's 3 entries, alive
            state, met = step(state, x)
            return fzero.gather(state), met.grad_norm, stale

    results = []
    for off in (fzero.Offload(optimizer="cpu"), None):
        mesh = fzero.SimMesh(n)
        xs = [torch.randn(4, 6, generator=torch.Generator().manual_seed(r)) for r in range(n)]
        results.append(mesh.run(lambda x: rank_fn(mesh, off, x), [(x,) for x in xs]))
    for (gp, gn, stale), (wp, wn, _) in zip(*results):
        assert_equal_leaves(gp, wp, "after a caught NonFiniteError")
        assert torch.equal(gn, wn) and stale == 3


POLICIES["bf16"] = fzero.Precision(torch.bfloat16)  # reduced in bf16, the fp32 master's gradient a cast of it


@pytest.mark.parametrize("n", [1, 2])
def test_the_bf16_policy_sheds_its_cast_shards(monkeypatch, n):
    """Precision(bf16): the shard is reduced in bf16 and cast to the fp32 master's dtype in the
    unit's backward; that fp32 shard is what the update reads, and nothing else reads it on the
    device (`accumulate`'s casts are no-ops), so it can be copied and shed as the others are."""
    got = _run(monkeypatch, n, 3, None, fzero.Offload(optimizer="cpu"), policy="bf16", clip=1e-3)
    want = _run(monkeypatch, n, 3, None, None, policy="bf16", clip=1e-3)
    _assert_same(got, want, "bf16")
    assert all(len(shed) == 6 for _, _, shed in got), [len(shed) for _, _, shed in got]


# -- CUDA: the caching allocator and the side stream (run on a GPU) ------------------------------


def _cuda_steps(mesh):
    """Three steps of stage 3 + optimizer offload (bf16/fp32, 4 units of 1 MiB fp32 buckets) on one
    GPU, every device -> host copy queued behind ~1 ms of sleep on the side stream, so the
    memory a shed shard freed is asked for again (the next unit's gradient, of the same size)
    while its copy has not run yet."""
    gen = torch.Generator().manual_seed(5)
    tree = {f"u{i}.w": torch.randn(512, 512, generator=gen) / 23 for i in range(4)}

    def loss(p, x):
        for i in range(4):
            x = torch.tanh(x @ p[f"u{i}.w"])
        return x.float().square().mean()

    with NoShedReads():
        state = fzero.init(tree, optim.adamw(1e-3), stage=3, mesh=mesh, units=lambda p: p.split(".")[0],
                           precision=POLICIES["bf16/fp32"], offload=fzero.Offload(optimizer="cpu"))
        step = fzero.train_step(loss, donate=True, clip_norm=1e-2)
        norms = []
        for t in range(3):
            x = torch.randn(64, 512, generator=torch.Generator().manual_seed(t)).to(mesh.device, torch.bfloat16)
            state, met = step(state, x)
            norms.append(met.grad_norm)
        return fzero.gather(state), norms


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the caching allocator and CUDA streams: needs a GPU")
def test_shedding_on_cuda_is_bitwise_the_run_that_keeps_the_shards(monkeypatch, nccl_mesh):
    """Freeing a shard right after its side-stream copy was queued is safe: `record_stream` makes
    the caching allocator hand the memory out again only after that copy ran, and the norm, on
    the compute stream, precedes every later use of it there. With every copy delayed, a
    premature reuse would overwrite a shard before its copy reads it and change the update's
    bits: the run that sheds is bitwise the run that keeps the shards, and its shards hold no
    memory after the steps."""
    mesh = nccl_mesh
    original, shed = offload_mod.HostTier.start_host, []

    def delayed(self, x):
        if self.cuda and x.device.type == "cuda":
            with torch.cuda.stream(offload_mod._side_stream(x.device)):
                torch.cuda._sleep(2_000_000)  # ~1 ms at 2 GHz: the copy runs after the next allocation
        return original(self, x)

    monkeypatch.setattr(offload_mod.HostTier, "start_host", delayed)
    monkeypatch.setattr(offload_mod, "shed", lambda x: (shed.append(x), x.untyped_storage().resize_(0)))
    got = _cuda_steps(mesh)
    kept = len(shed)
    monkeypatch.setattr(offload_mod, "sheddable", lambda x: False)
    want = _cuda_steps(mesh)  # the same early copies, nothing freed
    assert_equal_leaves(got[0], want[0], "cuda: shed vs kept")
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    assert kept == 12 == len(shed) and all(t.untyped_storage().nbytes() == 0 for t in shed)
