"""Functions the torchrun workers of `fzero.testing.Pool` run as `fn(mesh, *args)`.

Each takes the mesh first, so a test runs the same function on a `SimMesh` too:
`sim.run(functools.partial(fn, sim), per_rank_args)`.
"""

from __future__ import annotations

import gc
import os
import signal
import time
import warnings

import torch

import fzero


def collectives(mesh, x, y, src):
    """Every collective once: x[S, ...] for all_gather / all_reduce / broadcast, y[N * S, ...]
    for reduce_scatter."""
    return {
        "all_gather": fzero.collectives.all_gather(x, mesh),
        "reduce_scatter": fzero.collectives.reduce_scatter(y, mesh),
        "sum": fzero.collectives.all_reduce(x, mesh, "sum"),
        "max": fzero.collectives.all_reduce(x, mesh, "max"),
        "broadcast": fzero.collectives.broadcast(x, mesh, src),
    }


def started(mesh, x, y, src):
    """Every collective through `mesh.start`, all in flight at once, then waited for in reverse."""
    pending = {
        "all_gather": mesh.start("all_gather", x),
        "reduce_scatter": mesh.start("reduce_scatter", y),
        "sum": mesh.start("all_reduce", x, arg="sum"),
        "max": mesh.start("all_reduce", x, arg="max"),
        "broadcast": mesh.start("broadcast", x, arg=src),
    }
    return {op: pending[op].wait() for op in reversed(pending)}


def _loss(mesh, x, y, w):
    """L = <AG(x), w> + <RS(y), x> + <bcast(x), x>: every differentiable collective, forward and back."""
    return (fzero.collectives.all_gather(x, mesh) * w).sum() + (fzero.collectives.reduce_scatter(y, mesh) * x).sum() + (
        fzero.collectives.broadcast(x, mesh, mesh.world_size - 1) * fzero.collectives.all_reduce(x, mesh)).sum()


def grads(mesh, x, y, w):
    """torch.func.grad of `_loss` with respect to x and y, and plain autograd's."""
    gx, gy = torch.func.grad(lambda x, y: _loss(mesh, x, y, w), argnums=(0, 1))(x, y)
    xa, ya = x.detach().requires_grad_(True), y.detach().requires_grad_(True)
    _loss(mesh, xa, ya, w).backward()
    return gx, gy, xa.grad, ya.grad


def warnings_seen(mesh):
    """Every collective with all warnings recorded (the shim must not warn under torch 2.13)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        x = torch.ones(2)
        collectives(mesh, x, torch.ones(2 * mesh.world_size), 0)
    return [f"{w.category.__name__}: {w.message}" for w in seen]


def gather_shape(mesh, shape, dtype=torch.float32):
    return fzero.collectives.all_gather(torch.ones(shape, dtype=dtype), mesh)


def raise_on(mesh, bad):
    """`mesh.run` of a function that raises on rank `bad` only and gathers on the others."""

    def fn():
        fzero.collectives.all_reduce(torch.ones(1), mesh)
        if mesh.rank == bad:
            raise ValueError(f"boom on rank {bad}")
        return fzero.collectives.all_gather(torch.ones(1), mesh)

    return mesh.run(fn)


def tagged(mesh):
    """all_reduce of one shape and dtype on every rank, with a tag that differs by rank."""
    return fzero.collectives.all_reduce(torch.ones(2), mesh, tag=f"t{mesh.rank}")


def broadcast_grad_on(mesh, grad_ranks):
    """broadcast from rank 0 of `x` that requires grad on `grad_ranks` only, then the backward
    where the output requires grad: `x.grad`."""
    x = torch.ones(3, requires_grad=mesh.rank in grad_ranks)
    y = fzero.collectives.broadcast(x, mesh, 0)
    if y.requires_grad:
        y.sum().backward()
    return x.grad


def mesh_or_error(mesh, kwargs):
    """`repr(DistMesh(**kwargs))` over the workers' existing gloo group, or the MeshError's text."""
    try:
        return repr(fzero.DistMesh(**kwargs))
    except fzero.MeshError as e:
        return f"MeshError: {e}"


def meta_tensor(mesh):
    """A collective on a tensor that is not on the mesh's device."""
    return fzero.collectives.all_reduce(torch.ones(2, device="meta"), mesh)


# ---------------------------------------------------------------------------------------------
# Functions for `fzero.testing.pool.run_job`: fresh processes, no process group yet; fn(*args).


