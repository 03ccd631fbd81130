"""A loss that reads a parameter of the module given to `fzero.from_module` directly, in grad mode,
is refused (docs/bad-input.md row 208): fzero trains its own copy, the module's parameter keeps
the value `from_module` read and gets no gradient, so the term was dropped from training,
silently (found in review). The ways out the message gives train, with the bits of the same loss
reading a constant copy."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

import fzero
from fzero import optim


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


def _batches(n: int, steps: int = 2):
    g = torch.Generator().manual_seed(1)
    return [[(torch.randn(4, 6, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(steps)]
            for _ in range(n)]


def _run(model, loss_of, *, stage: int, n: int = 2, refused: bool = False, **step_kw):
    """`loss_of(apply) -> loss_fn`; the params each rank ends with (the full pytree), or with
    `refused` the `ConfigError` each rank raised."""
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, ""))
    mesh = fzero.SimMesh(n)

    def rank(batches):
        state = fzero.init(params, optim.adamw(1e-2), stage=stage, mesh=mesh, units=info.units)
        step = fzero.train_step(loss_of(apply), **step_kw)
        try:
            for batch in batches:
                state, _ = step(state, batch)
        except fzero.ConfigError as e:
            if refused:
                return e
            raise
        assert not refused, "the step was not refused"
        return fzero.gather(state)

    return mesh.run(rank, [(b,) for b in _batches(n)])


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("engine,gather", [("autograd", "on_use"), ("autograd", "eager"), ("func", "eager")])
def test_a_penalty_on_the_original_modules_parameter_is_refused(stage, engine, gather):
    model = _model()
    loss_of = lambda apply: lambda p, b: F.cross_entropy(apply(p, b[0]), b[1]) + model[0].weight.pow(2).sum()
    errors = _run(model, loss_of, stage=stage, engine=engine, gather=gather, refused=True)
    assert len(errors) == 2  # every rank raises it, at its first loss, before any collective of the backward
    for e in errors:
        assert "'0.weight' (Sequential)" in str(e) and "p['0.weight']" in str(e) and "Nothing was updated" in str(e)


def test_a_head_tied_by_hand_to_the_original_embedding_is_refused_naming_it():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.mix = torch.nn.Embedding(10, 6), torch.nn.Linear(6, 6)

        def forward(self, x):
            return torch.tanh(self.mix(self.emb(x)))

    torch.manual_seed(0)
    model = Tied()
    params, apply, info = fzero.from_module(model)
    mesh = fzero.SimMesh(1)
    loss_fn = lambda p, b: F.cross_entropy(F.linear(apply(p, b), model.emb.weight), b)  # the head reads the original

    def rank():
        state = fzero.init(params, optim.sgd(0.1), stage=1, mesh=mesh)
        return fzero.train_step(loss_fn)(state, torch.tensor([1, 2, 3]))

    with pytest.raises(fzero.ConfigError, match=r"'emb.weight' \(Tied\).*p\['emb.weight'\]"):
        mesh.run(rank)


def test_the_refused_step_leaves_its_state_as_it_was():
    model = _model()
    params, apply, info = fzero.from_module(model)
    mesh = fzero.SimMesh(1)
    bad = fzero.train_step(lambda p, b: F.cross_entropy(apply(p, b[0]), b[1]) + model[2].bias.sum())
    good = fzero.train_step(lambda p, b: F.cross_entropy(apply(p, b[0]), b[1]))
    batch = _batches(1)[0][0]

    def rank():
        state = fzero.init(params, optim.adamw(1e-2), stage=2, mesh=mesh)
        with pytest.raises(fzero.ConfigError, match=r"'2.bias'"):
            bad(state, batch)
        before = fzero.gather(state)
        assert all(torch.equal(before[k], params[k]) for k in params)
        return int(good(state, batch)[0].step)  # the same state still steps

    assert mesh.run(rank) == [1]


@pytest.mark.parametrize("way", ["detach", "no_grad", "requires_grad_false"])
def test_the_ways_out_train_with_the_bits_of_a_constant_copy(way):
    """Each way out reads the original as a constant: the run's params are bitwise those of the
    same loss reading a detached clone taken before training."""
    model = _model()
    constant = model[0].weight.detach().clone()
    if way == "requires_grad_false":
        reference_model = _model()
        model[0].weight.requires_grad_(False)  # frozen in params too (from_module keeps the flag): the reference alike
        reference_model[0].weight.requires_grad_(False)
    else:
        reference_model = _model()

    def penalty():
        if way == "detach":
            return model[0].weight.detach().pow(2).sum()
        if way == "no_grad":
            with torch.no_grad():
                return model[0].weight.pow(2).sum()
        return model[0].weight.pow(2).sum()

    got = _run(model, lambda apply: lambda p, b: F.cross_entropy(apply(p, b[0]), b[1]) + penalty(), stage=3)
    want = _run(reference_model, lambda apply: lambda p, b: F.cross_entropy(apply(p, b[0]), b[1])
                + constant.pow(2).sum(), stage=3)
    for g, w in zip(got, want):
        assert g.keys() == w.keys() and all(torch.equal(g[k], w[k]) for k in g)
    assert not torch.equal(got[0]["2.weight"], model[2].weight)  # it trained


def test_the_originals_are_held_weakly():
    model = _model()
    fzero.from_module(model)
    ref = weakref.ref(model[0].weight)
    del model
    gc.collect()
    assert ref() is None


def test_a_refused_step_called_again_is_refused_again():
    """The check is marked done only where it passed: a caller that caught the refusal and called
    the same step again trained without the term, silently (found in review)."""
    model = _model()
    params, apply, info = fzero.from_module(model)
    mesh = fzero.SimMesh(1)
    step = fzero.train_step(lambda p, b: F.cross_entropy(apply(p, b[0]), b[1]) + model[0].weight.pow(2).sum())
    batch = _batches(1)[0][0]

    def rank():
        state = fzero.init(params, optim.sgd(0.1), stage=0, mesh=mesh)
        for _ in range(3):
            with pytest.raises(fzero.ConfigError, match=r"'0.weight'"):
                step(state, batch)
        return int(state.step)

    assert mesh.run(rank) == [0]


def test_a_module_run_as_a_fixed_function_takes_requires_grad_false():
    """A module given to another `from_module` (trained by another state, its values loaded back)
    that this step's loss runs as a fixed function is refused too (the registry is process-wide);
    `requires_grad_(False)` on its parameters, the way out the message names for it, trains with
    the bits of the same loss over an unregistered copy of the module."""
    torch.manual_seed(0)
    critic = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    copy_of_critic = copy.deepcopy(critic)  # (a copy is no module given to from_module)
    fzero.from_module(critic)  # the critic's own state would train it
    model = _model()

    def run(reader):
        return _run(model, lambda apply: lambda p, b: reader(torch.tanh(apply(p, b[0]))).mean(), stage=3)

    with pytest.raises(fzero.ConfigError, match=r"'0.weight' \(Sequential\).*a fixed function.*its_apply\(fzero.gather"
                                                r"\(its_state\), x\).*not fzero.evaluate.*still holds the values from_module read.*"
                                                r"requires_grad_\(False\)"):
        run(critic)  # (the first way out named: a GAN user who froze the module trained on its first values)
    critic.requires_grad_(False)
    got, want = run(critic), run(copy_of_critic)
    for g, w in zip(got, want):
        assert all(torch.equal(g[k], w[k]) for k in g)
    assert not torch.equal(got[0]["0.weight"], model[0].weight)  # the gradient flowed through the critic


def test_a_read_on_the_second_micro_batch_only_is_refused():
    """Every micro-batch's loss of the first step is checked (found in review: the first
    micro-batch's alone was, and a penalty read on the second only was dropped, silently)."""
    model = _model()
    params, apply, info = fzero.from_module(model)
    mesh = fzero.SimMesh(1)
    seen = []

    def loss_fn(p, b):
        seen.append(len(seen))
        penalty = model[2].weight.pow(2).sum() if len(seen) % 2 == 0 else 0.0  # the second micro-batch's
        return F.cross_entropy(apply(p, b[0]), b[1]) + penalty

    def rank():
        state = fzero.init(params, optim.sgd(0.1), stage=1, mesh=mesh)
        fzero.train_step(loss_fn, micro_batches=2)(state, _batches(1)[0])

    with pytest.raises(fzero.ConfigError, match=r"'2.weight' \(Sequential\)"):
        mesh.run(rank)
    assert seen == [0, 1]  # refused at the second micro-batch's loss, before its backward


