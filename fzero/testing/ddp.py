"""fzero against torch DDP on a model of one's own: the trajectories of both, and their differences.

fzero's claim is that every stage gives `torch.nn.parallel.DistributedDataParallel`'s bits at
N = 2 (README, "Every stage equals ... DDP bit for bit at N = 2"; at N > 2 the backend's summation
order decides the last bits, and the claim is a bound: proofs/stages.md §3). These helpers let a
team check it for its own model, as fzero's own suite does (tests/ddp_cases.py rests on them):

    # cases.py (importable by the pool's workers)
    def make_model():
        torch.manual_seed(0)                    # the same model on every rank, on every call
        return MyModel()

    def loss_fn(model, batch):                  # model(x): DDP's forward, or fzero's apply bound to the params
        x, y = batch
        return F.cross_entropy(model(x), y)

    def both(mesh, batches, stage):
        ref = ddp_trajectory(mesh, make_model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False),
                             loss_fn, batches)
        got = fzero_trajectory(mesh, make_model, fzero.optim.adamw(1e-2), loss_fn, batches, stage=stage)
        return trajectory_differences(ref, got)

    # test_mine.py: batches[r] is rank r's list of batches, drawn in the test process
    assert pool.run(cases.both, [(batches[r], 3) for r in range(2)]) == [[], []]

Each function runs on every rank, as `fn(mesh, ...)` on a `fzero.testing.Pool` (a `DistMesh` over
a gloo process group) or under torchrun. A trajectory is a list with one dict per step, taken
after the step:

- the params by their names (`model.named_parameters()`, a tied weight once, under its first
  name; frozen params included);
- the buffers as "buffer:<name>" (every name of a shared buffer);
- the optimizer state per param, as "opt:<name>.<field>" (`OPT`; a param's name as above): torch's
  `opt.state[p]` on the DDP side (its tensors), fzero's state gathered and cut per leaf on the
  fzero side (the per-leaf form checkpoints save, `fzero.checkpoint`). The fields are named as
  torch names them, which fzero's `sgd` / `adam` / `adamw` share: "momentum_buffer"; "step",
  "exp_avg", "exp_avg_sq", "max_exp_avg_sq". "step" is held as float64 on both sides, 0-d:
  torch's per-param count (float32, float64 under a float64 default dtype) and fzero's per-leaf
  count (float32) are integers, which float64 holds exactly, so the comparison is exact and
  independent of torch's step dtype. fzero's sgd also counts its momentum updates per leaf
  ("count"); torch keeps no count (its "momentum_buffer" appears at a param's first update), so
  "count" is not listed: it decides whether the leaf's "momentum_buffer" is.
  A param with no torch state (it never had a gradient: frozen, unused on every rank so far, or
  not given to the optimizer) has no "opt:" entries; on the fzero side neither has a leaf whose
  update count is 0 (no "step" / "count" update yet) while all its fields are zeros, as `init`
  made them. A count of 0 with a field that is not all zeros lists every field of the leaf
  ("count" included), so it shows as keys only in fzero's snapshot. (Other optimizers' fields
  are listed by fzero's names; they match torch's only where the names agree.)

`trajectory_differences` compares two bit for bit, and reports comparing no step at all (or a
step of no keys) as a difference.

The loss is not compared. DDP has no counterpart of the loss fzero's step reports (the mean over
ranks of each rank's loss, a number of fzero's metrics): one made up here would test this module,
not fzero. And the loss each rank's forward computes at step t is a function of the params and
buffers step t - 1's snapshot holds (at step 0, those `make_model`'s check compared), the batch
and the random-number state: a difference in it shows in step t's params and optimizer state
wherever it changes a gradient. A defect in fzero's reported loss alone is not caught here.

Every rank must get the same number of batches: both functions agree on it (and on the model,
`make_model`'s check) in one small all-gather before training, and raise `ConfigError` on every
rank naming each rank's count (before, ranks with different counts waited for each other to the
timeout). An exception on one rank (in `make_model`, `make_optimizer`, `loss_fn`, `opt.step`)
is told to the others, which raise `RankFailed` instead of waiting in a collective: fzero's
step and collectives do so themselves (`Mesh.guard`), and `ddp_trajectory` agrees between DDP's
collectives, one all-gather of 4 int64 before each forward of `model` and one before each
backward, plus one after the last step (on a verified `DistMesh` each is 2 all-gathers, the
fingerprint and the row: about 2 ms a step at N = 2 on gloo, on a busy 2-core CPU, where a tiny
model's DDP step took 10 ms). Not covered: an exception on one rank only inside the backward
(DDP's gradient all-reduce) or inside DDP's own forward code; its peers wait to the timeout.

`loss_fn`'s `model` is a callable, not the module: `model(*args, **kwargs)` is the forward (DDP's,
or fzero's `apply` bound to the step's params), and reading any attribute of it (a DDP-ism such as
`model.module`) raises an AttributeError that says so, on both sides alike.

The optimizers must compute alike: `fzero.optim.sgd` / `adam` / `adamw` with `impl="single"`
are `torch.optim.X(foreach=False)`, `impl="foreach"` are `foreach=True`, with the same
hyper-parameters (proofs/optimizers.md §1, `tests/test_optim.py`); `impl="fused"` is
`fused=True` where fzero accepts it (proofs/optimizers.md §3).
The default `impl=None` is "foreach" on the CPU ("fused" on CUDA where torch's kernel is
element-wise, `fzero.optim.sgd`'s docstring); on the CPU, float32 params, it gives
`foreach=False`'s bits too (`tests/test_ddp.py` compares the default with `foreach=False`, and
`tests/test_testing_ddp.py` this module's functions). Only gloo (CPU) meshes are tested here.

Where the bits are promised: N = 1 and 2 with float32 (or float64) params. At N >= 3 fzero's
reduce-scatter and DDP's all-reduce add the ranks' gradients in other orders, so `[]` is not to be
expected: the difference is bounded (proofs/stages.md §3), and `trajectory_differences` has no
tolerance; compare there with your own bound. bf16 / fp16 params (no fp32 master) differ from
torch's in the elements of torch's "tails" (README, the foreach kernels' remainders), whatever
the stage.
"""

