"""A step of a state made of `fzero.from_module`'s params refuses a parameter whose
`requires_grad` changed on the module since `from_module` read it and now disagrees with what
the state does with the leaf (docs/bad-input.md row 211): `from_module` chose the frozen leaves
when it ran (`info.groups`, fixed at `fzero.init`), so a module frozen after `from_module` (a LoRA
user's `model.requires_grad_(False)` before re-enabling the adapters) trained every leaf, and a
layer thawed or frozen between steps went on as before, silently (found in review of a LoRA
user). The first version checked in `apply`, and refused a teacher or critic run through `apply`
with another state's params in a loss (found in review); the step checks its own state now."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

import fzero
from fzero import optim


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


def _batches(n: int, steps: int = 3):
    g = torch.Generator().manual_seed(1)
    return [[(torch.randn(4, 6, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(steps)]
            for _ in range(n)]


def _loss(apply):
    return lambda p, b: F.cross_entropy(apply(p, b[0]), b[1])


def _train(model, *, stage: int, between=None, n: int = 2, **step_kw):
    """Train `model` from `from_module` over 3 steps on `n` SimMesh ranks, calling `between(i)`
    before step i on rank 0 (the module is shared by the ranks); each rank's gathered params, or
    the `ConfigError` it raised and the step it raised at."""
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, ""))
    mesh = fzero.SimMesh(n)

    def rank(batches):
        state = fzero.init(params, optim.adamw(1e-2), stage=stage, mesh=mesh, units=info.units, groups=info.groups)
        step = fzero.train_step(_loss(apply), **step_kw)
        for i, batch in enumerate(batches):
            if between is not None and mesh.rank == 0:
                between(i)
            before = fzero.gather(state)
            try:
                state, _ = step(state, batch)
            except fzero.ConfigError as e:
                after = fzero.gather(state)
                assert all(torch.equal(before[k], after[k]) for k in before), "the refused step updated the state"
                return i, e
        return fzero.gather(state)

    return mesh.run(rank, [(b,) for b in _batches(n)])


KINDS = [("autograd", "on_use"), ("autograd", "eager"), ("func", "eager")]


def _refused(params, apply, info, match: str, stage: int = 0, make_apply=None) -> None:
    """One rank's first step of a state made of `params` is refused with a message matching
    `match` (`make_apply()`, where given, is called inside the rank for the apply the loss runs)."""
    mesh = fzero.SimMesh(1)

    def rank(batch):
        state = fzero.init(params, optim.adamw(1e-2), stage=stage, mesh=mesh, units=info.units, groups=info.groups)
        with pytest.raises(fzero.ConfigError, match=match):
            fzero.train_step(_loss(make_apply() if make_apply else apply))(state, batch)

    mesh.run(rank, [(_batches(1)[0][0],)])


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("engine,gather", KINDS)
def test_a_module_frozen_after_from_module_is_refused_at_the_first_step(stage, engine, gather):
    model = _model()
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, ""))
    model.requires_grad_(False)  # a LoRA user's freeze, then the adapters (here the last layer) back on
    model[2].requires_grad_(True)
    mesh = fzero.SimMesh(2)

    def rank(batches):
        state = fzero.init(params, optim.adamw(1e-2), stage=stage, mesh=mesh, units=info.units, groups=info.groups)
        with pytest.raises(fzero.ConfigError) as e:
            fzero.train_step(_loss(apply), engine=engine, gather=gather)(state, batches[0])
        return str(e.value)

    for message in mesh.run(rank, [(b,) for b in _batches(2)]):  # every rank, before any update
        assert "'0.bias' (trainable then, frozen now), '0.weight' (trainable then, frozen now)" in message
        assert "'2.weight'" not in message and "Sequential given to fzero.from_module" in message
        assert "fzero.from_module(model, units=...) again" in message and "info.groups" in message
        assert "this state, made of its params, trains or freezes each as before" in message


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("engine,gather", KINDS)
def test_a_layer_thawed_between_steps_is_refused_at_the_next_step(stage, engine, gather):
    model = _model()
    model[0].requires_grad_(False)

    def between(i):
        if i == 1:
            model[0].weight.requires_grad_(True)  # gradual unfreezing, as in torch

    got = _train(model, stage=stage, between=between, engine=engine, gather=gather)
    for i, e in got:
        assert i == 1 and "'0.weight' (frozen then, trainable now)" in str(e) and "'0.bias'" not in str(e)


@pytest.mark.parametrize("gather", ["on_use", "eager"])
def test_flags_set_back_before_the_step_train_with_the_bits_of_flags_never_changed(gather):
    """A GAN loop's idiom: the module frozen while another loss runs it as a fixed function
    (as row 208's refusal advises), its flags set back before its own state's step."""
    model = _model()
    reference = _train(model, stage=3, gather=gather)
    flipped = []

    def between(i):
        model.requires_grad_(False)  # the other loss's part of the step would run here
        flipped.append(i)
        model.requires_grad_(True)

    got = _train(model, stage=3, between=between, gather=gather)
    assert flipped == [0, 1, 2]
    for mine, theirs in zip(got, reference):
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize("gather", ["on_use", "eager"])
def test_reads_without_grad_pass_with_changed_flags(gather):
    """`fzero.evaluate` and `torch.no_grad()` reads take no gradient: no leaf's training depends
    on the flags there."""
    model = _model()
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, ""))
    model.requires_grad_(False)  # e.g. the module handed on to code that only runs it
    mesh = fzero.SimMesh(2)
    x = torch.randn(4, 6)

    def rank():
        state = fzero.init(params, optim.adamw(1e-2), stage=3, mesh=mesh, units=info.units, groups=info.groups)
        out = fzero.evaluate(lambda p, b: apply(p, b), gather=gather)(state, x)
        with torch.no_grad():
            direct = apply(params, x)
        return torch.equal(out, direct)

    assert mesh.run(rank) == [True, True]


def test_the_way_out_the_message_gives_trains_the_new_set():
    model = _model()
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, ""))
    mesh = fzero.SimMesh(2)
    batches = _batches(2)

    def rank(batches):
        state = fzero.init(params, optim.adamw(1e-2), stage=3, mesh=mesh, units=info.units, groups=info.groups)
        state, _ = fzero.train_step(_loss(apply))(state, batches[0])
        return fzero.gather(state)

    trained = mesh.run(rank, [(b,) for b in batches])[0]
    model.load_state_dict(info.state_dict(trained))  # the message's recipe
    model[0].requires_grad_(False)
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, ""))

    def again(batches):
        state = fzero.init(params, optim.adamw(1e-2), stage=3, mesh=mesh, units=info.units, groups=info.groups)
        for b in batches[1:]:
            state, _ = fzero.train_step(_loss(apply))(state, b)
        return fzero.gather(state)

    for got in mesh.run(again, [(b,) for b in batches]):
        assert torch.equal(got["0.weight"], trained["0.weight"]) and torch.equal(got["0.bias"], trained["0.bias"])
        assert not torch.equal(got["2.weight"], trained["2.weight"])


def test_a_module_freed_after_from_module_is_not_read():
    """The flags are held weakly: a user who drops the module after `from_module` (to free its
    memory) trains as before."""
    model = _model()
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, ""))
    expected = {k: v.clone() for k, v in params.items()}
    del model
    gc.collect()
    mesh = fzero.SimMesh(2)

    def rank(batch):
        state = fzero.init(params, optim.adamw(1e-2), stage=0, mesh=mesh, units=info.units, groups=info.groups)
        state, _ = fzero.train_step(_loss(apply))(state, batch)
        return fzero.gather(state)

    for got in mesh.run(rank, [(b[0],) for b in _batches(2)]):
        assert set(got) == set(expected) and not torch.equal(got["0.weight"], expected["0.weight"])


@pytest.mark.parametrize("gather", ["on_use", "eager"])
def test_a_compiled_loss_is_refused_too(gather):
    """The step checks its state, eagerly: a compiled loss, either gather (the first version,
    in `apply`, did not see a compiled dict path)."""
    torch._dynamo.reset()
    model = _model()
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, ""))
    model[0].requires_grad_(False)
    mesh = fzero.SimMesh(1)

    def rank(batch):
        state = fzero.init(params, optim.adamw(1e-2), stage=3, mesh=mesh, units=info.units, groups=info.groups)
        with pytest.raises(fzero.ConfigError, match=r"'0.weight' \(trainable then, frozen now\)"):
            fzero.train_step(torch.compile(_loss(apply), backend="aot_eager"), gather=gather)(state, batch)

    mesh.run(rank, [(_batches(1)[0][0],)])


@pytest.mark.parametrize("gather", ["on_use", "eager"])
def test_a_teacher_frozen_after_from_module_and_run_through_apply_with_its_states_params_trains(gather):
    """A distillation loop: the teacher given to `from_module` (its state trained it), then
    frozen, and run through its `apply` in the student's loss, with its own state's gathered
    params, plainly and under `torch.func.grad`: the student's step does not read the teacher's
    flags (found in review of the first version, which refused all three)."""
    teacher, student = _model(), _model()
    t_params, t_apply, t_info = fzero.from_module(teacher)
    s_params, s_apply, s_info = fzero.from_module(student, units=fzero.units_by_prefix(student, ""))
    teacher.requires_grad_(False)
    mesh = fzero.SimMesh(2)

    def rank(batches):
        t_state = fzero.init(t_params, optim.sgd(0.1), stage=0, mesh=mesh)
        tp = fzero.gather(t_state)

        def loss(p, b):
            soft = torch.func.grad(lambda q: t_apply(q, b[0]).logsumexp(-1).sum())(tp)["0.weight"].sum()
            return F.cross_entropy(s_apply(p, b[0]), t_apply(tp, b[0]).softmax(-1)) + 0 * soft

        # (stage 1: a torch.func transform inside a stage-3 on-use loss is its own refusal, docs/func.md)
        state = fzero.init(s_params, optim.adamw(1e-2), stage=1, mesh=mesh, units=s_info.units, groups=s_info.groups)
        state, _ = fzero.train_step(loss, gather=gather)(state, batches[0])
        return fzero.gather(state)

    for got in mesh.run(rank, [(b,) for b in _batches(2)]):
        assert not torch.equal(got["0.weight"], s_params["0.weight"])


def test_a_frozen_paramgroup_over_a_trainable_parameter_whose_flag_never_changed_trains():
    """Freezing by fzero's own `ParamGroup(frozen=True)`, the module's flags untouched: no flag
    changed, nothing refused; and a flag changed to what the state does already passes too."""
    model = _model()
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, ""))
    mesh = fzero.SimMesh(2)
    frozen = fzero.ParamGroup("mine", match=lambda path: path.startswith("0."), frozen=True)

    def rank(batches):
        state = fzero.init(params, optim.adamw(1e-2), stage=3, mesh=mesh, units=info.units, groups=[frozen])
        state, _ = fzero.train_step(_loss(apply))(state, batches[0])
        if mesh.rank == 0:
            model[0].requires_grad_(False)  # now the module agrees with the state
        state, _ = fzero.train_step(_loss(apply))(state, batches[1])
        return fzero.gather(state)

    for got in mesh.run(rank, [(b,) for b in _batches(2)]):
        assert torch.equal(got["0.weight"], params["0.weight"]) and not torch.equal(got["2.weight"], params["2.weight"])


def test_a_parameter_replaced_in_its_module_is_read_by_name():
    """`load_state_dict(..., assign=True)` puts new Parameters into the module: the check reads
    the module's parameter where it is now (found in review: the first version held the old ones
    and passed a frozen layer over, which then trained; the second read the old ones wherever
    something, here a torch optimizer, kept them alive)."""
    model = _model()
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, ""))
    held = torch.optim.SGD(model.parameters(), lr=0.1)  # keeps the old Parameters alive (found in review)
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    gc.collect()
    model[0].requires_grad_(False)
    assert all(p.requires_grad for p in held.param_groups[0]["params"])  # the old ones: unchanged
    _refused(params, apply, info, r"'0.bias' \(trainable then, frozen now\), '0.weight'")


def test_from_module_called_again_does_not_let_the_old_state_train_the_old_set():
    """Half the message's recipe: `from_module` again, the old state stepped on with the new
    `apply`: still refused (the state compares the module with what it was made of; found in
    review of the first version, which compared each `apply` with its own `from_module`)."""
    model = _model()
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, ""))

    def apply_again():
        model[0].requires_grad_(False)
        return fzero.from_module(model, units=fzero.units_by_prefix(model, ""))[1]

    _refused(params, apply, info, r"'0.weight' \(trainable then, frozen now\)", stage=1, make_apply=apply_again)


@pytest.mark.parametrize("how", ["parametrized", "replaced, the old kept"])
def test_a_parameter_moved_or_a_submodule_replaced_is_read_where_the_module_holds_it(how):
    """After `from_module`: a layer parametrized (its weight moves to
    `parametrizations.weight.original`, the same Parameter) then frozen; or the layer replaced by
    a frozen one while something keeps the old alive. Both trained the frozen leaf, silently
    (found in review of the check's second and third versions)."""
    model = _model()
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, ""))
    kept = model[0]
    if how == "parametrized":
        torch.nn.utils.parametrize.register_parametrization(model[0], "weight", torch.nn.Identity())
        model[0].parametrizations.weight.original.requires_grad_(False)
    else:
        model[0] = torch.nn.Linear(6, 8).requires_grad_(False)
    _refused(params, apply, info, r"'0.weight' \(trainable then, frozen now\)")
    assert kept is not None
