"""Differentiable collectives over a mesh; each declares its adjoint (all-gather <-> reduce-scatter,
all-reduce <-> all-reduce, broadcast <-> sum to the source). See `fzero._src.collectives`."""

from fzero._src.collectives import all_gather as all_gather
from fzero._src.collectives import all_reduce as all_reduce
from fzero._src.collectives import broadcast as broadcast
from fzero._src.collectives import reduce_scatter as reduce_scatter

__all__ = ["all_gather", "all_reduce", "broadcast", "reduce_scatter"]
