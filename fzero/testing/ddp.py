"""fzero against torch DDP on a model of one's own: the trajectories of both, and their differences.

fzero's claim is that every stage gives `torch.nn.parallel.DistributedDataParallel`'s bits at
N = 2 (README, "Every stage equals ... DDP bit for bit at N = 2"; at N > 2 the backend's summation
order decides the last bits, and the claim is a bound: proofs/stages.md §3). These helpers let a
team check it for its own model, as fzero's own suite does (tests/ddp_cases.py rests on them):

    # cases.py (importable by the pool's workers)
    def make_model():
        torch.manual_seed(0)                    # the same model on every rank, on every call
        return MyModel()

    def loss_fn(model, batch):                  # model: DDP's module, or fzero's apply bound to the params
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
after the step: the params by their names (`model.named_parameters()`, a tied weight once, under
its first name; frozen params included), then the buffers as "buffer:<name>" (every name of a
shared buffer). `trajectory_differences` compares two bit for bit.

The optimizers must compute alike: `fzero.optim.sgd` / `adam` / `adamw` with `impl="single"`
are `torch.optim.X(foreach=False)`, `impl="foreach"` are `foreach=True`, with the same
hyper-parameters (proofs/optimizers.md §1, `tests/test_optim.py`); `impl="fused"` is
`fused=True` where fzero accepts it (proofs/optimizers.md §3).
The default `impl=None` is "foreach" on the CPU ("fused" on CUDA where torch's kernel is
element-wise, `fzero.optim.sgd`'s docstring); on the CPU, float32 params, it gives
`foreach=False`'s bits too (`tests/test_ddp.py` compares the default with `foreach=False`, and
`tests/test_testing_ddp.py` this module's functions). Only gloo (CPU) meshes are tested here.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fzero._src.collectives import gather_rows, gather_texts
from fzero._src.errors import ConfigError
from fzero._src.mesh import Mesh, SimMesh
from fzero._src.module import broadcast_buffers as broadcast_module_buffers
from fzero._src.module import from_module, units_by_prefix
from fzero._src.optim.base import Optimizer
from fzero._src.state import gather, init
from fzero._src.step import train_step

#: The prefix of a buffer's key in a trajectory's snapshot ("buffer:body.1.running_mean").
BUFFER = "buffer:"

Snapshot = dict[str, torch.Tensor]
LossFn = Callable[[Callable[..., Any], Any], torch.Tensor]


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
    """torch DDP over `mesh`'s process group: this rank's params and buffers after every step.

    Per batch: `opt.zero_grad(set_to_none=True)`, `loss_fn(ddp, batch).backward()`, `opt.step()`,
    a snapshot (the module's own tensors, cloned).

    Args:
      mesh: a `DistMesh` (DDP needs a process group; a `SimMesh` is refused).
      make_model: `() -> nn.Module`, the same model on every rank and on every call: seed inside
        it (`torch.manual_seed(0)` before building). Checked: it is called twice, and the two
        models, then every rank's, must have the same names, dtypes, shapes and bits, else
        `ConfigError` naming the first difference (a model that differs between the two trainings
        would read as fzero differing from DDP).
      make_optimizer: `model -> torch.optim.Optimizer` over the module DDP wraps, e.g.
        `lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False)` (frozen params get
        no gradient, so torch.optim skips them; `fzero.testing.ddp`'s docstring says which settings give
        fzero's bits).
      loss_fn: `(model, batch) -> 0-d loss`, `model(*args, **kwargs)` being the forward (here the
        DDP-wrapped module), this rank's mean loss on `batch`.
      batches: this rank's batches, one per step.
      find_unused_parameters, broadcast_buffers: DDP's (fzero reduces a unit a rank skipped as
        zeros, as `find_unused_parameters=True` does; pass it where some rank leaves a parameter
        unused).
    """
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(mesh, SimMesh):
        raise ConfigError(f"ddp_trajectory: {mesh!r} is a SimMesh, whose ranks are threads of one process; torch DDP "
                          f"needs a process group: run it on every rank of a fzero.testing.Pool (or under torchrun) "
                          f"with its DistMesh")
    model = _built(mesh, make_model, "ddp_trajectory")
    ddp = DistributedDataParallel(model, process_group=mesh.group, find_unused_parameters=find_unused_parameters)
    # set, not passed: torch 2.13 deprecates the argument (a FutureWarning) for `forward_sync_buffers`,
    # which torch 2.11 lacks; the attribute is the forward's switch in both. The sync at
    # construction, which the argument also turned off, copies nothing: `_built` checked that
    # every rank's buffers are the same bits
    ddp.broadcast_buffers = broadcast_buffers
    opt = make_optimizer(model)
    out = []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        loss_fn(ddp, batch).backward()
        opt.step()
        snap = {k: v.detach().clone() for k, v in model.named_parameters()}
        snap.update({BUFFER + k: v.detach().clone() for k, v in model.named_buffers(remove_duplicate=False)})
        out.append(snap)
    return out


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
    """fzero at `stage`: this rank's gathered params and buffers after every step.

    `fzero.from_module(make_model())`, `fzero.init`, then per batch: `fzero.broadcast_buffers`
    (rank 0's buffers to every rank, as DDP's `broadcast_buffers=True` does before each forward),
    one `train_step` step, a snapshot (`fzero.gather`, and the buffers cloned).

    Args:
      mesh: the ranks' mesh (a `DistMesh` to compare with DDP; a `SimMesh` runs too, but its
        ranks share one module's buffers: README, "The equivalence guarantee").
      make_model, loss_fn, batches: as for `ddp_trajectory` (here `model` is `from_module`'s
        `apply` bound to the step's params).
      optimizer: a `fzero.optim` optimizer, the counterpart of `ddp_trajectory`'s.
      stage: the ZeRO stage, 0-3.
      units: None (one unit), a str naming the container whose children are the units
        (`fzero.units_by_prefix(model, units)`, e.g. "transformer.h"), or a `units=` of
        `from_module` (`path -> unit name`, `{unit: predicate}`).
      broadcast_buffers: False for DDP's `broadcast_buffers=False`.
      init_kwargs: more arguments of `fzero.init` (`precision`, `bucket_bytes`, ...); its
        `groups` come after `from_module`'s frozen group.
      step_kwargs: arguments of `fzero.train_step` (`clip_norm`, `gather`, ...).
    """
    model = _built(mesh, make_model, "fzero_trajectory")
    spec = units_by_prefix(model, units) if isinstance(units, str) else units
    params, apply, info = from_module(model, units=spec)
    del model
    extra = dict(init_kwargs or {})
    groups = (*info.groups, *extra.pop("groups", ()))
    state = init(params, optimizer, stage=stage, mesh=mesh, units=info.units, groups=groups, **extra)
    step = train_step(lambda p, batch: loss_fn(functools.partial(apply, p), batch), **step_kwargs)
    out = []
    for batch in batches:
        if broadcast_buffers:
            broadcast_module_buffers(info, mesh)
        state, _ = step(state, batch)
        snap = dict(gather(state))
        snap.update({BUFFER + k: v.detach().clone() for k, v in info.buffers.items()})
        out.append(snap)
    return out


# ---------------------------------------------------------------------------------------------
# The same model on every rank and on every call


def _built(mesh: Mesh, make_model: Callable[[], nn.Module], who: str) -> nn.Module:
    """`make_model()`, checked against a second call on this rank and against every rank's: the
    same names, dtypes, shapes and bits, else `ConfigError` on every rank, naming the first
    difference. (DDP and `fzero.init` both broadcast rank 0's values, so a model built
    differently would not fail: the two trainings would start from different models, or a rank's
    model would be silently replaced.)"""
    model = make_model()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{who}: make_model() must return an nn.Module, got {type(model).__name__}")
    mine = _fingerprint(model)
    again = _fingerprint(make_model())
    first = _first_difference(mine, again)
    rows = gather_rows(mesh, [int(first is not None), zlib.crc32("\n".join(mine).encode())], tag="fzero.testing/model")
    unseeded = [r for r, (bad, _) in enumerate(rows) if bad]
    if unseeded:
        said = (f"here (rank {mesh.rank}): the first call gave {first[0]}, the second {first[1]}" if first is not None
                else f"on rank(s) {unseeded}")
        raise ConfigError(f"{who}: make_model() built a different model on its second call {said} (world size "
                          f"{mesh.world_size}); it must build the same model on every call: seed inside it "
                          f"(torch.manual_seed(0) before building), else the two trainings start from different models")
    if len({crc for _, crc in rows}) > 1:
        texts = gather_texts(mesh, "\n".join(mine), tag="fzero.testing/model-entries")
        r = next(r for r, (_, crc) in enumerate(rows) if crc != rows[0][1])
        x, y = _first_difference(texts[0].split("\n"), texts[r].split("\n")) or ("?", "?")
        raise ConfigError(f"{who}: make_model() built different models on rank 0 and rank {r} (world size "
                          f"{mesh.world_size}): rank 0 has {x}, rank {r} {y}; it must build the same model on every "
                          f"rank: seed it alike on every rank (torch.manual_seed(0), not a seed of the rank) and build "
                          f"nothing from the rank")
    return model


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
    the bits (`-0.0` against `0.0`, or two NaNs, differ; tensors on another device are compared
    on the CPU). A line names the step, the key, the dtype and shape, how many elements differ
    and the largest |difference|. At most `limit` lines, then one saying how many more there were.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"trajectory_differences: limit must be an int >= 1, got {limit!r}")
    lines = []
    if len(ref) != len(got):
        lines.append(f"{len(ref)} steps in ref, {len(got)} in got")
    for t, (a, b) in enumerate(zip(ref, got)):
        only_a, only_b = [k for k in a if k not in b], [k for k in b if k not in a]
        if only_a or only_b:
            lines.append(f"step {t}: keys only in ref: {only_a[:4]}{' ...' * (len(only_a) > 4)}; only in got: "
                         f"{only_b[:4]}{' ...' * (len(only_b) > 4)}")
        lines += [f"step {t}: {k!r}: {d}" for k in a if k in b for d in [_tensor_difference(a[k], b[k])] if d]
    if len(lines) > limit:
        lines = [*lines[:limit], f"... and {len(lines) - limit} more"]
    return lines


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
    if a.dtype != torch.bool:
        wide = torch.complex128 if a.is_complex() else torch.float64
        x, y = (v.detach().cpu().reshape(-1)[differ].to(wide) for v in (a, b))
        text += f", max |diff| {(x - y).abs().max().item():.3g}"
    return text


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, uint8 on the CPU (lazy conjugate and negative views resolved)."""
    flat = x.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def _spec(x: torch.Tensor) -> str:
    """`float32[4, 16]`."""
    return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
