"""Offload (`fzero.Offload`): the same bits as the same stage without offload, and clear errors.

On this CPU-only machine the mesh device is the CPU, and the host tier copies into separate
buffers (`HostTier` with a CPU device): the code that copies gradients to the host, runs the
optimizer there and copies the new shard back is the code CUDA runs, minus the streams. The
optimizer then runs the same kernels on the same values, every copy copies bits and every cast
is one the stage makes anyway, so `torch.equal` is the right comparison (docs/offload.md,
proofs/offload.md).

The property draws the stage-equivalence problems (tests/stage_harness.py: pytrees with tied,
unused and frozen leaves, units, groups, engines, gather modes) and adds an optimizer among
sgd / adamw / lamb / adafactor, the bf16 policy or none, accumulation, clipping and donation;
it compares params, optimizer state, loss and gradient norm after every step.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
from fzero import optim
from fzero._src.offload import HostTier
from fzero.testing.strategies import example_count, seed_per_case

from . import dist_cases
from .stage_harness import assert_equal_leaves, build, make_loss, problems, reaches_nothing

OPTIMIZERS = {
    "sgd": lambda lr, wd: optim.sgd(lr, momentum=0.9, weight_decay=wd),
    "adamw": lambda lr, wd: optim.adamw(lr, weight_decay=wd),
    "lamb": lambda lr, wd: optim.lamb(lr, weight_decay=wd),
    "adafactor": lambda lr, wd: optim.adafactor(lr, weight_decay=wd),
}
POLICIES = {"none": fzero.Precision(), "bf16": fzero.Precision(torch.bfloat16),
            "bf16/fp32": fzero.Precision(torch.bfloat16, torch.float32)}


@st.composite
def offload_problems(draw, n: int, nvme: bool = False, params: str | None = None):
    """A stage-equivalence problem with an offload setting: `tier` "cpu" or "nvme" (`nvme`: always;
    NVMe writes its files in place, so donating steps only) and `params` None / "cpu" (stage 3),
    or "nvme" with the NVMe tier; `params` given (with `nvme`): stage 3 with that setting always."""
    pb = draw(problems(n) if params is None else problems(n).filter(lambda pb: pb["stage"] == 3))
    stage = pb["stage"]
    pb.update(opt=draw(st.sampled_from(sorted(OPTIMIZERS))), policy=draw(st.sampled_from(sorted(POLICIES))),
              micro=draw(st.sampled_from([1, 2])), clip=draw(st.sampled_from([None, 0.05])),
              donate=nvme or draw(st.booleans()))
    pb["tier"] = "nvme" if nvme else draw(st.sampled_from(["cpu", "nvme"])) if pb["donate"] else "cpu"
    on = [None, "cpu"] + (["nvme"] if pb["tier"] == "nvme" else [])
    pb["params"] = params if params is not None else draw(st.sampled_from(on)) if stage == 3 else None
    pb["ratio"] = draw(st.sampled_from([1.0, 0.6])) if pb["params"] is None else 1.0
    return pb


def run(pb, offload, snapshot=False):
    """Per rank: `[(gathered params, opt_state, Metrics)]` per step of `pb` with `offload` (with
    `snapshot`, the optimizer state read through the tier, as a checkpoint reads it: NVMe)."""
    params, batches, units, groups, roles = build(pb)
    mesh = fzero.SimMesh(pb["n"])
    opt = OPTIMIZERS[pb["opt"]](pb["lr"], pb["wd"])
    k = pb["micro"]

    def rank_fn(*mine):
        state = fzero.init(params, opt, stage=pb["stage"], mesh=mesh, units=units, groups=groups,
                           precision=POLICIES[pb["policy"]], offload=offload)
        step = fzero.train_step(make_loss(roles), engine=pb["engine"], gather=pb["gather"], micro_batches=k,
                                clip_norm=pb["clip"], donate=pb["donate"])
        trace = []
        for c in mine:
            state, m = step(state, c if k == 1 else [c, c.flip(0)])
            opts = [s if s is None or not snapshot or state.info.host_tier(b) is None
                    else state.info.host_tier(b).snapshot(b, s) for b, s in enumerate(state.opt_state)]
            trace.append((fzero.gather(state), [None if s is None else tuple(x.clone() for x in s) for s in opts], m))
        return trace

    per_rank = [tuple(batches[t][r] for t in range(pb["steps"])) for r in range(pb["n"])]
    return mesh.run(rank_fn, per_rank)


def assert_same_runs(got, want, what):
    for r, (g_rank, w_rank) in enumerate(zip(got, want)):
        for t, ((gp, go, gm), (wp, wo, wm)) in enumerate(zip(g_rank, w_rank)):
            assert_equal_leaves(gp, wp, f"{what}: params, rank {r}, step {t}")
            assert torch.equal(gm.loss, wm.loss) and torch.equal(gm.grad_norm, wm.grad_norm), f"{what}: metrics"
            for b, (x, y) in enumerate(zip(go, wo)):
                assert (x is None) == (y is None)
                for k, (u, v) in enumerate(zip(x or (), y or ())):
                    assert u.dtype == v.dtype and torch.equal(u, v), f"{what}: opt bucket {b} field {k}, step {t}"


def compare(pb, offload, what):
    """`pb` run with `offload` (its optimizer state read through the tier) equals `pb` without it.
    A problem whose loss reaches no trainable param is refused (`ConfigError`) with and without
    offload, as in stage_harness.check."""
    if reaches_nothing(pb):
        for off in (None, offload):
            with pytest.raises(fzero.ConfigError, match="no rank's loss depends on any trainable param"):
                run(pb, off)
        return
    want = run(pb, None)
    assert_same_runs(run(pb, offload, snapshot=True), want, what)


@pytest.mark.filterwarnings("ignore::fzero.GroupHoldsNoLeaf")  # drawn groups may take no leaf of a drawn tree
@pytest.mark.parametrize("n", [1, 2, 3])
def test_offloaded_equals_not_offloaded(n, tmp_path):
    """Every offload setting -- optimizer "cpu" or "nvme" (the master shard and the optimizer
    state's shard fields in swap files), params None or "cpu", ratio -- against the same stage
    without offload, bitwise (the optimizer state read back through the tier)."""
    @seed_per_case(n)  # derandomized, each N draws its own examples
    @settings(max_examples=example_count(25))
    @given(offload_problems(n))
    def prop(pb):
        path = str(tmp_path) if pb["tier"] == "nvme" else None
        compare(pb, fzero.Offload(optimizer=pb["tier"], params=pb["params"], ratio=pb["ratio"], nvme_path=path),
                f"stage {pb['stage']} offload={pb['tier']}/{pb['params']}")

    prop()


@pytest.mark.filterwarnings("ignore::fzero.GroupHoldsNoLeaf")  # drawn groups may take no leaf of a drawn tree
def test_nvme_offloaded_equals_not_offloaded(tmp_path):
    """The property above with every example on NVMe (donating steps; N = 2): the master shard
    and the optimizer state's shard fields live in swap files, read and written around each
    bucket's update (stage 3 with params="nvme": the compute-dtype shards too, read as each
    unit's gather starts), and the run is bitwise the one without offload."""
    @settings(max_examples=example_count(12))
    @given(offload_problems(2, nvme=True))
    def prop(pb):
        compare(pb, fzero.Offload(optimizer="nvme", params=pb["params"], ratio=pb["ratio"], nvme_path=str(tmp_path)),
                f"stage {pb['stage']} nvme/{pb['params']}")

    prop()


@pytest.mark.filterwarnings("ignore::fzero.GroupHoldsNoLeaf")  # drawn groups may take no leaf of a drawn tree
@pytest.mark.parametrize("n", [1, 2, 3])
def test_nvme_params_offloaded_equals_not_offloaded(n, tmp_path):
    """The property with every example stage 3 on params="nvme" (the master, the optimizer
    state's shard fields and the compute-dtype shards in swap files, the shards read as each
    unit's gather starts), at N = 1, 2 and 3: bitwise the run without offload. The properties
    above draw params="nvme" in few examples (it needs stage 3, a donating step and the NVMe
    tier: 0-2 of 25 or 12 in the ci profile), too few for the setting with the most new code."""
    @seed_per_case(n)  # derandomized, each N draws its own examples
    @settings(max_examples=example_count(6))
    @given(offload_problems(n, nvme=True, params="nvme"))
    def prop(pb):
        compare(pb, fzero.Offload(optimizer="nvme", params="nvme", nvme_path=str(tmp_path)),
                f"stage 3 nvme/nvme, N = {n}")

    prop()


def test_ratio_keeps_the_first_buckets_on_the_device():
    """`ratio` offloads whole buckets: the first trainable buckets in layout order stay on the
    device while they fit in (1 - ratio) of the trainable shard elements; frozen buckets never
    count. Those keep no master (no policy) and run the device's update."""
    params = {f"l{i}": torch.randn(8) for i in range(4)} | {"z": torch.randn(8)}
    frozen = (fzero.ParamGroup("frozen", match=lambda p: p == "l1", frozen=True),)
    mesh = fzero.SimMesh(2)
    # four trainable buckets of 4 elements per shard: (1 - ratio) * 16 elements may stay on the device
    for ratio, on_host in ((1.0, [0, 2, 3, 4]), (0.8, [0, 2, 3, 4]), (0.75, [2, 3, 4]), (0.5, [3, 4]), (0.3, [3, 4]),
                           (0.2, [4]), (0.01, [4])):
        s = mesh.run(lambda: fzero.init(params, optim.adamw(1e-2), stage=2, mesh=mesh, units=lambda p: p,
                                        groups=frozen, offload=fzero.Offload(optimizer="cpu", ratio=ratio)))[0]
        assert [b for b in range(5) if s.info.host_tier(b) is not None] == on_host, ratio
        assert [b for b in range(5) if s.master[b] is not None] == on_host, ratio


def test_tensors_live_where_offload_says():
    """The master shard and optimizer state are separate host buffers (not the params); with
    params offloaded the stage-3 shard is the master itself; frozen buckets keep no master."""
    params = {"w": torch.randn(6), "f": torch.randn(3)}
    frozen = (fzero.ParamGroup("frozen", match=lambda p: p == "f", frozen=True),)
    mesh = fzero.SimMesh(2)

    def rank_fn(stage, off):
        s = fzero.init(params, optim.adamw(1e-2), stage=stage, mesh=mesh, units=lambda p: p, groups=frozen,
                       offload=off)
        (f,), (w,) = ([b for b, spec in enumerate(s.layout.buckets) if spec.group.frozen == fz] for fz in (True, False))
        return s, w, f

    for stage in (1, 2, 3):
        s, w, f = mesh.run(rank_fn, [(stage, fzero.Offload(optimizer="cpu"))] * 2)[0]
        assert s.master[w] is not None and s.master[f] is None and s.opt_state[f] is None
        assert s.master[w].untyped_storage().data_ptr() != s.params[w].untyped_storage().data_ptr()
        assert s.info.host_tier(w) == HostTier(torch.device("cpu")) and s.info.host_tier(f) is None
    s, w, f = mesh.run(rank_fn, [(3, fzero.Offload(optimizer="cpu", params="cpu"))] * 2)[0]
    assert s.params[w] is s.master[w]
    bf16 = mesh.run(lambda: fzero.init(params, optim.adamw(1e-2), stage=3, mesh=mesh, units=lambda p: p, groups=frozen,
                                       precision=fzero.Precision(torch.bfloat16), offload=fzero.Offload(optimizer="cpu")))
    s = bf16[0]  # stage 3: the device shard in the compute dtype, the master (fp32) on the host; frozen: its own
    assert s.params[w].dtype == torch.bfloat16 and s.master[w].dtype == torch.float32
    assert s.params[f].dtype == torch.float32 and s.master[f] is None


@pytest.mark.parametrize("kwargs, match", [
    (dict(optimizer="gpu"), "Offload.optimizer must be one of"),
    (dict(params="disk", optimizer="cpu"), "Offload.params must be one of"),
    (dict(params="nvme", optimizer="cpu"), r"params='nvme'.*Offload\(optimizer='nvme', params='nvme', nvme_path=.*or "
                                           r"Offload\(optimizer='cpu', params='cpu'\)"),  # both ways run as named
    (dict(params="nvme", optimizer="cpu", nvme_path="/tmp"), r"params='nvme'.*optimizer='nvme'"),
    (dict(params="cpu"), "offload the optimizer too"),
    (dict(params="nvme"), r"params='nvme'.*use Offload\(optimizer='nvme', params='nvme', nvme_path=.*got "
                          r"optimizer=None"),  # (found in review: it named optimizer='cpu', itself refused)
    (dict(optimizer="nvme"), "needs nvme_path"),
    (dict(optimizer="cpu", nvme_path="/tmp"), "read only with optimizer='nvme'"),
    (dict(optimizer="cpu", ratio=0.0), r"ratio must be a float in \(0, 1\]"),
    (dict(optimizer="cpu", ratio=True), r"ratio must be a float in \(0, 1\]"),
    (dict(optimizer="cpu", params="cpu", ratio=0.5), "with params offloaded every shard is on the host"),
    (dict(optimizer="cpu", pin=1), "pin must be a bool"),
    (dict(optimizer="cpu", direct=True), "True only with optimizer='nvme'"),
])
def test_bad_settings_name_the_setting_and_the_way_out(kwargs, match):
    with pytest.raises(fzero.ConfigError, match=match):
        fzero.Offload(**kwargs)


@pytest.mark.parametrize("stage, off, match", [
    (0, fzero.Offload(optimizer="cpu"), "stage 0 replicates them .*use stage 1, 2 or 3"),
    (2, fzero.Offload(optimizer="cpu", params="cpu"), "stage 2 holds the full params .*use stage=3"),
    (2, fzero.Offload(optimizer="nvme", params="nvme", nvme_path="/tmp"), "stage 2 holds the full params .*stage=3"),
    (1, "cpu", "offload must be None or a fzero.Offload"),
])
def test_offload_that_does_not_fit_the_stage_is_refused_at_init(stage, off, match):
    mesh = fzero.SimMesh(1)
    with pytest.raises(fzero.ConfigError, match=match):
        mesh.run(lambda: fzero.init({"w": torch.ones(3)}, optim.sgd(0.1), stage=stage, mesh=mesh, offload=off))


def test_ranks_with_different_offload_settings_are_refused():
    mesh = fzero.SimMesh(2)
    with pytest.raises(fzero.ConfigError, match=r"'offload', rank\(s\) \[1\] differ from rank 0: offload: rank 0 "
                                                r"\(None, None, 1.0, .*\), rank 1 \('cpu', None, 1.0"):
        mesh.run(lambda off: fzero.init({"w": torch.ones(3)}, optim.sgd(0.1), stage=1, mesh=mesh, offload=off),
                 [(None,), (fzero.Offload(optimizer="cpu"),)])


def test_gloo_offloaded_equals_not_offloaded(dist2):
    """On real gloo process groups (asynchronous collectives), stages 1-3 with the optimizer
    offloaded (and stage 3 with params too) give the bits of the same stage without offload."""
    for stage, params in ((1, None), (2, None), (3, None), (3, "cpu")):
        got = dist2.run(dist_cases.offload_steps, [(stage, "cpu", params)] * 2)
        want = dist2.run(dist_cases.offload_steps, [(stage, None, None)] * 2)
        sim = fzero.SimMesh(2)
        ref = sim.run(functools.partial(dist_cases.offload_steps, sim), [(stage, "cpu", params)] * 2)
        for g, w, s in zip(got, want, ref):
            for k in w:
                assert torch.equal(g[k], w[k]) and torch.equal(g[k], s[k]), (stage, params, k)
    for stage in (1, 3):  # NVMe: the swap files on each worker
        got = dist2.run(dist_cases.offload_nvme_steps, [(stage,)] * 2)
        want = dist2.run(dist_cases.offload_steps, [(stage, None, None)] * 2)
        for g, w in zip(got, want):
            assert all(torch.equal(g[k], w[k]) for k in w), stage


@pytest.mark.parametrize("stage, params", [(1, None), (2, None), (3, None), (3, "cpu")])
def test_checkpoint_of_an_offloaded_state_loads_into_either_bitwise(tmp_path, stage, params):
    """Save an offloaded state (and a plain one) after a step; load each into an offloaded and a
    plain target: the same params, optimizer state, and next step, bit for bit."""
    tree = {"a": torch.randn(5, 3), "b": torch.randn(7)}
    loss = lambda p, x: torch.tanh(p["a"] * x).sum() + (p["b"] * x).square().sum()  # noqa: E731
    mesh = fzero.SimMesh(2)
    offload = fzero.Offload(optimizer="cpu", params=params)

    def rank_fn(x):
        def make(off):
            return fzero.init(tree, optim.adamw(1e-2, weight_decay=0.1), stage=stage, mesh=mesh, units=lambda p: p,
                              precision=fzero.Precision(torch.bfloat16), offload=off)

        step = fzero.train_step(loss)
        saved = {}
        for name, off in (("plain", None), ("offloaded", offload)):
            state, _ = step(make(off), x)
            saved[name] = fzero.checkpoint.save(state, tmp_path / name)
        out = []
        for src in saved.values():
            for off in (None, offload):
                loaded = fzero.checkpoint.load(src, make(off))
                after, m = step(loaded, x + 1)
                placed = off is None or all(  # params offloaded: the bf16 host copy of the master beside it
                    m is not None and (params is None or p.dtype == torch.bfloat16 and torch.equal(p, m.to(p.dtype)))
                    for p, m in zip(loaded.params, loaded.master))
                out.append((fzero.gather(loaded), [tuple(s) for s in loaded.opt_state], fzero.gather(after), m.loss,
                            placed))
        return out

    for rank_out in mesh.run(rank_fn, [(torch.tensor(1.0),), (torch.tensor(2.0),)]):
        first = rank_out[0]
        for params_now, opt, after, loss_next, placed in rank_out:
            assert placed
            assert_equal_leaves(params_now, first[0], "loaded params")
            assert all(torch.equal(u, v) for s, t in zip(opt, first[1]) for u, v in zip(s, t))
            assert_equal_leaves(after, first[2], "the step after the load")
            assert torch.equal(loss_next, first[3])


@pytest.mark.parametrize("prefetch", [0, 1, 2, 3])
@pytest.mark.parametrize("policy", ["none", "bf16"])
@pytest.mark.parametrize("where, per_unit", [("cpu", 1), ("nvme", 1), ("nvme", 2)])
def test_stage3_params_offload_with_release_refill_and_prefetch_is_bitwise(tmp_path, prefetch, policy, where,
                                                                           per_unit):
    """Flat-dict params (units freed after their forward, gathered again in backward) with
    `prefetch=k`: the host shards come to the device inside the prefetched flights and the
    backward's refills, and the run equals stage 3 without offload bit for bit. With
    params="nvme" each trainable shard is read from its file as its flight starts, into a buffer
    of its own: prefetch 3 holds more reads at once than the tier's pool has read buffers, and a
    unit holds one or two buckets (`per_unit`), and nothing waits on a buffer."""
    gen = torch.Generator().manual_seed(3)
    tree = {f"l{i}.w": torch.randn(6, 6, generator=gen) / 3 for i in range(4)}
    tree |= {f"l{i}.b": torch.randn(6, generator=gen) / 3 for i in range(4)} if per_unit == 2 else {}
    frozen = (fzero.ParamGroup("frozen", match=lambda p: p == "l2.w", frozen=True),
              *((fzero.ParamGroup("nowd", match=lambda p: p.endswith(".b"), weight_decay=0.0),) if per_unit == 2
                else ()))

    def loss(p, x):
        for i in range(4):
            x = torch.tanh(x @ p[f"l{i}.w"] + (p[f"l{i}.b"] if per_unit == 2 else 0))
            p.release(f"l{i}")  # freed now, gathered again when backward reads it (as from_module's apply)
        return x.float().square().mean()

    def run(offload):
        mesh = fzero.SimMesh(2)

        def rank_fn(x):
            state = fzero.init(tree, optim.adamw(1e-2), stage=3, mesh=mesh, units=lambda p: p.split(".")[0],
                               groups=frozen, precision=POLICIES[policy], offload=offload)
            step = fzero.train_step(loss, prefetch=prefetch, donate=True)
            for t in range(2):
                state, m = step(state, (x + t).to(POLICIES[policy].param_dtype or torch.float32))
            return fzero.gather(state), m.loss, m.grad_norm

        return mesh.run(rank_fn, [(torch.randn(3, 6, generator=gen),) for _ in range(2)])

    gen_state = gen.get_state()
    want = run(None)
    gen.set_state(gen_state)
    got = run(fzero.Offload(optimizer=where, params=where, nvme_path=str(tmp_path) if where == "nvme" else None))
    for (gp, gl, gn), (wp, wl, wn) in zip(got, want):
        assert_equal_leaves(gp, wp, "params")
        assert torch.equal(gl, wl) and torch.equal(gn, wn)


# -- NVMe: the optimizer state's shard fields in swap files -------------------------------------


@pytest.mark.parametrize("stage, opt, policy, params, ratio, direct", [
    (1, "adamw", "bf16", None, 1.0, False), (2, "lamb", "none", None, 0.6, False),
    (2, "adafactor", "bf16/fp32", None, 1.0, False), (3, "sgd", "bf16", None, 1.0, False),
    (3, "adamw", "bf16", "cpu", 1.0, False), (2, "adamw", "bf16", None, 1.0, True),
    (3, "adamw", "bf16", "nvme", 1.0, False), (3, "lamb", "none", "nvme", 1.0, True),
])
def test_nvme_equals_cpu_offload_bitwise(tmp_path, stage, opt, policy, params, ratio, direct):
    """`optimizer="nvme"` (double-buffered swap files per bucket and field, donate=True) gives the
    bits of `optimizer="cpu"` and of no offload: params, loss, gradient norm and optimizer state
    (read back through `snapshot`, as a checkpoint does)."""
    pb = dict(tree={"m0": [(3, 4), (5,)], "m1": [(2, 3, 2)], "m2": [()]}, role=["use", "tied", "use", "use"],
              unit_mode="per-module", group_mode="nowd", opt=opt, lr=3e-2, wd=0.01, steps=3, stage=stage,
              engine="autograd", gather="on_use", seed=11, n=2, policy=policy, micro=2, clip=0.05, donate=True,
              params=params, ratio=ratio)
    want = run(pb, None)
    cpu = run(pb, fzero.Offload(optimizer="cpu", params=params and "cpu", ratio=ratio))
    nvme = run(pb, fzero.Offload(optimizer="nvme", params=params, nvme_path=str(tmp_path), ratio=ratio,
                                 direct=direct), snapshot=True)  # direct: O_DIRECT (this machine's ext4 takes it)
    assert_same_runs(cpu, want, "cpu")
    assert_same_runs(nvme, want, "nvme")


@pytest.mark.parametrize("stage, params, policy", [(1, None, "bf16"), (2, None, "none"), (3, None, "bf16"),
                                                   (3, "cpu", "none"), (3, "cpu", "bf16"), (3, "nvme", "none"),
                                                   (3, "nvme", "bf16")])
def test_nvme_state_holds_stand_ins_and_its_checkpoint_loads_anywhere(tmp_path, stage, params, policy):
    """The state keeps a no-memory stand-in for each file-backed tensor (the moments, the master
    shard and, params="nvme", the compute-dtype shard); a checkpoint of an NVMe state reads the
    files and loads into plain and NVMe targets (the master then written to the target's fresh
    files) bit for bit; training on from either is bitwise training on without the checkpoint."""
    tree = {"a": torch.randn(5, 3), "b": torch.randn(7)}
    loss = lambda p, x: torch.tanh(p["a"] * x).sum() + (p["b"] * x).square().sum()  # noqa: E731
    mesh = fzero.SimMesh(2)
    nvme = fzero.Offload(optimizer="nvme", params=params, nvme_path=str(tmp_path / "swap"))
    (tmp_path / "swap").mkdir()

    def rank_fn(x):
        def make(off):
            return fzero.init(tree, optim.adamw(1e-2), stage=stage, mesh=mesh, units=lambda p: p, offload=off,
                              precision=POLICIES[policy])

        step = fzero.train_step(loss, donate=True)
        state, _ = step(make(nvme), x)
        assert all(f.stride() == (0,) for s in state.opt_state for f in s[1:])  # exp_avg, exp_avg_sq: stand-ins
        assert all(m.stride() == (0,) and (p.stride() == (0,)) == (params == "nvme")  # params="nvme": in files
                   for p, m in zip(state.params, state.master))
        path = fzero.checkpoint.save(state, tmp_path / "ckpt")
        out = []
        for off in (None, nvme):
            target = make(off)
            loaded = fzero.checkpoint.load(path, target)
            assert off is None or loaded.info.tier.files is not target.info.tier.files  # the target's stay its own
            after, m = step(loaded, x + 1)
            out.append((fzero.gather(after), m.loss))
        again, m = step(state, x + 1)  # the saved state's files were only read
        out.append((fzero.gather(again), m.loss))
        return out

    for (pa, la), *others in mesh.run(rank_fn, [(torch.tensor(1.0),), (torch.tensor(2.0),)]):
        for pb_, lb in others:
            assert_equal_leaves(pa, pb_, "after load")
            assert torch.equal(la, lb)


def test_a_load_whose_second_set_of_swap_files_does_not_fit_says_so_and_leaves_the_target(tmp_path, monkeypatch):
    """docs/offload.md: a load into an NVMe target makes fresh swap files beside the target's own.
    Where the disk cannot hold both, the `OffloadError` names the load, the checkpoint, the two
    sets and the way out, and the target still steps (found in review of offload: `init`'s words
    alone, on a disk that held the run's files)."""
    import shutil

    tree = {"a": torch.randn(5, 3), "b": torch.randn(7)}
    loss = lambda p, x: torch.tanh(p["a"] * x).sum() + (p["b"] * x).square().sum()  # noqa: E731
    mesh = fzero.SimMesh(1)
    nvme = fzero.Offload(optimizer="nvme", nvme_path=str(tmp_path))
    real = shutil.disk_usage

    def rank_fn():
        state = fzero.init(tree, optim.adamw(1e-2), stage=1, mesh=mesh, offload=nvme)
        step = fzero.train_step(loss, donate=True)
        state, _ = step(state, torch.tensor(1.0))
        path = fzero.checkpoint.save(state, tmp_path / "ckpt")
        monkeypatch.setattr(shutil, "disk_usage", lambda d: real(d)._replace(free=100))
        with pytest.raises(fzero.OffloadError, match=(
                rf"{re.escape(str(path))}.*: a load into an NVMe target makes it a fresh set of swap files while the "
                r"target's own still hold its state \(twice the files on the disk for the load.*has 100 bytes free, "
                r"the swap files need \d+ bytes.*Nothing was loaded and the target is as it was; free room for a "
                r"second set, or load into a state made by fzero.init with an nvme_path on another disk")):
            fzero.checkpoint.load(path, state)
        monkeypatch.setattr(shutil, "disk_usage", real)
        state, m = step(state, torch.tensor(2.0))
        return int(state.step)

    assert mesh.run(rank_fn) == [2]


def test_a_load_that_has_no_room_on_one_rank_raises_on_every_rank_and_each_steps_on(tmp_path, monkeypatch):
    """`load`'s errors come on every rank or on none: the second set of swap files is made among the
    checks the ranks agree on. Rank 1's disk has no room (ranks of one node share a disk that has room
    for some second sets): rank 1 raises the `OffloadError`, rank 0 a `CheckpointError` naming rank 1's,
    and both targets step on together (found in review: rank 0 loaded, and its next step met
    `RankFailed`)."""
    import shutil

    tree = {"a": torch.randn(5, 3), "b": torch.randn(7)}
    loss = lambda p, x: torch.tanh(p["a"] * x).sum() + (p["b"] * x).square().sum()  # noqa: E731
    mesh = fzero.SimMesh(2)
    nvme = fzero.Offload(optimizer="nvme", nvme_path=str(tmp_path))
    real, full = shutil.disk_usage, threading.local()
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda d: real(d)._replace(free=100) if getattr(full, "on", 0) else real(d))

    def rank_fn():
        state = fzero.init(tree, optim.adamw(1e-2), stage=2, mesh=mesh, offload=nvme)
        step = fzero.train_step(loss, donate=True)
        state, _ = step(state, torch.tensor(1.0))
        path = fzero.checkpoint.save(state, tmp_path / "ckpt")
        full.on = mesh.rank == 1
        try:
            fzero.checkpoint.load(path, state)
        except fzero.FzeroError as e:
            raised = type(e).__name__, str(e)
        full.on = False
        state, _ = step(state, torch.tensor(2.0))
        return raised, int(state.step)

    got = mesh.run(rank_fn)
    assert [(kind, n) for (kind, _), n in got] == [("CheckpointError", 2), ("OffloadError", 2)], got
    assert "a load into an NVMe target makes it a fresh set of swap files" in got[1][0][1], got[1][0][1]
    assert "rank 1: " in got[0][0][1] and "has 100 bytes free" in got[0][0][1], got[0][0][1]

