"""Testing helpers for fzero and for code built on it.

- hypothesis strategies: `pytrees`, `float_tensors`, `integer_valued`, `shapes`, `world_sizes`,
  `units`, `groups`; `examples(n)` (n examples in the "ci" profile, 10 n in "local").
- `assert_trees_equal`: structure, dict key order, dtypes and values, naming the first difference.
- `Pool`: a persistent group of torchrun workers on a gloo process group (`fzero.testing.pool`).
"""

from fzero.testing.pool import Pool as Pool
from fzero.testing.pool import PoolError as PoolError
from fzero.testing.pool import RemoteError as RemoteError
from fzero.testing.pool import WorkerError as WorkerError
from fzero.testing.strategies import FLOAT_DTYPES as FLOAT_DTYPES
from fzero.testing.strategies import assert_trees_equal as assert_trees_equal
from fzero.testing.strategies import example_count as example_count
from fzero.testing.strategies import examples as examples
from fzero.testing.strategies import float_tensors as float_tensors
from fzero.testing.strategies import groups as groups
from fzero.testing.strategies import integer_valued as integer_valued
from fzero.testing.strategies import pytrees as pytrees
from fzero.testing.strategies import shapes as shapes
from fzero.testing.strategies import units as units
from fzero.testing.strategies import world_sizes as world_sizes

__all__ = [
    "FLOAT_DTYPES",
    "Pool",
    "PoolError",
    "RemoteError",
    "WorkerError",
    "assert_trees_equal",
    "example_count",
    "examples",
    "float_tensors",
    "groups",
    "integer_valued",
    "pytrees",
    "shapes",
    "units",
    "world_sizes",
]
