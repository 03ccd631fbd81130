"""fzero: ZeRO stages 0-3 as pure functions on PyTorch, equal to DDP bit for bit.

This namespace is the run API (meshes, `init`, `train_step`, `gather`, `evaluate`,
`from_module`, the state and step types, loss scalers, errors), re-exported from the private
`fzero._src` modules. The other layers are namespaces of their own: `fzero.layout`,
`fzero.collectives`, `fzero.optim`, `fzero.accounting`, `fzero.checkpoint` (each imported with
`fzero`) and `fzero.testing` (import it yourself); docs/architecture.md.
"""

from fzero._src.errors import CollectiveMismatch as CollectiveMismatch
from fzero._src.errors import ConfigError as ConfigError
from fzero._src.errors import FzeroError as FzeroError
from fzero._src.collectives import ForwardModeOnSimMesh as ForwardModeOnSimMesh
from fzero._src.errors import LayoutError as LayoutError
from fzero._src.errors import MeshError as MeshError
from fzero._src.errors import NonFiniteError as NonFiniteError
from fzero._src.errors import OffloadError as OffloadError
from fzero._src.errors import LossScaleError as LossScaleError
from fzero._src.errors import RankFailed as RankFailed
from fzero._src.layout import GroupHoldsNoLeaf as GroupHoldsNoLeaf
from fzero._src.originals import ModuleWrittenAfterInit as ModuleWrittenAfterInit
from fzero._src.originals import UnitsNotPassed as UnitsNotPassed
from fzero._src.layout import ParamGroup as ParamGroup
from fzero._src.evaluate import evaluate as evaluate
from fzero._src.gathering import DivergentPaths as DivergentPaths
from fzero._src.gathering import LazyParams as LazyParams
from fzero._src.mesh import CollectiveRecord as CollectiveRecord
from fzero._src.mesh import DistMesh as DistMesh
from fzero._src.mesh import Mesh as Mesh
from fzero._src.mesh import SimMesh as SimMesh
from fzero._src.offload import Offload as Offload
from fzero._src.precision import NoFp32Master as NoFp32Master
from fzero._src.precision import Precision as Precision
from fzero._src.scale import DynamicLossScale as DynamicLossScale
from fzero._src.scale import LossScaleAtFloor as LossScaleAtFloor
from fzero._src.scale import LossScaleState as LossScaleState
from fzero._src.scale import StaticLossScale as StaticLossScale
from fzero._src.stages import STAGES as STAGES
from fzero._src.stages import Stage as Stage
from fzero._src.state import StateInfo as StateInfo
from fzero._src.state import ZeroState as ZeroState
from fzero._src.state import gather as gather
from fzero._src.state import own_values as own_values
from fzero._src.state import init as init
from fzero._src.step import AmbiguousMicroBatches as AmbiguousMicroBatches
from fzero._src.step import Metrics as Metrics
from fzero._src.config import StepConfig as StepConfig
from fzero._src.step import train_step as train_step
from fzero._src.module import ModuleCompileDropped as ModuleCompileDropped
from fzero._src.module import ModuleInfo as ModuleInfo
from fzero._src.module import broadcast_buffers as broadcast_buffers
from fzero._src.module import from_module as from_module
from fzero._src.module import units_by_prefix as units_by_prefix
from fzero import accounting as accounting
from fzero import checkpoint as checkpoint
from fzero import collectives as collectives
from fzero import layout as layout
from fzero import optim as optim

__version__ = "0.1.0"

__all__ = [
    "AmbiguousMicroBatches",
    "CollectiveMismatch",
    "CollectiveRecord",
    "ConfigError",
    "DistMesh",
    "DivergentPaths",
    "DynamicLossScale",
    "ForwardModeOnSimMesh",
    "FzeroError",
    "GroupHoldsNoLeaf",
    "LayoutError",
    "LazyParams",
    "LossScaleAtFloor",
    "LossScaleError",
    "LossScaleState",
    "Mesh",
    "MeshError",
    "Metrics",
    "ModuleWrittenAfterInit",
    "ModuleCompileDropped",
    "StepConfig",
    "ModuleInfo",
    "NoFp32Master",
    "NonFiniteError",
    "Offload",
    "OffloadError",
    "ParamGroup",
    "Precision",
    "RankFailed",
    "STAGES",
    "SimMesh",
    "Stage",
    "StateInfo",
    "StaticLossScale",
    "UnitsNotPassed",
    "ZeroState",
    "broadcast_buffers",
    "evaluate",
    "from_module",
    "gather",
    "init",
    "own_values",
    "accounting",
    "checkpoint",
    "collectives",
    "layout",
    "optim",
    "train_step",
    "units_by_prefix",
]