def test_nvme_master_lives_in_its_file_and_readers_read_it_there(tmp_path):
    """With optimizer="nvme" each trainable bucket's master shard is a swap file: the state holds
    a stand-in (zeros, stride 0, no memory; `held_bytes` puts its bytes in the "nvme" tier, none in
    host memory) and every reader outside the step reads the file (`state.master_values`, which
    `fzero.gather` and `fzero.checkpoint.save` use): the values equal the "cpu" tier's host master
    after the same steps, and they are not the stand-in's zeros."""
    from fzero._src.accounting import held_bytes
    from fzero._src.state import master_values

    tree = {"a": torch.randn(6, 4), "b": torch.randn(9)}
    loss = lambda p, x: torch.tanh(p["a"] * x).sum() + (p["b"] * x).square().sum()  # noqa: E731
    mesh = fzero.SimMesh(2)
    opt = optim.adamw(1e-2)

    def rank_fn(x):
        out = []
        for off in (fzero.Offload(optimizer="cpu"), fzero.Offload(optimizer="nvme", nvme_path=str(tmp_path))):
            state = fzero.init(tree, opt, stage=3, mesh=mesh, units=lambda p: p, offload=off,
                               precision=fzero.Precision(torch.bfloat16))
            for t in range(2):
                state, _ = fzero.train_step(loss, donate=True)(state, x + t)
            out.append((state, [master_values(state, b).clone() for b in range(len(state.master))],
                        fzero.gather(state), held_bytes(state, opt).tiers))
        return out

    for (cpu, cpu_masters, cpu_full, cpu_tiers), (disk, masters, full, tiers) in mesh.run(
            rank_fn, [(torch.tensor(1.0),), (torch.tensor(2.0),)]):
        for b, (m, want) in enumerate(zip(masters, cpu_masters)):
            assert cpu.master[b].stride() == (1,) and disk.master[b].stride() == (0,)
            assert torch.equal(m, want) and torch.equal(m, cpu.master[b]) and m.abs().sum() > 0
            assert not torch.equal(disk.master[b], m)  # the stand-in is no copy of the values
        assert_equal_leaves(full, cpu_full, "gather")
        assert (tiers.host.master, tiers.nvme.master) == (0, cpu_tiers.host.master) and cpu_tiers.host.master > 0