from __future__ import annotations

import contextlib
import functools
import math
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fzero._src.checkpoint import KINDS, sources
from fzero._src.collectives import gather_rows, gather_texts
from fzero._src.errors import ConfigError, RankFailed
from fzero._src.mesh import DistMesh, Mesh, SimMesh, _is_shared
from fzero._src.module import broadcast_buffers as broadcast_module_buffers
from fzero._src.module import from_module, persistent_buffers, units_by_prefix
from fzero._src.optim.base import Optimizer, field_shapes
from fzero._src.state import ZeroState, gather, init
from fzero._src.step import train_step

#: The prefix of a buffer's key in a trajectory's snapshot ("buffer:body.1.running_mean").
BUFFER = "buffer:"
#: The prefix of an optimizer state entry's key in a trajectory's snapshot
#: ("opt:body.0.weight.exp_avg": "opt:" + the param's name + "." + the field).
OPT = "opt:"

Snapshot = dict[str, torch.Tensor]
LossFn = Callable[[Callable[..., Any], Any], torch.Tensor]

# The fields of an optimizer's per-leaf state that count its updates: a leaf counted 0 has had
# none, and torch keeps no state for it. "step" is torch's name too (listed, as float64); fzero's
# sgd's "count" has no torch counterpart (torch's momentum_buffer appears at the first update).
_COUNTS = ("step", "count")
_UNLISTED = ("count",)


# ---------------------------------------------------------------------------------------------
# The two trainings


