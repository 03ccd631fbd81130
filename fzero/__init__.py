"""fzero: ZeRO stages 0-3 as pure functions on PyTorch, equal to DDP bit for bit.

Public names are re-exported here from the private `fzero._src` modules.
"""

from fzero._src.collectives import all_gather as all_gather
from fzero._src.collectives import all_reduce as all_reduce
from fzero._src.collectives import broadcast as broadcast
from fzero._src.collectives import reduce_scatter as reduce_scatter
from fzero._src.errors import CollectiveMismatch as CollectiveMismatch
from fzero._src.errors import ConfigError as ConfigError
from fzero._src.errors import FzeroError as FzeroError
from fzero._src.errors import LayoutError as LayoutError
from fzero._src.errors import MeshError as MeshError
from fzero._src.errors import NonFiniteError as NonFiniteError
from fzero._src.errors import LossScaleError as LossScaleError
from fzero._src.errors import RankFailed as RankFailed
from fzero._src.layout import BucketSpec as BucketSpec
from fzero._src.layout import Layout as Layout
from fzero._src.layout import LeafSpec as LeafSpec
from fzero._src.layout import ParamGroup as ParamGroup
from fzero._src.layout import Segment as Segment
from fzero._src.layout import local_shards as local_shards
from fzero._src.layout import pack as pack
from fzero._src.layout import plan as plan
from fzero._src.layout import shard as shard
from fzero._src.layout import unpack as unpack
from fzero._src.layout import unshard as unshard
from fzero._src.gathering import LazyParams as LazyParams
from fzero._src.mesh import CollectiveRecord as CollectiveRecord
from fzero._src.mesh import DistMesh as DistMesh
from fzero._src.mesh import Mesh as Mesh
from fzero._src.mesh import SimMesh as SimMesh
from fzero._src.scale import DynamicLossScale as DynamicLossScale
from fzero._src.scale import LossScaleState as LossScaleState
from fzero._src.scale import StaticLossScale as StaticLossScale
from fzero._src.stages import STAGES as STAGES
from fzero._src.stages import Stage as Stage
from fzero._src.state import StateInfo as StateInfo
from fzero._src.state import ZeroState as ZeroState
from fzero._src.state import gather as gather
from fzero._src.state import init as init
from fzero._src.step import Metrics as Metrics
from fzero._src.step import StepConfig as StepConfig
from fzero._src.step import train_step as train_step
from fzero._src.module import ModuleInfo as ModuleInfo
from fzero._src.module import broadcast_buffers as broadcast_buffers
from fzero._src.module import from_module as from_module
from fzero._src.module import units_by_prefix as units_by_prefix
from fzero._src.estimate import BytesPerParam as BytesPerParam
from fzero._src.estimate import MemoryEstimate as MemoryEstimate
from fzero._src.estimate import bytes_per_param as bytes_per_param
from fzero._src.estimate import estimate as estimate
from fzero._src.estimate import estimate_stages as estimate_stages
from fzero._src.accounting import CommVolume as CommVolume
from fzero._src.accounting import HeldBytes as HeldBytes
from fzero._src.accounting import comm_volume as comm_volume
from fzero._src.accounting import expected_comm as expected_comm
from fzero._src.accounting import held_bytes as held_bytes
from fzero._src.accounting import storage_bytes as storage_bytes
from fzero import accounting as accounting
from fzero import collectives as collectives
from fzero import layout as layout
from fzero import optim as optim

__version__ = "0.1.0"

__all__ = [
    "BucketSpec",
    "BytesPerParam",
    "CollectiveMismatch",
    "CollectiveRecord",
    "CommVolume",
    "ConfigError",
    "DistMesh",
    "DynamicLossScale",
    "FzeroError",
    "HeldBytes",
    "Layout",
    "LayoutError",
    "LazyParams",
    "LeafSpec",
    "LossScaleError",
    "LossScaleState",
    "MemoryEstimate",
    "Mesh",
    "MeshError",
    "Metrics",
    "StepConfig",
    "ModuleInfo",
    "NonFiniteError",
    "ParamGroup",
    "RankFailed",
    "STAGES",
    "Segment",
    "SimMesh",
    "Stage",
    "StateInfo",
    "StaticLossScale",
    "ZeroState",
    "all_gather",
    "all_reduce",
    "broadcast",
    "broadcast_buffers",
    "bytes_per_param",
    "comm_volume",
    "estimate",
    "estimate_stages",
    "expected_comm",
    "from_module",
    "gather",
    "held_bytes",
    "init",
    "local_shards",
    "accounting",
    "collectives",
    "layout",
    "optim",
    "pack",
    "plan",
    "reduce_scatter",
    "shard",
    "storage_bytes",
    "train_step",
    "units_by_prefix",
    "unpack",
    "unshard",
]
