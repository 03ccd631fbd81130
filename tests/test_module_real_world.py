"""from_module on patterns of real-world modules (found in review of real-world modules):

- F5: a parameter also held in an unregistered attribute (`self._refs = [self.w2]`), which
  `copy.deepcopy(module, memo=placeholders)` maps to a meta stand-in that nothing rebinds: the
  dict path (`apply(params, x)`, `gather="eager"`) returned uninitialised memory or a loss of
  log(V), and the on-use path's error pointed to `gather="eager"`, which was as wrong. Now every
  path raises a `ConfigError` naming the parameter, its shape and where it is held.
- F4: a hook whose closure holds the module or one of its parameters reads the original, never
  the trained leaf: refused by `from_module`, naming the hook, its module and what it holds.
- F1: `get_extra_state`: `ModuleInfo.state_dict` holds each `_extra_state`, so the strict
  round trip `model.load_state_dict(info.state_dict(fzero.gather(state)))` holds.
"""

import functools
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fzero

D, V = 8, 11


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(6, D, generator=g), torch.randint(0, V, (6,), generator=g)


def _train(params, apply, info, stage: int, gather: str, steps: int = 1, world: int = 1):
    """`steps` SGD steps on a `SimMesh(world)`; `(gathered params, losses)` of rank 0."""
    mesh = fzero.SimMesh(world)

    def rank_fn():
        state = fzero.init(params, fzero.optim.sgd(0.1), stage=stage, mesh=mesh, units=info.units,
                           groups=info.groups)
        step = fzero.train_step(lambda p, b: F.cross_entropy(apply(p, b[0]), b[1]), gather=gather)
        losses = []
        for k in range(steps):
            state, m = step(state, _batch(k))
            losses.append(m.loss)
        return fzero.gather(state), losses

    return mesh.run(rank_fn)[0]


def _torch_sgd(model: nn.Module, steps: int = 1) -> dict[str, torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    for k in range(steps):
        x, y = _batch(k)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


# -- F5: a parameter also held in a list, dict or plain attribute -------------------------------


class _ListRef(nn.Module):
    """`w2` registered, and also held in a plain list its forward reads it from."""

    def __init__(self, where: str = "list"):
        super().__init__()
        self.l, self.w2 = nn.Linear(D, V), nn.Parameter(torch.randn(V, V))
        if where == "list":
            self._refs = [self.w2]
        else:
            self.__dict__["_ref"] = self.w2  # a plain attribute, past nn.Module.__setattr__
        self.where = where

    def forward(self, x):
        return self.l(x) @ (self._refs[0] if self.where == "list" else self._ref)


_HELD = r"parameter 'w2' \(float32\[11, 11\]\) is also held outside the module's registered parameters, as {}"


@pytest.mark.parametrize("where,shown", [("list", r"'_refs\[0\]'"), ("attr", r"'_ref'")])
def test_a_param_held_in_a_list_is_a_config_error_on_the_dict_path(where, shown):
    """`apply(params, x)` with a plain dict (what `fzero.gather` gives, what `gather="eager"`
    runs): the forward read the meta stand-in from the list, and torch's CPU product over a meta
    operand returned uninitialised memory (found in review). Now a `ConfigError` naming the
    parameter, its shape and where it is held, without pointing to `gather="eager"`."""
    torch.manual_seed(0)
    model = _ListRef(where)
    params, apply, _ = fzero.from_module(model)
    with pytest.raises(fzero.ConfigError, match=_HELD.format(shown)) as e:
        apply(params, _batch()[0])
    assert "eager" not in str(e.value) and "read it through its module attribute" in str(e.value)


@pytest.mark.parametrize("gather", ["eager", "on_use"])
@pytest.mark.parametrize("stage", [0, 3])
def test_a_param_held_in_a_list_is_a_config_error_in_a_step(stage, gather):
    """In a step: `gather="eager"` trained on a loss of log(11) (the stand-in read), silently;
    `gather="on_use"` raised, pointing to `gather="eager"`. Both now raise the same error."""
    torch.manual_seed(0)
    params, apply, info = fzero.from_module(_ListRef())
    with pytest.raises(fzero.ConfigError, match=_HELD.format(r"'_refs\[0\]'")) as e:
        _train(params, apply, info, stage, gather)
    assert "eager" not in str(e.value)


class _Tied(nn.Module):
    """A tied head, an LSTM (whose `_flat_weights` list holds its params) and a BatchNorm."""

    def __init__(self):
        super().__init__()
        self.emb, self.rnn, self.bn = nn.Embedding(V, D), nn.LSTM(D, D, batch_first=True), nn.BatchNorm1d(D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        h = self.rnn(self.emb(x.abs().long() % V))[0].mean(1)
        return self.head(self.bn(h))


def test_registered_params_still_run_on_every_path():
    """The check at use has no false positive where the params are read through their
    registered slots (a tied weight, an LSTM's `_flat_weights`, a buffer): the dict path gives
    the module's output bit for bit, and a step at each gather equals torch's SGD."""
    torch.manual_seed(0)
    model = _Tied()
    x = _batch()[0]
    params, apply, info = fzero.from_module(model)
    assert torch.equal(apply(params, x), model(x))
    torch.manual_seed(0)
    want = _torch_sgd(_Tied())
    for gather in ("eager", "on_use"):
        torch.manual_seed(0)
        model = _Tied()
        params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, ""))
        got, _ = _train(params, apply, info, 3, gather)
        assert all(torch.equal(got[k], want[k]) for k in got), gather


