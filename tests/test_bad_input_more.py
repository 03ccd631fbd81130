"""More bad input for `fzero.init`, `ParamGroup` and the optimizers (docs/bad-input.md): memory
shared between leaves, NaN / inf initial params, params that differ across ranks by path, wrong
types given for `groups` / `ParamGroup` fields, and non-finite hyper-parameters."""

from __future__ import annotations

import dataclasses

import math

import numpy as np
import pytest
import torch

import fzero
from fzero import optim


def _init(params, *, n: int = 2, stage: int = 1, opt=None, **kw):
    mesh = fzero.SimMesh(n)
    return mesh.run(lambda: fzero.init(params, opt or optim.sgd(0.1), stage=stage, mesh=mesh, **kw))


# --- leaves that share memory (item 7) ----------------------------------------------------------

def test_leaves_sharing_memory_are_refused_naming_both_paths():
    w = torch.arange(12.0).reshape(4, 3)
    base = torch.arange(10.0)
    bad = {
        "transpose": ({"emb": w, "head": w.t()}, ("'emb'", "'head'")),
        "reshape": ({"a": base, "b": base.view(2, 5)}, ("'a'", "'b'")),
        "overlapping slices": ({"a": base[:3], "b": base[1:]}, ("'a'", "'b'")),
        "strided, one shared element": ({"a": base[0::2], "b": base[4::3]}, ("'a'", "'b'")),  # both hold base[4]
        "expanded": ({"a": base[:1].expand(4), "b": base[:2]}, ("'a'", "'b'")),
        "another dtype": ({"a": base[:4], "b": base[2:6].view(torch.bfloat16)}, ("'a'", "'b'")),
    }
    arr = np.arange(8, dtype=np.float32)  # two tensors over two storages of one numpy buffer
    bad["numpy views"] = ({"a": torch.from_numpy(arr[:5]), "b": torch.from_numpy(arr[4:])}, ("'a'", "'b'"))
    for name, (params, paths) in bad.items():
        with pytest.raises(fzero.LayoutError, match="share memory") as info:
            _init(params, stage=0)
        assert all(p in str(info.value) for p in paths), (name, info.value)


def test_views_of_one_buffer_that_share_no_element_are_allowed():
    base = torch.arange(12.0)
    m = torch.arange(12.0).reshape(3, 4)
    ok = [
        {"a": base[:6], "b": base[6:]},  # disjoint slices
        {"c0": m[:, 0], "c1": m[:, 1], "c2": m[:, 2:]},  # interleaved columns: spans overlap, elements do not
        {"even": base[0::2], "odd": base[1::2]},
        {"a": base[:4].view(2, 2), "e": torch.empty(0), "f": base[:0]},  # zero-size leaves own no memory
    ]
    for params in ok:
        states = _init(params, stage=0)
        assert len(states) == 2


# --- NaN / inf initial params (item 9) ---------------------------------------------------------

def test_nonfinite_trainable_initial_params_are_refused_naming_leaf_shape_and_count():
    params = {"w": torch.ones(4), "bad": torch.tensor([[1.0, math.nan], [math.inf, 2.0]])}
    with pytest.raises(fzero.NonFiniteError, match=r"'bad' \(float32\[2, 2\]: 2 of 4 elements NaN or inf\)") as info:
        _init(params, stage=1)
    assert "'w'" not in str(info.value)


@pytest.mark.parametrize("sync", [True, False])
def test_only_the_values_kept_are_checked(sync):
    """With sync, rank 0's values are broadcast: a NaN on rank 1 only is overwritten, not refused;
    without sync rank 1 keeps its own values and every rank raises, naming rank 1 (the flag rides
    init's serial all-gather: rank 0 does not wait in a collective rank 1 left)."""
    mesh = fzero.SimMesh(2)

    def rank_fn(w):
        return fzero.init({"w": w}, optim.sgd(0.1), stage=2, mesh=mesh, sync=sync)

    args = [(torch.ones(3),), (torch.tensor([1.0, math.nan, 1.0]),)]
    if sync:
        assert len(mesh.run(rank_fn, args)) == 2
    else:
        def caught(w):
            with pytest.raises(fzero.NonFiniteError, match=r"the values of rank\(s\) \[1\]"):
                rank_fn(w)
            return True

        assert mesh.run(caught, args) == [True, True]


def test_frozen_leaves_may_hold_inf():
    mesh = fzero.SimMesh(2)
    params = {"w": torch.ones(3), "mask": torch.tensor([0.0, -math.inf, 0.0])}
    groups = [fzero.ParamGroup("mask", match=lambda p: p == "mask", frozen=True)]

    def rank_fn():
        state = fzero.init(params, optim.sgd(0.1), stage=3, mesh=mesh, groups=groups)
        state, _ = fzero.train_step(lambda p, x: (p["w"] ** 2).sum())(state, None)
        return fzero.gather(state)

    out = mesh.run(rank_fn)[0]
    # SGD on the reduced gradient 2w = 2 (fl(1/2) = 1/2: exact), as torch.optim.SGD(foreach=False) writes it: the
    # same float32 op, so the same bits (was `allclose` to 0.8, a tolerance nothing derived)
    want = torch.ones(3).add_(torch.full((3,), 2.0), alpha=-0.1)
    assert torch.equal(out["mask"], params["mask"]) and torch.equal(out["w"], want), out


# --- params differing across ranks by path (item 10b) -------------------------------------------