def ddp_trajectory(
    mesh: Mesh,
    make_model: Callable[[], nn.Module],
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    loss_fn: LossFn,
    batches: Sequence[Any],
    *,
    find_unused_parameters: bool = False,
    broadcast_buffers: bool = True,
) -> list[Snapshot]:
    """torch DDP over `mesh`'s process group: this rank's params, buffers and optimizer state after
    every step.

    Per batch: `opt.zero_grad(set_to_none=True)`, `loss_fn(model, batch).backward()`, `opt.step()`,
    a snapshot (the module's own tensors and `opt.state`'s, cloned; `fzero.testing.ddp`'s docstring
    says what it holds). Between DDP's collectives the ranks agree that none raised (one small
    all-gather before each forward and each backward), so that an exception on one rank raises
    on every rank (`RankFailed` on the others) instead of leaving them waiting.

    Args:
      mesh: a `DistMesh` (DDP needs a process group; a `SimMesh` is refused).
      make_model: `() -> nn.Module`, the same model on every rank and on every call, a new one on
        each call: seed inside it (`torch.manual_seed(0)` before building). Checked: it is called
        twice, and the two models, then every rank's, must have the same names, dtypes, shapes
        and bits, else `ConfigError` naming the first difference (a model that differs between
        the two trainings would read as fzero differing from DDP); the two must not be one object
        or share a tensor's storage (a cached module, which the first training would train in
        place), else `ConfigError`.
      make_optimizer: `model -> torch.optim.Optimizer` over the module DDP wraps, e.g.
        `lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False)` (frozen params get
        no gradient, so torch.optim skips them; `fzero.testing.ddp`'s docstring says which settings give
        fzero's bits).
      loss_fn: `(model, batch) -> 0-d loss`, this rank's mean loss on `batch`; `model` is a
        callable, `model(*args, **kwargs)` the DDP-wrapped module's forward (not the module: it
        has no attributes, `model.module` included).
      batches: this rank's batches, one per step; every rank must have as many (checked:
        `ConfigError` on every rank, naming each rank's count).
      find_unused_parameters, broadcast_buffers: DDP's (fzero reduces a unit a rank skipped as
        zeros, as `find_unused_parameters=True` does; pass it where some rank leaves a parameter
        unused).
    """
    from torch.nn.parallel import DistributedDataParallel

    who = "ddp_trajectory"
    if isinstance(mesh, SimMesh):
        raise ConfigError(f"ddp_trajectory: {mesh!r} is a SimMesh, whose ranks are threads of one process; torch DDP "
                          f"needs a process group: run it on every rank of a fzero.testing.Pool (or under torchrun) "
                          f"with its DistMesh")
    batches = list(batches)
    model = _built(mesh, make_model, who, len(batches))
    ddp = DistributedDataParallel(model, process_group=mesh.group, find_unused_parameters=find_unused_parameters)
    # set, not passed: torch 2.13 deprecates the argument (a FutureWarning) for `forward_sync_buffers`,
    # which torch 2.11 lacks; the attribute is the forward's switch in both. The sync at
    # construction, which the argument also turned off, copies nothing: `_built` checked that
    # every rank's buffers are the same bits
    ddp.broadcast_buffers = broadcast_buffers
    with _telling(mesh):
        opt = make_optimizer(model)
    out = []
    for t, batch in enumerate(batches):
        forward = _Model(functools.partial(_agreed_forward, mesh, ddp, t), who,
                         "DDP's forward (the DistributedDataParallel-wrapped module)")
        with _telling(mesh):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(forward, batch)
        _agreed(mesh, who, _BACKWARD, where=f"at step {t}, before DDP's backward")
        loss.backward()
        with _telling(mesh):
            opt.step()
            snap = _joined(who, _module_snapshot(model), _torch_optimizer_snapshot(model, opt))
        out.append(snap)
    _agreed(mesh, who, _END, where=f"after the last step ({len(batches)} steps)")
    return out


def _agreed_forward(mesh: Mesh, ddp: nn.Module, t: int, *args: Any, **kwargs: Any) -> Any:
    """DDP's forward at step `t`, once every rank is there (or `RankFailed`, where one raised)."""
    _agreed(mesh, "ddp_trajectory", _FORWARD, where=f"at step {t}, before DDP's forward")
    return ddp(*args, **kwargs)


def fzero_trajectory(
    mesh: Mesh,
    make_model: Callable[[], nn.Module],
    optimizer: Optimizer,
    loss_fn: LossFn,
    batches: Sequence[Any],
    *,
    stage: int,
    units: str | Any = None,
    broadcast_buffers: bool = True,
    init_kwargs: Mapping[str, Any] | None = None,
    **step_kwargs: Any,
) -> list[Snapshot]:
    """fzero at `stage`: this rank's gathered params, buffers and optimizer state after every step.

    `fzero.from_module(make_model())`, `fzero.init`, then per batch: `fzero.broadcast_buffers`
    (rank 0's buffers to every rank, as DDP's `broadcast_buffers=True` does before each forward),
    one `train_step` step, a snapshot (`fzero.gather`, the buffers cloned, and the optimizer
    state all-gathered where the stage shards it and cut per leaf: `fzero.testing.ddp`'s
    docstring says what it holds).

    Args:
      mesh: the ranks' mesh (a `DistMesh` to compare with DDP; a `SimMesh` runs too, called on
        each rank inside `mesh.run`: each rank builds its own model with `make_model`, so its
        buffers are its own, unlike one module's `apply` shared by SimMesh ranks, README, "The
        equivalence guarantee").
      make_model, loss_fn, batches: as for `ddp_trajectory` (here `model(*args, **kwargs)` is
        `from_module`'s `apply` bound to the step's params).
      optimizer: a `fzero.optim` optimizer, the counterpart of `ddp_trajectory`'s.
      stage: the ZeRO stage, 0-3.
      units: None (one unit), a str naming the container whose children are the units
        (`fzero.units_by_prefix(model, units)`, e.g. "transformer.h"), or a `units=` of
        `from_module` (`path -> unit name`, `{unit: predicate}`).
      broadcast_buffers: False for DDP's `broadcast_buffers=False`.
      init_kwargs: more arguments of `fzero.init` (`precision`, `bucket_bytes`, ...); its
        `groups` come after `from_module`'s frozen group.
      step_kwargs: arguments of `fzero.train_step` (`gather`, `engine`, `prefetch`, ...). Those
        that change the update -- `clip_norm` where it clips, `micro_batches`, `loss_scale` --
        have no counterpart on `ddp_trajectory`'s side, which steps once per batch with no
        clipping: there the trajectories differ by design (the suite's own DDP references for
        them, with `no_sync` and `clip_grad_norm_`, are in tests/ddp_cases.py).
    """
    who = "fzero_trajectory"
    batches = list(batches)
    model = _built(mesh, make_model, who, len(batches))
    spec = units_by_prefix(model, units) if isinstance(units, str) else units
    params, apply, info = from_module(model, units=spec)
    del model
    extra = dict(init_kwargs or {})
    groups = (*info.groups, *extra.pop("groups", ()))
    state = init(params, optimizer, stage=stage, mesh=mesh, units=info.units, groups=groups, **extra)
    what = "from_module's apply bound to the step's params"
    step = train_step(lambda p, batch: loss_fn(_Model(functools.partial(apply, p), who, what), batch), **step_kwargs)
    out = []
    for batch in batches:
        if broadcast_buffers:
            broadcast_module_buffers(info, mesh)
        state, _ = step(state, batch)
        params = dict(gather(state))
        buffers = {BUFFER + k: v.detach().clone() for k, v in info.buffers.items()}
        out.append(_joined(who, params, buffers, _fzero_optimizer_snapshot(state, list(params))))
    return out


