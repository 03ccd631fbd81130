"""Casting ahead (`train_step(cast_ahead=True)`): the params autocast casts, handed to the loss cast.

Under `torch.autocast` a matrix product reads each fp32 param through a cast to the autocast
dtype (`aten._to_copy`), and its backward casts the param's gradient back (`ToCopyBackward0`: on
CUDA one launch of torch's dynamic-cast loop per leaf, unvectorised). Where a leaf's one read in
the loss is such a product, handing the loss the cast itself gives the same bits:

- forward: fzero's cast of the leaf (`Bucket.cast_views`: one `to` per run of neighbouring cast
  leaves in the flat buffer) rounds each element as autocast's `_to_copy` does (to nearest even),
  and autocast hands a tensor already in its dtype to the op as it is, so the op reads the same
  values;
- backward: the cast's gradient is what the op sends it, in the autocast dtype; `ToCopyBackward0`
  would widen it to fp32, which is exact, and the unit's backward widens it instead on its way
  into the fp32 bucket (`unit._write`, one multi-tensor copy per dtype).

Which leaves (`Slot.learned`): the first step hands every fp32 leaf as it is, as a `Watched`
tensor, which reports every torch function, tensor method and tensor attribute read that takes
it (`Reads`). A leaf is cast from the next step on where its reads were exactly
one function of `CASTING` (matrix products and convolutions, whose every floating input autocast
casts to its lower-precision dtype) with autocast on for the leaf's device in a narrower float
dtype, besides reads of attributes the cast shares (`SAME`: its shape, device, ...); and where
the step's autograd graph agrees -- the leaf's one consumer is a `ToCopyBackward0` to that dtype.

Every later step watches the cast leaves the same way, through its forward and its backward
(a hook may read a param), and raises `ConfigError` at the first read that is not such a product
under autocast in the leaf's cast dtype, or a second one -- again after the forward and after the
backward, should the loss catch it: a loss whose reads of a param change is refused, not run
with other bits. The step's state is untouched (the error comes before the update). A cast leaf
kept past its step raises at any later read. A call that another tensor subclass takes part in
counts as another read (and is left to that subclass); a compiled function reading a watched
leaf raises. Not seen, so not checked: reads that bypass `__torch_function__` -- `torch.tensor(t)`,
`t.as_subclass(...)`, DLPack, `set_`, nested tensors, C++ extensions.

Only at N = 1 (an error on one rank must not leave the others in a collective), with the
autograd engine, where nothing is freed and gathered again in backward (stage 3 at N = 1 reads
its held shard), nothing is offloaded, and no torch.func transform runs the step (`step.backward`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from .errors import ConfigError
from .unit import UnitProgram, _Unit, remembered
from .watched import Watched

NARROW = (torch.bfloat16, torch.float16)  # the autocast dtypes a cast may narrow to

# the functions whose every floating input autocast casts to its lower-precision dtype, on CUDA
# and on the CPU (torch's autocast op lists)
CASTING = frozenset([F.linear, F.conv1d, F.conv2d, F.conv3d, torch.matmul, torch.mm, torch.addmm, torch.bmm,
                     torch.baddbmm, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
                     torch.Tensor.mm, torch.Tensor.addmm, torch.Tensor.bmm, torch.Tensor.baddbmm])

# attributes and methods whose answer is the same for the cast as for the leaf
SAME = frozenset(["shape", "device", "ndim", "requires_grad", "is_leaf", "layout", "is_cuda", "is_cpu", "is_meta",
                  "is_sparse", "is_quantized", "is_nested", "is_mkldnn", "size", "dim", "numel", "nelement",
                  "stride", "is_contiguous", "is_floating_point", "is_complex", "get_device"])

Casts = Mapping[str, tuple]  # unit -> per output leaf (`UnitProgram.leaves` order): its cast dtype, or None


def casting(program: UnitProgram, casts: tuple | None, watch: bool = False) -> UnitProgram:
    """`program` whose forward hands each leaf in `casts`' dtype (None: as it is) and, with
    `watch`, the leaves whose reads are watched as `Watched`; made once."""
    if not casts or not any(c is not None for c in casts):
        casts = None
    if casts is None and not watch:
        return program
    return remembered(_PROGRAMS, program, (casts, watch),
                      lambda: dataclasses.replace(program, casts=casts, watch=watch))


_PROGRAMS: dict = {}


@dataclasses.dataclass(frozen=True)
class Learned:
    """What one state's first step learned: unit -> per leaf its cast dtype or None."""

    casts: dict[str, tuple]

    @property
    def count(self) -> int:
        """How many leaves are cast."""
        return sum(c is not None for cs in self.casts.values() for c in cs)


class CastAhead:
    """One `train_step`'s casting: a `Slot` per state (its `StateInfo`, held weakly)."""

    def __init__(self) -> None:
        self._slots: dict = {}

    def of(self, info: Any) -> Slot:
        return remembered(self._slots, info, None, Slot)


class Slot:
    """One state's casting: `learned` (None before the first forward)."""

    def __init__(self) -> None:
        self.learned: Learned | None = None

    @property
    def casts(self) -> Casts | None:
        """The casts to hand this step's forward, or None (nothing learned yet, or nothing to cast)."""
        return self.learned.casts if self.learned is not None and self.learned.count else None

    def reads(self, step: Any) -> Reads | None:
        """The `Reads` of this step's forward: learning (nothing learned yet), checking (leaves
        to cast), or None (nothing to cast)."""
        if self.learned is None:
            return Reads(step, learning=True)
        return Reads(step, learning=False) if self.learned.count else None

    def seen(self, reads: Reads | None) -> None:
        """After the step's backward: learn from a learning step's reads and graph."""
        if reads is None or not reads.learning:
            return
        casts: dict[str, list] = {}
        for key, (program, k) in reads.leaves.items():
            dtype = _cast_only(reads.uses.get(key, []))
            if dtype is not None and reads.graph.get(key) == dtype:
                casts.setdefault(program.name, [None] * len(program.leaves))[k] = dtype
        self.learned = Learned({u: tuple(c) for u, c in casts.items()})