def test_params_whose_paths_differ_across_ranks_say_so():
    mesh = fzero.SimMesh(2)
    with pytest.raises(fzero.LayoutError, match=r"the paths differ: rank\(s\) \[1\]") as info:
        mesh.run(lambda key: fzero.init({key: torch.ones(3)}, optim.sgd(0.1), stage=1, mesh=mesh), [("v",), ("u",)])
    assert "same count" not in str(info.value)
    with pytest.raises(fzero.LayoutError, match=r"same count, other shape or dtype: the dtype differs on rank\(s\) \[1\]"):
        mesh.run(lambda d: fzero.init({"w": torch.ones(3, dtype=d)}, optim.sgd(0.1), stage=1, mesh=mesh),
                 [(torch.float32,), (torch.float64,)])
    with pytest.raises(fzero.LayoutError, match="pytree structure does not"):
        mesh.run(lambda p: fzero.init(p, optim.sgd(0.1), stage=1, mesh=mesh), [([torch.ones(3)],), ((torch.ones(3),),)])


def test_params_of_other_leaf_counts_or_containers_name_them_alike_on_every_rank():
    """Found in review: other leaf counts said the counts only, and other containers each rank's
    own treespec (so the ranks' words differed)."""
    mesh = fzero.SimMesh(3)

    def words(make):
        def rank_fn(r):
            try:
                fzero.init(make(r), optim.sgd(0.1), stage=1, mesh=mesh)
            except fzero.LayoutError as e:
                return str(e)
        return mesh.run(rank_fn, [(0,), (1,), (2,)])

    base = {"w": torch.ones(4, 3), "b": torch.zeros(3)}
    got = words(lambda r: base | ({"extra": torch.ones(2)} if r == 1 else {}) if r != 2 else {"w": base["w"]})
    assert got == [got[0]] * 3 and got[0] == (
        "params differ across ranks (world size 3): rank 0: 2 leaves, rank 1: 3 leaves, rank 2: 1 leaf (rank 1 has "
        "'extra'; rank 2 lacks 'b', against rank 0's); every rank must pass the same pytree structure"), got
    got = words(lambda r: [torch.ones(3)] if r == 2 else (torch.ones(3),))
    assert got == [got[0]] * 3 and "(rank 0: PyTreeSpec((*,)); rank 2: PyTreeSpec([*]))" in got[0], got


@pytest.mark.parametrize("n,shapes", [(2, [(2, 3), (3, 2)]), (3, [(4,), (4,), (5,)])])
def test_params_whose_shapes_differ_across_ranks_name_every_ranks_shape(n, shapes):
    """The message names the leaf's path, each rank's path, dtype and shape (before: this rank's
    shape and each rank's element count only), the world size, the leaves after it that differ
    too, and the way out (on SimMesh rank 0 raises it, the others stop with `RankFailed`; on
    DistMesh every rank raises it: tests/test_ddp.py)."""
    mesh = fzero.SimMesh(n)
    with pytest.raises(fzero.LayoutError, match=rf"world size {n}\) at leaf 'w' \(rank 0's path; leaf 1 of 3") as info:
        mesh.run(lambda r: fzero.init({"a": torch.ones(2), "w": torch.ones(shapes[r]), "z": torch.ones(shapes[r])},
                                      optim.sgd(0.1), stage=1, mesh=mesh), [(r,) for r in range(n)])
    message = str(info.value)
    each = ", ".join(f"rank {r}: 'w' float32{list(shape)} ({math.prod(shape)} elements)"
                     for r, shape in enumerate(shapes))
    assert each in message, message
    assert "1 later leaf(s) differ too" in message
    assert "build the params the same way on every rank" in message


# --- wrong types (item 11) ----------------------------------------------------------------------

@pytest.mark.parametrize("engine", ["autograd", "func"])
def test_params_without_tensor_leaves_train_nothing_with_either_engine(engine):
    """Params with no tensor leaves make a state with nothing to train (the accounting tests draw
    them): a step computes the loss and updates nothing, with either engine (the autograd
    engine raised torch's "`inputs` argument to `grad()` cannot be empty")."""
    for params in ({}, [], {"a": {}}):
        mesh = fzero.SimMesh(1)

        def rank_fn():
            state = fzero.init(params, optim.sgd(0.1), stage=3, mesh=mesh)
            new, m = fzero.train_step(lambda p, x: x.sum(), engine=engine)(state, torch.ones(2, requires_grad=True))
            return m.loss.item(), m.grad_norm.item(), int(new.step)

        assert mesh.run(rank_fn) == [(2.0, 0.0, 1)]


def test_wrong_groups_name_the_argument_and_the_value():
    params = {"w": torch.ones(3)}
    cases = [
        (None, r"groups must be a list .*got NoneType None"),
        ([3], r"groups\[0\] must be a fzero.ParamGroup.*got int 3"),
        ("nowd", r"groups must be a list .*got str 'nowd'"),
        (fzero.ParamGroup("g"), r"got one ParamGroup 'g'; pass groups=\[\.\.\.\]"),
    ]
    for groups, match in cases:
        with pytest.raises(fzero.LayoutError, match=match):
            _init(params, groups=groups)
    with pytest.raises(fzero.LayoutError, match=r"units\['a'\] must be a callable"):
        _init(params, units={"a": "w"})


def test_paramgroup_fields_are_checked_by_type():
    cases = [
        (dict(lr_scale="2"), r"lr_scale must be a Python float .*got str '2'"),
        (dict(lr_scale=True), r"lr_scale must be a Python float"),
        (dict(lr_scale=10**400), r"lr_scale must be finite"),
        (dict(match="w"), r"match must be None \(every leaf\) or a callable path -> bool, got str 'w'"),
        (dict(weight_decay=0.01), r"weight_decay must be a bool .*got float 0.01; a group has no decay amount"),
        (dict(frozen="yes"), r"frozen must be a bool"),
        (dict(name=3), r"name must be a str"),
    ]
    for kw, match in cases:
        with pytest.raises(fzero.LayoutError, match=match):
            fzero.ParamGroup(**{"name": "g", **kw})
    assert fzero.ParamGroup("g", weight_decay=0.0).weight_decay is False  # torch's spelling of "no decay"
    assert fzero.ParamGroup("g", lr_scale=2).lr_scale == 2.0 and isinstance(fzero.ParamGroup("g", lr_scale=2).lr_scale, float)


