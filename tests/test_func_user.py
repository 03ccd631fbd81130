"""What a torch.func user meets first: derivatives read through `fzero.gather`, a `(loss, aux)`
loss, and `torch.inference_mode()` around `init` and the step (found in review).

- `gather` reads the state's values under `torch.no_grad()` into fresh tensors: a reverse-mode
  derivative through it was exact zeros (`torch.func.grad`) or silently absent (plain autograd,
  the result not requiring grad). It now raises `ConfigError` on every rank, naming the way out
  (`fzero.layout.unpack` of the state's own tensors); a forward-mode tangent still flows.
- A loss returning `(loss, aux)` was told to use `normalize="tokens"`, which then read the aux as
  the token count and divided the gradient by it, silently; the message now says the step takes
  no aux, how to keep one, and what a 2-tuple means.
- Under `torch.inference_mode()` the autograd engine's step said no param was reached, and the
  func engine's (and `init`) made a state of inference tensors that the next step outside it
  refused with torch's raw error. Both now run as outside inference mode (the same bits, normal
  tensors); a state already made of inference tensors is a `ConfigError` naming its parts.
"""

from __future__ import annotations

import datetime
import re

import pytest
import torch
import torch.utils._pytree as tree

import fzero
from fzero import optim
from fzero._src.state import outside_inference_mode
from fzero.testing import assert_trees_equal

LR = 0.125
P = {"w": torch.linspace(-1.0, 1.0, 6, dtype=torch.float64).view(2, 3),
     "v": torch.linspace(0.5, 1.5, 3, dtype=torch.float64)}
C = torch.linspace(-2.0, 2.0, 6, dtype=torch.float64).view(2, 3)


def _x(rank: int) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, 8, dtype=torch.float64).view(4, 2) + 0.25 * rank


def _loss(p, x):
    return torch.tanh(x @ p["w"] + p["v"]).pow(2).mean()


def _by_unpack(state) -> dict:
    """The way out `gather`'s refusal names: the state's own tensors unpacked (all-gathered first
    where the stage shards them)."""
    flats = state.params
    if state.stage.sharded("params") and state.mesh.world_size > 1:
        flats = [fzero.collectives.all_gather(p, state.mesh) for p in flats]
    return fzero.layout.unpack(state.layout, flats)


# -- F1: a derivative through gather ------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("stage", [0, 3])
def test_a_meta_gradient_read_through_gather_is_refused_on_every_rank_not_zero(stage, n):
    """`grad` of `<c, gather(step(state))["w"]>` w.r.t. the held params was exact zeros; now a
    `ConfigError` on every rank naming gather, the transform and the way out, which gives the
    meta-gradient (a nonzero one, the same as reading the held buffer)."""
    mesh = fzero.SimMesh(n)

    def rank_fn():
        state = fzero.init(P, optim.sgd(LR, impl="single"), stage=stage, mesh=mesh)
        step = fzero.train_step(_loss, engine="func")
        x = _x(mesh.rank)

        def through(read):
            return lambda held: (read(step(state.replace(params=held), x)[0])["w"] * C).sum()

        try:
            torch.func.grad(through(fzero.gather))(tuple(state.params))
            words = "no error"
        except fzero.ConfigError as e:
            words = str(e)
        return words, torch.func.grad(through(_by_unpack))(tuple(state.params))

    out = mesh.run(rank_fn)
    for words, _ in out:
        assert words.startswith("fzero.gather of a state whose params are being differentiated (a torch.func "
                                "transform, level 1"), words
        assert "a derivative through it would be zero, silently" in words
        assert "fzero.layout.unpack(state.layout, " in words and "torch.no_grad()" in words
        assert ("[fzero.collectives.all_gather(p, state.mesh) for p in state.params]" in words) == (
            stage == 3 and n > 1), words
    grads = [g for _, g in out]
    assert all(any(bool(t.ne(0).any()) for t in g) for g in grads)  # the way out carries the derivative
    if n == 1:  # it is the derivative read from the held buffer itself (stage 0: params[0] is the flat buffer)
        mesh1 = fzero.SimMesh(1)

        def held_fn():
            state = fzero.init(P, optim.sgd(LR, impl="single"), stage=stage, mesh=mesh1)
            step = fzero.train_step(_loss, engine="func")
            w = state.layout.leaves[[ls.path for ls in state.layout.leaves].index("w")]
            return torch.func.grad(lambda held: (step(state.replace(params=held), _x(0))[0].params[w.bucket][
                w.offset : w.offset + w.numel].view(2, 3) * C).sum())(tuple(state.params))

        assert_trees_equal(mesh1.run(held_fn)[0], grads[0])