def test_nvme_update_hands_out_no_read_buffer(tmp_path):
    """What a step's state keeps besides the stand-ins -- with params="cpu" and fp32 params the
    host shard the units read, the update's cast of the master being a no-op -- is a buffer of
    its own, never a view of a swap read buffer (which the next bucket's prefetch refills)."""
    tree = {f"l{i}": torch.randn(6) for i in range(4)}
    mesh = fzero.SimMesh(1)

    def rank_fn():
        state = fzero.init(tree, optim.adamw(1e-2), stage=3, mesh=mesh, units=lambda p: p,
                           offload=fzero.Offload(optimizer="nvme", params="cpu", nvme_path=str(tmp_path)))
        state, _ = fzero.train_step(lambda p, x: sum((v * x).sum() for v in p.values()), donate=True)(
            state, torch.tensor(2.0))
        return state

    state = mesh.run(rank_fn)[0]
    pool = {b.untyped_storage().data_ptr() for b in state.info.tier.files._read_free}  # all free after the step
    assert len(pool) == 6 and all(p.stride() == (1,) and p.untyped_storage().data_ptr() not in pool
                                  for p in state.params)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_derivative_through_an_offloaded_step_is_refused(stage):
    """torch.func through a step whose update runs on a host tier failed at the first host copy
    ("Cannot access storage of TensorWrapper"); past it the derivative lacked its identity term or
    was zero (found in review). Refused before the step, naming the offload."""
    mesh = fzero.SimMesh(2)

    def rank_fn():
        state = fzero.init({"w": torch.ones(4, dtype=torch.float64)}, fzero.optim.sgd(0.1), stage=stage, mesh=mesh,
                           offload=fzero.Offload(optimizer="cpu"))
        step = fzero.train_step(lambda p, x: (p["w"] * x).square().sum(), engine="func")
        torch.func.grad(lambda ps: step(state.replace(params=ps), torch.ones(4, dtype=torch.float64))[0].params[0]
                        .sum())(state.params)

    with pytest.raises(fzero.ConfigError, match=r"inside a torch.func transform .* with Offload\(optimizer='cpu'"):
        mesh.run(rank_fn)