class _Model:
    """What `loss_fn` gets as `model`: a callable running the forward, and nothing else. Before,
    the fzero side passed a `functools.partial`, so a DDP-ism (`model.module`) failed there only,
    as "'functools.partial' object has no attribute 'module'" (found in review)."""

    __slots__ = ("_forward", "_who", "_what")

    def __init__(self, forward: Callable[..., Any], who: str, what: str) -> None:
        self._forward, self._who, self._what = forward, who, what

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"{self._who}: loss_fn's `model` has no attribute {name!r}: it is a callable, not the module; "
            f"model(*args, **kwargs) runs {self._what}. loss_fn must call model(...) only, the same way on both "
            f"sides (ddp_trajectory and fzero_trajectory): no `model.module` or other attribute of a module")

    def __repr__(self) -> str:
        return f"<{self._who}'s model: {self._what}>"


# ---------------------------------------------------------------------------------------------
# Snapshots


def _joined(who: str, *parts: Snapshot) -> Snapshot:
    """One snapshot of its parts (params, buffers, optimizer state), in order; `ConfigError` where
    a key is in two (a param named "buffer:x" or "opt:x..."), which would hide one of them."""
    out: Snapshot = {}
    for part in parts:
        twice = [k for k in part if k in out]
        if twice:
            raise ConfigError(f"{who}: the snapshot key(s) {twice[:4]} name both a param and a buffer or optimizer "
                              f"state entry ({BUFFER!r} and {OPT!r} prefix those): rename the param")
        out.update(part)
    return out


def _module_snapshot(model: nn.Module) -> Snapshot:
    """The module's params (a tied one under its first name) and its buffers ("buffer:<name>",
    every name), cloned."""
    return _joined("ddp_trajectory", {k: v.detach().clone() for k, v in model.named_parameters()},
                   {BUFFER + k: v.detach().clone() for k, v in model.named_buffers(remove_duplicate=False)})


def _opt_entry(field: str, t: torch.Tensor) -> torch.Tensor:
    """A state tensor as a snapshot holds it: cloned; "step" as float64 (exact for any count)."""
    return t.detach().to(torch.float64, copy=True) if field == "step" else t.detach().clone()


def _torch_optimizer_snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> Snapshot:
    """`opt.state[p]`'s tensors per param, "opt:<name>.<field>", in `named_parameters` order (a param
    without state, none; `opt.state` is read with `get`, which adds no entry)."""
    out = {}
    for name, p in model.named_parameters():
        for field, value in (opt.state.get(p) or {}).items():
            if isinstance(value, torch.Tensor):
                out[f"{OPT}{name}.{field}"] = _opt_entry(field, value)
    return out