class _Flattening(_Tied):
    """`_Tied` whose forward calls `rnn.flatten_parameters()` first (the DataParallel idiom; a
    no-op on the CPU)."""

    def forward(self, x):
        self.rnn.flatten_parameters()
        return super().forward(x)


@pytest.mark.parametrize("units", ["one", "per child"])
def test_an_rnn_flattened_in_the_forward_trains_as_without(units):
    """Found in review: `flatten_parameters()` read the copy's `_flat_weights` stand-ins (`.is_cuda`)
    and was refused at every stage and gather, with ways out that failed too. `from_module`'s copy
    makes it a no-op: each gather gives the steps of the model without the call."""
    torch.manual_seed(0)
    want = _torch_sgd(_Tied())
    for gather in ("eager", "on_use"):
        torch.manual_seed(0)
        model = _Flattening()
        params, apply, info = fzero.from_module(
            model, units=None if units == "one" else fzero.units_by_prefix(model, ""))
        got, _ = _train(params, apply, info, 3, gather)
        assert all(torch.equal(got[k], want[k]) for k in got), gather
    assert isinstance(model.rnn.flatten_parameters, types.MethodType) and (
        model.rnn.flatten_parameters.__func__ is nn.LSTM.flatten_parameters), "the user's module is not changed"


# -- F4: a hook holding the module or one of its parameters ----------------------------------------