def test_offload_given_deepspeeds_config_keys_names_fzeros():
    """DeepSpeed's `offload_optimizer` keys (`device`, `pin_memory`, `buffer_count`) were Python's
    bare `TypeError`; now a `ConfigError` naming fzero's setting for each, or that there is none
    (found in review of an offload user). Positional and known keywords still work."""
    with pytest.raises(fzero.ConfigError, match=r"Offload got 'device' \(device -> optimizer= .*or params="):
        fzero.Offload(device="cpu")
    with pytest.raises(fzero.ConfigError, match=r"'pin_memory', 'buffer_count' \(pin_memory -> pin=; buffer_count -> "
                                                r"no such setting"):
        fzero.Offload(optimizer="cpu", pin_memory=True, buffer_count=4)
    assert fzero.Offload("cpu", None, None, 0.5, pin=False) == fzero.Offload(optimizer="cpu", ratio=0.5, pin=False)
    with pytest.raises(fzero.ConfigError, match=r"e.g. fzero.Offload\(optimizer='cpu'\), got str 'cpu'"):
        fzero.init({"w": torch.zeros(4)}, optim.sgd(0.1), stage=1, mesh=fzero.SimMesh(1), offload="cpu")
    with pytest.raises(fzero.ConfigError, match=r"Offload\(params='nvme'\) keeps param shards in swap files, but stage 2"):
        fzero.init({"w": torch.zeros(4)}, optim.sgd(0.1), stage=2, mesh=fzero.SimMesh(1),
                   offload=fzero.Offload(optimizer="nvme", params="nvme", nvme_path="/tmp"))


def test_paramgroup_given_torchs_per_group_keys_names_what_a_group_sets():
    """torch's param-group keys (`lr`, `betas`, `eps`) were Python's bare `TypeError` ("unexpected
    keyword argument"); now a `LayoutError` naming them, what a group sets, and for `lr` the
    `lr_scale` that gives it (found in review of a LoRA user). The fields keep their order and
    `dataclasses.replace` still works."""
    with pytest.raises(fzero.LayoutError, match=r"ParamGroup 'lora_B' got 'lr', which a group does not set: .*"
                                                 r"lr_scale\).*for lr=0.0001: lr_scale=0.0001 / the optimizer's lr"):
        fzero.ParamGroup("lora_B", lr=1e-4)
    with pytest.raises(fzero.LayoutError, match=r"got 'betas', 'eps', .*betas, eps and momentum are the optimizer's"):
        fzero.ParamGroup("g", betas=(0.9, 0.95), eps=1e-6)
    g = fzero.ParamGroup("g", None, False, 2.0)
    assert (g.name, g.match, g.weight_decay, g.lr_scale, g.frozen) == ("g", None, False, 2.0, False)
    assert dataclasses.replace(g, lr_scale=3).lr_scale == 3.0 and hash(g) == hash(fzero.ParamGroup("g", None, False, 2.0))
    with pytest.raises(fzero.LayoutError, match="lr_scale must be a Python float"):
        dataclasses.replace(g, lr_scale="3")


# --- hyper-parameters (lesser) ------------------------------------------------------------------

def test_nonfinite_or_negative_hyperparameters_are_refused_at_construction():
    inf, nan = math.inf, math.nan
    cases = [
        (lambda: optim.sgd(inf), "lr must be finite"),
        (lambda: optim.sgd(nan), r"lr must be a finite float >= 0.0, got nan"),
        (lambda: optim.sgd(-1.0), r"lr must be a finite float >= 0.0, got -1.0"),
        (lambda: optim.sgd(0.1, momentum=inf), "momentum must be finite"),
        (lambda: optim.sgd(0.1, weight_decay=inf), "weight_decay must be finite"),
        (lambda: optim.sgd(0.1, maximize="no"), "maximize must be a bool"),
        (lambda: optim.sgd(0.1, momentum=0.9, nesterov=2), "nesterov must be a bool"),
        (lambda: optim.adamw(inf), "lr must be finite"),
        (lambda: optim.adam(1e-3, eps=inf), "eps must be finite"),
        (lambda: optim.adam(1e-3, amsgrad="true"), "amsgrad must be a bool"),
        (lambda: optim.lamb(1e-3, weight_decay=inf), "weight_decay must be finite"),
        (lambda: optim.adafactor(inf), "lr must be finite"),
        (lambda: optim.adafactor(1e-2, relative_step=2), "relative_step must be a bool"),
        (lambda: optim.sgd([0.1, inf]), r"lr\[1\] must be finite"),
        (lambda: optim.sgd(10**400), "beyond float's range"),
        (lambda: optim.cosine(inf, 10), "peak must be finite"),
    ]
    for make, match in cases:
        with pytest.raises(optim.OptimizerError, match=match):
            make()
    with pytest.raises(optim.OptimizerError, match="lr at step 1 must be finite"):
        optim.as_schedule(lambda t: 0.1 if t == 0 else inf)(1)
    optim.adafactor(1e-2, d=inf)  # inf switches update clipping off: allowed


def test_sync_must_be_a_bool():
    for sync in ("no", 0, None):
        with pytest.raises(fzero.ConfigError, match=r"sync must be a bool .*got"):
            _init({"w": torch.ones(3)}, sync=sync)


def test_mesh_must_be_a_mesh():
    """Before: `mesh=None` (or a device, or a world size) raised an AttributeError from inside."""
    for mesh in (None, 2, "cpu", torch.device("cpu")):
        with pytest.raises(fzero.ConfigError, match=r"mesh must be a fzero.SimMesh\(N\) or fzero.DistMesh\(\).*got"):
            fzero.init({"w": torch.ones(3)}, optim.sgd(0.1), stage=1, mesh=mesh)


