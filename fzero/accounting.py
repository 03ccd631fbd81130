"""What a rank holds and what it sends: held bytes and a storage census, recorded communication
and its formula, and the memory estimate of ZeRO's Table 1 (proofs/memory.md,
proofs/communication.md)."""

from fzero._src.accounting import CommVolume as CommVolume
from fzero._src.accounting import HeldBytes as HeldBytes
from fzero._src.accounting import LiveStorages as LiveStorages
from fzero._src.accounting import TierSplit as TierSplit
from fzero._src.accounting import comm_volume as comm_volume
from fzero._src.accounting import expected_comm as expected_comm
from fzero._src.accounting import grad_bytes as grad_bytes
from fzero._src.accounting import held_bytes as held_bytes
from fzero._src.accounting import storage_bytes as storage_bytes
from fzero._src.estimate import BytesPerParam as BytesPerParam
from fzero._src.estimate import MemoryEstimate as MemoryEstimate
from fzero._src.estimate import TierBytes as TierBytes
from fzero._src.estimate import bytes_per_param as bytes_per_param
from fzero._src.estimate import estimate as estimate
from fzero._src.estimate import estimate_stages as estimate_stages
from fzero._src.estimate import policy_bytes_per_param as policy_bytes_per_param

__all__ = ["BytesPerParam", "CommVolume", "HeldBytes", "LiveStorages", "MemoryEstimate", "TierBytes", "TierSplit",
           "bytes_per_param", "comm_volume", "estimate", "estimate_stages", "expected_comm", "grad_bytes", "held_bytes",
           "policy_bytes_per_param", "storage_bytes"]
