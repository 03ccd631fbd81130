"""fzero.testing's equivalence tooling, made trustworthy: what a review of a team's DDP-equivalence
suite built on it found (each test failed before its fix).

- the snapshots of `ddp_trajectory` / `fzero_trajectory` hold the optimizer state per leaf, so a
  defect below the params' rounding (1 ulp of Adam's exp_avg on rank 1) is caught;
- comparing zero steps is a difference, not `[]`;
- `examples(n)` reads the hypothesis profile when applied, `example_count` the loaded profile;
- ranks given different numbers of batches, and an exception on one rank (in `make_model`,
  `make_optimizer` or `loss_fn`, around DDP's collectives), raise on every rank at once;
- a pool's worker puts torch's global settings back after each call;
- a cached `make_model` is refused; `loss_fn`'s `model` says what it is; a function of the wrong
  style for `Pool.run` / `run_job` says so.

The worker functions are at module level: the pool's workers import them by name.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from torch import nn

import fzero
import fzero.testing.ddp as ddp_module
from fzero.testing import (
    OPT,
    RemoteError,
    WorkerError,
    ddp_trajectory,
    example_count,
    examples,
    fzero_trajectory,
    register_profiles,
    trajectory_differences,
)
from fzero.testing._worker import _check_call
from fzero.testing.pool import run_job

from tests.test_testing_ddp import net_loss

# ---------------------------------------------------------------------------------------------
# A model with a BatchNorm (buffers DDP broadcasts in its forward), a frozen param and a param
# no rank uses


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.GELU())
        self.head = nn.Linear(8, 3)
        self.head.bias.requires_grad_(False)
        self.unused = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()




def batches_for(n: int, steps: int, seed: int = 0) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(4, 5, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(steps)]
            for _ in range(n)]


OPTIMIZERS = {
    "adamw": (lambda: fzero.optim.adamw(1e-2, weight_decay=0.1),
              lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1,
                                          foreach=False)),
    "sgd": (lambda: fzero.optim.sgd(0.1, momentum=0.9, weight_decay=0.01),
            lambda m: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1, momentum=0.9,
                                      weight_decay=0.01, foreach=False)),
}


def _ulp(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x, torch.tensor(float("inf"), dtype=x.dtype))


@contextlib.contextmanager
def exp_avg_one_ulp_up_on_rank_1(mesh):
    """A defect in fzero's step: on rank 1, after every step, the first element this rank holds
    of the largest bucket's Adam exp_avg goes 1 ulp up (below the params' rounding: before, no
    difference showed in 5 steps)."""
    real = ddp_module.train_step

    def defective(loss, **kwargs):
        step = real(loss, **kwargs)

        def run(state, batch):
            new, metrics = step(state, batch)
            if mesh.rank != 1:
                return new, metrics
            held = [(s.exp_avg.numel(), b) for b, s in enumerate(new.opt_state) if hasattr(s, "exp_avg")]
            b = max(held)[1]
            opt = list(new.opt_state)
            bumped = opt[b].exp_avg.clone()
            bumped[0] = _ulp(bumped[0])
            opt[b] = opt[b]._replace(exp_avg=bumped)
            return new.replace(opt_state=tuple(opt)), metrics

        return run

    ddp_module.train_step = defective
    try:
        yield
    finally:
        ddp_module.train_step = real


def against_ddp(mesh, batches: list, kind: str) -> dict:
    """DDP's trajectory (`kind`'s optimizer), its differences from fzero's at every stage, and
    (adamw) from fzero's with the exp_avg defect."""
    make_fzero, make_torch = OPTIMIZERS[kind]
    ref = ddp_trajectory(mesh, make_net, make_torch, net_loss, batches, find_unused_parameters=True)
    run = functools.partial(fzero_trajectory, mesh, make_net, make_fzero(), net_loss, batches, units="body")
    step = OPT + "head.weight.step"
    out = {"keys": list(ref[0]), "steps": [float(s[step]) for s in ref if step in s],
           "stages": {stage: trajectory_differences(ref, run(stage=stage)) for stage in range(4)}}
    if kind == "adamw":
        with exp_avg_one_ulp_up_on_rank_1(mesh):
            out["defect"] = {stage: trajectory_differences(ref, run(stage=stage), limit=100) for stage in range(4)}
    return out