@pytest.mark.parametrize("path", [123, b"/tmp"])
def test_an_nvme_path_of_another_type_is_a_config_error(path):
    with pytest.raises(fzero.ConfigError, match="Offload.nvme_path must be a str or os.PathLike"):
        fzero.Offload(optimizer="nvme", nvme_path=path)


def test_nvme_broken_update_names_the_leaf_read_from_the_master_file(tmp_path):
    """The rare path after a donating NVMe update made the params inf (fp16 params and adamw's
    eps = 1e-8, which underflows: a division by zero, as tests/test_misuse.py): the next reader
    finds the leaf by reading the master from its file (a stand-in would read zeros: finite, no
    leaf named)."""
    mesh = fzero.SimMesh(2)
    params = {"w": torch.linspace(-1, 1, 64).half()}

    def rank_fn():
        state = fzero.init(params, optim.adamw(1e-3), stage=3, mesh=mesh,
                           offload=fzero.Offload(optimizer="nvme", nvme_path=str(tmp_path)))
        new, _ = fzero.train_step(lambda p, x: (p["w"] * x).sum(), donate=True)(state, torch.full((64,), 1e-3))
        fzero.gather(new)

    with pytest.raises(fzero.NonFiniteError, match=r"update of a donating step .* in 'w' "):
        mesh.run(rank_fn)