def _written_run(write, stage=0, steps=2, between=None, keep=None):
    """A two-layer model through from_module, `write(model, phase)` called with phase "before init"
    and "after init", two SGD steps at N = 2 (`between(model, info, gathered params, rank)` after the first);
    returns rank 0's trained params and the ModuleWrittenAfterInit warnings."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    params, apply, info = fzero.from_module(model)
    write(model, "before init")
    mesh = fzero.SimMesh(2)

    def rank():  # (one module: SimMesh's ranks are threads of one process, taking turns at collectives; rank 0
        # writes once both have copied it, and both step after the write: an all-reduce on each side)
        state = fzero.init(params, optim.sgd(0.1), mesh=mesh, stage=stage,
                           **({} if keep is None else {"precision": keep}))
        fzero.collectives.all_reduce(torch.zeros(1), mesh)
        if mesh.rank == 0:
            write(model, "after init")
        fzero.collectives.all_reduce(torch.zeros(1), mesh)
        step = fzero.train_step(lambda p, x: apply(p, x.to(p["0.weight"].dtype)).float().square().sum())
        for i in range(steps):
            if i == 1 and between is not None:
                between(model, info, fzero.gather(state), mesh.rank)
            state, _ = step(state, torch.full((2, 3), 1.0 + mesh.rank))
        return fzero.gather(state)

    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = mesh.run(rank)[0]
    return out, [w for w in caught if issubclass(w.category, fzero.ModuleWrittenAfterInit)]


_PRETRAINED = {"0.weight": torch.full((4, 3), 0.5), "0.bias": torch.zeros(4), "1.weight": torch.full((1, 4), 0.25),
               "1.bias": torch.zeros(1)}


@pytest.mark.parametrize("stage", [0, 3])
def test_weights_loaded_into_the_module_after_init_warn_at_the_first_step(stage):
    """`model.load_state_dict(pretrained)` after `fzero.init` (found in review of a user migrating a
    torch script): the state trains init's copies, as before, and its first step warns
    `ModuleWrittenAfterInit` naming the parameters (bad-input row 248); loaded before init, the same
    weights are trained from, with no warning; so is an `assign=True` load before init refused to go
    silently (the module then holds tensors init never copied)."""
    def after(model, phase):
        if phase == "after init":
            model.load_state_dict(_PRETRAINED)

    def before(model, phase):
        if phase == "before init":
            model.load_state_dict(_PRETRAINED)

    untouched, none = _written_run(lambda model, phase: None, stage)
    loaded_after, warned = _written_run(after, stage)
    loaded_before, silent = _written_run(before, stage)
    assert none == [] and silent == []
    assert all(torch.equal(loaded_after[k], untouched[k]) for k in untouched)
    # one warning per rank, naming the parameters whose values that rank holds otherwise (at stage 3 its shard's)
    words = [str(w.message) for w in warned]
    named = {n for w in words for n in ("'0.bias'", "'0.weight'", "'1.bias'", "'1.weight'") if n in w}
    assert len(warned) == 2 and len(named) == 4 and all(" of the Sequential given to fzero.from_module" in w for w in words)
    # every rank names every parameter: at stage 3 a rank holding none of a leaf compares a print of its values
    # (found in review: those ranks passed it over, and only the rank whose module was written sees a write)
    assert all(all(n in w for n in ("'0.bias'", "'0.weight'", "'1.bias'", "'1.weight'")) for w in words), words
    assert "fzero.init({name: sd[name] for name in params}, ...)" in words[0]
    assert all(w.filename == __file__ for w in warned)  # the user's line, past torch's wrapper of the step
    assert not torch.equal(loaded_before["0.weight"], untouched["0.weight"])

    def assigned(model, phase):
        if phase == "before init":
            model.load_state_dict(_PRETRAINED, assign=True)

    _, replaced = _written_run(assigned, stage)
    assert len(replaced) == 2 and all("'0.weight'" in str(w.message) for w in replaced)  # (a shard of each at stage 3)


def test_the_states_own_values_written_back_before_its_first_step_do_not_warn():
    """Writing the state's values into the module before its first step (to evaluate it with
    torch, a GAN loop syncing its critic first) moves the version counters, but the state holds
    those values: no warning (found in review of the first version, which warned on any write)."""
    def write_back(model, phase):
        if phase == "after init":
            model.load_state_dict(model.state_dict())

    _, warned = _written_run(write_back, stage=3)
    assert warned == []


def test_trained_values_written_back_between_steps_do_not_warn():
    """Only the first step checks: writing into the module between steps (the trained values, to
    evaluate it with torch, is how the module is used) warns nothing, whatever is written: here
    other values than the state's (a review found the test writing the state's own values, which
    no step would warn of, so that checking every step passed it)."""
    def write_back(model, info, full, rank):
        if rank == 0:  # (one module: SimMesh's ranks are threads of one process)
            model.load_state_dict(_PRETRAINED)

    _, warned = _written_run(lambda model, phase: None, between=write_back)
    assert warned == []


def test_the_first_steps_check_reads_each_buckets_master_once(monkeypatch):
    """The values compared are read once per bucket, not once per leaf (an NVMe master is read
    from its file: found in review, 96 reads of one bucket at the first step)."""
    import fzero._src.state as state_impl
    reads, read = [], state_impl.master_values
    monkeypatch.setattr(state_impl, "master_values", lambda state, b: reads.append(b) or read(state, b))

    def write_back(model, phase):
        if phase == "after init":
            model.load_state_dict(model.state_dict())

    bf16 = fzero.Precision(torch.bfloat16, torch.float32)
    _, warned = _written_run(write_back, stage=1, steps=1, keep=bf16)
    checked = len(reads)
    reads.clear()
    _written_run(lambda model, phase: None, stage=1, steps=1, keep=bf16)  # no write: the check reads nothing
    assert warned == [] and checked - len(reads) == 2  # four leaves, one bucket: read once on each of two ranks


def _first_step_warnings(stage: int, write: str) -> list[str]:
    """One process per rank, each seeding its model with its rank (init's `sync` broadcasts rank
    0's values): `write` is "state back" (every rank writes the state's gathered values into its
    module) or "rank 0 pretrained" (rank 0 alone loads other weights, DDP's habit); the
    ModuleWrittenAfterInit words of the first step."""
    import warnings
    mesh = fzero.DistMesh(backend="gloo", timeout=30)
    torch.manual_seed(mesh.rank)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    params, apply, info = fzero.from_module(model)
    state = fzero.init(params, optim.sgd(0.1), mesh=mesh, stage=stage)
    full = fzero.gather(state)
    if write == "state back":
        model.load_state_dict(info.state_dict(full))
    elif mesh.rank == 0:
        model.load_state_dict(_PRETRAINED)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fzero.train_step(lambda p, x: apply(p, x).square().sum())(state, torch.ones(2, 3))
    return [str(w.message) for w in caught if issubclass(w.category, fzero.ModuleWrittenAfterInit)]


@pytest.mark.dist
@pytest.mark.parametrize("stage", [1, 3])
def test_one_process_per_rank_warns_only_where_the_module_holds_other_values(stage):
    """Ranks seeded apart, the state's values written back on every rank: no warning (found in
    review: a rank holding none of a leaf compared a print of its own values from before init's
    broadcast, and warned). Rank 0 alone loading other weights: rank 0 warns naming every
    parameter, also those in rank 1's shard at stage 3 (found in review: passed over), and rank 1,
    whose module holds the state's values, warns nothing."""
    from fzero.testing.pool import run_job
    assert run_job(2, _first_step_warnings, [(stage, "state back")] * 2, timeout=60) == [[], []]
    loaded, other = run_job(2, _first_step_warnings, [(stage, "rank 0 pretrained")] * 2, timeout=60)
    assert len(loaded) == 1 and other == [], (loaded, other)
    assert all(n in loaded[0] for n in ("'0.bias'", "'0.weight'", "'1.bias'", "'1.weight'")), loaded