class Reads:
    """The reads of the watched unit leaves during one step's forward and backward: the
    Gathering hands it each unit's outputs (`watch`), and each `Watched` leaf reports every torch
    call that takes it (`read`). Learning: every fp32 leaf is watched and its reads recorded
    (`uses`), and the forward's graph (`graph`, taken before the backward frees it). Checking:
    the cast leaves are watched, and a read that is not one `CASTING` call under autocast in the
    leaf's dtype raises `ConfigError` -- again after the forward and after the backward
    (`check`), should the loss have caught it. After the step (`close`), a cast leaf someone kept
    raises at any read; an uncast one is a view of the params, read as it would be anyway."""

    def __init__(self, step: Any, learning: bool) -> None:
        self.step, self.learning, self.open = step, learning, True
        self.leaves: dict[tuple[str, int], tuple[UnitProgram, int]] = {}
        self.uses: dict[tuple[str, int], list[tuple]] = {}
        self.graph: dict[tuple[str, int], torch.dtype] = {}
        self.refused: ConfigError | None = None
        self._paths: dict[tuple[str, int], str] = {}

    def watch(self, program: UnitProgram, outs: list[torch.Tensor], paths: list[str]) -> None:
        for k, (t, path) in enumerate(zip(outs, paths)):
            if type(t) is Watched:
                key = (program.name, k)
                t.reader = functools.partial(self.read, key)
                self.leaves[key], self._paths[key] = (program, k), path

    def forward_done(self, loss: torch.Tensor) -> None:
        """After the forward: the graph's casts (learning), and a refusal the loss caught (checking)."""
        if self.learning and loss.grad_fn is not None and _has_metadata(loss.grad_fn):
            self.graph = _narrowing_casts(loss.grad_fn)
        self.check()

    def check(self) -> None:
        if self.refused is not None:
            raise self.refused

    def close(self) -> None:
        self.open = False

    def read(self, key: tuple[str, int], t: torch.Tensor, func: Any) -> None:
        if not self.open:
            if not self.learning:
                raise ConfigError(f"cast_ahead: the param {self._paths[key]!r} handed cast to step "
                                  f"{int(self.step)}'s loss was read after that step; keep no params past a step "
                                  f"(or use train_step(cast_ahead=False))")
            return
        use = _use(func, t)
        if use[0] == "same":
            return
        uses = self.uses.setdefault(key, [])
        uses.append(use)
        if not self.learning and (use != ("cast", t.dtype) or len(uses) > 1):
            self.refused = self.refused or ConfigError(
                f"cast_ahead: step {int(self.step)}: the loss read param {self._paths[key]!r} (unit {key[0]!r}) "
                f"{_said(use)}{' a second time' if len(uses) > 1 else ''}; the first step read it once, through a "
                f"matrix product under autocast, so fzero hands it cast to {t.dtype}, which this read would see "
                f"instead of the fp32 param. A loss whose reads of a param change needs train_step(cast_ahead=False)")
            raise self.refused


def _use(func: Any, t: torch.Tensor) -> tuple:
    """A read by kind: ("same",) where the cast answers as the leaf would, ("cast", dtype) for a
    `CASTING` call under autocast on the leaf's device, else ("other", name)."""
    name = getattr(func, "__name__", repr(func))
    if name == "__get__":  # an attribute read
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    if name in SAME:
        return ("same",)
    if func in CASTING:
        device = t.device.type
        if torch.is_autocast_enabled(device):
            return ("cast", torch.get_autocast_dtype(device))
        return ("other", f"{name} with autocast off")
    return ("other", name)


def _said(use: tuple) -> str:
    return f"through {use[1]}" if use[0] == "other" else f"through a matrix product under autocast in {use[1]}"


def _cast_only(uses: list[tuple]) -> torch.dtype | None:
    """The dtype where a leaf's reads were one `CASTING` call under autocast in a narrower float dtype."""
    return uses[0][1] if len(uses) == 1 and uses[0][0] == "cast" and uses[0][1] in NARROW else None


def _narrowing_casts(root: Any) -> dict[tuple[str, int], torch.dtype]:
    """`{(unit, leaf): dtype}` for each unit leaf whose one consumer in the graph below `root` is
    a `ToCopyBackward0` to a narrower dtype of the same shape."""
    consumers: dict[tuple[Any, int], list[Any]] = {}
    seen, stack = {root}, [root]
    while stack:
        node = stack.pop()
        for below, k in node.next_functions:
            if below is None:
                continue
            consumers.setdefault((below, k), []).append(node)
            if below not in seen:
                seen.add(below)
                stack.append(below)
    out = {}
    for (node, k), users in consumers.items():
        if not isinstance(node, _Unit._backward_cls) or k >= len(node.program.leaves) or len(users) != 1:
            continue
        if type(users[0]).__name__ != "ToCopyBackward0":
            continue
        leaf, cast = node._input_metadata[k], users[0]._input_metadata[0]
        if cast.dtype.itemsize < leaf.dtype.itemsize and tuple(cast.shape) == tuple(leaf.shape):
            out[(node.program.name, k)] = cast.dtype
    return out


def _has_metadata(node: Any) -> bool:
    """Whether this torch's autograd nodes carry their outputs' metadata (`_input_metadata`);
    where not, nothing is cast."""
    return hasattr(node, "_input_metadata")
