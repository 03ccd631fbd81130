"""Params that gather a unit when the loss first uses it (`train_step(..., gather="on_use")`).

`LazyParams` is the read-only mapping `{dotted path: leaf}` a loss receives instead of the params
pytree when gathering on use. Reading any leaf of a unit runs that unit's Function once per step
(in stage 3: all-gathers the unit's buckets) and caches all its leaves; a unit the loss never
reads is never gathered. Two ways to read it:

- index it: `params["h.0.w"]` (a loss written for a flat dict of params);
- pass it to the `apply` of `fzero.from_module`, which binds each unit's parameters in a forward
  pre-hook of the unit's submodule, so a block is gathered when the block runs.

Params that are not a flat dict get shape-correct placeholders instead (`FirstUse`): the first
torch function that receives one gets the real leaf, gathering its unit then.

Every rank must read the units in the same order (the same program on every rank does).

Release and re-gather (stage 3 with `engine="autograd"`): when the step can `release` a unit,
`from_module`'s `apply` frees the unit's gathered storage after its submodule's forward
(`untyped_storage().resize_(0)`, as FSDP2 does). The step runs the loss under a
`saved_tensors_hooks` whose unpack gathers a released unit again (`refill`) the first time
backward reads a tensor saved from its storage, and the unit's Function frees it once more after
its backward. The saved tensors are views of that storage, so they read the re-gathered values,
the same bits (all-gather copies them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten


class LazyParams(Mapping):
    """`{path: leaf}`; a unit's leaves are produced by `materialize(unit)` on first read."""

    def __init__(self, unit_of: dict[str, str], materialize: Callable[[str], dict[str, torch.Tensor]],
                 release: Callable[[str], None] | None = None, refill: Callable[[str], None] | None = None) -> None:
        self._unit_of = unit_of
        self._materialize = materialize
        self._release, self._refill = release, refill
        self._done: dict[str, dict[str, torch.Tensor]] = {}
        self._released: set[str] = set()

    @property
    def releasable(self) -> bool:
        """Whether `release` frees memory (stage 3, autograd engine); else it does nothing."""
        return self._release is not None

    def release(self, unit: str) -> None:
        """Free the unit's gathered storage until `refill` (or the next read) gathers it again."""
        if self._release is not None and unit in self._done and unit not in self._released:
            self._release(unit)
            self._released.add(unit)

    def refill(self, unit: str) -> None:
        """Gather a released unit again, into the same storage."""
        if unit in self._released:
            self._refill(unit)  # type: ignore[misc]
            self._released.discard(unit)

    def unit_of(self, path: str) -> str:
        return self._unit_of[path]

    def unit(self, unit: str) -> dict[str, torch.Tensor]:
        """All leaves of `unit`, gathering it now if it was not yet."""
        if unit not in self._done:
            self._done[unit] = self._materialize(unit)
        self.refill(unit)
        return self._done[unit]

    @property
    def gathered(self) -> tuple[str, ...]:
        """The units read so far, in the order they were first read."""
        return tuple(self._done)

    def __getitem__(self, path: str) -> torch.Tensor:
        if path not in self._unit_of:
            raise KeyError(f"{path!r} is not a params path; some are {list(self._unit_of)[:5]}")
        return self.unit(self._unit_of[path])[path]

    def __iter__(self) -> Iterator[str]:
        return iter(self._unit_of)

    def __len__(self) -> int:
        return len(self._unit_of)

    def __repr__(self) -> str:
        return f"LazyParams({len(self)} leaves, gathered units {list(self._done)})"


class FirstUse(TorchFunctionMode):
    """For params that are not a flat dict: the loss gets shape-correct placeholder leaves (a 0-d
    zero expanded to the leaf's shape: no memory), and the first torch function or tensor method
    that receives a placeholder gets the real leaf instead, read from a `LazyParams` -- so the
    unit is gathered, and its Function created, at its first use. Reading a placeholder's
    attributes through torch (`.shape` included) counts as a use; data read any other way (e.g.
    `.data_ptr()`) would see the placeholder's zeros."""

    def __init__(self, placeholders: dict[int, str], read: Callable[[str], torch.Tensor]) -> None:
        super().__init__()
        self._paths, self._read = placeholders, read

    def __torch_function__(self, func, types, args=(), kwargs=None):
        flat, spec = tree_flatten((args, kwargs or {}))
        if any(isinstance(a, torch.Tensor) and id(a) in self._paths for a in flat):
            flat = [self._read(self._paths[id(a)]) if isinstance(a, torch.Tensor) and id(a) in self._paths else a
                    for a in flat]
            args, kwargs = tree_unflatten(flat, spec)
        return func(*args, **(kwargs or {}))