def _scaled(**hooks) -> nn.Module:
    """`Linear, Tanh, Linear` and a root parameter `scale` (ones(V)); `hooks[kind]` builds the
    hook of `m[2]` from the model."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, V))
    m.scale = nn.Parameter(torch.ones(V))
    m.register_buffer("shift", torch.zeros(V))
    for kind, make in hooks.items():
        getattr(m[2], kind)(make(m))
    return m


def _times(mod, args, out, s=None):
    return out * s


def _times_first(mod, args, out, s=()):
    return out * s[0]


def _closing(value, make):
    """`make(value)`: a hook whose closure holds `value`."""
    return make(value)


_CAPTURING = {
    "closure over a param": ("register_forward_hook", lambda m: _closing(m.scale, lambda s: lambda mod, i, o: o * s),
                             "parameter 'scale'"),
    "closure over the module": ("register_forward_hook", lambda m: lambda mod, i, o: o * m.scale, "the module itself"),
    "closure over a submodule": ("register_forward_pre_hook",
                                 lambda m: _closing(m[0], lambda lin: lambda mod, a: (a[0] * lin.weight[0, 0],)),
                                 "submodule '0'"),
    "default argument": ("register_forward_hook", lambda m: lambda mod, i, o, s=m.scale: o * s, "parameter 'scale'"),
    "partial argument": ("register_forward_hook", lambda m: functools.partial(_times, s=m.scale), "parameter 'scale'"),
    "partial over a list": ("register_forward_hook", lambda m: functools.partial(_times_first, s=[m.scale]),
                            "parameter 'scale'"),
    "bound method in a closure": ("register_forward_pre_hook",
                                  lambda m: _closing(m[0].forward, lambda f: lambda mod, a: (a[0] + f(a[0]),)),
                                  "submodule '0'"),
    "list in a closure": ("register_forward_hook",
                          lambda m: _closing([m.scale], lambda ws: lambda mod, i, o: o * ws[0]),
                          "parameter 'scale'"),
    "closure over a buffer": ("register_forward_hook", lambda m: _closing(m.shift, lambda b: lambda mod, i, o: o + b),
                              "buffer 'shift'"),
    "a global": ("register_forward_hook", lambda m: eval("lambda mod, i, o: o * model.scale", {"model": m}),
                 "the module itself"),
    "backward hook": ("register_full_backward_hook", lambda m: lambda mod, gi, go: (gi[0] * m.scale,),
                      "the module itself"),
    # found in review: `co_names` was read for the globals, never the code nested in the hook
    "a global read in a nested lambda": ("register_forward_hook",
                                         lambda m: eval("lambda mod, i, o: o * (lambda: model.scale)()", {"model": m}),
                                         "the module itself"),
    # found in review: an object holding the module (a trainer) was not looked into
    "closure over an object holding the module": (
        "register_forward_hook",
        lambda m: _closing(types.SimpleNamespace(model=m), lambda t: lambda mod, i, o: o * t.model.scale),
        r"the module itself \(in its closure, as attribute 'model' of a SimpleNamespace\)"),
    "a global object holding a param": ("register_forward_hook",
                                        lambda m: eval("lambda mod, i, o: o * cfg.w", {"cfg": types.SimpleNamespace(
                                            w=m.scale, n=3)}), "parameter 'scale'"),
}


@pytest.mark.parametrize("case", sorted(_CAPTURING))
def test_a_hook_holding_the_module_or_its_params_is_refused(case):
    """Found in review: copy.deepcopy leaves a function as it is, so a hook closing over the
    module or one of its parameters read the original from apply's copy: the loss was computed
    with the initial `scale`, which never trained, and every leaf differed from torch's, with no
    error. Now `from_module` refuses it, naming the hook's module, the hook and what it holds."""
    register, make, what = _CAPTURING[case]
    model = _scaled(**{register: make})
    with pytest.raises(fzero.ConfigError, match=r"from_module: the .*hook .* of submodule '2' \(Linear\) holds "
                                                + what) as e:
        fzero.from_module(model)
    assert "the hook's module argument" in str(e.value)


class _Scaler(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.ones(V))

    def hook(self, mod, args, out):
        return out * self.s

    def forward(self, x):
        return x


_FINE = {
    "a bound method": lambda m: m.scaler.hook,
    "the param through its module argument": lambda m: lambda mod, i, o: o * mod.weight[0, :].sum(),
    "a plain tensor and a number": lambda m: _closing((torch.full((V,), 2.0), 0.5),
                                                      lambda tc: lambda mod, i, o: o * tc[0] + tc[1]),
    "a partial holding the module": lambda m: functools.partial(lambda root, mod, i, o: o * root.scaler.s, m),
    # found in review: `co_names` lists attribute names too, so `mod.weight` was read as the global `weight`
    "an attribute named as a global": lambda m: eval("lambda mod, i, o: o * mod.weight[0, :].sum()",
                                                     {"weight": m[2].weight}),
    "an object holding no part of it": lambda m: _closing(types.SimpleNamespace(k=2.0, t=torch.ones(V)),
                                                          lambda c: lambda mod, i, o: o * c.t * c.k),
}