def _leaf_opt_fields(state: ZeroState) -> dict[str, dict[str, torch.Tensor]]:
    """`{leaf path: {field: whole tensor}}`: every bucket's optimizer state cut per leaf, in the
    canonical per-leaf form checkpoints save (`fzero._src.checkpoint.sources` and `KINDS`), each
    of its canonical shape (`optim.base.field_shapes`: a "shard" field the leaf's elements in the
    leaf's shape, a "leaf" field its one entry, 0-d; "rows" / "cols" the leaf's block). Where the
    stage shards the optimizer state a field is all-gathered first (a collective: every rank
    calls it); at stage 0 each rank reads its own copy. Frozen buckets hold no state."""
    layout, mesh = state.layout, state.mesh
    out: dict[str, dict[str, torch.Tensor]] = {}
    for src in sources(state):
        if not src.prefix.startswith("opt/"):
            continue
        x = src.tensor.detach()
        if src.sharded and mesh.world_size > 1:
            x = mesh.collective("all_gather", x.to(mesh.device), tag="fzero.testing/opt-state").to(x.device)
        kind, field = KINDS[src.kind], src.prefix.removeprefix("opt/")
        # every leaf of the bucket has the field, a 0-element leaf too (no chunk names it: torch's
        # state for an empty param holds empty tensors), then every rank's segments fill it in
        whole = {leaf: x.new_zeros(kind.numel(layout.leaves[leaf])) for leaf in layout.buckets[src.bucket].leaves}
        for r in range(mesh.world_size):  # each element once
            for leaf, start, values in kind.chunks(layout, src.bucket, x, r, False):
                whole[leaf][start : start + values.numel()] = values
        for leaf, t in whole.items():
            ls = layout.leaves[leaf]
            out.setdefault(ls.path, {})[field] = t.view(field_shapes(src.kind, [ls.shape])[0])
    return out


