"""Checkpoints in a canonical per-leaf form: save on N ranks at one stage, load on M at another,
bit for bit; a checkpoint is visible only when complete (see `fzero._src.checkpoint`)."""

from fzero._src.checkpoint import BuffersNotLoaded as BuffersNotLoaded
from fzero._src.checkpoint import CheckpointError as CheckpointError
from fzero._src.checkpoint import CheckpointNotSynced as CheckpointNotSynced
from fzero._src.checkpoint import complete as complete
from fzero._src.checkpoint import export as export
from fzero._src.checkpoint import latest as latest
from fzero._src.checkpoint import load as load
from fzero._src.checkpoint import OldCheckpointNotRemoved as OldCheckpointNotRemoved
from fzero._src.checkpoint import LrScheduleMovedOn as LrScheduleMovedOn
from fzero._src.checkpoint import read_manifest as read_manifest
from fzero._src.checkpoint import save as save
from fzero._src.checkpoint import save_safetensors as save_safetensors
from fzero._src.checkpoint import summary as summary
from fzero._src.checkpoint import UnsealedCheckpointSkipped as UnsealedCheckpointSkipped

__all__ = ["BuffersNotLoaded", "CheckpointError", "CheckpointNotSynced", "LrScheduleMovedOn", "OldCheckpointNotRemoved",
           "UnsealedCheckpointSkipped", "complete", "export", "latest", "load",
           "read_manifest", "save", "save_safetensors",
           "summary"]