@pytest.mark.parametrize("case", sorted(_FINE))
@pytest.mark.parametrize("stage", [0, 3])
def test_a_hook_that_copy_rebinds_trains_as_torch_does(case, stage):
    """No false positive: a bound method (deepcopy rebinds its module), a hook reading its
    module argument, one closing over a plain tensor or a number, and a partial holding the
    module (deepcopy copies its arguments) train bit for bit as torch's SGD does."""
    def build():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, V))
        m.scaler = _Scaler()
        m[2].register_forward_hook(_FINE[case](m))
        return m

    want = _torch_sgd(build(), steps=2)
    params, apply, info = fzero.from_module(build())
    got, _ = _train(params, apply, info, stage, "on_use", steps=2)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_hook_keyed_by_its_module_is_refused_with_the_way_out_for_capture():
    """Activation capture keyed by the module object (`acts[mod] = out`) is refused (deepcopy
    cannot rebind the key, and a rebound key would break the user's lookup), but the message said
    the hook "would read the original module's tensors", untrue here (found in review). It now
    says what holds in both cases and gives the way out, keying by name, which runs as written."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, V))
    acts = {}
    for _, m in model.named_modules():
        m.register_forward_hook(lambda mod_, i, o, mod=m: acts.__setitem__(mod, o))
    with pytest.raises(fzero.ConfigError,
                       match=r"holds the module itself \(in its defaults\): the original object") as e:
        fzero.from_module(model)
    msg = str(e.value)
    assert "where the hook reads that object's tensors" in msg and "would read" not in msg
    way_out = msg.split("key them by name: ")[1]
    assert way_out == "for n, m in model.named_modules(): m.register_forward_hook(lambda mod, i, o, n=n: " \
                      "acts.__setitem__(n, o))"
    model = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, V))
    acts = {}
    exec(way_out, {"model": model, "acts": acts})
    params, apply, _ = fzero.from_module(model)
    out = apply(params, _batch()[0])
    assert sorted(acts) == ["", "0", "1", "2"] and torch.equal(acts[""], out)


def _global_hook_holding(m):
    return lambda mod, i, o: o * m.scale if mod is not m and isinstance(mod, nn.Linear) and mod.out_features == V \
        else None


@pytest.mark.parametrize("register", ["register_module_forward_hook", "register_module_forward_pre_hook"])
def test_a_global_module_hook_holding_the_module_is_refused(register):
    """torch's global module hooks run for apply's copy too, and are never copied: one closing
    over the model read the original `scale`, accepted, gradients lost (found in review). Now
    refused, naming the hook and how it was registered."""
    model = _scaled()
    hook = (_global_hook_holding(model) if register == "register_module_forward_hook"
            else lambda mod, a: (a[0] * model.scale[0],) if mod is model[2] else None)
    handle = getattr(torch.nn.modules.module, register)(hook)
    try:
        with pytest.raises(fzero.ConfigError, match=rf"from_module: the global module hook .* \(torch\.nn\.modules"
                                                    rf"\.module\.{register}\) holds the module itself \(in its "
                                                    rf"closure\)"):
            fzero.from_module(model)
    finally:
        handle.remove()


@pytest.mark.parametrize("stage", [0, 3])
def test_a_global_module_hook_holding_no_part_of_the_module_trains_as_torch_does(stage):
    """No false positive: a global hook that holds no part of the module (a log of output shapes,
    a plain tensor) is accepted, and the steps equal torch's SGD bit for bit."""
    log, two = [], torch.full((V,), 2.0)
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda mod, i, o: (log.append(tuple(o.shape)), o * two if isinstance(mod, nn.Linear) and mod.out_features == V
                           else None)[1])
    try:
        def build():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, V))

        want = _torch_sgd(build(), steps=2)
        params, apply, info = fzero.from_module(build())
        got, _ = _train(params, apply, info, stage, "on_use", steps=2)
    finally:
        handle.remove()
    assert log and all(torch.equal(got[k], want[k]) for k in want)


# -- a nested apply (a second from_module'd model called inside the first's forward) ---------------


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = nn.Linear(V, V)

    def forward(self, h, w):
        return self.s(F.linear(h, w))


class _Outer(nn.Module):
    """Its forward calls another from_module'd model (`inner`, with a plain dict), passing its
    own head's weight, read outside the head's forward."""

    def __init__(self, inner):
        super().__init__()
        self.a, self.head, self.inner = nn.Linear(D, D), nn.Linear(D, V), inner

    def forward(self, x):
        return self.inner(self.a(x), self.head.weight)


