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