def _leaf_entries(fields: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One leaf's fzero state as a snapshot lists it (`fzero.testing.ddp`'s docstring): nothing for a
    leaf never updated (an update count of 0) whose fields are all zeros, as init made them; else
    every field but sgd's "count" -- all of them, "count" too, where the count is 0 but a field
    is not zeros, which torch, holding no state for such a param, cannot match."""
    counts = [fields[f] for f in _COUNTS if f in fields]
    if counts and not any(bool(c.any()) for c in counts):
        if not any(bool(t.any()) for t in fields.values()):
            return {}
        return {f: _opt_entry(f, t) for f, t in fields.items()}
    return {f: _opt_entry(f, t) for f, t in fields.items() if f not in _UNLISTED}


def _fzero_optimizer_snapshot(state: ZeroState, order: Sequence[str]) -> Snapshot:
    """fzero's optimizer state per leaf, "opt:<path>.<field>", in the order of `order` (the params'
    names as `gather` gives them: the order `named_parameters` gives DDP's; leaves not named
    there last)."""
    per_leaf = _leaf_opt_fields(state)
    rank = {name: i for i, name in enumerate(order)}
    out = {}
    for path in sorted(per_leaf, key=lambda p: (rank.get(p, len(rank)), p)):
        out.update({f"{OPT}{path}.{f}": t for f, t in _leaf_entries(per_leaf[path]).items()})
    return out


# ---------------------------------------------------------------------------------------------
# Agreement between the ranks: one small all-gather of a row [code, a, b, c] per agreement

_TAG = "fzero.testing/agree"
_FAILED, _BUILT, _FORWARD, _BACKWARD, _END = -1, 1, 2, 3, 4
_WHERE = {_BUILT: "built its models", _FORWARD: "is at a forward of `model`", _BACKWARD: "is at the backward",
          _END: "has taken its last step"}


@contextlib.contextmanager
def _telling(mesh: Mesh) -> Iterator[None]:
    """Tell the other ranks of an exception raised here, so that they raise `RankFailed` at their
    next agreement (`_agreed`) instead of waiting for this rank in a collective: a verified
    `DistMesh`'s guard announces it (the others' agreement, an fzero collective, raises); on an
    unverified one this rank sends a row of code `_FAILED` to the agreements' all-gather; a
    `SimMesh`'s guard announces it as a verified DistMesh's does."""
    if isinstance(mesh, DistMesh) and not mesh.verify and mesh.world_size > 1:
        try:
            yield
        except Exception as e:
            if not _is_shared(e):  # not an agreement's own error, which every rank raised
                with contextlib.suppress(Exception):
                    gather_rows(mesh, [_FAILED, 0, 0, 0], _TAG)
            raise
    else:
        with mesh.guard():
            yield


def _agreed(mesh: Mesh, who: str, code: int, *values: int, where: str) -> list[list[int]]:
    """Every rank's row `[code, *values]` (padded to 4), in rank order, once every rank is here or
    has raised; `RankFailed` where a rank raised (`_telling`), `ConfigError` on every rank where
    the ranks are at different points (`code`)."""
    row = [code, *values, *[0] * (3 - len(values))]
    try:
        rows = gather_rows(mesh, row, _TAG)
    except RankFailed as e:  # a verified DistMesh: another rank's guard announced its exception
        raise RankFailed(f"{who}: another rank raised; rank {mesh.rank} stops {where}, instead of waiting for it "
                         f"in a collective (world size {mesh.world_size}); the cause is that rank's error: {e}") from e
    failed = [r for r, (c, *_) in enumerate(rows) if c == _FAILED]
    if failed:
        raise RankFailed(f"{who}: rank(s) {failed} raised; rank {mesh.rank} stops {where}, instead of waiting for "
                         f"it in a collective (world size {mesh.world_size}); the cause is that rank's error")
    codes = [c for c, *_ in rows]
    if len(set(codes)) > 1:
        said = "; ".join(f"rank {r} {_WHERE.get(c, f'is at {c}')}" for r, c in enumerate(codes))
        raise ConfigError(f"{who}: the ranks are out of step {where} (world size {mesh.world_size}): {said}; "
                          f"loss_fn must call `model` the same number of times on every rank, once per step for "
                          f"DDP, else DDP's collectives would pair up wrongly and wait")
    return rows


# ---------------------------------------------------------------------------------------------
# The same model on every rank and on every call, and as many batches


def _built(mesh: Mesh, make_model: Callable[[], nn.Module], who: str, steps: int) -> nn.Module:
    """`make_model()`, checked against a second call on this rank and against every rank's: the
    same names, dtypes, shapes and bits, and two separate models, else `ConfigError` on every
    rank, naming the first difference. (DDP and `fzero.init` both broadcast rank 0's values, so a
    model built differently would not fail: the two trainings would start from different models,
    or a rank's model would be silently replaced.) The ranks agree on it, and on `steps` (each
    rank's number of batches), in one all-gather; an exception in `make_model` on one rank
    raises `RankFailed` on the others (before, they waited for it to the timeout)."""
    with _telling(mesh):
        model, again = (_module_of(make_model(), who, call) for call in ("", " on its second call"))
        _check_separate(model, again, who)
        mine = _fingerprint(model)
        first = _first_difference(mine, _fingerprint(again))
        del again
    crc = zlib.crc32("\n".join(mine).encode())
    rows = _agreed(mesh, who, _BUILT, int(first is not None), crc, steps, where="after make_model()")
    counts = [row[3] for row in rows]
    if len(set(counts)) > 1:
        listed = ", ".join(f"rank {r}: {k}" for r, k in enumerate(counts))
        raise ConfigError(f"{who}: the ranks were given different numbers of batches ({listed}; world size "
                          f"{mesh.world_size}); each batch is one step, and every rank takes every step: give every "
                          f"rank as many batches (one list per rank, of one length)")
    unseeded = [r for r, row in enumerate(rows) if row[1]]
    if unseeded:
        said = (f"here (rank {mesh.rank}): the first call gave {first[0]}, the second {first[1]}" if first is not None
                else f"on rank(s) {unseeded}")
        raise ConfigError(f"{who}: make_model() built a different model on its second call {said} (world size "
                          f"{mesh.world_size}); it must build the same model on every call: seed inside it "
                          f"(torch.manual_seed(0) before building), else the two trainings start from different models")
    if len({row[2] for row in rows}) > 1:
        texts = gather_texts(mesh, "\n".join(mine), tag="fzero.testing/model-entries")
        r = next(r for r, row in enumerate(rows) if row[2] != rows[0][2])
        x, y = _first_difference(texts[0].split("\n"), texts[r].split("\n")) or ("?", "?")
        raise ConfigError(f"{who}: make_model() built different models on rank 0 and rank {r} (world size "
                          f"{mesh.world_size}): rank 0 has {x}, rank {r} {y}; it must build the same model on every "
                          f"rank: seed it alike on every rank (torch.manual_seed(0), not a seed of the rank) and build "
                          f"nothing from the rank")
    return model


def _module_of(model: Any, who: str, call: str) -> nn.Module:
    """`model`, which `make_model()` returned (`call`: which call, for the message), where it is an
    `nn.Module`; else `ConfigError`."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{who}: make_model() must return an nn.Module, got {type(model).__name__}{call}")
    return model