def _nested():
    torch.manual_seed(0)
    inner_model = _Inner()
    pb, apply_b, _ = fzero.from_module(inner_model)
    return inner_model, _Outer(lambda h, w: apply_b(pb, h, w))


def test_a_nested_apply_keeps_the_outer_calls_stand_ins_checked():
    """Found in review: the nested call's table of stand-ins replaced the outer on-use call's, so
    the outer head's weight, read outside its unit's forward and passed in, was the meta stand-in:
    a loss from uninitialised memory, no error (before this change: the ConfigError below)."""
    _, model = _nested()
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, ""))
    with pytest.raises(fzero.ConfigError, match=r"parameter 'head\.weight' \(unit 'head'\) was used \(linear\) "
                                                r"outside the forward of the submodule its unit is bound in"):
        _train(params, apply, info, 3, "on_use")


@pytest.mark.parametrize("gather", ["eager", "on_use"])
def test_a_nested_apply_where_the_outer_unit_is_bound_trains_as_torch_does(gather):
    """No false positive from keeping the outer table: with the head in the root's unit (bound
    for the whole forward) the nested call gets the leaf, and the step equals torch's SGD."""
    inner_model, model = _nested()
    torch.manual_seed(1)
    ref = _Outer(lambda h, w: inner_model(h, w))  # (the inner model's parameters are not trained: a lambda)
    ref.load_state_dict(model.state_dict())
    want = _torch_sgd(ref)
    params, apply, info = fzero.from_module(model)
    got, _ = _train(params, apply, info, 3, gather)
    assert all(torch.equal(got[k], want[k]) for k in want)


# -- F1: get_extra_state / set_extra_state -----------------------------------------------------------