# ---------------------------------------------------------------------------------------------
# F1: the optimizer state is compared


@pytest.mark.dist
def test_the_optimizer_state_is_compared_per_leaf_and_catches_a_one_ulp_defect_at_every_stage(dist2):
    """Before, a snapshot held params and buffers only: a 1-ulp defect in Adam's exp_avg on rank 1
    at every step passed at every stage (the params' rounding absorbed it)."""
    batches = batches_for(2, steps=2)
    params = ["body.0.weight", "body.0.bias", "body.1.weight", "body.1.bias", "head.weight"]  # trained
    for kind, fields in (("adamw", ("step", "exp_avg", "exp_avg_sq")), ("sgd", ("momentum_buffer",))):
        results = dist2.run(against_ddp, [(batches[r], kind) for r in range(2)])
        for rank, res in enumerate(results):
            opt_keys = [k for k in res["keys"] if k.startswith(OPT)]
            # per trained param, torch's fields; none for the frozen head.bias nor the unused Linear
            # (torch holds no state for them: fzero's, zeros with a count of 0, is not listed either)
            assert opt_keys == [f"{OPT}{p}.{f}" for p in params for f in fields], (kind, opt_keys)
            assert res["stages"] == {0: [], 1: [], 2: [], 3: []}, (kind, rank, res["stages"])
        if kind == "adamw":
            assert results[0]["steps"] == [1.0, 2.0]  # torch's per-param step, as float64
            for stage, lines in results[1]["defect"].items():  # rank 1's own state differs at every stage
                assert lines and all(".exp_avg'" in line for line in lines), (stage, lines)
            for stage in (1, 2, 3):  # where the state is sharded, rank 0 gathers rank 1's shard
                assert results[0]["defect"][stage], stage


def test_a_leaf_never_updated_is_listed_only_where_its_state_is_not_inits():
    entries = ddp_module._leaf_entries
    zeros = {"step": torch.zeros(()), "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}
    assert entries(zeros) == {}
    touched = {**zeros, "exp_avg": torch.tensor([0.0, 1e-30, 0.0])}  # a write to a leaf never updated
    assert list(entries(touched)) == ["step", "exp_avg", "exp_avg_sq"]
    sgd = {"count": torch.ones(()), "momentum_buffer": torch.ones(3)}
    assert list(entries(sgd)) == ["momentum_buffer"]  # torch's SGD keeps no count
    assert list(entries({**sgd, "count": torch.zeros(())})) == ["count", "momentum_buffer"]
    assert entries({"step": torch.tensor(3.0, dtype=torch.float32)})["step"].dtype == torch.float64


def test_a_snapshot_key_in_two_parts_is_refused():
    """A param named "buffer:b" beside a buffer "b" would share the key "buffer:b": one hid the other."""
    params, buffers = {"buffer:b": torch.zeros(1)}, {"buffer:b": torch.ones(1)}
    with pytest.raises(fzero.ConfigError, match=r"fzero_trajectory: the snapshot key\(s\) \['buffer:b'\] name both a "
                                                r"param and a buffer or optimizer state entry"):
        ddp_module._joined("fzero_trajectory", params, buffers)


# ---------------------------------------------------------------------------------------------
# F2: nothing compared is a difference


def test_comparing_no_steps_or_empty_steps_is_a_difference():
    """Before, `trajectory_differences([], [])` was `[]`: a test given no batches passed whatever
    fzero did."""
    assert trajectory_differences([], []) == ["0 steps in ref and got: nothing compared"]
    assert trajectory_differences([{}], [{}]) == ["step 0: no keys in ref and got: nothing compared"]
    assert trajectory_differences([], [{"w": torch.zeros(1)}]) == ["0 steps in ref, 1 in got"]


# ---------------------------------------------------------------------------------------------
# F3, F4: the hypothesis profile


def current_profile() -> str:
    return getattr(settings, "get_current_profile_name", lambda: settings._current_profile)()


@contextlib.contextmanager
def loaded(profile: str):
    before = current_profile()
    settings.load_profile(profile)
    try:
        yield
    finally:
        settings.load_profile(before)


def test_examples_reads_the_profile_when_applied_not_when_made():
    """Before, `examples(n)` copied the profile loaded when it was made: made at import, before
    conftest's `register_profiles()`, its tests ran random seeds under a 200 ms deadline."""
    with loaded("default"):  # hypothesis's own profile, as before register_profiles()
        few = examples(3)

    @few
    @given(st.integers())
    def prop(x):
        pass

    got, profile = prop._hypothesis_internal_use_settings, settings()
    assert got.max_examples == example_count(3)
    assert (got.deadline, got.derandomize, got.database) == (profile.deadline, profile.derandomize, profile.database)


def test_example_count_reads_the_loaded_profile_and_an_empty_variable_is_unset(monkeypatch):
    """Before, only HYPOTHESIS_PROFILE was read: `pytest --hypothesis-profile=local` (which loads
    "local" after conftest.py ran) got n examples, not 10 n; and HYPOTHESIS_PROFILE= made
    `register_profiles` raise "Profile '' is not registered"."""
    monkeypatch.delenv("HYPOTHESIS_PROFILE", raising=False)
    with loaded("local"):
        assert example_count(3) == 30 and examples(3).max_examples == 30
    with loaded("ci"):
        assert example_count(3) == 3
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "")
    with loaded(current_profile()):
        assert register_profiles() == "ci" and current_profile() == "ci"
        assert example_count(3) == 3


