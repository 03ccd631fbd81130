"""fzero's exceptions. Each message names the pytree path, shapes, world size and the way out."""

from __future__ import annotations


class FzeroError(Exception):
    """Base class of every error fzero raises on purpose."""


class ConfigError(FzeroError, ValueError):
    """A setting (a stage, a count, a dtype, an option) is not one fzero accepts."""


class LayoutError(FzeroError, ValueError):
    """A params pytree, a plan or a buffer does not fit the layout."""


class MeshError(FzeroError, RuntimeError):
    """A collective could not run: ranks disagree, a rank failed or returned early."""


class CollectiveMismatch(MeshError):
    """Ranks called different collectives (op, dtype, shape or tag) at the same point."""


class RankFailed(MeshError):
    """Another rank raised; this rank stops instead of waiting for it forever."""


class NonFiniteError(FzeroError, FloatingPointError):
    """A loss or gradient was NaN or inf on some rank (see `on_nonfinite`)."""


class LossScaleError(FzeroError, FloatingPointError):
    """The gradients overflowed with the loss scale already at `min_scale` (`raise_at_min`)."""


class OffloadError(FzeroError, OSError):
    """Offloaded state cannot be kept: an NVMe path is missing, unwritable or full, or its I/O failed."""