class _Counted(nn.Module):
    """Two linears and extra state: the count of the forwards it ran and the first input of the
    last, kept by `get_extra_state`."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(D, D), nn.Linear(D, V)
        self.calls, self.last = 0, None

    def get_extra_state(self):
        return {"calls": self.calls, "last": self.last}

    def set_extra_state(self, state):
        self.calls, self.last = state["calls"], state["last"]

    def forward(self, x):
        self.calls, self.last = self.calls + 1, x[0, 0].item()
        return self.l2(torch.tanh(self.l1(x)))


def _with_extra():
    torch.manual_seed(0)
    return nn.Sequential(_Counted(), nn.Tanh(), nn.Linear(V, V))


@pytest.mark.parametrize("gather", ["eager", "on_use"])
@pytest.mark.parametrize("stage", [0, 3])
def test_the_strict_round_trip_holds_a_modules_extra_state(stage, gather):
    """Found in review: `ModuleInfo.state_dict` left out `_extra_state`, so README's
    `model.load_state_dict(info.state_dict(fzero.gather(state)))` raised torch's "Missing key(s)
    in state_dict: '0._extra_state'". Now it is there, read from the copy of the module that ran
    the steps (on the on-use path a thread's own copy): the count of forwards is the steps'."""
    model = _with_extra()
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, ""))
    got, _ = _train(params, apply, info, stage, gather, steps=3)
    want = _torch_sgd(_with_extra(), steps=3)
    sd = info.state_dict(got)
    assert sd["0._extra_state"] == {"calls": 3, "last": _batch(2)[0][0, 0].item()}
    assert set(sd) == set(model.state_dict())
    model.load_state_dict(sd)  # strict
    assert model[0].calls == 3
    assert all(torch.equal(v.detach(), want[k]) for k, v in model.named_parameters())


def test_extra_state_is_read_from_the_copy_that_ran_also_after_its_thread_ended():
    """On a `SimMesh` each rank (thread) runs its own copy on the on-use path, and a thread's
    copy goes with its thread: `state_dict` on a rank reads that rank's copy (the last input its
    forward saw), and after `mesh.run` the copy that ran last, which `from_module` keeps (not the
    copy the dict path runs, which ran none)."""
    params, apply, info = fzero.from_module(_with_extra())
    mesh = fzero.SimMesh(2)

    def rank_fn():
        state = fzero.init(params, fzero.optim.sgd(0.1), stage=3, mesh=mesh)
        step = fzero.train_step(lambda p, b: F.cross_entropy(apply(p, b[0]), b[1]))
        for k in range(2):
            state, _ = step(state, _batch(k + 2 * mesh.rank))
        full = fzero.gather(state)
        return full, info.state_dict(full)["0._extra_state"]

    (full, extra0), (_, extra1) = mesh.run(rank_fn)
    last = [_batch(1 + 2 * r)[0][0, 0].item() for r in range(2)]
    assert (extra0, extra1) == ({"calls": 2, "last": last[0]}, {"calls": 2, "last": last[1]})
    assert info.state_dict(full)["0._extra_state"] in (extra0, extra1)


def test_an_export_takes_the_extra_state_from_the_run(tmp_path):
    """`checkpoint.export` reads the files alone, which hold no extra state: its dict plus
    `info.extra_state()` loads strictly (export's docstring)."""
    model = _with_extra()
    params, apply, info = fzero.from_module(model)
    mesh = fzero.SimMesh(1)

    def rank_fn():
        state = fzero.init(params, fzero.optim.sgd(0.1), stage=3, mesh=mesh)
        state, _ = fzero.train_step(lambda p, b: F.cross_entropy(apply(p, b[0]), b[1]))(state, _batch())
        return fzero.checkpoint.save(state, tmp_path, buffers=info.buffers), fzero.gather(state)

    path, full = mesh.run(rank_fn)[0]
    exported = fzero.checkpoint.export(path, aliases=info.aliases)
    with pytest.raises(RuntimeError, match="_extra_state"):
        model.load_state_dict(exported)
    model.load_state_dict({**exported, **info.extra_state()})
    assert model[0].calls == 1 and all(torch.equal(v.detach(), full[k]) for k, v in model.named_parameters())


class _MaxScaled(nn.Module):
    """Extra state computed from a parameter (an FP8-style scale: the weight's largest magnitude)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, V)
        self.wmax = None

    def forward(self, x):
        return self.lin(x)

    def get_extra_state(self):
        return {"wmax": self.lin.weight.detach().abs().max()}

    def set_extra_state(self, state):
        self.wmax = state["wmax"]


@pytest.mark.parametrize("gather", ["eager", "on_use"])
def test_extra_state_reading_a_param_reads_the_trained_value(gather):
    """Found in review: `get_extra_state` ran on apply's copy, whose parameters are meta
    stand-ins, so a scale read from the weight was a meta tensor in the state dict, which a strict
    `load_state_dict` accepted. Now `state_dict(full)` binds `full`'s params while it runs."""
    torch.manual_seed(0)
    model = _MaxScaled()
    params, apply, info = fzero.from_module(model)
    got, _ = _train(params, apply, info, 3, gather)
    wmax = info.state_dict(got)["_extra_state"]["wmax"]
    assert not wmax.is_meta and torch.equal(wmax, got["lin.weight"].abs().max())
    model.load_state_dict(info.state_dict(got))
    assert torch.equal(model.wmax, got["lin.weight"].abs().max()) and model.get_extra_state()["wmax"] == wmax
    assert torch.equal(info.extra_state(got)["_extra_state"]["wmax"], wmax)
    with pytest.raises(fzero.ConfigError, match="get_extra_state called without params"):
        info.extra_state()  # the copy holds its stand-ins again, not the leaves bound for the read


def test_extra_state_reading_a_param_without_params_names_it_and_the_way_out():
    """`info.extra_state()` alone (the export recipe) has no params to bind: a `get_extra_state`
    that reads one raises naming it and `info.extra_state(fzero.gather(state))`; before, it
    returned the meta stand-in's result."""
    params, apply, info = fzero.from_module(_MaxScaled())
    apply(params, _batch()[0])
    with pytest.raises(fzero.ConfigError, match=r"parameter 'lin\.weight' was read \(detach\) by a get_extra_state "
                                                r"called without params .* "
                                                r"info\.extra_state\(fzero\.gather\(state\)\)"):
        info.extra_state()
    with pytest.raises(fzero.ConfigError, match=r"ModuleInfo\.extra_state\(full\) takes the params .* missing "
                                                r"\['lin\.bias'\]"):
        info.extra_state({"lin.weight": params["lin.weight"]})


def test_extra_state_on_a_simmesh_is_kept_within_one_mesh_run_and_restarts_at_the_next():
    """Pins what `ModuleInfo.state_dict`'s docstring says (found in review: it said "the steps'"):
    on the on-use path each thread's copy is made from `from_module`'s copy, so a thread keeps the
    count across its steps (3 steps in one `mesh.run`: 3, as torch counts), and each `mesh.run`
    (new threads) starts from `from_module`'s again (3 steps in 3 `mesh.run` calls: 1)."""
    params, apply, info = fzero.from_module(_with_extra())
    mesh = fzero.SimMesh(1)
    step = fzero.train_step(lambda p, b: F.cross_entropy(apply(p, b[0]), b[1]))

    def steps(state, n):
        for k in range(n):
            state, _ = step(state, _batch(k))
        return state, info.extra_state()["0._extra_state"]["calls"]

    state = mesh.run(lambda: fzero.init(params, fzero.optim.sgd(0.1), stage=3, mesh=mesh))[0]
    state, calls = mesh.run(steps, [(state, 3)])[0]
    assert calls == 3 and info.extra_state()["0._extra_state"]["calls"] == 3
    for _ in range(3):
        state, calls = mesh.run(steps, [(state, 1)])[0]
        assert calls == 1
    assert info.extra_state()["0._extra_state"]["calls"] == 1


# -- a hook registered on a parameter tensor ----------------------------------------------------


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, V))