@pytest.mark.parametrize("stage", [0, 3])
def test_gather_under_plain_autograd_reads_the_values_of_params_that_require_grad(stage):
    """Plain autograd is not refused (a logging read in a meta-learning loop whose params require
    grad; found in review of the first refusal, which raised there): the values, which do not
    require grad, so a derivative of them alone raises in torch."""
    mesh = fzero.SimMesh(1)

    def rank_fn():
        state = fzero.init(P, optim.sgd(LR), stage=stage, mesh=mesh)
        tracked = state.replace(params=tuple(p.detach().clone().requires_grad_() for p in state.params))
        read = fzero.gather(tracked)
        assert not any(t.requires_grad for t in read.values())
        with pytest.raises(RuntimeError, match="does not require grad"):
            torch.autograd.grad(read["w"].sum(), [p for p in tracked.params])
        return read, fzero.gather(state)

    read, plain = mesh.run(rank_fn)[0]
    assert_trees_equal(read, plain)


@pytest.mark.parametrize("n", [1, 2])
def test_the_refusals_way_out_runs_as_written_under_a_precision_policy(n):
    """Under a precision policy the params are held in the compute dtype, the layout's buckets in
    the master's: the way out `gather`'s refusal gives casts each to its bucket's dtype (found in
    review: `unpack(state.layout, state.params)` raised a LayoutError there). The expression in the
    message, evaluated as written, gives the meta-gradient."""
    mesh = fzero.SimMesh(n)
    policy = fzero.Precision(torch.float32, torch.float64)

    def rank_fn():
        state = fzero.init(P, optim.sgd(LR, impl="single"), stage=1, mesh=mesh, precision=policy)
        step = fzero.train_step(lambda p, x: _loss(p, x.to(p["w"].dtype)), engine="func")
        x = _x(mesh.rank)
        assert state.params[0].dtype != state.layout.buckets[0].dtype  # the case: held in the compute dtype
        # with respect to the held params and the master both: at stage 1 under a policy with a
        # master, either alone is refused by the step (tests/test_master_through_step.py)
        def through(read):
            return lambda held, master: (read(step(state.replace(params=held, master=master), x)[0])["w"] * C).sum()

        with pytest.raises(fzero.ConfigError) as caught:
            torch.func.grad(through(fzero.gather), argnums=(0, 1))(tuple(state.params), tuple(state.master))
        way = re.search(r"fzero\.layout\.unpack\(state\.layout, (.*?)\)(?: \(|;)", str(caught.value)).group(1)
        assert ".to(b.dtype)" in way, way

        def read(new):
            return fzero.layout.unpack(new.layout, eval(way, {"fzero": fzero, "state": new}))

        return torch.func.grad(through(read), argnums=(0, 1))(tuple(state.params), tuple(state.master))

    for g_held, g_master in mesh.run(rank_fn):
        assert any(bool(t.ne(0).any()) for t in (*g_held, *g_master))


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # torch's jvp decompositions
def test_what_gather_is_not_refused_for():
    """A forward-mode tangent flows through gather (`torch.no_grad()` stops no jvp): its tangent is
    the held params' tangent; a transform that differentiates something else (the state a
    constant) and a `vmap` read the values as before."""
    mesh = fzero.SimMesh(1)

    def rank_fn():
        state = fzero.init(P, optim.sgd(LR), stage=3, mesh=mesh)
        tangent = tuple(torch.ones_like(p) for p in state.params)
        _, t = torch.func.jvp(lambda held: fzero.gather(state.replace(params=held))["w"], (tuple(state.params),),
                              (tangent,))
        g = torch.func.grad(lambda a: (a * fzero.gather(state)["w"]).sum())(torch.tensor(2.0, dtype=torch.float64))
        v = torch.func.vmap(lambda a: a * fzero.gather(state)["v"].sum())(torch.ones(3, dtype=torch.float64))
        return t, g, v

    t, g, v = mesh.run(rank_fn)[0]
    assert torch.equal(t, torch.ones(2, 3, dtype=torch.float64))
    assert torch.equal(g, P["w"].sum()) and torch.equal(v, P["v"].sum().expand(3))