def test_nvme_finite_check_reads_each_master_before_its_buffer_is_reused(tmp_path):
    """The donating update's finite check runs after every bucket's update, when bucket 0's read
    buffers already hold bucket 2's files (the pool keeps two buckets'): it reads the ends each
    master had before it went back to its file. Bucket "a" (fp16, adamw's eps underflows: inf) is
    updated first, "b", "c", "d" (fp32) stay finite; the broken update is found, naming "a"."""
    mesh = fzero.SimMesh(1)
    params = {"a": torch.linspace(-1, 1, 16).half(), **{k: torch.linspace(-1, 1, 16) for k in "bcd"}}

    def rank_fn():
        state = fzero.init(params, optim.adamw(1e-3), stage=1, mesh=mesh, units=lambda p: p,
                           offload=fzero.Offload(optimizer="nvme", nvme_path=str(tmp_path)))
        assert [state.layout.buckets[b].leaves for b in state.info.tier.masters] == [(0,), (1,), (2,), (3,)]
        loss = lambda p, x: sum((p[k].float() * x).sum() for k in "abcd")  # noqa: E731
        new, _ = fzero.train_step(loss, donate=True)(state, torch.full((16,), 1e-3))
        fzero.gather(new)

    with pytest.raises(fzero.NonFiniteError, match=r"update of a donating step .* in 'a' "):
        mesh.run(rank_fn)


def test_nvme_init_reserves_the_master_files_before_training(tmp_path, monkeypatch):
    """The preflight counts the master's files: AdamW on 10 fp32 elements (N = 1, one bucket) needs
    m, v and the master, 3 · 40 = 120 bytes; a disk with 119 free fails at `fzero.init` naming
    both numbers, and 120 is enough."""
    import shutil

    real = shutil.disk_usage
    mesh = fzero.SimMesh(1)

    def make(free):
        monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=free))
        return mesh.run(lambda: fzero.init({"w": torch.ones(10)}, optim.adamw(0.1), stage=1, mesh=mesh,
                                           offload=fzero.Offload(optimizer="nvme", nvme_path=str(tmp_path))))[0]

    with pytest.raises(fzero.OffloadError, match=r"has 119 bytes free, the swap files need 120 bytes \(1 more\)"):
        make(119)
    state = make(120)
    assert sorted(state.info.tier.files.entries) == ["b0/exp_avg", "b0/exp_avg_sq", "b0/master"]


def test_nvme_params_init_reserves_the_master_and_shard_files_before_training(tmp_path, monkeypatch):
    """params="nvme" (stage 3, the bf16 policy) adds each trainable bucket's compute-dtype shard
    file to the preflight's count, and a frozen bucket (its shard in host memory) adds none: AdamW
    on 10 trainable fp32 elements (N = 1) needs m, v and the master, 3 · 40 bytes, and the bf16
    shard, 2 · 10 = 20 bytes: 140; a disk with 139 free fails at `fzero.init`, 140 is enough."""
    import shutil

    real = shutil.disk_usage
    mesh = fzero.SimMesh(1)
    tree = {"w": torch.ones(10), "f": torch.ones(6)}
    frozen = (fzero.ParamGroup("frozen", match=lambda p: p == "f", frozen=True),)

    def make(free):
        monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=free))
        return mesh.run(lambda: fzero.init(tree, optim.adamw(0.1), stage=3, mesh=mesh, groups=frozen,
                                           units=lambda p: p, precision=fzero.Precision(torch.bfloat16),
                                           offload=fzero.Offload(optimizer="nvme", params="nvme",
                                                                 nvme_path=str(tmp_path))))[0]

    with pytest.raises(fzero.OffloadError, match=r"has 139 bytes free, the swap files need 140 bytes \(1 more\)"):
        make(139)
    state = make(140)
    (b,) = [b for b, spec in enumerate(state.layout.buckets) if not spec.group.frozen]
    assert {n: (e.numel, e.dtype) for n, e in state.info.tier.files.entries.items()} == {
        f"b{b}/{f}": (10, d) for f, d in [("exp_avg", torch.float32), ("exp_avg_sq", torch.float32),
                                          ("master", torch.float32), ("params", torch.bfloat16)]}


@pytest.mark.parametrize("params", [None, "nvme"])
def test_nvme_refuses_a_copy_of_its_state(tmp_path, params):
    """A pytree copy of an NVMe state (`optree.tree_map(torch.clone, state)`, an independent
    snapshot of any other state) shares the swap files with the original and holds zeros where
    they hold the values: stepping it updated the files' newer values and, params="nvme", ran
    the units on those zeros (loss 0.0). The step and every reader refuse it
    (`NvmeTier.check_holds`), naming the bucket, the file and the way out; a map that keeps the
    tensors (the identity) is the state itself, and the state the step returned trains on."""
    import optree

    tree = {"a": torch.randn(5, 3), "b": torch.randn(7)}
    loss = lambda p, x: torch.tanh(p["a"] * x).sum() + (p["b"] * x).square().sum()  # noqa: E731
    mesh = fzero.SimMesh(1)

    def rank_fn():
        state = fzero.init(tree, optim.adamw(1e-2), stage=3, mesh=mesh, units=lambda p: p,
                           offload=fzero.Offload(optimizer="nvme", params=params, nvme_path=str(tmp_path)))
        step = fzero.train_step(loss, donate=True)
        state, _ = step(state, torch.tensor(1.0))
        copy = optree.tree_map(torch.clone, state, namespace="fzero")
        for use in (lambda s: step(s, torch.tensor(2.0)), fzero.gather,
                    lambda s: fzero.checkpoint.save(s, tmp_path / "ckpt")):
            with pytest.raises(fzero.OffloadError, match=r"master shard of bucket \d \(\['[ab]'\]\) is not the NVMe "
                                                         r"tier's stand-in.*fzero.checkpoint.save"):
                use(copy)
        same = optree.tree_map(lambda x: x, state, namespace="fzero")
        state, m = step(same, torch.tensor(2.0))
        return m.loss

    assert mesh.run(rank_fn)[0] > 0


def test_nvme_needs_donate_and_a_usable_path(tmp_path):
    mesh = fzero.SimMesh(1)
    with pytest.raises(fzero.OffloadError, match="does not exist"):
        mesh.run(lambda: fzero.init({"w": torch.ones(3)}, optim.adamw(0.1), stage=1, mesh=mesh,
                                    offload=fzero.Offload(optimizer="nvme", nvme_path=str(tmp_path / "missing"))))

    def undonated():
        state = fzero.init({"w": torch.ones(3)}, optim.adamw(0.1), stage=1, mesh=mesh,
                           offload=fzero.Offload(optimizer="nvme", nvme_path=str(tmp_path)))
        fzero.train_step(lambda p, x: p["w"].sum() * x)(state, torch.tensor(1.0))

    with pytest.raises(fzero.ConfigError, match=r"writes the optimizer state's swap files in place.*donate=True"):
        mesh.run(undonated)