# ---------------------------------------------------------------------------------------------
# F5, F6: every rank raises, at once


def raising_on_rank_1(where: str):
    """`(make_model, make_optimizer, loss_fn)` of which `where`'s raises on rank 1."""
    rank = torch.distributed.get_rank()

    def make_model():
        if where == "make_model" and rank == 1:
            raise RuntimeError("make_model broke on rank 1")
        return make_net()

    def make_optimizer(m):
        if where == "make_optimizer" and rank == 1:
            raise RuntimeError("make_optimizer broke on rank 1")
        return OPTIMIZERS["sgd"][1](m)

    def loss_fn(model, batch):
        x, y = batch
        if rank == 1 and where == "loss before the forward":
            raise RuntimeError("the batch broke on rank 1")
        if rank == 1 and where == "loss after the forward":
            y = y[:-1]  # a shape error in the loss, after DDP's forward
        return F.cross_entropy(model(x), y)

    return make_model, make_optimizer, loss_fn


def ddp_failing(mesh, batches: list, where: str, verify: bool = True):
    if not verify:
        mesh = fzero.DistMesh(mesh.group, verify=False)
    make_model, make_optimizer, loss_fn = raising_on_rank_1(where)
    return ddp_trajectory(mesh, make_model, make_optimizer, loss_fn, batches, find_unused_parameters=True)


def ddp_failing_under_run(mesh, batches: list, where: str):
    return mesh.run(lambda: ddp_failing(mesh, batches, where))


def fzero_failing(mesh, batches: list, where: str):
    make_model, _, loss_fn = raising_on_rank_1(where)
    return fzero_trajectory(mesh, make_model, OPTIMIZERS["sgd"][0](), loss_fn, batches, stage=3)


@pytest.mark.dist
@pytest.mark.parametrize("fn, where, verify", [
    (ddp_failing, "make_model", True),
    (ddp_failing, "make_optimizer", True),
    (ddp_failing, "loss before the forward", True),  # rank 0 would wait in DDP's buffer broadcast
    (ddp_failing, "loss after the forward", True),  # rank 0 would wait in DDP's gradient all-reduce
    (ddp_failing, "loss after the forward", False),  # an unverified DistMesh: a row of its own
    (ddp_failing_under_run, "loss after the forward", True),  # under mesh.run, as the old hint said
    (fzero_failing, "make_model", True),
])
def test_an_exception_on_one_rank_raises_on_every_rank(dist2, fn, where, verify):
    """Before, the other rank waited in a collective: a PoolError after `error_grace` (10 s here),
    the pool killed; under `mesh.run` both hung to the timeout."""
    batches = batches_for(2, steps=2)
    args = [(batches[r], where, verify) if fn is ddp_failing else (batches[r], where) for r in range(2)]
    with pytest.raises(WorkerError) as info:
        dist2.run(fn, args, timeout=60)
    errors = info.value.errors
    assert [(e.rank, e.type_name.rsplit(".", 1)[-1]) for e in errors][0] == (0, "RankFailed"), errors
    assert errors[1].rank == 1 and "RankFailed" not in errors[1].type_name, errors[1]
    assert "broke on rank 1" in errors[1].message or "batch_size" in errors[1].message, errors[1]
    assert "stops" in errors[0].message and "instead of waiting for it in a collective" in errors[0].message, errors[0]