def test_a_gather_refused_on_one_simmesh_rank_stops_the_other():
    """Only rank 0 differentiates through gather: rank 0 raises its `ConfigError`, rank 1 (in
    gather's first collective) stops with `RankFailed` instead of waiting."""
    mesh = fzero.SimMesh(2)

    def rank_fn():
        state = fzero.init(P, optim.sgd(LR), stage=3, mesh=mesh)
        if mesh.rank == 0:  # a derivative through gather on this rank alone
            return torch.func.grad(lambda held: fzero.gather(state.replace(params=held))["w"].sum())(
                tuple(state.params))
        return fzero.gather(state)

    with pytest.raises(fzero.ConfigError, match="fzero.gather of a state whose params are being differentiated"):
        mesh.run(rank_fn)


def one_rank_gathers_tracked(_mesh):
    """On a pool worker: a verified gloo `DistMesh` of its own (short timeout), rank 0's params
    differentiated through gather; each rank's `gather` outcome and how long it took."""
    import time

    group = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(seconds=8))
    mesh = fzero.DistMesh(group, verify=True, timeout=8.0)
    state = fzero.init(P, optim.sgd(LR), stage=3, mesh=mesh)
    start = time.monotonic()
    try:
        if mesh.rank == 0:  # a derivative through gather on this rank alone
            torch.func.grad(lambda held: fzero.gather(state.replace(params=held))["w"].sum())(tuple(state.params))
        else:
            fzero.gather(state)
        return "returned", "", time.monotonic() - start
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        return type(e).__name__, str(e)[:200], time.monotonic() - start


@pytest.mark.dist
def test_a_gather_refused_on_one_gloo_rank_stops_the_other_at_once(dist2):
    (k0, t0, s0), (k1, t1, s1) = dist2.run(one_rank_gathers_tracked, [()] * 2, timeout=60)
    assert k0 == "ConfigError" and "fzero.gather of a state whose params are being differentiated" in t0, t0
    assert k1 == "RankFailed", (k1, t1)
    assert s0 < 2.0 and s1 < 2.0, (s0, s1)


# -- F2: a (loss, aux) loss ---------------------------------------------------------------------


def _loss_aux(p, x):
    out = x @ p["w"] + p["v"]
    return torch.tanh(out).pow(2).mean(), (out > 0).double().mean()  # the aux: an "accuracy"


