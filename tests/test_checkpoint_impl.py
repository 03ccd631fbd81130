"""fzero.checkpoint.load into a target whose optimizer differs from the saved one only in `impl`.

fzero's `adam`, `adamw` and `sgd` take `impl` ("single", "foreach", "fused", or None), which
picks torch's implementation of the update; the state (moments, step counts, momentum buffers)
has the same layout and meaning under each. A resume on another machine may lack the saved
impl's kernel (fused on a device or dtype torch has none for), so `load` takes an `impl`
difference alone: the loaded state is the saved one bit for bit, and the next step is the
target impl's, exactly as a run that trained under the saved impl and switched in memory. Every
other setting is still compared (an `impl` that differs beside it is not named), and a variable
named `impl` of a user's own optimizer function is a setting like any other. Before, each of
these loads raised "was saved with another optimizer setting (adamw): impl: checkpoint 'fused',
target 'foreach'".

The params are two leaves of 512 elements: at N = 2 each lies whole in one rank's shard, so
`impl="fused"` on the CPU (a placement-dependent kernel, which refuses a cut leaf) runs at every
stage.
"""

import re

import pytest
import torch

import fzero
import fzero.checkpoint as ck
from fzero import optim
from fzero._src.tree import flatten_with_paths

OPTIMIZERS = {
    "adamw": lambda impl, lr=1e-2: fzero.optim.adamw(lr, weight_decay=0.1, impl=impl),
    "sgd": lambda impl, lr=0.1: fzero.optim.sgd(lr, momentum=0.9, impl=impl),
}
# (optimizer, saved impl, target impl, the step after the load against the uninterrupted run's
# under the saved impl): the "same" bits (the default None is "foreach" on the CPU,
# `resolve_impl`), or no claim (None: whether two of torch's kernels round alike is torch's
# business, which varies by CPU and version)
CHANGES = [("adamw", "fused", "foreach", None), ("adamw", None, "foreach", "same"),
           ("sgd", "foreach", "single", None), ("sgd", "single", "fused", None)]


def params(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(512, generator=g), "b": torch.randn(16, 32, generator=g)}


def loss_fn(p, x):
    return ((x @ p["b"].T).tanh() @ p["a"].view(16, 32)).pow(2).mean()


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(3, 32, generator=torch.Generator().manual_seed(100 * step + rank))


def tensors(state) -> dict:
    """Every tensor of a state (params, optimizer fields, step, master), by pytree path."""
    paths, leaves, _ = flatten_with_paths(state)
    return dict(zip(paths, leaves))