@pytest.mark.parametrize("register", ["register_hook", "register_post_accumulate_grad_hook"])
def test_a_hook_on_a_parameter_tensor_is_refused(register):
    """`m[2].weight.register_hook(lambda g: g * 0)` (a per-parameter gradient transform) ran in
    torch's training and not in fzero's: apply's copy replaces the parameter, and its hooks with it,
    so the gradient went untransformed, silently (found in review)."""
    m = _mlp()
    getattr(m[2].weight, register)(lambda g: g * 0 if register == "register_hook" else None)
    with pytest.raises(fzero.ConfigError, match=rf"from_module: parameter '2.weight' \(float32\[11, 8\]\) has a "
                                                rf"tensor hook \({register}: '[\w.]*test_module_real_world\."
                                                rf"test_a_hook_on_a_parameter_tensor_is_refused.<locals>.<lambda>'\)"):
        fzero.from_module(m)


def test_a_removed_parameter_hook_is_no_hook():
    m = _mlp()
    m[2].weight.register_hook(lambda g: g * 0).remove()
    params, apply, info = fzero.from_module(m)
    got, _ = _train(params, apply, info, stage=0, gather="eager")
    want = _torch_sgd(_mlp())
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_hook_on_a_frozen_parameter_is_no_hook():
    """A hook registered on every parameter, then the backbone frozen: torch never runs a frozen
    parameter's hook, so neither is it refused (found in review)."""
    m = _mlp()
    for p in m.parameters():
        p.register_hook(lambda g: g)
    for p in m[2].parameters():
        p.requires_grad_(False)
    m[0].weight.requires_grad_(False)
    m[0].bias.requires_grad_(False)
    fzero.from_module(m)  # every hooked parameter frozen: accepted


def test_a_submodule_with_extra_state_under_two_names_is_in_the_state_dict_under_both():
    """A submodule with `get_extra_state`, registered twice (shared): `info.extra_state()` holds
    `a._extra_state` and `b._extra_state`, as the module's `state_dict` does, so a strict load
    matches (a mutant listing it once passed the suite: found by a mutation audit)."""
    class WithExtra(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.calls = 3

        def forward(self, x):
            return self.lin(x)

        def get_extra_state(self):
            return {"calls": self.calls}

        def set_extra_state(self, state):
            self.calls = state["calls"]

    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = WithExtra()
            self.b = self.a

        def forward(self, x):
            return self.b(self.a(x))

    model = Shared()
    params, _, info = fzero.from_module(model)
    assert sorted(info.extra_state()) == ["a._extra_state", "b._extra_state"]
    model.load_state_dict(info.state_dict({k: v.clone() for k, v in params.items()}))  # strict