@pytest.mark.parametrize("engine", ["autograd", "func"])
def test_a_loss_returning_an_aux_is_told_the_step_takes_none_and_how_to_keep_it(engine):
    """Before: "(return (loss_sum, count) with normalize='tokens')" alone, where the aux is then
    read as the token count (an accuracy of 0.375 multiplied the update by 2.67). Now the message
    says there is no has_aux, how to keep an aux, and what a 2-tuple means; its first way out
    (a list the loss closes over) gives the aux and the plain step's bits."""
    mesh = fzero.SimMesh(1)

    def rank_fn():
        state = fzero.init(P, optim.sgd(LR), stage=3, mesh=mesh)
        with pytest.raises(fzero.ConfigError) as e:
            fzero.train_step(_loss_aux, engine=engine)(state, _x(0))
        kept = []

        def loss(p, x):
            loss, aux = _loss_aux(p, x)
            kept.append(aux.detach())
            return loss

        new = fzero.train_step(loss, engine=engine)(state, _x(0))[0]
        plain = fzero.train_step(_loss, engine=engine)(state, _x(0))[0]
        return str(e.value), kept, fzero.gather(new), fzero.gather(plain)

    words, kept, new, plain = mesh.run(rank_fn)[0]
    assert words.startswith("loss_fn returned a tuple of 2 (float64[], float64[]); with normalize='mean' it must "
                            "return one 0-d loss."), words
    for part in ("takes no auxiliary output (no has_aux", "append aux.detach() to a list the loss closes over",
                 "fzero.evaluate(fn)(state, batch), which returns whatever fn returns",
                 "A 2-tuple is what normalize='tokens' takes: (loss_sum, count), count the number of tokens",
                 "an aux returned there is read as that count"):
        assert part in words, (part, words)
    assert len(kept) == 1 and torch.equal(kept[0], _loss_aux(P, _x(0))[1])
    assert_trees_equal(new, plain)


# -- F3: torch.inference_mode() ------------------------------------------------------------------


def _states_under(mode, stage: int, engine: str, n: int, donate: bool = False):
    """Per rank: (the state after one step called under `mode`, a next donating autograd-engine
    step's gathered params)."""
    mesh = fzero.SimMesh(n)

    def rank_fn():
        state, x = fzero.init(P, optim.adamw(LR), stage=stage, mesh=mesh), _x(mesh.rank)
        with mode():  # (a batch made under it is an inference tensor: the note of the last test)
            new, m = fzero.train_step(_loss, engine=engine, donate=donate)(state, x)
        inference = [t.is_inference() for t in tree.tree_leaves(new)]
        after = fzero.train_step(_loss, donate=True)(new, _x(mesh.rank))[0]
        return fzero.gather(after), float(m.loss), inference

    return mesh.run(rank_fn)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("engine", ["autograd", "func"])
@pytest.mark.parametrize("stage", [0, 3])
def test_a_step_under_inference_mode_trains_as_outside_it(stage, engine, n):
    """Before: the autograd engine raised "no rank's loss depends on any trainable param"; the func
    engine's new state was inference tensors, and the next autograd-engine step raised torch's
    "Setting requires_grad=True on inference tensor". Now both train with the bits of a step
    outside it, into normal tensors that the next (donating) step takes."""
    plain = _states_under(torch.enable_grad, stage, engine, n)
    for mode in (torch.inference_mode, torch.no_grad):
        got = _states_under(mode, stage, engine, n, donate=engine == "autograd")
        for (params, loss, inference), (want, want_loss, _) in zip(got, plain):
            assert not any(inference)
            assert loss == want_loss
            assert_trees_equal(params, want)


def test_init_under_inference_mode_makes_a_state_of_normal_tensors():
    """Before: a state of inference tensors, which the autograd engine's first step refused with
    torch's raw error. Now the state made outside it, bit for bit."""
    mesh = fzero.SimMesh(2)

    def rank_fn():
        with torch.inference_mode():
            state = fzero.init(P, optim.adamw(LR), stage=1, mesh=mesh)
        plain = fzero.init(P, optim.adamw(LR), stage=1, mesh=mesh)
        assert not any(t.is_inference() for t in tree.tree_leaves(state))
        step = fzero.train_step(_loss)
        return fzero.gather(step(state, _x(mesh.rank))[0]), fzero.gather(step(plain, _x(mesh.rank))[0])

    for got, want in mesh.run(rank_fn):
        assert_trees_equal(got, want)


