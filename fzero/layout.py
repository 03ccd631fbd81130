"""The static plan: a params pytree -> buckets -> flat buffers -> N contiguous shards.

Pure functions over shapes and dtypes (see `fzero._src.layout`).
"""

from fzero._src.layout import BucketSpec as BucketSpec
from fzero._src.layout import GroupHoldsNoLeaf as GroupHoldsNoLeaf
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

__all__ = ["BucketSpec", "GroupHoldsNoLeaf", "Layout", "LeafSpec", "ParamGroup", "Segment", "local_shards", "pack",
           "plan", "shard", "unpack", "unshard"]
