"""Checkpoints in a canonical per-leaf form: save on N ranks at one stage, load on M at another,
bit for bit; a checkpoint is visible only when complete (see `fzero._src.checkpoint`)."""

from fzero._src.checkpoint import CheckpointError as CheckpointError
from fzero._src.checkpoint import complete as complete
from fzero._src.checkpoint import latest as latest
from fzero._src.checkpoint import load as load
from fzero._src.checkpoint import read_manifest as read_manifest
from fzero._src.checkpoint import save as save

__all__ = ["CheckpointError", "complete", "latest", "load", "read_manifest", "save"]