def test_a_checkpoint_loaded_under_inference_mode_is_a_state_of_normal_tensors(tmp_path):
    """`checkpoint.load` under inference mode made a state of inference tensors, which the next
    step refused (found in review of the step's fix): it now loads as outside it, bit for bit."""
    mesh = fzero.SimMesh(2)

    def rank_fn():
        state = fzero.init(P, optim.adamw(LR), stage=1, mesh=mesh)
        step = fzero.train_step(_loss)
        state, _ = step(state, _x(mesh.rank))
        path = fzero.checkpoint.save(state, str(tmp_path))
        with torch.inference_mode():
            loaded = fzero.checkpoint.load(path, state)
        assert not any(t.is_inference() for t in tree.tree_leaves(loaded))
        return fzero.gather(step(loaded, _x(mesh.rank))[0]), fzero.gather(step(state, _x(mesh.rank))[0])

    for got, want in mesh.run(rank_fn):
        assert_trees_equal(got, want)


def test_load_under_inference_mode_fills_buffers_made_there(tmp_path):
    """An eval script under `torch.inference_mode()` builds its module there (BatchNorm's buffers
    are inference tensors) and loads with `buffers=`: `load` runs outside inference mode, and its
    copy into those buffers raised torch's "Inplace update to inference tensor outside
    InferenceMode" (found in review of the first version); each is now written in its own mode."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    mesh = fzero.SimMesh(1)

    def save_fn():
        params, apply, info = fzero.from_module(model)
        state = fzero.init(params, optim.sgd(LR), stage=0, mesh=mesh)
        step = fzero.train_step(lambda p, x: apply(p, x).pow(2).mean())
        state, _ = step(state, torch.randn(8, 3))
        return fzero.checkpoint.save(state, str(tmp_path), buffers=info.buffers), dict(info.buffers)

    path, saved = mesh.run(save_fn)[0]

    def load_fn():
        with torch.inference_mode():
            fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
            params, _, info = fzero.from_module(fresh)
            target = fzero.init(params, optim.sgd(LR), stage=0, mesh=mesh)
            fzero.checkpoint.load(path, target, buffers=info.buffers)
            return dict(info.buffers)

    got = mesh.run(load_fn)[0]
    assert got.keys() == saved.keys() and all(torch.equal(got[k], saved[k]) for k in saved)
    assert not torch.equal(saved["1.running_mean"], torch.zeros(4))  # non-vacuous: the step moved them


def test_the_step_runs_in_the_callers_grad_mode_outside_inference_mode():
    """Inference mode turns grad mode off: inside it the step runs as under `torch.no_grad()`
    outside (and as under grad mode where the caller turned that on again inside it)."""
    probe = outside_inference_mode(lambda: (torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
    with torch.inference_mode():
        assert probe() == (False, False)
        with torch.enable_grad():
            assert probe() == (False, True)
    assert probe() == (False, True)


@pytest.mark.parametrize("engine, donate", [("autograd", False), ("autograd", True), ("func", True)])
def test_a_state_of_inference_tensors_is_refused_naming_its_parts(engine, donate):
    """A state made of inference tensors (a tree_map under inference mode; an older fzero's init
    or step under it) given to a step that differentiates or writes them: before, torch's
    "Setting requires_grad=True on inference tensor outside InferenceMode" (or "Inplace update
    to inference tensor"), naming nothing; now `ConfigError` on every rank naming the parts and
    the way out, which gives the bits of the state it was cloned from."""
    mesh = fzero.SimMesh(2)

    def rank_fn():
        state = fzero.init(P, optim.adamw(LR), stage=3, mesh=mesh)
        with torch.inference_mode():
            made = tree.tree_map(torch.clone, state)
        step = fzero.train_step(_loss, engine=engine, donate=donate)
        try:
            step(made, _x(mesh.rank))
            words = "no error"
        except fzero.ConfigError as e:
            words = str(e)
        healed = tree.tree_map(torch.clone, made)  # the way out the error names
        want = fzero.gather(fzero.train_step(_loss, engine=engine)(state, _x(mesh.rank))[0])
        return words, fzero.gather(step(healed, _x(mesh.rank))[0]), want

    for words, got, want in mesh.run(rank_fn):
        assert words.startswith("this state holds inference tensors (made under torch.inference_mode()): params of "
                                "bucket "), words
        assert "'v' (float64[3])" in words and "'w' (float64[2, 3])" in words and "opt_state of bucket" in words
        assert "state = torch.utils._pytree.tree_map(torch.clone, state)" in words
        assert_trees_equal(got, want)


def test_a_batch_of_inference_tensors_gets_a_note_naming_its_leaves():
    """The step trains outside inference mode, where autograd cannot save an inference tensor:
    torch's error on a batch made under it carries a note naming the batch's leaves."""
    mesh = fzero.SimMesh(1)

    def rank_fn():
        state = fzero.init(P, optim.sgd(LR), stage=0, mesh=mesh)
        with torch.inference_mode():
            batch = {"x": _x(0)}
            with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward") as e:
                fzero.train_step(lambda p, b: _loss(p, b["x"]))(state, batch)
        return getattr(e.value, "__notes__", [])

    notes = mesh.run(rank_fn)[0]
    assert any(n.startswith("fzero: the batch holds inference tensors (made under torch.inference_mode()) at ['x']")
               for n in notes), notes


@pytest.mark.parametrize("out", [lambda loss: [loss, loss.detach()], lambda loss: {"loss": loss, "aux": loss.detach()}],
                         ids=["list", "dict"])
def test_a_loss_returned_in_a_list_or_dict_is_told_the_step_takes_no_aux(out):
    """A `[loss, aux]` list or a `{"loss": ..., "aux": ...}` dict (the `has_aux` habit in another
    container) was told only that the loss must be a 0-d floating tensor (found in review)."""
    mesh = fzero.SimMesh(1)

    def rank_fn():
        state = fzero.init(P, optim.sgd(LR), stage=0, mesh=mesh)
        fzero.train_step(lambda p, x: out(_loss(p, x)))(state, _x(0))

    # the type alone, no blanks where a tensor's dtype and shape would go (it read "got list  ; ...")
    with pytest.raises(fzero.FzeroError, match=r"0-d floating tensor \(this rank's mean loss\), got (list|dict); the "
                                               r"step takes no auxiliary output: return the loss alone"):
        mesh.run(rank_fn)


def _loss_error(loss_fn) -> pytest.ExceptionInfo:
    """The error one stage-0 step on `SimMesh(1)` raises with `loss_fn`."""
    mesh = fzero.SimMesh(1)

    def rank_fn():
        state = fzero.init(P, optim.sgd(LR), stage=0, mesh=mesh)
        fzero.train_step(loss_fn)(state, _x(0))

    with pytest.raises(fzero.FzeroError) as info:
        mesh.run(rank_fn)
    return info


def test_a_loss_fn_that_returns_nothing_is_asked_for_its_return():
    """A loss_fn that computes the loss and forgets `return` read "got NoneType", no way out
    (found in review)."""
    _loss_error(lambda p, x: None).match(r"got NoneType; loss_fn returned nothing: does it end with `return loss`\?")


def test_a_complex_loss_is_told_to_make_it_real():
    """A 0-d complex loss read "must return a 0-d floating tensor", no way out (found in review)."""
    _loss_error(lambda p, x: torch.complex(_loss(p, x), _loss(p, x))).match(
        r"got Tensor torch.complex(64|128) torch.Size\(\[\]\); make it real, e.g. loss.abs\(\) or loss.real")


_KEEPS = {"fp32": {}, "bf16": {"precision": fzero.Precision(torch.bfloat16, torch.float32)},
          "offload": {"offload": fzero.Offload(optimizer="cpu")}}


@pytest.mark.parametrize("keep", sorted(_KEEPS))
@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_an_ema_kept_over_own_values_gathers_to_the_ema_of_the_gathered_params(stage, donate, keep):
    """README's EMA recipe: an EMA kept element-wise over `fzero.own_values(state)` (the rank's
    flat buffers `gather` reads: its shard at stage 3, the fp32 master where the state keeps one,
    under a bf16 policy at stages 1-2 and under `Offload`; cloned at the start, as a donating step
    updates them in place) and read with `fzero.gather(state, values=ema)` is, bit for bit, the EMA
    of the gathered params kept on every rank (element-wise, in the same dtype, so the same ops per
    element; a shard's padding stays out of `gather`). Found in review: the first recipe, over
    `state.params` through `state.replace(params=ema)`, gave the trained params where a master
    exists (gather reads the master), and a bf16 EMA under the policy."""
    mesh, decay = fzero.SimMesh(2), 0.75
    if keep == "offload" and stage == 0:
        pytest.skip("Offload(optimizer='cpu') needs stage >= 1")

    def rank_fn():
        state = fzero.init({k: v.float() for k, v in P.items()}, optim.adamw(LR), stage=stage, mesh=mesh,
                           **_KEEPS[keep])
        step = fzero.train_step(lambda p, x: _loss(p, x.to(p["w"].dtype)), donate=donate)
        ema = tuple(t.clone() for t in fzero.own_values(state))
        full_ema = {k: v.clone() for k, v in fzero.gather(state).items()}
        for i in range(3):
            state, _ = step(state, _x(mesh.rank + i).float())
            ema = tuple(decay * e + (1 - decay) * t for e, t in zip(ema, fzero.own_values(state)))
            full_ema = {k: decay * e + (1 - decay) * fzero.gather(state)[k] for k, e in full_ema.items()}
        return fzero.gather(state, values=ema), full_ema, fzero.gather(state)

    for from_own, from_full, params in mesh.run(rank_fn):
        assert_trees_equal(from_own, from_full)
        assert not torch.equal(from_own["w"], params["w"])


def test_gather_values_that_do_not_fit_name_the_bucket_and_what_fits():
    """`gather(state, values=...)` of the wrong count or a bucket of another shape or dtype: a
    `ConfigError` naming the bucket and what `own_values` holds there (and the world size)."""
    mesh = fzero.SimMesh(2)

    def rank_fn():
        state = fzero.init(P, optim.sgd(LR), stage=3, mesh=mesh)
        own = fzero.own_values(state)
        errors = []
        for bad in (own[0], [*own, own[0]], [t.float() for t in own], [t[:-1] for t in own],
                    [t.to("meta") for t in own]):
            with pytest.raises(fzero.ConfigError) as e:
                fzero.gather(state, values=bad)
            errors.append(str(e.value))
        return errors

    for words in mesh.run(rank_fn):
        assert "takes one tensor per bucket, 1 here" in words[0] and "got a tensor float64[5]" in words[0]
        assert "got 2 values" in words[1]
        assert "takes float64[5] on cpu, as fzero.own_values(state) holds it on rank" in words[2]
        assert "of 2, got float32[5] on cpu" in words[2] and "got float64[4] on cpu" in words[3]
        assert "got float64[5] on meta" in words[4]  # (found in review: gathered to meta tensors, no error)


@pytest.mark.parametrize("n, stage", [(1, 3), (2, 1), (2, 3)])
def test_gather_values_read_as_given_and_refused_under_a_derivative(n, stage):
    """A right-shaped tensor expanded from one value is read as its values (found in review: a bare
    `setStorage` error), and a torch.func transform differentiating through the values is a
    `ConfigError` on every rank (found in review: `torch.func.grad` through them gave zeros,
    silently, as `gather` of the state's own params did before `_refuse_derivative`)."""
    mesh = fzero.SimMesh(n)

    def rank_fn():
        state = fzero.init(P, optim.sgd(LR), stage=stage, mesh=mesh,
                           precision=fzero.Precision(torch.float32, torch.float64) if stage == 1 else fzero.Precision())
        own = fzero.own_values(state)
        flat = fzero.gather(state, values=[torch.full((), 0.5, dtype=t.dtype).expand(t.shape) for t in own])
        with pytest.raises(fzero.ConfigError) as e:
            torch.func.grad(lambda v: fzero.gather(state, values=[v])["w"].sum())(own[0])
        return flat, str(e.value)

    for flat, words in mesh.run(rank_fn):
        assert all(torch.equal(flat[k], torch.full_like(P[k], 0.5)) for k in P)
        assert words.startswith("fzero.gather(state, values=...) with values being differentiated"), words


def _dp_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _dp_loss(apply, orders: list | None = None):
    """examples/dp_sgd.py's clipped loss without noise: the clip factors come from a sum over
    `params.values()`, whose order decides their bits."""
    def per_example(w, xi, yi):
        return torch.nn.functional.cross_entropy(apply(w, xi[None]), yi[None])

    def loss(params, batch):
        x, y = batch
        if orders is not None:
            orders.append(list(params))
        w = dict(params)
        grads = torch.func.vmap(torch.func.grad(per_example), in_dims=(None, 0, 0))(w, x, y)
        norms = torch.stack([g.flatten(1).square().sum(1) for g in grads.values()]).sum(0).sqrt()
        c = torch.clamp(1.0 / (norms + 1e-6), max=1.0).detach()
        return (c * torch.func.vmap(per_example, in_dims=(None, 0, 0))(w, x, y)).sum() / x.shape[0]

    return loss


@pytest.mark.parametrize("gather", ["on_use", "eager"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_loss_iterates_the_params_in_the_order_they_were_given(stage, gather):
    """The dict a loss gets (`LazyParams` on use) iterates in the order of the params given to
    `init` (`from_module`'s: the module's), as `gather="eager"`'s dict and `fzero.gather` do. On use
    it followed the layout's order, which sorts a dict's keys, so a DP-SGD clip norm summed over
    `params.values()` added its leaves in another order than torch over `named_parameters()`, and
    the gradients differed in the last bits from the second step on (found in review of a torch.func
    user). SGD, N = 1, four steps: torch's bits."""
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(4)]
    params, apply, info = fzero.from_module(_dp_model(), units=lambda path: path.split(".")[0])
    mesh = fzero.SimMesh(1)
    orders: list = []

    def rank_fn():
        state = fzero.init(params, optim.sgd(0.5), stage=stage, mesh=mesh, units=info.units)
        step = fzero.train_step(_dp_loss(apply, orders), gather=gather)
        for b in batches:
            state, _ = step(state, b)
        return fzero.gather(state)

    got = mesh.run(rank_fn)[0]
    assert orders and all(o == ["0.weight", "0.bias", "2.weight", "2.bias"] for o in orders), orders
    ref = _dp_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5, foreach=False)
    for b in batches:
        opt.zero_grad()
        w = dict(ref.named_parameters())
        _dp_loss(lambda p, x: torch.func.functional_call(ref, p, (x,)))(w, b).backward()
        opt.step()
    assert all(torch.equal(got[k], v) for k, v in ref.named_parameters())


def test_grad_over_a_whole_state_meets_torchs_integer_refusal_and_over_its_params_works():
    """docs/func.md: `torch.func.grad` with respect to a whole `ZeroState` meets torch's own
    refusal (the state's step counter is an integer tensor, which torch.func cannot make require
    grad; the call is the user's, so fzero cannot word it); with respect to `state.params`, the
    documented form, it is the derivative of the loss over the flat buffers."""
    mesh = fzero.SimMesh(1)

    def rank_fn():
        state = fzero.init(P, optim.sgd(LR), stage=0, mesh=mesh)
        with pytest.raises(RuntimeError, match="only Tensors of floating point dtype can require gradients"):
            torch.func.grad(lambda s: sum(p.square().sum() for p in s.params))(state)
        return torch.func.grad(lambda ps: sum(p.square().sum() for p in ps))(state.params), state.params

    grads, flats = mesh.run(rank_fn)[0]
    assert all(torch.equal(g, 2 * f) for g, f in zip(grads, flats, strict=True))