def test_evaluate_reads_offloaded_states(tmp_path):
    """`fzero.evaluate` (a forward through the units, prefetching) gives the same output for an
    offloaded state (host memory, or NVMe: the master and, params="nvme", the shards in files) as
    for the plain one after the same step."""
    gen = torch.Generator().manual_seed(5)
    tree = {f"l{i}.w": torch.randn(6, 6, generator=gen) / 3 for i in range(3)}

    def loss(p, x):
        for i in range(3):
            x = torch.tanh(x @ p[f"l{i}.w"])
        return x.float().square().mean()

    mesh = fzero.SimMesh(2)

    def rank_fn(x):
        out = []
        nvme = dict(optimizer="nvme", nvme_path=str(tmp_path))
        for stage, off in ((2, None), (2, fzero.Offload(optimizer="cpu")), (2, fzero.Offload(**nvme)), (3, None),
                           (3, fzero.Offload(optimizer="cpu", params="cpu")),
                           (3, fzero.Offload(**nvme, params="nvme"))):
            s = fzero.init(tree, optim.adamw(1e-2), stage=stage, mesh=mesh, units=lambda p: p.split(".")[0],
                           precision=fzero.Precision(torch.bfloat16), offload=off)
            s, _ = fzero.train_step(loss, donate=True)(s, x)
            out.append(fzero.evaluate(loss, prefetch=1)(s, x))
        return out

    for outs in mesh.run(rank_fn, [(torch.randn(3, 6, generator=gen).bfloat16(),) for _ in range(2)]):
        assert all(torch.equal(outs[0], o) for o in outs[1:3]) and all(torch.equal(outs[3], o) for o in outs[4:])


@pytest.mark.parametrize("offload", [None, fzero.Offload(optimizer="cpu")])
def test_gather_of_a_stage3_master_all_gathers_each_bucket_once(offload):
    """`fzero.gather` of a stage-3 state that keeps a master shard (a bf16 policy; optimizer
    offload) returns the params and all-gathers each bucket's `N * S` elements once: the stage's
    `enter` gathers the master shard itself (gathering it first, then entering the full buffer,
    moved N times the bytes); besides them, the gather's own 1-element marker."""
    n = 2
    mesh = fzero.SimMesh(n)
    params = {"a": torch.arange(8.0), "b": torch.arange(6.0).reshape(2, 3)}

    def rank_fn():
        state = fzero.init(params, optim.adamw(0.1), stage=3, mesh=mesh, units=lambda p: p,
                           precision=fzero.Precision(torch.bfloat16), offload=offload)
        with mesh.record() as log:
            full = fzero.gather(state)
        sizes = {spec.tag: spec.padded_numel for spec in state.layout.buckets}
        return full, [(r.tag, r.elements) for r in log if r.rank == mesh.rank and r.op == "all_gather"], sizes

    for full, gathers, sizes in mesh.run(rank_fn):
        assert torch.equal(full["a"], params["a"]) and torch.equal(full["b"], params["b"])
        assert sorted(gathers) == sorted([*sizes.items(), ("fzero.gather", n)])


def _cuda_steps(mesh, stage, offload, policy):
    """Three donating steps of `stage` on one GPU (4 units of one 256 x 256 fp32 bucket each,
    AdamW, stage 3 prefetching 2 units): `(gathered params, [grad norm per step])`."""
    gen = torch.Generator().manual_seed(7)
    tree = {f"u{i}.w": torch.randn(256, 256, generator=gen) / 16 for i in range(4)}

    def loss(p, x):
        for i in range(4):
            x = torch.tanh(x @ p[f"u{i}.w"])
        return x.float().square().mean()

    state = fzero.init(tree, optim.adamw(1e-3), stage=stage, mesh=mesh, units=lambda p: p.split(".")[0],
                       precision=POLICIES[policy], offload=offload)
    step = fzero.train_step(loss, donate=True, prefetch=2 if stage == 3 else 0)
    norms = []
    for t in range(3):
        x = torch.randn(32, 256, generator=torch.Generator().manual_seed(t))
        state, met = step(state, x.to(mesh.device, POLICIES[policy].param_dtype or torch.float32))
        norms.append(met.grad_norm)
    return fzero.gather(state), norms


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host buffers and CUDA streams: needs a GPU")
@pytest.mark.parametrize("stage, params, policy", [(2, None, "none"), (3, None, "none"), (3, "nvme", "none"),
                                                   (3, "nvme", "bf16")])
def test_nvme_on_cuda_with_every_copy_delayed_is_bitwise_the_cpu_tier(tmp_path, monkeypatch, nccl_mesh, stage, params,
                                                                      policy):
    """On CUDA every host buffer an asynchronous copy reads outlives that copy, and none is written
    before it ran: each host -> device copy (`HostTier.to_device`, `Loading.wait`) and each
    device -> host copy (`start_host`) is queued behind ~10 ms of `torch.cuda._sleep`, so the host
    runs far ahead of the copies. Were a copy to read a swap read buffer (`NvmeTier.host_cast`
    makes the master the update hands over a buffer of its own: the next bucket's prefetch refills
    the read buffer while the copy waits), or a `start_load` buffer the caching host allocator
    handed out again before the copy's event (buffers allocated in the reader threads), the
    params would differ from the "cpu" tier's run without delays; they are bitwise equal, as are
    the gradient norms, and the delayed copies did run."""
    from fzero._src import offload as offload_mod

    mesh = nccl_mesh
    sleep = 20_000_000  # GPU cycles: ~10 ms at 2 GHz, far longer than a 256 KiB file read on the host
    tier, loading = offload_mod.HostTier, offload_mod.Loading
    to_device, wait, start_host = tier.to_device, loading.wait, tier.start_host
    delayed = []

    def late(host_tier, stream=None):  # sleep on `stream` (the current one by default) before the copy
        if host_tier.cuda:
            with torch.cuda.stream(stream or torch.cuda.current_stream()):
                torch.cuda._sleep(sleep)
            delayed.append(stream is None)

    want = _cuda_steps(mesh, stage, fzero.Offload(optimizer="cpu", params=params and "cpu"), policy)
    monkeypatch.setattr(tier, "to_device", lambda self, x, d: (late(self), to_device(self, x, d))[1])
    monkeypatch.setattr(loading, "wait", lambda self: (late(self.tier), wait(self))[1])
    monkeypatch.setattr(tier, "start_host", lambda self, x: (
        late(self, offload_mod._side_stream(x.device)) if x.device.type == "cuda" else None,
        start_host(self, x))[1])
    nvme = fzero.Offload(optimizer="nvme", params=params, nvme_path=str(tmp_path))
    got = _cuda_steps(mesh, stage, nvme, policy)
    torch.cuda.synchronize()
    assert_equal_leaves(got[0], want[0], f"cuda, stage {stage}, params={params}: nvme (delayed) vs cpu")
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    assert delayed.count(True) >= 12 and delayed.count(False) >= 12  # host -> device, device -> host: 4 buckets x 3


# -- gradient shards to the host inside backward (unit.Inflight's host, offload.early_copies) -----