def ddp_of(mesh, batches: list):
    return ddp_trajectory(mesh, make_net, OPTIMIZERS["sgd"][1], net_loss, batches, find_unused_parameters=True)


@pytest.mark.dist
def test_ranks_given_different_numbers_of_batches_are_refused_on_every_rank(dist2):
    """Before, both ranks waited for the missing step to the pool's timeout, no cause given."""
    batches = batches_for(2, steps=2)
    with pytest.raises(WorkerError) as info:
        dist2.run(ddp_of, [(batches[0],), (batches[1][:1],)], timeout=60)
    assert [e.rank for e in info.value.errors] == [0, 1]
    for e in info.value.errors:
        assert e.type_name.endswith("ConfigError"), e
        assert "ddp_trajectory: the ranks were given different numbers of batches (rank 0: 2, rank 1: 1; world " \
               "size 2)" in e.message, e.message
    mesh = fzero.SimMesh(2)
    with pytest.raises(fzero.ConfigError, match=r"fzero_trajectory: the ranks were given different numbers of batches "
                                                r"\(rank 0: 2, rank 1: 1; world size 2\)"):
        mesh.run(lambda b: fzero_trajectory(mesh, make_net, OPTIMIZERS["sgd"][0](), net_loss, b, stage=1),
                 [(batches[0],), (batches[1][:1],)])


# ---------------------------------------------------------------------------------------------
# F7: a worker's torch settings do not leak into the next call


def sets_float64_and_fails(mesh):
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.use_deterministic_algorithms(True)
    raise AssertionError("failed before putting the settings back")


def torch_settings(mesh):
    return str(torch.get_default_dtype()), torch.is_grad_enabled(), torch.are_deterministic_algorithms_enabled()


@pytest.mark.dist
def test_a_call_that_changes_torchs_settings_does_not_change_the_next_calls(dist2):
    """Before, the next call (the next test) ran in float64 without grad: an equivalence test in the
    wrong dtype passed."""
    with pytest.raises(WorkerError):
        dist2.run(sets_float64_and_fails)
    assert dist2.run(torch_settings) == [("torch.float32", True, False)] * 2


# ---------------------------------------------------------------------------------------------
# F8, F9: a cached model; what `model` is; a function of the other style


_CACHE: dict[str, nn.Module] = {}


def cached_net() -> Net:
    if "net" not in _CACHE:
        _CACHE["net"] = make_net()
    return _CACHE["net"]


def net_around_a_cached_body() -> Net:
    net = make_net()
    net.body = cached_net().body
    return net


@pytest.mark.parametrize("make_model, said", [
    (cached_net, r"returned the same Net object on two calls"),
    (net_around_a_cached_body, r"returned models that share the storage of \['body.0.weight', 'body.0.bias', "
                               r"'body.1.weight', 'body.1.bias'\] \.\.\. \(7 tensor\(s\)\)"),
])
def test_a_cached_model_is_refused(make_model, said):
    """Before, DDP trained the cached module in place and fzero started from DDP's trained params:
    every element differed at step 0, with no hint."""
    mesh = fzero.SimMesh(2)
    with pytest.raises(fzero.ConfigError, match=rf"fzero_trajectory: make_model\(\)('s two calls)? {said}.*"
                                                r"copy.deepcopy\(cached\)"):
        mesh.run(lambda: fzero_trajectory(mesh, make_model, fzero.optim.sgd(0.1), net_loss, [], stage=1))


def loss_of_a_ddp_habit(model, batch):
    x, y = batch
    return F.cross_entropy(model.module(x), y)


