"""Casting ahead (`train_step(cast_ahead=True)`): the params autocast casts, handed to the loss cast.

Under `torch.autocast` a matrix product reads each fp32 param through a cast to the autocast
dtype (`aten._to_copy`), and its backward casts the param's gradient back (`ToCopyBackward0`: on
CUDA one launch of torch's dynamic-cast loop per leaf, unvectorised). Where a leaf's one use in
the loss is that cast, handing the loss the cast itself gives the same bits:

- forward: fzero's cast of the leaf (`Bucket.cast_views`: one `to` per run of neighbouring cast
  leaves in the flat buffer) rounds each element as autocast's `_to_copy` does (to nearest even),
  and autocast hands a tensor already in its dtype to the op as it is, so every op after the
  cast reads the same tensor values;
- backward: the cast's gradient is what autograd adds up over the cast's uses, in the autocast
  dtype, in the same order either way; `ToCopyBackward0` would widen it to fp32, which is exact,
  and the unit's backward widens it instead on its way into the fp32 bucket (`unit._write`, one
  multi-tensor copy per dtype).

Which leaves (`learn`): in the autograd graph of a step that casts nothing, a unit output with
exactly one consumer, a `ToCopyBackward0` whose output is a narrower floating dtype of the same
shape. A leaf cast twice (two uses, each cast apart) is not one: its two widened gradients are
added in fp32, not in the autocast dtype.

Every later step that casts checks its own graph (`holds`): each cast leaf is consumed as the
learned cast's output was -- the same consumer nodes, by type and output dtypes, and the nodes
consuming those -- or not at all (a leaf the step did not use gets no gradient either way). Where
one is not, the step drops the graph, runs its forward again without casts, and learns from that
graph: a loss whose use of a param changes costs one more forward that step, never other bits.
What the graph cannot show is autocast switched off around an op that reads the cast the same
way (the same consumer types and dtypes): proofs/precision.md, "Casting ahead", on what that can
and cannot do to a matrix product.

Only where the forward issues no collective (stages 0-2, or stage 3 at N = 1: a second forward on
one rank must not call collectives the others do not), nothing is freed and gathered again in
backward, nothing is offloaded, and no torch.func transform runs the step (`step.backward`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from .unit import UnitProgram, _Unit, remembered

NARROW = (torch.bfloat16, torch.float16)  # the autocast dtypes a cast may narrow to

Casts = Mapping[str, tuple]  # unit -> per output leaf (`UnitProgram.leaves` order): its cast dtype, or None


def casting(program: UnitProgram, casts: tuple | None) -> UnitProgram:
    """`program` whose forward hands each leaf in `casts`' dtype (None: as it is), made once."""
    if not casts or not any(c is not None for c in casts):
        return program
    return remembered(_PROGRAMS, program, casts, lambda: dataclasses.replace(program, casts=casts))


_PROGRAMS: dict = {}


@dataclasses.dataclass
class Learned:
    """What one state's steps learned: `casts` (unit -> per leaf dtype or None) and, per cast
    leaf `(unit, k)`, how the cast's output was consumed (`_uses`)."""

    casts: dict[str, tuple]
    uses: dict[tuple[str, int], tuple]

    @property
    def count(self) -> int:
        """How many leaves are cast."""
        return len(self.uses)


class CastAhead:
    """One `train_step`'s casting: a `Slot` per state (its `StateInfo`, held weakly)."""

    def __init__(self) -> None:
        self._slots: dict = {}
        self.last: Learned | None = None  # what the last slot learned, for reports (benchmarks)

    def of(self, info: Any) -> Slot:
        return remembered(self._slots, info, None, lambda: Slot(self))