def _early_run(monkeypatch, offload, n, micro=1, clip=None, policy="none", ratio_buckets=False):
    """Stage 2 or 3 runs (the step's Inflight gets `early_copies` from `step.backward`), logging
    each `HostTier.start_host` call:
    True where it returned a copy started during the backward. Returns the log per rank and step,
    and the gathered params, loss and gradient norm per rank."""
    gen = torch.Generator().manual_seed(5)
    tree = {f"l{i}.w": torch.randn(6, 6, generator=gen) / 3 for i in range(3)}
    xs = [torch.randn(4, 6, generator=gen) for _ in range(n)]
    stage, params = offload

    def loss(p, x):
        for i in range(3):
            x = torch.tanh(x @ p[f"l{i}.w"])
        return x.float().square().mean()

    mesh = fzero.SimMesh(n)
    logs = {}
    original = HostTier.start_host

    def spy(self, x):
        hit = self.early.get(id(x))
        logs.setdefault(threading.get_ident(), []).append(hit is not None and hit[0]() is x)
        return original(self, x)

    def rank_fn(x, off):
        state = fzero.init(tree, optim.adamw(1e-2), stage=stage, mesh=mesh, units=lambda p: p.split(".")[0],
                           precision=POLICIES[policy], offload=off, bucket_bytes=4 * 36 if ratio_buckets else None)
        step = fzero.train_step(loss, micro_batches=micro, clip_norm=clip, donate=True)
        for t in range(2):
            batch = (x + t).to(POLICIES[policy].param_dtype or torch.float32)
            state, met = step(state, batch if micro == 1 else [batch, batch.flip(0)])
        return fzero.gather(state), met.loss, met.grad_norm, threading.get_ident()

    with monkeypatch.context() as m:  # set once, here: monkeypatch is not thread-safe
        m.setattr(HostTier, "start_host", spy)
        want = mesh.run(rank_fn, [(x, None) for x in xs])
        got = mesh.run(rank_fn, [(x, fzero.Offload(optimizer="cpu", params=params,
                                                   ratio=0.5 if ratio_buckets else 1.0)) for x in xs])
    for (gp, gl, gn, _), (wp, wl, wn, _) in zip(got, want):
        assert_equal_leaves(gp, wp, f"stage {stage} params={params}")
        assert torch.equal(gl, wl) and torch.equal(gn, wn)
    return [logs.get(ident, []) for *_, ident in got]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("stage, params", [(2, None), (3, None), (3, "cpu")])
def test_gradient_copies_start_in_backward_and_the_update_takes_them(monkeypatch, n, stage, params):
    """One micro-batch, no rescale: each trainable bucket's reduced shard starts for the host in
    its unit's backward (a start_host that is not a hit), and the update's start_host of the same
    tensor returns that copy (a hit): per step 3 misses, then 3 hits. Bitwise the run without
    offload (the copy is of the tensor the update reads)."""
    logs = _early_run(monkeypatch, (stage, params), n)
    for log in logs:
        assert log == ([False] * 3 + [True] * 3) * 2, log


@pytest.mark.parametrize("what", ["micro", "clip"])
def test_early_copies_are_not_used_where_the_update_reads_another_tensor(monkeypatch, what):
    """Two micro-batches: no early copy (the update reads the sum; it copies it then). Clipping
    that clips: the first step (nothing copied early yet in the log's first three) and then the
    early copies count, since the host rescales its copy (`HostUpdate`'s factor: the same float32
    product, one rounding). Both bitwise the run without offload."""
    if what == "micro":
        logs = _early_run(monkeypatch, (3, None), 2, micro=2)
        assert all(log == [False] * 3 * 2 for log in logs), logs
    else:
        logs = _early_run(monkeypatch, (2, None), 2, clip=1e-3)
        assert all(log == ([False] * 3 + [True] * 3) * 2 for log in logs), logs


def test_early_copies_skip_buckets_kept_on_the_device(monkeypatch):
    """ratio < 1: without the bucket's index (the unit backward's `inflight.add(flight)`) nothing is
    copied early; with it (`add(flight, bucket)`) only the offloaded buckets are."""
    from fzero._src.offload import early_copies
    from fzero._src.stages import Flight
    from fzero._src.mesh import Pending
    from fzero._src.unit import Inflight

    tree = {f"l{i}.w": torch.randn(6, 6) for i in range(3)}
    mesh = fzero.SimMesh(1)
    state = mesh.run(lambda: fzero.init(tree, optim.adamw(1e-2), stage=2, mesh=mesh, units=lambda p: p.split(".")[0],
                                        offload=fzero.Offload(optimizer="cpu", ratio=0.5)))[0]
    host = [b for b in range(3) if state.info.host_tier(b) is not None]
    assert host == [1, 2]
    started = []
    monkeypatch.setattr(HostTier, "start_early", lambda self, x, norm=None: started.append(x))
    shards = [torch.randn(36) for _ in range(3)]
    for bucket in (None, 0, 1, 2):
        inflight = Inflight(host=early_copies(state.info, 1))
        for b, x in enumerate(shards):
            inflight.add(Flight(Pending(x)), bucket if bucket is None else b)
        inflight.wait()
    assert [id(x) for x in started] == [id(shards[b]) for b in host] * 3
    assert early_copies(state.info, 2) is None  # accumulation: the update copies the sum


def test_inflight_hands_each_reduced_shard_to_host_once_when_it_exists():
    """A flight done at start (N = 1) goes to `host` at `add`; an open one when it is closed
    (make_room, add past depth, wait), after its wait; each once."""
    from fzero._src.stages import Flight
    from fzero._src.mesh import Pending

    class Open:  # a backend handle: the result exists once waited
        def __init__(self, log, x):
            self.log, self.x = log, x

        def wait(self):
            self.log.append(("waited", id(self.x)))

    log = []
    host = lambda x, b: log.append(("host", id(x), b))  # noqa: E731
    from fzero._src.unit import Inflight

    inflight = Inflight(depth=1, host=host)
    a, b, c = torch.zeros(2), torch.ones(2), torch.full((2,), 2.0)
    inflight.add(Flight(Pending(a)), 0)  # done at start
    assert log == [("host", id(a), 0)]
    inflight.add(Flight(Pending(b, work=Open(log, b))), 1)  # past depth: a is closed (already handed over)
    assert log == [("host", id(a), 0)]
    inflight.make_room()  # b is closed: waited, then handed over
    assert log[1:] == [("waited", id(b)), ("host", id(b), 1)]
    inflight.add(Flight(Pending(c, work=Open(log, c))), 2)
    inflight.wait()
    assert log[3:] == [("waited", id(c)), ("host", id(c), 2)]


def test_params_offload_casts_each_shard_once_per_step_not_per_unit():
    """params="cpu" under a bf16 policy: the state keeps a bf16 host copy of each trainable master
    shard beside it (made once per step, after the update), so no unit's enter -- forward, and the
    backward's refill of a released unit -- casts a shard fp32 -> bf16 on the host. Counted over a
    step's aten ops (a cast is `_to_copy` or `copy_` from a float32 tensor into a bfloat16 one of a
    shard's size): one per trainable bucket per step, whatever the number of enters. Before the
    copy existed every enter cast its shard on the host: 9 per step here, not 3."""
    from torch.utils._python_dispatch import TorchDispatchMode

    tree = {f"l{i}.w": torch.randn(6, 6) / 3 for i in range(3)}
    bf16 = fzero.Precision(torch.bfloat16)

    def loss(p, x):
        for i in range(3):
            x = torch.tanh(x @ p[f"l{i}.w"])
            p.release(f"l{i}")  # freed now, gathered again when backward reads it
        return x.float().square().mean()

    class Casts(TorchDispatchMode):
        def __init__(self, sizes):
            super().__init__()
            self.sizes, self.count = sizes, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            src = args[1] if func is torch.ops.aten.copy_.default else args[0]
            dst = args[0] if func is torch.ops.aten.copy_.default else out
            if (func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default) and src.dtype == torch.float32
                    and dst.dtype == torch.bfloat16 and src.numel() in self.sizes):
                self.count += 1
            return out

    mesh = fzero.SimMesh(2)

    def rank_fn(x):
        state = fzero.init(tree, optim.adamw(1e-2), stage=3, mesh=mesh, units=lambda p: p.split(".")[0],
                           precision=bf16, offload=fzero.Offload(optimizer="cpu", params="cpu"))
        assert all(p.dtype == torch.bfloat16 and m.dtype == torch.float32 for p, m in zip(state.params, state.master))
        step = fzero.train_step(loss, donate=True, prefetch=1)
        counts = []
        for t in range(2):
            with Casts({b.shard_numel for b in state.layout.buckets}) as casts:
                state, _ = step(state, (x + t).to(torch.bfloat16))
            counts.append(casts.count)
        return counts

    for counts in mesh.run(rank_fn, [(torch.randn(4, 6),) for _ in range(2)]):
        assert counts == [3, 3], counts