def test_loss_fns_model_says_it_is_a_callable_not_the_module():
    """Before: "'functools.partial' object has no attribute 'module'", on the fzero side only."""
    mesh = fzero.SimMesh(2)
    batches = batches_for(2, steps=1)
    with pytest.raises(AttributeError, match=r"fzero_trajectory: loss_fn's `model` has no attribute 'module': it is "
                                             r"a callable, not the module; model\(\*args, \*\*kwargs\) runs"):
        mesh.run(lambda b: fzero_trajectory(mesh, make_net, fzero.optim.sgd(0.1), loss_of_a_ddp_habit, b, stage=0),
                 [(b,) for b in batches])


def pool_style(mesh, batches, stage):
    return stage


def job_style(batches):
    return len(batches)


@pytest.mark.dist
def test_a_function_of_the_other_style_says_how_it_is_called(dist2):
    """`Pool.run` calls `fn(mesh, *args)`, `run_job` `fn(*args)`; before, Python's "missing 1
    required positional argument" (run_job: returned as a RemoteError, not raised)."""
    with pytest.raises(WorkerError, match=r"Pool.run calls fn\(mesh, \*args\).*does not fit Pool.run"):
        dist2.run(job_style, [([1, 2],), ([3],)])
    [got] = run_job(1, pool_style, [([1, 2], 0)], timeout=60)
    assert isinstance(got, RemoteError) and got.type_name == "builtins.TypeError", got
    assert "run_job calls fn(*args): rank r's 2 argument(s), with no mesh" in got.message, got.message


# ---------------------------------------------------------------------------------------------
# A2: what a test module sets when imported stays on the worker; a decorated function's own
# signature; storage only read may be shared; examples(n) is a settings


_IMPORT_TIME_WARNING = "fzero testing trust: a warning the filter this module sets when imported ignores"
warnings.filterwarnings("ignore", message=_IMPORT_TIME_WARNING)  # on a worker too, where warnings are errors


def warns_what_this_module_ignores(mesh):
    warnings.warn(_IMPORT_TIME_WARNING)
    return True


@pytest.mark.dist
def test_what_a_module_sets_when_imported_stays_for_every_call(dist2):
    """Before, a worker imported the module inside the first call's `catch_warnings()`, after
    saving torch's settings: its import-time filter (or `torch.set_default_dtype`) was undone when
    that call returned, and the next identical call failed (or ran in float32)."""
    assert dist2.run(warns_what_this_module_ignores) == [True, True]
    assert dist2.run(warns_what_this_module_ignores) == [True, True]


@mock.patch("os.getpid", return_value=-7)
def under_mock_patch(mesh, x, getpid):  # mock.patch appends its mock: the call takes (mesh, x)
    return x, os.getpid()


def seeded(fn):
    @functools.wraps(fn)
    def wrapper(mesh, *args):
        return fn(mesh, 42, *args)

    return wrapper


@seeded
def takes_a_seed(mesh, seed, x):
    return seed + x


@pytest.mark.dist
def test_a_decorated_function_is_checked_against_its_own_signature(dist2):
    """Before, `inspect.signature` followed `__wrapped__`: `fn(mesh, x, getpid)` under
    `@mock.patch`, or `fn(mesh, seed, x)` under a decorator giving the seed, was refused."""
    _check_call(takes_a_seed, ("mesh", 1), "pool")
    _check_call(under_mock_patch, ("mesh", 1), "pool")
    with pytest.raises(TypeError, match=r"Pool.run calls fn\(mesh, \*args\).*job_style\(batches\) does not take"):
        _check_call(job_style, ("mesh", [1]), "pool")  # a plain function is still checked
    assert dist2.run(under_mock_patch, [(1,), (2,)]) == [(1, -7), (2, -7)]


TABLE = torch.randn(10, 8, generator=torch.Generator().manual_seed(1))  # pretrained vectors, loaded once
MASK = torch.ones(8)  # a constant every build registers as a non-persistent buffer
RUNNING = nn.BatchNorm1d(8, affine=False)  # running statistics, persistent buffers a forward updates