def lose_a_rank(victim, verify):
    """Rank `victim` SIGKILLs itself after one all_reduce; the others then call all_gather.
    Returns, on the others, (error type, message, seconds from the call to the raise)."""
    mesh = fzero.DistMesh(backend="gloo", verify=verify, timeout=20.0)
    fzero.collectives.all_reduce(torch.ones(1), mesh)
    if mesh.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        fzero.collectives.all_gather(torch.ones(1), mesh)
    except fzero.MeshError as e:
        again = ""
        try:
            fzero.collectives.all_reduce(torch.ones(1), mesh)
        except fzero.MeshError as later:
            again = f"{type(later).__name__}: {later}"
        return type(e).__name__, str(e), time.monotonic() - start, again
    return "returned", "", time.monotonic() - start, ""


def backend_choice(fake_cuda_devices):
    """DistMesh() and DistMesh(backend="nccl") on a node whose CUDA seems to have
    `fake_cuda_devices` devices (torch.cuda is patched; the CPU build has none), then
    DistMesh(backend="gloo") and one all_reduce. Returns (error texts, the all_reduce)."""
    torch.cuda.is_available = lambda: fake_cuda_devices > 0
    torch.cuda.device_count = lambda: fake_cuda_devices
    errors = []
    for kwargs in ({}, {"backend": "nccl"}):
        try:
            fzero.DistMesh(**kwargs)
            errors.append("no error")
        except fzero.MeshError as e:
            errors.append(f"MeshError: {e}")
    mesh = fzero.DistMesh(backend="gloo")
    return errors, fzero.collectives.all_reduce(torch.ones(1), mesh)


def offload_steps(mesh, stage, optimizer, params, nvme_path=None):
    """Two AdamW steps (bf16 policy, clipping) of a small problem at `stage` with
    `fzero.Offload(optimizer, params)` (None: no offload): the gathered params and the step's
    metrics."""
    g = torch.Generator().manual_seed(7)
    tree = {"a": torch.randn(5, 3, generator=g), "b": torch.randn(11, generator=g)}
    off = None if optimizer is None else fzero.Offload(optimizer=optimizer, params=params, nvme_path=nvme_path)
    state = fzero.init(tree, fzero.optim.adamw(1e-2, weight_decay=0.1), stage=stage, mesh=mesh,
                       units=lambda p: p, precision=fzero.Precision(torch.bfloat16), offload=off)
    step = fzero.train_step(lambda p, x: torch.tanh(p["a"] * x).sum() + (p["b"] * x).square().sum(), clip_norm=1.0,
                            donate=True)
    for t in range(2):
        state, m = step(state, torch.tensor(1.0 + mesh.rank + t))
    return {**fzero.gather(state), "loss": m.loss, "grad_norm": m.grad_norm}