def test_host_update_rescales_the_host_copy_as_the_device_would():
    """`HostUpdate(..., factor)`: the host copy of each offloaded bucket's unscaled shard times the
    factor -- the device's `g * factor` bit for bit (one float32 rounding of the same product) --
    for a step that leaves the rescale of offloaded buckets to the host (its early copies are then
    of the tensors the update reads); buckets on the device pass through unscaled and untouched."""
    from fzero._src.offload import HostUpdate

    tree = {f"l{i}.w": torch.randn(6, 6) for i in range(3)}
    mesh = fzero.SimMesh(1)
    state = mesh.run(lambda: fzero.init(tree, optim.adamw(1e-2), stage=2, mesh=mesh, units=lambda p: p.split(".")[0],
                                        offload=fzero.Offload(optimizer="cpu", ratio=0.5)))[0]
    reduced = {b: torch.randn(36) for b in range(3)}
    factor = 0.3  # not a power of two: the product rounds
    host = HostUpdate(state.info, reduced, factor)
    for b, g in reduced.items():
        got, _, _, _ = host.inputs(b, g, state.opt_state[b], state.master[b], None)
        if state.info.host_tier(b) is None:
            assert got is g
        else:
            assert got is not g and torch.equal(got, g * factor) and not torch.equal(got, g)


# -- an NVMe tier's I/O errors in a step (found in review) --------------------------------------


def _nvme_run(tmp_path, fail, steps=3):
    """A donating stage-2 AdamW run of `steps` steps on an NVMe tier, params and losses; `fail(k)`
    runs before step k and may return a context (a simulated I/O error) under which that step is
    tried first, then retried outside it."""
    mesh = fzero.SimMesh(1)
    tmp_path.mkdir()
    g = torch.Generator().manual_seed(3)
    params = {"a": torch.randn(6, generator=g), "b": torch.randn(4, 3, generator=g)}
    xs = [torch.randn(3, generator=g) for _ in range(steps)]
    loss = lambda p, x: (p["a"][:3] * x).tanh().sum() + (p["b"] @ x).square().sum()  # noqa: E731

    def rank_fn():
        state = fzero.init(params, fzero.optim.adamw(1e-2), stage=2, mesh=mesh, units=lambda path: path,
                           offload=fzero.Offload(optimizer="nvme", nvme_path=str(tmp_path)))
        step, errors = fzero.train_step(loss, donate=True), []
        for k, x in enumerate(xs):
            context = fail(k)
            if context is not None:
                with context, pytest.raises(fzero.OffloadError) as e:
                    step(state, x)
                errors.append(str(e.value))
            state, _ = step(state, x)
        return fzero.gather(state), errors

    return mesh.run(rank_fn)[0]


def test_a_step_retried_after_a_failed_swap_read_equals_the_run_without_it(tmp_path, monkeypatch):
    """A swap-file read that fails once (EIO) kept its failed read in the pool: every later read
    of that entry raised it again, so the state could never step or be saved (found in review).
    The failed read now gives its buffer back, and the update gives back every read buffer it
    holds when it raises: the retry reads the files and equals the run that never failed."""
    import errno

    from fzero._src import nvme

    real = nvme._pread_all
    left = {"n": 0}

    def flaky(*args):
        if left["n"]:
            left["n"] -= 1
            raise OSError(errno.EIO, "Input/output error (simulated)")
        return real(*args)

    monkeypatch.setattr(nvme, "_pread_all", flaky)

    @contextlib.contextmanager
    def once():
        left["n"] = 1
        yield

    want, _ = _nvme_run(tmp_path / "clean", lambda k: None)
    got, errors = _nvme_run(tmp_path / "flaky", lambda k: once() if k == 1 else None)
    assert len(errors) == 1 and "EIO" in errors[0] and "SwapFiles.read" in errors[0]
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_a_state_whose_swap_write_failed_is_still_a_load_target(tmp_path, monkeypatch):
    """After a swap-file write failed in a step (ENOSPC), the input state's files hold part of
    the next step: it cannot step again, but `checkpoint.load(path, state)` refused it as a target
    too (found in review), though a load reads only the target's structure and gives the loaded
    state swap files of its own. It is now taken, and the loaded state steps on; a step of it
    says that its update failed and the state is lost (it blamed a copy or an older state)."""
    import errno

    from fzero._src import nvme

    mesh = fzero.SimMesh(1)
    real = nvme._pwrite_all

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device (simulated)")

    def rank_fn():
        state = fzero.init({"a": torch.ones(6), "b": torch.ones(4)}, fzero.optim.adamw(1e-2), stage=2, mesh=mesh,
                           units=lambda path: path, offload=fzero.Offload(optimizer="nvme", nvme_path=str(tmp_path)))
        step = fzero.train_step(lambda p, x: (p["a"] * x).sum() + p["b"].square().sum(), donate=True)
        state, _ = step(state, torch.ones(6))
        saved = fzero.checkpoint.save(state, tmp_path / "ck")
        monkeypatch.setattr(nvme, "_pwrite_all", full)
        with pytest.raises(fzero.OffloadError, match="No space left"):
            step(state, torch.ones(6))
        monkeypatch.setattr(nvme, "_pwrite_all", real)
        with pytest.raises(fzero.OffloadError, match=r"step raised while its NVMe tier was updating it \(OffloadError: "
                                                     r".*No space left.*the state is lost.*checkpoint.load"):
            step(state, torch.ones(6))  # (the message blamed a copy or an older state)
        loaded = fzero.checkpoint.load(saved, state)
        loaded, m = step(loaded, torch.ones(6))
        return int(loaded.step), m.skipped

    assert mesh.run(rank_fn)[0] == (2, False)


def test_a_swap_read_failing_on_one_rank_of_two_loses_the_others_state_and_a_checkpoint_restores_both(tmp_path,
                                                                                                     monkeypatch):
    """docs/offload.md: at stages 1-2 each bucket's all-gather starts right after its update, so
    when rank 1's first read fails (EIO) rank 0 has written a bucket in place: it gets `RankFailed`
    and its state is lost, so a retry cannot pair up (found in review of an offload user: the docs
    promised the retry for one rank only). Every rank loading the last checkpoint is the way on:
    the run then equals the one that never failed."""
    import errno

    from fzero._src import nvme

    real, armed = nvme._pread_all, {"path": None, "left": 0}

    def flaky(fd, out, offset, path):
        if armed["left"] and path.startswith(armed["path"]):
            armed["left"] -= 1
            raise OSError(errno.EIO, "Input/output error (simulated)")
        return real(fd, out, offset, path)

    monkeypatch.setattr(nvme, "_pread_all", flaky)
    g = torch.Generator().manual_seed(3)
    params = {"a": torch.randn(6, generator=g), "b": torch.randn(4, 3, generator=g)}
    xs = [[torch.randn(3, generator=g) for _ in range(3)] for _ in range(2)]
    loss = lambda p, x: (p["a"][:3] * x).tanh().sum() + (p["b"] @ x).square().sum()  # noqa: E731

    def run(fail: bool):
        mesh = fzero.SimMesh(2)

        def rank_fn(mine):
            state = fzero.init(params, fzero.optim.adamw(1e-2), stage=2, mesh=mesh, units=lambda path: path,
                               offload=fzero.Offload(optimizer="nvme", nvme_path=str(tmp_path)))
            step, seen = fzero.train_step(loss, donate=True), []
            state, _ = step(state, mine[0])
            fzero.checkpoint.save(state, tmp_path / f"ckpt-{fail}")
            if fail and mesh.rank == 1:
                armed.update(path=state.info.tier.files.path, left=1)
            for k in (1, 2):
                try:
                    state, _ = step(state, mine[k])
                    continue
                except (fzero.OffloadError, fzero.RankFailed) as e:
                    seen.append(type(e).__name__)
                try:  # the retry: rank 0's state is lost, so neither pairs up
                    step(state, mine[k])
                except fzero.FzeroError as e:
                    seen.append(type(e).__name__ + (": lost" if "lost" in str(e) else ""))
                state = fzero.checkpoint.load(fzero.checkpoint.latest(tmp_path / f"ckpt-{fail}"), state)
                state, _ = step(state, mine[1])
                state, _ = step(state, mine[2])
                break
            return fzero.gather(state), seen

        return mesh.run(rank_fn, [(x,) for x in xs])

    clean = run(False)
    (got0, seen0), (got1, seen1) = run(True)
    assert seen0[0] == "RankFailed" and seen0[1].endswith(": lost"), seen0
    assert seen1[0] == "OffloadError" and seen1[1].startswith("RankFailed"), seen1
    for got in (got0, got1):
        assert got.keys() == clean[0][0].keys() and all(torch.equal(got[k], clean[0][0][k]) for k in got)