class Pretrained(nn.Module):
    def __init__(self, norm: nn.Module | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding.from_pretrained(TABLE)  # frozen
        self.register_buffer("mask", MASK, persistent=False)
        self.norm = norm if norm is not None else nn.BatchNorm1d(8, affine=False)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.emb(x) * self.mask))


def test_storage_only_read_may_be_shared_but_written_storage_is_refused():
    """Before, a frozen `Embedding.from_pretrained(TABLE)` and a constant non-persistent buffer,
    shared by every build, were refused as a cached model."""
    mesh = fzero.SimMesh(2)
    g = torch.Generator().manual_seed(0)
    batches = [[(torch.randint(0, 10, (4,), generator=g), torch.randint(0, 3, (4,), generator=g))] for _ in range(2)]
    got = mesh.run(lambda b: fzero_trajectory(mesh, Pretrained, fzero.optim.sgd(0.1), net_loss, b, stage=1),
                   [(b,) for b in batches])
    start = Pretrained()
    for [snap] in got:  # one step on each rank: the shared tensors read, the rest trained
        assert torch.equal(snap["emb.weight"], TABLE) and torch.equal(snap["buffer:mask"], MASK)
        assert not torch.equal(snap["head.weight"], start.head.weight)
    with pytest.raises(fzero.ConfigError, match=r"x: make_model\(\)'s two calls returned models that share the storage "
                                                r"of \['norm.running_mean', 'norm.running_var', "
                                                r"'norm.num_batches_tracked'\] \(3 tensor\(s\)\), which a training "
                                                r"writes .*copy.deepcopy\(cached\)"):
        ddp_module._check_separate(Pretrained(RUNNING), Pretrained(RUNNING), "x")


def test_examples_is_a_settings_read_when_read(monkeypatch):
    """Before, `examples(n)` was no settings: `settings(examples(3), deadline=...)` raised
    InvalidArgument and `examples(3).deadline` AttributeError."""
    monkeypatch.delenv("HYPOTHESIS_PROFILE", raising=False)
    with loaded("ci"):
        few = examples(3)
        assert isinstance(few, settings) and few.deadline is None and few.max_examples == 3
    with loaded("default"):  # read now, not when made: hypothesis's own 200 ms deadline
        assert few.deadline == settings().deadline == few.built().deadline and few.deadline is not None
    with loaded("local"):
        child = settings(few, deadline=1234)
        assert few.max_examples == child.max_examples == 30 and child.deadline.total_seconds() == 1.234

        @child
        @given(st.integers())
        def prop(x):
            pass

        assert prop._hypothesis_internal_use_settings is child
    settings.register_profile("fzero-trust-examples", few)  # its own profile: it would read itself
    with loaded("fzero-trust-examples"), pytest.raises(InvalidArgument, match=r"examples\(3\) reads the loaded "
                                                                                r"hypothesis profile, so it cannot"):
        few.deadline


def test_examples_as_a_parent_runs(monkeypatch):
    """`@settings(examples(n), deadline=...)`, the README's form, run as a test: before, it raised
    InvalidArgument "examples(3) reads the loaded hypothesis profile" at its first example, since
    hypothesis makes the running test's settings (whose parent is `examples(n)`) `settings.default`
    while it runs, and `built()` read `settings.default` (found in a docs check)."""
    monkeypatch.delenv("HYPOTHESIS_PROFILE", raising=False)
    seen = []
    with loaded("ci"):

        @settings(examples(3), deadline=1000)
        @given(st.integers())
        def prop(x):
            seen.append(x)

        prop()
    assert len(seen) == 3, seen


def test_a_second_register_profiles_registers_the_same_local_profile():
    """`register_profiles()` called again while "ci" is loaded: "local" is still random seeds with
    a database (before, it inherited "ci"'s derandomize and no database)."""
    from hypothesis import settings as hsettings

    from fzero.testing import register_profiles

    loaded = hsettings._current_profile
    try:
        register_profiles()
        hsettings.load_profile("ci")
        register_profiles()
        local = hsettings.get_profile("local")
        assert not local.derandomize and local.database is not None, (local.derandomize, local.database)
    finally:
        hsettings.load_profile(loaded)