def assert_bits(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: {k}"


@pytest.mark.parametrize("opt, saved, target, against_saved", CHANGES)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_checkpoint_loads_into_another_impl_and_steps_on_under_it(tmp_path, stage, opt, saved, target,
                                                                     against_saved):
    """Trained 2 steps under impl A at (2, stage), saved, loaded into a target made with impl B:
    every tensor of the loaded state equals the saved one (torch.equal), the loaded state runs
    the target's optimizer, and its next step equals, bit for bit, the step of the trained state
    switched to the target's optimizer in memory (`state.replace(info=target.info)`); against the
    uninterrupted run's step under A its params are equal where B is what A resolved to."""
    mesh = fzero.SimMesh(2)
    step = fzero.train_step(loss_fn)

    def rank_fn():
        state = fzero.init(params(), OPTIMIZERS[opt](saved), stage=stage, mesh=mesh)
        for k in range(2):
            state, _ = step(state, batch(k, mesh.rank))
        path = ck.save(state, str(tmp_path))
        into = fzero.init(params(seed=9), OPTIMIZERS[opt](target), stage=stage, mesh=mesh)
        loaded = ck.load(path, into)
        assert_bits(tensors(loaded), tensors(state), f"rank {mesh.rank}: loaded")
        assert loaded.optimizer is into.optimizer
        resumed, _ = step(loaded, batch(2, mesh.rank))
        switched, _ = step(state.replace(info=into.info), batch(2, mesh.rank))
        assert_bits(tensors(resumed), tensors(switched), f"rank {mesh.rank}: the step after the load")
        if against_saved is not None:
            continued, _ = step(state, batch(2, mesh.rank))
            mine, theirs = fzero.gather(resumed), fzero.gather(continued)  # every rank: the whole params
            assert all(torch.equal(mine[k], theirs[k]) for k in mine), f"rank {mesh.rank}: the params after the step"

    mesh.run(rank_fn)


def save_then_load(tmp_path, saved_opt, *targets) -> list:
    """Saves a fresh state (step 0) of `saved_opt()` on SimMesh(2) at stage 1; per target
    optimizer, "loaded" or the `CheckpointError` text of loading into it (rank 0's)."""
    mesh = fzero.SimMesh(2)

    def rank_fn():
        path = ck.save(fzero.init(params(), saved_opt(), stage=1, mesh=mesh), str(tmp_path))
        out = []
        for make in targets:
            try:
                ck.load(path, fzero.init(params(seed=9), make(), stage=1, mesh=mesh))
                out.append("loaded")
            except ck.CheckpointError as e:
                out.append(str(e))
        return out

    return mesh.run(rank_fn)[0]


def test_every_other_setting_is_still_compared_and_named_without_the_impl(tmp_path):
    """Saved with adamw(lr=0.01, impl="fused"): a target of impl "foreach" loads; one of lr 0.02
    is refused naming the lr, and so is one of lr 0.02 and impl "foreach" -- naming the lr alone
    (before: "impl: checkpoint 'fused', target 'foreach'; lr: ...", and the impl-only target was
    refused too)."""
    adamw = OPTIMIZERS["adamw"]
    impl_only, lr_only, both = save_then_load(tmp_path, lambda: adamw("fused"), lambda: adamw("foreach"),
                                              lambda: adamw("fused", lr=2e-2), lambda: adamw("foreach", lr=2e-2))
    assert impl_only == "loaded"
    for err in (lr_only, both):
        assert "another optimizer setting (adamw): lr: checkpoint 0.01, target 0.02;" in err, err
        assert "impl" not in err, err


def custom(impl: str) -> fzero.optim.Optimizer:
    """A user's optimizer: fzero's sgd (impl "foreach") inside the user's own update function,
    whose closure holds a setting that happens to be named `impl` (a value fzero's `impl` takes)."""
    inner = fzero.optim.sgd(0.1, impl="foreach")

    def update_(grad, state, param, ctx):
        scaled = grad if impl == "fused" else grad * 0.5
        return inner.update_(scaled, state, param, ctx)

    return fzero.optim.in_place(inner.init, update_, inner.spec)


def test_only_fzero_optimizers_impl_is_let_through(tmp_path):
    """A variable named `impl` in a user's optimizer function is the user's setting: a target whose
    one differs is refused naming it, where fzero's own sgd of another impl loads."""
    sgd = OPTIMIZERS["sgd"]
    fzeros = save_then_load(tmp_path / "fzero", lambda: sgd("fused"), lambda: sgd("single"))
    users = save_then_load(tmp_path / "user", lambda: custom("fused"), lambda: custom("foreach"))
    assert fzeros == ["loaded"]
    assert "another optimizer setting" in users[0] and "impl: checkpoint 'fused', target 'foreach'" in users[0], users


def test_a_schedule_of_another_function_is_named_by_its_function(tmp_path):
    """Saved with a hand-written schedule, loaded into `cosine`: the message names the lr's
    function on each side (before: "of other settings", the two whole descriptions cut at 300
    characters before the schedule, which looked the same; found in review)."""
    [err] = save_then_load(tmp_path, lambda: fzero.optim.adamw(lambda t: 1e-3 * min(1.0, (t + 1) / 3)),
                           lambda: fzero.optim.adamw(fzero.optim.cosine(1e-3, 7, warmup_steps=3)))
    assert "another optimizer setting (adamw): lr (schedule fn): checkpoint function " in err, err
    assert "<lambda>" in err and 'target function cosine.<locals>.fn ["0.0", "0.001", "7", "3"]' in err, err


def test_a_description_of_an_earlier_fzero_is_named_as_such_not_as_another_optimizer():
    """A checkpoint of an fzero from before `Optimizer.prepare_` (2026-12-01) describes adamw with
    no name kept (`two_phase`), so its name was read off the function that makes the state,
    `_adam.<locals>.init`: "saved with another optimizer: checkpoint adam, target adamw" about the
    same optimizer (found in a review of old checkpoints). The message says what it is and the way
    on. Made here by renaming the node that keeps the name, as that fzero's description lacked it."""
    import json

    from fzero._src.checkpoint import _jsonable, _other_optimizer
    from fzero._src.state import describe

    optimizer = optim.adamw(1e-2)
    want = _jsonable(describe(optimizer))
    earlier = json.loads(json.dumps(want).replace('"two_phase.<locals>.update_"', '"_adam.<locals>.update_"'))
    message = _other_optimizer("ck", earlier, optimizer, want)
    assert "another optimizer:" not in message and "checkpoint adam, target adamw" not in message
    assert re.search(r"'ck' was saved with an optimizer described otherwise than the target's \(adamw\): the "
                     r"checkpoint's description names none, and makes its state with the same function \(adam\); an "
                     r"earlier fzero \(before Optimizer\.prepare_, 2026-12-01\) described its optimizers so.*"
                     r"fzero\.init\(fzero\.checkpoint\.export\(path\), \.\.\.\)", message), message
    lamb = _jsonable(describe(optim.lamb(1e-2)))
    assert "another optimizer: checkpoint lamb, target adamw" in _other_optimizer("ck", lamb, optimizer, want)
