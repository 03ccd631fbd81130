"""The gradient norm: each rank's part of `‖g‖²` from its shards, the same bits in every stage.

`sum_of_squares` (one 2-norm per shard of the reduced gradient, `shard_squares`, their squares
summed in float64) is the part of `‖g‖²` each rank puts in the agreement's row;
`exact_sum_of_squares` recomputes a part exactly where one is not finite (the rare path), and
`in_order` sums the ranks' parts on the host in rank order (proofs/stages.md §3). Where a shard
exists in the backward (N = 1, CUDA), `EarlyNorms` takes its norm there, beside the backward on a
side stream (`Side`, which the units' gradient assembly and the update's finite check,
`update.Ends`, run on too), and the agreement reads that norm instead of the shard. These are
numbers only: the agreement decides with them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .collectives import func_level
from .config import StepConfig
from .state import ZeroState
from .unit import Assembly


def in_order(values: list[float]) -> float:
    """`((0 + v_0) + v_1) + ...` in float64 (Python floats): the sum over ranks, in rank order."""
    total = 0.0
    for v in values:
        total += v
    return total


def shard_squares(shards: list[torch.Tensor], device: torch.device,
                  known: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """`ν²[K]` in float64 (on `device`), `ν_k = ‖x_k‖₂` of shard k: one `torch._foreach_norm`
    per (device, dtype) of the shards (a single read of each, no transient; accumulated in
    float32, or float64 for float64 shards: 16-bit shards are widened to float32 in the
    kernel), then one stack, cast and square. `ν_k²` is exact in float64.

    The value of `ν_k` depends only on the shard's values and length, never on where it sits in
    memory (a slice of stage 0's full buffer, or a tensor of its own in stages 1-3), so every
    stage gets the same bits: on the CPU the kernel is `torch.linalg.vector_norm` per tensor,
    whose order of additions does not depend on the address (`tests/test_speed.py`); on CUDA the
    multi-tensor kernel takes a vectorised path for a tensor whose address is a multiple of 16
    bytes and a scalar path otherwise, which add in different orders, so a shard that is not so
    placed (stage 0's slice of the full buffer at N > 1, where `S * itemsize` is not a multiple
    of 16 bytes) is copied first, to a fresh (aligned) tensor as stages 1-3 hold.
    Error of `ν_k²` against the exact `Σ x²`: at most `(γ_{S+1} + 2u)·Σx² + (1 + γ_{S+1})·m·2^-150`
    (u = 2^-24, S the shard's length: S squares and additions in any order, one square root and
    its rounding to float32; m the nonzero elements with |x| < 2^-63, whose float32 squares are
    subnormal and lose up to 2^-150 each: relative alone where there are none), the same kind of
    error torch's `clip_grad_norm_` has (proofs/stages.md §1.3, §3), for (S + 1)·u < 1 (shards
    under 2^24 - 1 elements; past that no bound is derived). NaN and
    inf propagate; a float32 norm of finite values may overflow to inf, which `agree` resolves
    exactly. `known`: `{k: ν_k}` taken already (`shard_norm`, of shards whose memory is gone:
    `offload.early_copies`), used instead of reading shard k.
    """
    if not shards:
        return torch.zeros(0, dtype=torch.float64, device=device)
    known = known or {}
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}  # CUDA's one kernel: one device and dtype
    for k, x in enumerate(shards):
        if k not in known:
            groups.setdefault((x.device, x.dtype), []).append(k)
    norms: list[torch.Tensor | None] = [known.get(k) for k in range(len(shards))]
    for (where, dtype), ks in groups.items():
        xs = [_placed(shards[k].detach().reshape(-1)) for k in ks]  # read as numbers: not differentiated
        for k, nu in zip(ks, _norms(xs, _norm_dtype(dtype))):
            norms[k] = nu
    return torch.stack([nu if nu.device == device else nu.to(device) for nu in norms]).to(torch.float64).square()


def shard_norm(x: torch.Tensor) -> torch.Tensor:
    """`ν = ‖x‖₂` of one shard, as `shard_squares` takes it (the same kernel on the same values:
    `_foreach_norm` gives each tensor of its list the value it gives that tensor alone), before
    the square: for a shard whose memory goes before the agreement (`offload.early_copies`)."""
    return _norms([_placed(x.detach().reshape(-1))], _norm_dtype(x.dtype))[0]


class EarlyNorms:
    """The shard norms of a step's reduced gradients taken as each exists in the backward, on a
    side stream on CUDA, so that the agreement's pass over the gradient runs beside the rest of
    the backward instead of after it: at N = 1 each unit's reduction returns its input, which is
    then the bucket's reduced gradient and, where nothing else adds to it, the shard the
    agreement reads (`of` says where).

    The same side stream assembles those gradients (`assembly`, `unit._assemble`): at N = 1 a
    unit's backward reads its assembled gradient only through the identity, so its copy runs
    beside the backward of the units below, and the norm after it, in stream order.

    `take(x)` starts `shard_norm(x)` (the side stream first waits for what the step's stream has
    queued, which made `x`); `known(shards)` joins the side stream to the step's and returns
    `{k: ν_k}` for the shards taken: the same tensor (address, length, dtype, contiguous) with
    no write since (`_version`). `x` is kept until then, so no other tensor takes its address.
    The same kernel on the same values, so the same bits (`shard_norm`); a shard not taken, or
    written since, is read by the agreement as before."""

    DEVICES = ("cuda",)  # where a step takes them (a side stream runs beside the backward)

    def __init__(self, device: torch.device) -> None:
        self.side = Side(device)
        self.taken: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def of(config: StepConfig, state: ZeroState) -> EarlyNorms | None:
        """For a step whose reductions return the bucket's gradient in the backward and whose
        agreement reads it unchanged: `beside_backward`, and one micro-batch (with more, the
        agreement reads their sum); else None."""
        return EarlyNorms(state.mesh.device) if config.micro_batches == 1 and beside_backward(config, state) else None

    def assembly(self, state: ZeroState) -> Assembly | None:
        """The units' gradient assembly on this side stream (`Inflight.side`; `side_assembly`)."""
        return side_assembly(self.side, state)

    def take(self, x: torch.Tensor) -> None:
        if x.requires_grad or not x.is_contiguous() or x.device != self.side.device:
            return
        self.taken[_norm_key(x)] = (x, self.side.run(shard_norm, x))

    def known(self, shards: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        self.side.join()
        hits = {k: self.taken.get(_norm_key(x)) for k, x in enumerate(shards) if x.is_contiguous()}
        return {k: hit[1] for k, hit in hits.items() if hit is not None}


def beside_backward(config: StepConfig, state: ZeroState) -> bool:
    """Whether each unit's reduction returns its input in the backward and work may run beside
    the backward on a side stream: one rank, a device of `EarlyNorms.DEVICES`, the autograd engine,
    no offload tier (whose early host copies read the reduced gradient in the backward, on the
    step's stream; it takes its own norms, `offload.early_norms`), nothing differentiating
    through the step."""
    mesh = state.mesh
    return (mesh.world_size == 1 and mesh.device.type in EarlyNorms.DEVICES and config.engine == "autograd"
            and state.info.tier is None and func_level() is None)


def side_assembly(side: Side, state: ZeroState) -> Assembly | None:
    """The units' gradient assembly on `side` (`Inflight.side`), or None: CUDA (a stream to run
    beside), and the params on the device (an offloaded unit's gathered storage is freed after its
    backward, which the assembly may still read). The step joins it at the end of each
    micro-batch's backward, before any gradient is read or added to the micro-batches' sum."""
    return Assembly(side) if side.stream is not None and state.info.offload.params is None else None


def _norm_key(x: torch.Tensor) -> tuple:
    return (x.data_ptr(), x.numel(), x.dtype, x._version)


class Side:
    """Work queued beside the step's stream: on CUDA on the device's side stream, after what the
    step's stream has queued so far (`run`), until `join` makes the step's stream wait for it;
    elsewhere run in line."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.used = device, False
        self.stream = _side_stream(device) if device.type == "cuda" else None

    def run(self, fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> Any:
        if self.stream is None:
            return fn(x)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.used = True
        with torch.cuda.stream(self.stream):
            return fn(x)

    def join(self) -> None:
        if self.used:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per CUDA device, made once."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _norm_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _norms(xs: list[torch.Tensor], acc: torch.dtype) -> list[torch.Tensor]:
    """`‖x‖₂` of each 1-d `x` (one device and dtype), accumulated in `acc`: one `_foreach_norm`;
    under a torch.func transform, which has no rule for it, one `vector_norm` each (on the CPU the
    kernel `_foreach_norm` runs per tensor: the same bits)."""
    if func_level() is None:
        return list(torch._foreach_norm(xs, 2, dtype=acc))
    return [torch.linalg.vector_norm(x, 2, dtype=None if x.dtype == acc else acc) for x in xs]


def _placed(x: torch.Tensor) -> torch.Tensor:
    """`x`, or on CUDA a copy of it where its address is not a multiple of 16 bytes (`shard_squares`)."""
    return x.clone() if x.device.type == "cuda" and func_level() is None and x.data_ptr() % 16 else x


def sum_of_squares(shards: list[torch.Tensor], device: torch.device,
                   known: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """`Σ_k ν_k²` in float64 (0-d, on `device`): one `torch.sum` of `shard_squares` (a fresh
    tensor, the same values in the same order in every stage, so the same bits; its order of
    additions depends on K and the device only). Error against the exact `Σ x²`: each shard's
    (`shard_squares`: relative, plus an absolute part where squares are subnormal), and `γ_{K-1}`
    in float64 for the sum of the K non-negative terms (proofs/stages.md §3). `known`:
    `shard_squares`'s."""
    return shard_squares(shards, device, known).sum()


SQ_CHUNK = 1 << 22  # elements per float64 chunk of `exact_sum_of_squares`: a 32 MiB scratch buffer


def exact_sum_of_squares(shards: list[torch.Tensor], device: torch.device, chunk: int = SQ_CHUNK) -> torch.Tensor:
    """The rare path's `‖g‖²`: `Σ_k s_k` in float64 (0-d, on `device`), `s_k = Σ_i x_i²` over
    chunk k of at most `chunk` elements: each shard `[S]` is cut into chunks from its start, in
    shard order.

    Each chunk is copied into one reused float64 scratch buffer, squared there and summed into
    `parts[k]`; then `parts` is summed. So no float64 copy of a whole shard exists (the transient
    is `8 * min(chunk, max S)` bytes, not `16 * S`), and the order of additions depends only on
    the shards' lengths and values: every stage sums the same shard the same way (stage 0 reads its
    rank's slice of the full buffer; the copy into the scratch makes where the slice sits in
    memory irrelevant). A float32, bfloat16 or float16 value squares exactly in float64, so the
    only roundings are the float64 additions; NaN and inf survive them (squares are >= 0: no
    inf - inf), so `‖g‖²` is non-finite iff some element is.
    """
    counts = [-(-x.numel() // chunk) for x in shards]
    parts = torch.zeros(sum(counts), dtype=torch.float64, device=device)
    widest = max((min(x.numel(), chunk) for x in shards), default=0)
    scratch = torch.empty(widest, dtype=torch.float64, device=device)
    k = 0
    for x in shards:
        flat = x.reshape(-1)
        for start in range(0, flat.numel(), chunk):
            piece = flat[start : start + chunk]
            buf = scratch[: piece.numel()]
            buf.copy_(piece)
            buf.square_()
            torch.sum(buf, dim=0, out=parts[k])
            k += 1
    return parts.sum()