def offload_nvme_steps(mesh, stage):
    """`offload_steps` with the optimizer state in swap files under a fresh temporary folder."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        return offload_steps(mesh, stage, "nvme", None, nvme_path=d)


def loss_writes_on(mesh, stage, bad):
    """`mesh.run` of one step whose loss writes a param in place (after using it, under
    `torch.no_grad()`) on rank `bad` only."""

    def fn():
        state = fzero.init({"a": torch.ones(4), "b": torch.ones(3)}, fzero.optim.sgd(0.1), stage=stage, mesh=mesh)

        def loss(p, c):
            out = (p["a"] * c).sum() + p["b"].sum()
            if mesh.rank == bad:
                with torch.no_grad():
                    p["b"].clamp_(max=0.5)
            return out

        return fzero.train_step(loss)(state, torch.ones(4))[1].loss

    return mesh.run(fn)


def donated_state_on(mesh, stage, call, bad):
    """`call` ("step", "evaluate" or "gather") on the state a donating step consumed on rank
    `bad` (the returned state on the others); outside `mesh.run`, whose guard would tell the
    other ranks itself, as in a script."""
    state = fzero.init({"a": torch.ones(4), "b": torch.ones(3)}, fzero.optim.sgd(0.1), stage=stage, mesh=mesh)
    step = fzero.train_step(lambda p, c: (p["a"] * c).sum() + p["b"].sum(), donate=True)
    new, _ = step(state, torch.ones(4))
    use = state if mesh.rank == bad else new
    if call == "step":
        return float(step(use, torch.ones(4))[1].loss)
    if call == "evaluate":
        return float(fzero.evaluate(lambda p, c: (p["a"] * c).sum())(use, torch.ones(4)))
    return float(fzero.gather(use)["a"].sum())


def failing_twice(mesh):
    """Rank 0 passes a bad `stage` to two `fzero.init`s in a row (each error caught, no collective
    between them), rank 1 good ones; then both a good one. What each call gave, per rank."""
    seen = []
    for _ in range(2):
        try:
            fzero.init({"w": torch.ones(4)}, fzero.optim.sgd(0.1), stage=7 if mesh.rank == 0 else 1, mesh=mesh)
            seen.append("ok")
        except fzero.FzeroError as e:
            seen.append(type(e).__name__)
    state = fzero.init({"w": torch.ones(4)}, fzero.optim.sgd(0.1), stage=1, mesh=mesh)
    return seen, float(fzero.gather(state)["w"].sum())


def gather_beside_a_step(mesh):
    """Stage 3: both ranks step once, then rank 0 steps again while rank 1 calls `fzero.gather`
    (the step's forward gathers have the gather's op, dtype, shape and tag). What each got."""
    state = fzero.init({"a": torch.ones(4), "b": torch.ones(3)}, fzero.optim.sgd(0.1), stage=3, mesh=mesh)
    step = fzero.train_step(lambda p, c: (p["a"] * c).sum() + p["b"].sum())
    state, _ = step(state, torch.ones(4))
    try:
        if mesh.rank == 0:
            step(state, torch.ones(4))
        else:
            fzero.gather(state)
        return "returned"
    except fzero.FzeroError as e:
        return f"{type(e).__name__}: {e}"


def mesh_where_one_rank_is_elsewhere(mesh, verify, extra_on):
    """Every rank constructs a DistMesh with `verify[rank]`; or rank `extra_on` alone constructs
    one while the others run a verified collective on `mesh`. The error's type and text, or
    "made"; then one verified all-reduce on `mesh`, which every rank must still reach."""
    try:
        if extra_on is None:
            fzero.DistMesh(verify=verify[mesh.rank])
        elif mesh.rank == extra_on:
            fzero.DistMesh()
        else:
            fzero.collectives.all_reduce(torch.ones(2), mesh)
        out = "made"
    except fzero.MeshError as e:
        out = f"{type(e).__name__}: {e}"
    return out, fzero.collectives.all_reduce(torch.ones(2), mesh)



def mesh_built_over_a_group_on_one_rank(mesh):
    """Rank 0 constructs a DistMesh over a new group (2 s timeout) that rank 1 never builds one
    over (it took another path): rank 0's `MeshError` text; None on rank 1. Both then meet in a
    verified all-reduce on `mesh`, which must still work."""
    import datetime

    group = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(seconds=20))
    out = None
    if mesh.rank == 0:
        try:
            fzero.DistMesh(group, timeout=2)
        except fzero.MeshError as e:
            out = str(e)
    return out, fzero.collectives.all_reduce(torch.ones(2), mesh)


def ranks_on_two_meshes(mesh):
    """Both ranks construct meshes A and B over one new group, in one order (4 s timeouts, the
    group's too: the data exchange waits on it); rank 0 passes A to an all-gather (point to point
    at N = 2, tagged per mesh), rank 1 passes B: each rank's `MeshError` text. Then both meet in a
    verified all-reduce on `mesh`, which must still work."""
    import datetime

    group = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(seconds=4))
    a, b = fzero.DistMesh(group, timeout=4), fzero.DistMesh(group, timeout=4)
    try:
        fzero.collectives.all_gather(torch.ones(2), a if mesh.rank == 0 else b)
        out = None
    except fzero.MeshError as e:
        out = str(e)
    return out, fzero.collectives.all_reduce(torch.ones(2), mesh)


def peer_leaves_or_stalls(timeout, verify, how):
    """After one all_reduce, rank 1 destroys its process group and stays alive (`how="leave"`:
    gloo fails rank 0's next collective at once), or sleeps past the timeout (`"stall"`); rank 0
    calls an all_reduce. Returns, on rank 0, (error type, message, seconds from the call to the
    raise); None on rank 1. The job's default group is started with a 60 s rendezvous, so that a
    loaded machine's slow process start is not the timeout under test (found on the GPU machine
    under `-n 8`: torch's store waited 2 s for the second client); the mesh runs over a group of
    its own with the short timeout (its data collectives' timeout where `verify=False`)."""
    import datetime

    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    group = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
    mesh = fzero.DistMesh(group, verify=verify, timeout=timeout)
    fzero.collectives.all_reduce(torch.ones(1), mesh)
    if mesh.rank == 1:
        if how == "leave":
            torch.distributed.destroy_process_group()  # every group; the last reference to the mesh's goes
            del mesh, group  # below, so that its connections close
            gc.collect()
        time.sleep(3 * timeout)  # alive meanwhile, so rank 0 finds no lost process on its host
        return None
    start = time.monotonic()
    try:
        fzero.collectives.all_reduce(torch.ones(1), mesh)
    except fzero.MeshError as e:
        return type(e).__name__, str(e), time.monotonic() - start
    return "returned", "", time.monotonic() - start


def bad_argument_on_one_rank(how):
    """Inside `mesh.run` (DistMesh, timeout 10 s), rank 1 calls a collective with an argument its
    own check refuses (`how`: "indivisible", a reduce_scatter of 3 rows over 2 ranks; "device", a
    meta tensor), rank 0 a good reduce_scatter. Rank 1 stays alive afterwards, as a rank that
    handles the error (a notebook, a retry) does. Then both run one all_reduce. Returns (the
    error's type and text, seconds from the call to the raise, the all_reduce)."""
    mesh = fzero.DistMesh(backend="gloo", timeout=10.0)
    bad = {"indivisible": lambda: torch.ones(3), "device": lambda: torch.ones(4, device="meta")}[how]
    start = time.monotonic()
    try:
        mesh.run(lambda: fzero.collectives.reduce_scatter(bad() if mesh.rank == 1 else torch.ones(4), mesh))
        seen = "returned"
    except fzero.MeshError as e:
        seen = f"{type(e).__name__}: {e}"
    return seen, time.monotonic() - start, fzero.collectives.all_reduce(torch.ones(1), mesh)


def caught_loss_error(mesh, fails: int, attempts: int = 3):
    """Stage 1, SGD: rank 1's loss raises `ValueError` on its first `fails` calls; each rank
    retries a failed step up to `attempts` times. Per rank: what each attempt gave (the error's
    type and message, or "ok"), and the params after."""
    params = {"w": torch.linspace(-1.0, 1.0, 12).reshape(4, 3)}
    x, y = torch.linspace(-2.0, 2.0, 8).reshape(2, 4), torch.tensor([0, 2])
    calls = [0]

    def loss(p, b):
        calls[0] += 1
        if mesh.rank == 1 and calls[0] <= fails:
            raise ValueError(f"transient error {calls[0]} on rank 1")
        return torch.nn.functional.cross_entropy(b[0] @ p["w"], b[1])

    state = fzero.init(params, fzero.optim.sgd(0.1), stage=1, mesh=mesh)
    step, log = fzero.train_step(loss), []
    for _ in range(attempts):
        try:
            state, _ = step(state, (x, y))
        except Exception as e:  # noqa: BLE001 - what each attempt raised is the result
            log.append((type(e).__name__, str(e)))
            continue
        log.append(("ok", ""))
        break
    return log, fzero.gather(state)["w"]


def forward_ad_reread(mesh, stage: int):
    """Stage `stage`, on-use gathering: a loss that runs the model, then again inside a plain
    `torch.autograd.forward_ad` level (a directional derivative with respect to the input): a
    released unit is read again under forward AD. The params after one step, gathered."""
    import torch.autograd.forward_ad as fwAD

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, ""))

    def loss(p, x):
        out = apply(p, x)
        with fwAD.dual_level():
            t = fwAD.unpack_dual(apply(p, fwAD.make_dual(x, torch.ones_like(x)))).tangent
        return out.square().mean() + t.square().mean()

    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(3 + mesh.rank))
    state = fzero.init(params, fzero.optim.sgd(0.1), stage=stage, mesh=mesh, units=info.units, groups=info.groups)
    with warnings.catch_warnings():  # torch 2.13 loads its forward-AD decompositions through torch.jit.script
        warnings.filterwarnings("ignore", message="`torch.jit.script` is deprecated", category=DeprecationWarning)
        state, _ = fzero.train_step(loss)(state, x)
    return fzero.gather(state)