def test_frozen_leaves_may_share_memory_with_each_other_not_with_trainable_ones():
    """Frozen leaves are never updated, so two frozen views of one tensor stay tied (a frozen
    embedding and its transposed head); a trainable leaf overlapping a frozen one would drift
    from it, and is refused."""
    w = torch.randn(3, 4)
    frozen = [fzero.ParamGroup("tied", match=lambda p: p in ("emb", "head"), frozen=True)]
    mesh = fzero.SimMesh(1)

    def rank_fn():
        state = fzero.init({"emb": w, "head": w.t(), "x": torch.ones(2)}, optim.sgd(0.1), stage=1, mesh=mesh,
                           groups=frozen)
        return fzero.gather(state)

    (got,) = mesh.run(rank_fn)
    assert torch.equal(got["head"], w.t()) and torch.equal(got["emb"], w)
    half = [fzero.ParamGroup("emb", match=lambda p: p == "emb", frozen=True)]
    with pytest.raises(fzero.LayoutError, match="share memory"):
        _init({"emb": w, "head": w.t()}, groups=half, n=1)


def test_flags_take_numpy_bools_and_0_or_1_as_torch_does():
    """torch's flags take `amsgrad=0` or a numpy bool; so do fzero's (`layout.as_flag`); strings
    and other numbers are refused."""
    assert fzero.ParamGroup("g", frozen=np.True_).frozen is True
    assert fzero.ParamGroup("g", weight_decay=np.False_).weight_decay is False
    assert fzero.ParamGroup("g", weight_decay=1).weight_decay is True
    optim.adamw(0.1, amsgrad=0)
    optim.sgd(0.1, nesterov=np.False_)
    with pytest.raises(optim.OptimizerError, match="maximize must be a bool"):
        optim.sgd(0.1, maximize="no")
    with pytest.raises(fzero.LayoutError, match="frozen must be a bool"):
        fzero.ParamGroup("g", frozen=2)


# --- a loss that writes a param in place ----------------------------------------------------------

def _writes(p, c):
    """Uses its params, then clamps one in place under no_grad (what a user's constraint looks like)."""
    out = (p["a"] * c).sum() + p["b"].sum()
    with torch.no_grad():
        p["b"].clamp_(max=0.5)
    return out


def _writes_first(p, c):
    """Clamps a param in place under no_grad, then reads it (torch's view check raises in the loss)."""
    b = p["b"]
    with torch.no_grad():
        b.clamp_(max=0.5)
    return (p["a"] * c).sum() + b.sum()


def _writes_in_vmap(p, c):
    """The unit is first read inside a vmap (docs/func.md), then written after use."""
    out = torch.func.vmap(lambda ci: (p["a"] * ci).sum())(c.expand(2, 4)).sum() / 2 + p["b"].sum()
    with torch.no_grad():
        p["a"].mul_(0.5)
    return out


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_loss_writing_a_param_in_place_raises_naming_its_unit(stage, n):
    """Before: the write reached the input state where the stage holds the params whole (stages
    0-2, stage 3 at N = 1) and was lost at stage 3, N > 1: the stages differed, silently. Now
    `ConfigError` in every stage, naming the unit and its leaves (views of one buffer share one
    version counter, so the message cannot say which leaf): written after use or before (where
    torch's view check raises first, chained), with either engine, a unit first read inside a
    vmap; the same for `fzero.evaluate`, which still runs under `torch.inference_mode()`."""
    mesh = fzero.SimMesh(n)
    params = {"a": torch.ones(4), "b": torch.ones(3)}

    def rank_fn():
        for engine in ("autograd", "func"):  # func: the write reaches the tensor under torch.func's wrappers
            state = fzero.init(params, optim.sgd(0.1), stage=stage, mesh=mesh)
            with pytest.raises(fzero.ConfigError, match=r"the loss \(or evaluate function\) wrote a param in place, "
                                                        r"in unit\(s\) \['default'\]: one or more of 'a', 'b' "):
                fzero.train_step(_writes, engine=engine)(state, torch.ones(4))
        for loss_fn in (_writes_first, _writes_in_vmap):  # torch's own error, chained; a unit first read in vmap
            state = fzero.init(params, optim.sgd(0.1), stage=stage, mesh=mesh)
            with pytest.raises(fzero.ConfigError, match="wrote a param in place"):
                fzero.train_step(loss_fn)(state, torch.ones(4))
        state = fzero.init(params, optim.sgd(0.1), stage=stage, mesh=mesh)
        with pytest.raises(fzero.ConfigError, match="wrote a param in place"):
            fzero.evaluate(_writes)(state, torch.ones(4))
        state = fzero.init(params, optim.sgd(0.1), stage=stage, mesh=mesh)  # (the write reached the last one)
        with torch.inference_mode():  # leaves that are inference tensors keep no version: not checked, no error
            assert float(fzero.evaluate(lambda p, c: (p["a"] * c).sum() + p["b"].sum())(state, torch.ones(4))) == 7.0
        # reading, and writing a new tensor, are fine
        state = fzero.init(params, optim.sgd(0.1), stage=stage, mesh=mesh)
        _, m = fzero.train_step(lambda p, c: (p["a"] * c).sum() + p["b"].clamp(max=0.5).sum())(state, torch.ones(4))
        return m.loss

    assert mesh.run(rank_fn) == [4 + 1.5] * n