class Slot:
    """What one state's steps learned (`learned`, None before the first forward)."""

    def __init__(self, owner: CastAhead) -> None:
        self.owner, self.learned = owner, None

    @property
    def casts(self) -> Casts | None:
        """The casts to hand this step's forward, or None (nothing learned yet, or nothing to cast)."""
        return self.learned.casts if self.learned is not None and self.learned.count else None

    def seen(self, loss: torch.Tensor, casts: Casts | None) -> bool:
        """After a forward that handed `casts`: whether its graph holds them (True where it handed
        none, after learning from it if nothing was learned yet). False: the learned casts are
        dropped; run the forward again without casts."""
        if loss.grad_fn is None or not has_metadata(loss.grad_fn) or casts is None and self.learned is not None:
            return True
        consumers = _consumers(loss.grad_fn)
        if casts is None:
            self.learned = self.owner.last = learn(consumers)
            return True
        if holds(self.learned, consumers):
            return True
        self.learned = None
        return False


def _consumers(root: Any) -> dict[tuple[Any, int], list[Any]]:
    """`{(node, output index): [nodes that read that output]}` over the graph below `root`."""
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
    return consumers


def _unit_outputs(consumers: Mapping[tuple[Any, int], list[Any]]) -> Iterable[tuple[Any, int, list[Any]]]:
    """`(unit node, leaf index, its consumers)` for every unit leaf the graph reads."""
    for (node, k), users in consumers.items():
        if isinstance(node, _Unit._backward_cls) and k < len(node.program.leaves):
            yield node, k, users


def _kind(node: Any) -> tuple:
    """A node by its type and the dtypes of its outputs."""
    return type(node).__name__, tuple(str(m.dtype) for m in node._input_metadata)


def _uses(users: Sequence[Any], consumers: Mapping[tuple[Any, int], list[Any]]) -> tuple:
    """How a tensor is consumed: each consumer's kind with the kinds of the nodes reading it, sorted."""
    return tuple(sorted((_kind(u), tuple(sorted(_kind(v) for k in range(len(u._input_metadata))
                                                for v in consumers.get((u, k), ()))))
                        for u in users))


def learn(consumers: Mapping[tuple[Any, int], list[Any]]) -> Learned:
    """The casts a graph with no casts of fzero's shows (see the module docstring)."""
    casts: dict[str, list] = {}
    uses: dict[tuple[str, int], tuple] = {}
    for node, k, users in _unit_outputs(consumers):
        if len(users) != 1 or type(users[0]).__name__ != "ToCopyBackward0":
            continue
        program, out = node.program, users[0]._input_metadata[0]
        leaf = _leaf_metadata(node, k)
        if leaf is None or out.dtype not in NARROW or out.dtype.itemsize >= leaf.dtype.itemsize \
                or not leaf.dtype.is_floating_point or tuple(out.shape) != tuple(leaf.shape) or out.device != leaf.device:
            continue
        casts.setdefault(program.name, [None] * len(program.leaves))[k] = out.dtype
        uses[(program.name, k)] = _uses(consumers.get((users[0], 0), ()), consumers)
    return Learned({u: tuple(c) for u, c in casts.items()}, uses)


def _leaf_metadata(node: Any, k: int) -> Any:
    """The unit node's output k's metadata (shape, dtype, device), or None where torch has none."""
    meta = getattr(node, "_input_metadata", None)
    return meta[k] if meta is not None and k < len(meta) else None


def holds(learned: Learned, consumers: Mapping[tuple[Any, int], list[Any]]) -> bool:
    """Whether a graph that handed `learned.casts` consumed every cast leaf as learned (or not at all)."""
    for node, k, users in _unit_outputs(consumers):
        casts = node.program.casts
        if casts is not None and casts[k] is not None and _uses(users, consumers) != learned.uses.get(
                (node.program.name, k)):
            return False
    return True


def has_metadata(node: Any) -> bool:
    """Whether this torch's autograd nodes carry their outputs' metadata (`_input_metadata`,
    which `learn` and `holds` read); where not, nothing is cast."""
    return hasattr(node, "_input_metadata")