def _check_separate(model: nn.Module, again: nn.Module, who: str) -> None:
    """`ConfigError` where `make_model`'s two calls gave one module, or modules sharing the storage
    of a tensor a training writes (`_written`): a cached module. The first training (DDP's
    optimizer, fzero's buffers) changes it in place, so the second started from the first's
    trained values and every element differed at step 0, with no hint (found in review). Storage
    only read may be shared: a frozen param (`nn.Embedding.from_pretrained(TABLE)`) or a
    non-persistent buffer (a constant mask) of one module-level tensor (before, refused too;
    found in review)."""
    how = ("a new model on every call (a cached module is trained in place by the first of the two trainings, "
           "so the second would start from its trained values): build it anew, or return copy.deepcopy(cached)")
    if again is model:
        raise ConfigError(f"{who}: make_model() returned the same {type(model).__name__} object on two calls; it must "
                          f"return {how}")

    def storages(m: nn.Module) -> dict[int, tuple[str, bool]]:
        """`storage address -> (name, written)`, a storage written where any of its tensors is."""
        out: dict[int, tuple[str, bool]] = {}
        for name, t, written in _written(m):
            storage = t.untyped_storage()
            if t.device.type != "meta" and storage.nbytes() and storage.data_ptr():
                first, was = out.get(storage.data_ptr(), (name, False))
                out[storage.data_ptr()] = (first, was or written)
        return out

    first = storages(model)
    shared = [name for ptr, (name, written) in storages(again).items() if ptr in first and (written or first[ptr][1])]
    if shared:
        raise ConfigError(f"{who}: make_model()'s two calls returned models that share the storage of "
                          f"{shared[:4]}{' ...' * (len(shared) > 4)} ({len(shared)} tensor(s)), which a training "
                          f"writes (a trainable param or a persistent buffer; frozen params and non-persistent "
                          f"buffers may be shared); it must return {how}")