@pytest.mark.parametrize("precision", [None, "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_param_written_in_place_in_grad_mode_is_refused_by_torch_at_every_stage(stage, precision):
    """A write in grad mode (`p["b"].clamp_(max=0.5)` outside `torch.no_grad()`) is refused by
    torch itself, as the write to a view a Function returned, at every stage and policy, and
    reaches no state. Found in review of a first fix that handed stage 2-3 leaves detached from
    their buffer: torch then let the write through, so stage 2 (whose leaves lie in its state's
    full buffer) and stage 3 raised fzero's `ConfigError` after the loss instead, and stage 2's
    input state held the write (`gather_leaves`, `alone`)."""
    mesh = fzero.SimMesh(2)
    params = {"a": torch.ones(4), "b": torch.ones(3)}
    kw = {} if precision is None else {"precision": fzero.Precision(torch.bfloat16, torch.float32)}

    def rank_fn():
        state = fzero.init(params, optim.sgd(0.1), stage=stage, mesh=mesh, **kw)
        step = fzero.train_step(lambda p, c: (p["a"] * c).sum() + p["b"].clamp_(max=0.5).sum())
        with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
            step(state, torch.ones(4))
        return fzero.gather(state)["b"]

    assert all(torch.equal(b, torch.ones(3)) for b in mesh.run(rank_fn))


@pytest.mark.parametrize("stage", [0, 3])
def test_a_loss_writing_in_place_on_one_gloo_rank_stops_every_rank(dist2, stage):
    from . import dist_cases  # the pool's workers import it as tests.dist_cases

    out = dist2.run(dist_cases.loss_writes_on, [(stage, 1)] * 2, return_exceptions=True)
    assert isinstance(out[1].exception, fzero.ConfigError) and "wrote a param in place" in out[1].message, out[1]
    assert isinstance(out[0].exception, fzero.RankFailed) and "rank(s) [1] raised" in out[0].message, out[0]
    assert [float(r[0]) for r in dist2.run(dist_cases.loss_writes_on, [(stage, -1)] * 2)] == [4 + 3.0] * 2  # mesh.run's lists


@pytest.mark.parametrize("stage, call", [(0, "step"), (3, "step"), (3, "evaluate"), (3, "gather")])
def test_a_donated_state_reused_on_one_gloo_rank_stops_every_rank(dist2, stage, call):
    """Rank 1 passes the state its donating step consumed: it raises the donation error, and rank
    0 stops at once with `RankFailed` at the collective it waits in. Before, the state was checked
    outside the mesh's guard, so rank 0 waited out DistMesh's timeout and raised a `MeshError`."""
    from . import dist_cases

    out = dist2.run(dist_cases.donated_state_on, [(stage, call, 1)] * 2, return_exceptions=True)
    assert isinstance(out[1].exception, fzero.FzeroError) and "was donated" in out[1].message, out[1]
    assert isinstance(out[0].exception, fzero.RankFailed) and "rank(s) [1] raised" in out[0].message, out[0]
    # after one SGD step of gradient 1 (exact: fl(1/2)·1 + fl(1/2)·1), as torch.optim.SGD(foreach=False) writes it,
    # then the same float32 sums the worker's loss / evaluation / gather reads: the same bits, where a relative
    # tolerance of 1e-6 against the float64 4·0.9 + 3·0.9 stood before, derived from nothing
    a, b = (torch.ones(k).add_(torch.ones(k), alpha=-0.1) for k in (4, 3))
    want = {"step": float((a * torch.ones(4)).sum() + b.sum()), "evaluate": float((a * torch.ones(4)).sum()),
            "gather": float(a.sum())}[call]
    got = dist2.run(dist_cases.donated_state_on, [(stage, call, -1)] * 2)
    assert got == [want] * 2, (got, want)


def test_a_second_error_in_a_row_on_one_gloo_rank_still_stops_the_others(dist2):
    """A rank that catches an error and calls again, erring again with no collective between the
    two, tells the others both times. Before, the guard took "no collective since the last
    announcement" for "the same failure re-raised" and stayed silent the second time: rank 1's
    second `init` was paired with rank 0's third and the ranks went out of step (a wrong
    `LayoutError`, or a wait for DistMesh's timeout)."""
    from . import dist_cases

    (seen0, total0), (seen1, total1) = dist2.run(dist_cases.failing_twice)
    assert seen0 == ["ConfigError", "ConfigError"] and seen1 == ["RankFailed", "RankFailed"], (seen0, seen1)
    assert total0 == total1 == 4.0


# --- a unit first read under torch.no_grad() inside the loss ----------------------------------------

@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "rank 0 only"])
@pytest.mark.parametrize("engine", ["autograd", "func"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_param_first_read_under_no_grad_still_trains(stage, engine, mode):
    """Before: a loss that first read `p["w"]` under `torch.no_grad()` (a statistic) and then used
    it with grad got leaves made without a graph, so `w` was silently left untrained (with a unit
    per leaf; with one unit the step raised "no rank's loss depends on any trainable param").
    torch's params require grad however they are first touched: now every unit's leaves are made
    in the grad and inference modes the loss is called in, and the step equals torch's SGD bit for
    bit. "rank 0 only": rank 0 alone reads `w` first under no_grad (before: stages 0-1 updated
    `w` from rank 1's gradient alone, stages 2-3 raised `DivergentPaths`); the statistic is the
    same number on every rank, so the loss is too."""
    mesh = fzero.SimMesh(2)
    quiet = torch.inference_mode if mode == "inference_mode" else torch.no_grad

    def loss(p, c, first=True):
        if first:
            with quiet():
                s = float(p["w"].norm())
        else:
            s = float(p["w"].detach().norm())
        return (p["w"] ** 2 * c).sum() / s + p["b"].sum()  # (saves w for backward: no inference tensor may be it)

    def rank_fn():
        state = fzero.init({"w": torch.ones(3), "b": torch.ones(2)}, optim.sgd(0.1), stage=stage, mesh=mesh,
                           units=lambda path: path)
        first = mode != "rank 0 only" or mesh.rank == 0
        step = fzero.train_step(lambda p, c: loss(p, c, first), engine=engine)
        return fzero.gather(step(state, torch.arange(1.0, 4.0))[0])

    ref = {"w": torch.nn.Parameter(torch.ones(3)), "b": torch.nn.Parameter(torch.ones(2))}
    opt = torch.optim.SGD(ref.values(), lr=0.1)
    loss(ref, torch.arange(1.0, 4.0), first=False).backward()
    opt.step()
    for got in mesh.run(rank_fn):
        assert all(torch.equal(got[k], ref[k].detach()) for k in ref), (got, ref)


def test_a_batch_passed_whole_with_micro_batches_is_named():
    """`micro_batches=2` with one batch `(x, y)` reads it as the micro-batches `x` and `y`; before,
    torch raised inside the loss (a dtype error of cross_entropy), or, where the shapes let it,
    the loss ran on rows of x. Micro-batches whose tensors differ in dtype at one place, or that
    are bare tensors of different numbers of dimensions, are now a `ConfigError`; sizes may differ
    (a shorter last micro-batch), and so may structures and, inside them, dimensions (review: an
    image beside a video is a loss's business)."""
    mesh = fzero.SimMesh(1)
    x, y = torch.randn(4, 3), torch.randint(0, 2, (4,))

    def loss(p, b):
        if isinstance(b, dict):  # a micro-batch of another structure: fine
            b = (b["x"], b["y"])
        return torch.nn.functional.cross_entropy(b[0] @ p["w"], b[1])

    def rank_fn():
        state = fzero.init({"w": torch.ones(3, 2)}, optim.sgd(0.1), stage=1, mesh=mesh)
        step = fzero.train_step(loss, micro_batches=2)
        with pytest.raises(fzero.ConfigError, match=r"micro-batch 1's tensor #0 is int64\[4\] but micro-batch 0's "
                                                    r"is float32\[4, 3\].*reads as the micro-batches x and y"):
            step(state, (x, y))
        with pytest.raises(fzero.ConfigError, match=r"tensor #1 is float32\[2\] but micro-batch 0's is int64\[4\]"):
            step(state, [(x, y), (x[:2], y[:2].float())])
        with pytest.raises(fzero.ConfigError, match=r"micro-batch 1's tensor #0 is float32\[4\] but micro-batch 0's "
                                                    r"is float32\[4, 3\]"):
            step(state, (x, y.float()))  # a float target: the same dtype, one dimension fewer
        # structured micro-batches may differ in dimensions (an image, then a video: the loss's business)
        _, m0 = fzero.train_step(lambda p, b: p["w"].sum() * b["x"].mean(), micro_batches=2)(
            state, [{"x": torch.ones(2, 4)}, {"x": torch.ones(2, 3, 4)}])
        _, m1 = step(state, [(x, y), (x[:2], y[:2])])
        _, m2 = step(state, [(x, y), {"x": x[:2], "y": y[:2]}])
        return float(m1.loss), float(m2.loss)

    a, b = mesh.run(rank_fn)[0]
    assert a == b


def test_gather_on_one_gloo_rank_beside_a_step_on_the_other_is_a_mismatch(dist2):
    """Before: rank 1's `fzero.gather` paired its all-gathers with rank 0's stage-3 forward
    gathers (same op, dtype, shape and tag) and returned, and rank 0 was left waiting. The gather's
    own first collective now mismatches, on both ranks, as a `CollectiveMismatch` naming the
    gather's call and saying every rank must make it (the stepping rank's forward said it as
    `DivergentPaths`, whose advice -- gather='eager', a data-dependent branch -- was not the way
    out; found in a new user's walkthrough, tests/test_calls_on_some_ranks.py)."""
    from . import dist_cases

    for words in dist2.run(dist_cases.gather_beside_a_step):
        assert words.startswith("CollectiveMismatch") and "tag='fzero.gather'" in words, words
        assert "rank 1 is in fzero.gather, which every rank must call" in words, words


def test_leaves_whose_paths_are_one_string_or_that_fzero_cannot_shard_are_refused_at_init():
    """Two leaves whose dotted paths are one string: before, `init` took them and every stage
    read one as the other (the loss got `a.b`'s tensor for `a`'s `b`, a load left one unloaded),
    silently (found in review). Sparse, nested and float8 leaves failed deep inside with torch's
    errors (`reshape is not implemented for sparse tensors`, `"min_values_cpu" not implemented`)
    naming no leaf. Each is now a `LayoutError` at `init` naming the leaves."""
    mesh = fzero.SimMesh(2)
    cases = [
        ({"a.b": torch.ones(2), "a": {"b": torch.ones(3)}}, r"params\['a'\]\['b'\] and params\['a.b'\] have the same "
                                                          r"path 'a.b'"),
        ({1: torch.ones(2), "1": torch.ones(2)}, r"params\[1\] and params\['1'\] have the same path '1'"),
        ({"a": [torch.ones(2)], "a.0": torch.ones(2)}, r"params\['a'\]\[0\] and params\['a.0'\] have the same path"),
        ({"w": torch.eye(3).to_sparse()}, r"params leaf 'w' is a torch.sparse_coo tensor.*t.to_dense\(\)"),
        ({"w": torch.zeros(3).to(torch.float8_e4m3fn)}, r"params leaf 'w' has dtype torch.float8_e4m3fn.*float8 is a"),
    ]
    for params, match in cases:
        with pytest.raises(fzero.LayoutError, match=match):
            mesh.run(lambda: fzero.init(params, optim.sgd(0.1), stage=1, mesh=mesh))


def test_two_groups_under_one_name_are_refused_naming_both():
    """Two unnamed groups (both "default", as is the group of the leaves no group matches) gave
    buckets of one tag in one unit and dtype; where a tag keys a bucket, one was read for all
    (found in review: stage 3's NVMe param offload loaded one bucket's shard for every one).
    Groups holding leaves must be named apart; one group given twice is one group."""
    params = {"a": torch.ones(3), "b": torch.ones(4), "c": torch.ones(5)}
    twins = [fzero.ParamGroup(match=lambda p: p == "a", weight_decay=False),
             fzero.ParamGroup(match=lambda p: p == "b", lr_scale=0.5)]
    with pytest.raises(fzero.LayoutError, match=r"two parameter groups hold leaves under one name 'default'"):
        fzero.layout.plan(params, 2, groups=twins)
    with pytest.raises(fzero.LayoutError, match=r"under one name 'default'"):  # against the unmatched leaves' group
        fzero.layout.plan(params, 2, groups=twins[:1])
    named = [fzero.ParamGroup("no-decay", match=lambda p: p == "a", weight_decay=False),
             fzero.ParamGroup("half", match=lambda p: p == "b", lr_scale=0.5)]
    layout = fzero.layout.plan(params, 2, groups=named + named[:1])
    assert len({b.tag for b in layout.buckets}) == len(layout.buckets) == 3


def test_a_group_name_that_repeats_another_buckets_tag_is_refused():
    """A group named "default#1" beside the second `bucket_bytes` part of "default" made one tag
    twice, and stage 3's NVMe param offload read leaf y with z's values (found in review)."""
    params = {"x": torch.ones(4), "y": torch.ones(4), "z": torch.ones(4)}
    groups = [fzero.ParamGroup("default#1", match=lambda p: p == "z", lr_scale=0.5)]
    with pytest.raises(fzero.LayoutError, match=r"have one tag 'default/float32/default#1'"):
        fzero.layout.plan(params, 2, groups=groups, bucket_bytes=16)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_pure_update_that_writes_its_input_is_refused(stage):
    """A user's `Optimizer.update` that writes `param` in place (breaking "pure: never mutates its
    inputs") changed the input state of a pure step at every stage, silently (found in review).
    The step now reads the inputs' version counters around it and raises `OptimizerError` naming
    what was written, the bucket and its leaves, and the ways out; an update that writes clones,
    fzero's own, runs."""
    base = optim.sgd(0.1)

    def writes_param(grad, state, param, ctx):
        new, new_state = base.update(grad, state, param, ctx)
        param.copy_(new)
        return param, new_state

    mesh = fzero.SimMesh(2)
    params = {"a": torch.arange(6.0), "b": torch.ones(3)}
    loss = lambda p, x: (p["a"].sum() - x) ** 2 + p["b"].square().sum()  # noqa: E731

    def rank_fn():
        step = fzero.train_step(loss)
        state = fzero.init(params, base, stage=stage, mesh=mesh)
        step(state, torch.tensor(1.0))  # fzero's own update: runs
        bad = fzero.init(params, base._replace(update=writes_param), stage=stage, mesh=mesh)
        with pytest.raises(fzero.optim.OptimizerError, match=r"the optimizer's update wrote its input\(s\) \['param'\] "
                                                             r"in place \(bucket '.*', leaves \['a', 'b'\]\).*must be "
                                                             r"pure.*Optimizer.update_"):
            step(bad, torch.tensor(1.0))

    mesh.run(rank_fn)


STAND_IN = r"{} is one of the stand-ins of the swap files.*fzero\.gather\(state\).*params=\"cpu\""


def test_unpack_of_nvme_stand_ins_is_refused(tmp_path):
    """Under `Offload(params="nvme")` `state.params` holds stand-ins of the swap files (a 0-d zero
    expanded, every stride 0). `fzero.layout.unpack(state.layout, state.params)`, the README's
    differentiable read, gave zeros, and a loss over them ran, silently (found in review); it, and
    `shard` / `local_shards`, now refuse them, naming the bucket and `fzero.gather`."""
    mesh = fzero.SimMesh(1)
    off = fzero.Offload(optimizer="nvme", params="nvme", nvme_path=str(tmp_path))

    def rank_fn():
        state = fzero.init({"w": torch.arange(1.0, 5.0)}, optim.adamw(1e-2), stage=3, mesh=mesh, offload=off)
        assert torch.equal(fzero.gather(state)["w"], torch.arange(1.0, 5.0))
        for read in (lambda: fzero.layout.unpack(state.layout, state.params),
                     lambda: fzero.layout.shard(state.layout, state.params),
                     lambda: fzero.layout.local_shards(state.layout, state.params, 0)):
            with pytest.raises(fzero.LayoutError, match=STAND_IN.format(r"flat buffers of bucket '.*' "
                                                                        r"\(torch.float32\[4\]\)")):
                read()
        flats = fzero.layout.pack(state.layout, {"w": torch.arange(1.0, 5.0)})
        assert torch.equal(fzero.layout.unpack(state.layout, flats)["w"], torch.arange(1.0, 5.0))

    mesh.run(rank_fn)


def test_the_readme_read_of_nvme_stand_ins_at_stage_3_n_2_is_refused(tmp_path):
    """At stage 3, N > 1, the README's differentiable read all-gathers each bucket's shard first:
    of `Offload(params="nvme")`'s stand-ins, that made real zeros, which `unpack` took, silently
    (found in review: the stride test caught N = 1 only). Stand-ins are now marked exactly
    (`layout.is_stand_in`), and `fzero.collectives.all_gather` of one raises on every rank,
    naming the stand-ins and `fzero.gather`; `layout.unshard` of one, as the stack of shards
    `[N, S]`, too. The state is left as it was: `fzero.gather` reads the values."""
    mesh = fzero.SimMesh(2)
    off = fzero.Offload(optimizer="nvme", params="nvme", nvme_path=str(tmp_path))

    def rank_fn():
        state = fzero.init({"w": torch.arange(1.0, 5.0)}, optim.adamw(1e-2), stage=3, mesh=mesh, offload=off)
        gathered = STAND_IN.format(r"all_gather's input \(torch.float32\[2\], rank \d\)")
        with pytest.raises(fzero.MeshError, match=gathered):
            [fzero.collectives.all_gather(p, mesh) for p in state.params]
        stacks = [p.expand(2, p.numel()) for p in state.params]
        stacked = STAND_IN.format(r"shards of bucket '.*' \(torch.float32\[2, 2\]\)")
        with pytest.raises(fzero.LayoutError, match=stacked):
            fzero.layout.unshard(state.layout, stacks)
        return fzero.gather(state)["w"]

    assert all(torch.equal(w, torch.arange(1.0, 5.0)) for w in mesh.run(rank_fn))


@pytest.mark.parametrize("n", [1, 2])
def test_the_readme_read_of_nvme_stand_ins_under_torch_func_is_refused(n, tmp_path):
    """The README's differentiable read under `torch.func.grad` / `vjp` (and `vmap`, N = 1):
    torch.func hands `unpack` / `all_gather` its wrappers, which have no `_base` and no
    storage, so the stand-in check said no, and the read took zeros, silently (found in review:
    a regression at N = 1, where the stride test had refused them, and never refused at N = 2).
    `layout.is_stand_in` now looks under the wrappers; a read of real flat buffers under the same
    transforms still gives their values."""
    mesh = fzero.SimMesh(n)
    off = fzero.Offload(optimizer="nvme", params="nvme", nvme_path=str(tmp_path))

    def rank_fn():
        state = fzero.init({"w": torch.arange(1.0, 5.0)}, optim.adamw(1e-2), stage=3, mesh=mesh, offload=off)

        def loss(ps):
            if n > 1:
                ps = [fzero.collectives.all_gather(p, mesh) for p in ps]
            return (fzero.layout.unpack(state.layout, ps)["w"] ** 2).sum()

        reads = {"grad": lambda ps: torch.func.grad(loss)(ps), "vjp": lambda ps: torch.func.vjp(loss, ps)[0]}
        if n == 1:
            reads["vmap"] = lambda ps: torch.func.vmap(lambda x: loss([x[0]]))([ps[0].unsqueeze(0)])
        refused = (fzero.LayoutError, STAND_IN.format(r"flat buffers of bucket '.*' \(torch.float32\[4\]\)")) if n == 1 else (
            fzero.MeshError, STAND_IN.format(r"all_gather's input \(torch.float32\[2\], rank \d\)"))
        for name, read in reads.items():
            with pytest.raises(refused[0], match=refused[1]):
                read(state.params)
        real = fzero.layout.pack(state.layout, {"w": torch.arange(1.0, 5.0)})
        real = real if n == 1 else [f.view(n, -1)[mesh.rank].clone() for f in real]
        # d/dx sum(x^2) = 2x of real values; at N = 2 the all-gather's adjoint sums the two ranks' 2x
        assert torch.equal(reads["grad"](real)[0], 2 * n * real[0])
        return fzero.gather(state)["w"]

    assert all(torch.equal(w, torch.arange(1.0, 5.0)) for w in mesh.run(rank_fn))


@pytest.mark.parametrize("take", ["autograd", "torch.func"])
def test_an_expanded_gradient_of_a_flat_buffer_is_unpacked(take):
    """A flat buffer expanded from one value is a tensor of its own, not a stand-in: autograd's
    (and torch.func's) gradient of `flat.sum()` with respect to a flat buffer is such an expand
    (every stride 0), and `unpack` / `shard` of it give its values. Before (found in review): the
    stride test that refused NVMe's stand-ins refused it too, blaming `Offload(params="nvme")`."""
    params = {"a": torch.randn(3, 2), "b": torch.randn(4)}
    layout = fzero.layout.plan(params, 2)
    flats = [f.clone().requires_grad_() for f in fzero.layout.pack(layout, params)]
    if take == "autograd":
        grads = torch.autograd.grad(sum(f.sum() for f in flats), flats)
    else:
        grads = [torch.func.grad(lambda f: f.sum())(f.detach()) for f in flats]
    assert all(not any(g.stride()) for g in grads)  # the case: every stride 0
    got = fzero.layout.unpack(layout, grads)
    assert torch.equal(got["a"], torch.ones(3, 2)) and torch.equal(got["b"], torch.ones(4))
    assert all(torch.equal(s, torch.ones_like(s)) for s in fzero.layout.shard(layout, grads))


def test_int_settings_take_numpy_ints(tmp_path):
    """`np.int64` for an int setting is the int (bad-input.md, "deliberately accepts"; before, each
    was refused as not an int: found in review of a stage-3 user), and a bool still is not."""
    np = pytest.importorskip("numpy")
    loss = lambda p, x: (p["w"] * x).sum()  # noqa: E731
    mesh = fzero.SimMesh(2)

    def rank():
        state = fzero.init({"w": torch.ones(5)}, fzero.optim.sgd(0.1), stage=3, mesh=mesh, align=np.int64(2),
                           bucket_bytes=np.int64(1000))
        step = fzero.train_step(loss, micro_batches=np.int64(2), persist_bytes=np.int64(4),
                                max_live_bytes=np.int64(10**6), prefetch=np.int64(1))
        state, _ = step(state, [torch.ones(5), torch.ones(5)])
        return fzero.evaluate(loss, prefetch=np.int64(2))(state, torch.ones(5)), state.layout.buckets[0].shard_numel

    assert mesh.run(rank) == [(torch.tensor(4.5), 4)] * 2
    with pytest.raises(fzero.ConfigError, match="micro_batches must be an int >= 1"):
        fzero.train_step(loss, micro_batches=np.bool_(True))
    # the world size, a loss scaler's counts and save's keep too (a review of the first version found them refused)
    assert fzero.SimMesh(np.int64(2)).world_size == 2
    assert fzero.layout.plan({"w": torch.ones(3)}, np.int64(2)).world_size == 2
    scaler = fzero.DynamicLossScale(window=np.int64(10), hysteresis=np.int32(3))
    assert repr(scaler) == repr(fzero.DynamicLossScale(window=10, hysteresis=3))
    one = fzero.SimMesh(1)
    one.run(lambda: fzero.checkpoint.save(fzero.init({"w": torch.ones(3)}, fzero.optim.sgd(0.1), stage=0, mesh=one),
                                          str(tmp_path), keep=np.int64(1)))