def _written(model: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """`(name, tensor, written)` of every param and buffer, shared ones under each name: written
    where a training may change it in place: a trainable param (the optimizer) or a persistent
    buffer (BatchNorm's running statistics and count, which its forward updates). Not a frozen
    param nor a non-persistent buffer (by convention a constant: a mask, position ids), which
    only the buffer broadcasts write, with rank 0's bits, the same on every rank (`_built`)."""
    kept = persistent_buffers(model)
    return [*((name, p, p.requires_grad) for name, p in model.named_parameters(remove_duplicate=False)),
            *((name, b, name in kept) for name, b in model.named_buffers(remove_duplicate=False))]


def _fingerprint(model: nn.Module) -> list[str]:
    """One line per param and buffer: kind (a frozen param says so), name, dtype, shape and the
    crc32 of its bytes."""
    tensors = [("param" if v.requires_grad else "frozen param", k, v) for k, v in model.named_parameters()]
    tensors += [("buffer", k, v) for k, v in model.named_buffers()]
    return [f"{kind} {name!r} {_spec(v)} crc {zlib.crc32(_bytes(v).numpy()):08x}" for kind, name, v in tensors]


def _first_difference(a: list[str], b: list[str]) -> tuple[str, str] | None:
    """The first entry of two fingerprints that differs, as each has it ("nothing more" past its
    end), or None."""
    for x, y in zip(a, b):
        if x != y:
            return x, y
    if len(a) != len(b):
        n = min(len(a), len(b))
        return (a[n] if len(a) > n else "nothing more"), (b[n] if len(b) > n else "nothing more")
    return None


# ---------------------------------------------------------------------------------------------
# Comparing two trajectories


def trajectory_differences(ref: Sequence[Mapping[str, torch.Tensor]], got: Sequence[Mapping[str, torch.Tensor]],
                           limit: int = 6) -> list[str]:
    """Where two trajectories differ, one line each: `[]` when they are bitwise equal at every step.
    `ref` and `got` are per-step snapshots, `{name: tensor}` (what `ddp_trajectory` and
    `fzero_trajectory` return).

    Compared per step: the keys (those on one side only), then per key the dtype and shape, then
    the bits (`-0.0` against `0.0`, or a NaN against a NaN of other bits, differ; tensors on
    another device are compared on the CPU). A line names the step, the key, the dtype and
    shape, how many elements differ and the largest |difference| (exact for integers); where that
    is 0 or NaN (signed zeros, NaNs), the first differing element's index and both values with
    their bits. At most `limit` lines, then one saying how many more there were.

    Nothing to compare is a difference, never `[]`: two trajectories of 0 steps ("0 steps in ref
    and got: nothing compared"), and a step where both snapshots are empty. (Before, `[]`: a test
    given no batches passed whatever fzero did; found in review.)
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"trajectory_differences: limit must be an int >= 1, got {limit!r}")
    for name, run in (("ref", ref), ("got", got)):
        _check_trajectory(name, run)
    if not ref and not got:
        return ["0 steps in ref and got: nothing compared"]
    lines = []
    if len(ref) != len(got):
        lines.append(f"{len(ref)} steps in ref, {len(got)} in got")
    for t, (a, b) in enumerate(zip(ref, got)):
        if not a and not b:
            lines.append(f"step {t}: no keys in ref and got: nothing compared")
        only_a, only_b = [k for k in a if k not in b], [k for k in b if k not in a]
        if only_a or only_b:
            lines.append(f"step {t}: keys only in ref: {only_a[:4]}{' ...' * (len(only_a) > 4)}; only in got: "
                         f"{only_b[:4]}{' ...' * (len(only_b) > 4)}")
        lines += [f"step {t}: {k!r}: {d}" for k in a if k in b for d in [_tensor_difference(a[k], b[k])] if d]
    if len(lines) > limit:
        lines = [*lines[:limit], f"... and {len(lines) - limit} more"]
    return lines


def _check_trajectory(name: str, run: Any) -> None:
    """A `ValueError` naming the slip where `run` is no sequence of `{name: tensor}` snapshots:
    one snapshot given alone, or what `mesh.run` / `pool.run` return, a trajectory per rank (found
    in review of fzero.testing: torch's "Boolean value of Tensor ... is ambiguous", or "string
    indices must be integers")."""
    if isinstance(run, Mapping):
        raise ValueError(f"trajectory_differences: {name} is one snapshot ({type(run).__name__}); give a list of them, "
                         f"one per step (what ddp_trajectory and fzero_trajectory return)")
    if not isinstance(run, Sequence) or isinstance(run, (str, bytes)):
        raise ValueError(f"trajectory_differences: {name} must be a list of {{name: tensor}} snapshots, one per step; "
                         f"got {type(run).__name__}")
    bad = next((i for i, step in enumerate(run) if not isinstance(step, Mapping)), None)
    if bad is not None:
        per_rank = " (one trajectory per rank, as mesh.run and pool.run return? compare each rank's: " \
                   "trajectory_differences(ref[r], got[r]))" if isinstance(run[bad], (list, tuple)) else ""
        raise ValueError(f"trajectory_differences: {name}[{bad}] is a {type(run[bad]).__name__}, not a {{name: "
                         f"tensor}} snapshot{per_rank}")


def _tensor_difference(a: Any, b: Any) -> str | None:
    """How two snapshot entries differ, or None where they are the same bits."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return f"not tensors: {type(a).__name__} and {type(b).__name__}"
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{_spec(a)} in ref, {_spec(b)} in got"
    bytes_a, bytes_b = _bytes(a), _bytes(b)
    if torch.equal(bytes_a, bytes_b):
        return None
    differ = (bytes_a.view(a.numel(), -1) != bytes_b.view(b.numel(), -1)).any(1)
    text = f"{_spec(a)}: {int(differ.sum())} of {a.numel()} elements differ"
    if a.dtype == torch.bool:
        return text
    x, y = (_flat(v)[differ] for v in (a, b))
    if not (a.is_floating_point() or a.is_complex()):  # exact: float64 rounds int64's above 2**53 (found in review)
        return text + f", max |diff| {max(abs(i - j) for i, j in zip(x.tolist(), y.tolist()))}"
    wide = torch.complex128 if a.is_complex() else torch.float64
    largest = (x.to(wide) - y.to(wide)).abs().max().item()
    text += f", max |diff| {largest:.3g}"
    if largest == 0 or math.isnan(largest):  # signed zeros or NaNs: the values say nothing, their bits do
        i = int(differ.nonzero()[0])
        text += (f"; first at flat index {i}: ref {_element(a, i)}, got {_element(b, i)}")
    return text


def _element(x: torch.Tensor, i: int) -> str:
    """Element `i` of `x` (flat) and its bits in hex: `-0.0 (0x80000000)`."""
    one = _flat(x)[i : i + 1]
    if one.is_complex():  # (two floats: their values carry the sign of a zero and a NaN's payload is rare)
        return str(one.item())
    return f"{one.item()} (0x{bytes(one.view(torch.uint8).flip(0).tolist()).hex()})"


def _flat(x: torch.Tensor) -> torch.Tensor:
    """`x` on the CPU, contiguous and flat, lazy conjugate and negative views resolved."""
    return x.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, uint8 on the CPU (`_flat`)."""
    flat = _flat(x)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def _spec(x: torch.Tensor) -> str:
    """`float32[4, 16]`."""
    return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
