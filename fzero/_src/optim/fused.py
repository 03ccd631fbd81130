r"""When torch's fused optimizer kernels give torch's bits on pieces of a flat shard.

torch.optim with `fused=True` makes one kernel call over its parameters, each parameter its own
tensor. fzero calls the same kernel on pieces of a shard. An element gets torch's bits if the
kernel computes it the same way in both placements. Two cases:

* **element-wise**: the kernel's arithmetic does not depend on where an element sits (its
  offset in the tensor, the tensor's alignment, its length). Then any piece will do, and fzero
  calls the kernel once over maximal runs of leaves with equal step count.
* **placement-dependent**: otherwise. Then a piece must be placed as torch's own tensor: the
  whole leaf, at an address with torch's alignment. fzero calls the kernel per leaf and
  refuses (`OptimizerError`) a leaf the shard cuts or misaligns.

What torch's kernels do (read in torch 2.13's sources, measured on an H200 with torch 2.11):

* CPU (`aten/src/ATen/native/cpu/Fused{Adam,SGD}Kernel.cpp`): each tensor is split across
  threads; each thread's part runs a vectorised body with the scalars rounded to the element
  type and a scalar tail in float64. Which elements fall in a tail depends on the tensor's
  length and torch's thread count: placement-dependent, always.
* CUDA (`multi_tensor_apply` with `FusedAdamMathFunctor` / `FusedSgdMathFunctor`): one
  per-element function, inlined into a vectorised path (every operand's address a multiple of
  `kILP * itemsize` bytes and the length a multiple of `kILP = 4`) and a scalar path, each
  unrolled over `kILP` lanes. Whether those inlined copies round alike is the compiler's
  choice. Measured: `_fused_adamw_` alike everywhere (every flag); `_fused_adam_` with L2
  weight decay differs by path and by lane; `_fused_sgd_` with momentum and `maximize`
  differs by path (proofs/optimizers.md, section 3).

So on CUDA fzero *checks* each kernel configuration once (`elementwise`): the same random data
placed at several offsets, alignments and lengths must give the same bits. This is evidence,
not a proof; the bitwise tests against torch (tests/test_optim.py, on a GPU) are the other half.
Other devices are treated as placement-dependent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

KILP = 4  # torch's multi_tensor_apply ILP (aten/src/ATen/native/cuda/MultiTensorApply.cuh)

# (offset of the piece in elements from an aligned address, elements before the data, length
# rounding): the vectorised path (offset 0, length % 4 == 0) with lanes shifted by 0..3 and by a
# thread block, and the scalar path with several lane shifts.
PLACEMENTS = ((0, 0, True), (0, 1, True), (0, 2, True), (0, 3, True), (0, 4, True), (0, 2048 + 1, True),
              (1, 0, False), (1, 1, False), (1, 3, False), (1, 512, False), (1, 513, False), (3, 2048, False))
PROBE_NUMEL = 70_000  # more than one multi_tensor_apply chunk (65536 elements)

_checked: dict[tuple, bool] = {}


def elementwise(key: tuple, launch: Callable[[list[torch.Tensor]], None], depth: int, positive: Sequence[int],
                dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel configuration `key` computes every element alike, wherever it sits.

    `launch(tensors)` runs the kernel (hyper-parameters bound) on `depth` 1-d operand tensors of
    one piece, in place; operands at `positive` get non-negative data (second moments). CPU and
    devices other than CUDA: False without running anything. CUDA: the same data is placed as
    `PLACEMENTS` says and the results compared bit for bit; cached per `(device, dtype, key)`.
    """
    if device.type != "cuda":
        return False
    full = (str(device), dtype, key)
    if full not in _checked:
        _checked[full] = _probe(launch, depth, positive, dtype, device)
    return _checked[full]


def _probe(launch, depth, positive, dtype, device) -> bool:
    gen = torch.Generator(device).manual_seed(0)
    data = [torch.randn(PROBE_NUMEL, generator=gen, device=device, dtype=torch.float32) for _ in range(depth)]
    for k in positive:  # second moments: v >= 0, and v_max >= v
        data[k] = data[k].abs()
    for k, k_next in zip(positive, positive[1:]):
        data[k_next] += data[k]
    data = [d.to(dtype) for d in data]
    first = None
    for offset, before, vectorised in PLACEMENTS:
        length = before + PROBE_NUMEL
        length += (-length) % KILP if vectorised else (length % KILP == 0)
        pieces = []
        for d in data:
            buf = torch.zeros(offset + length, dtype=dtype, device=device)  # allocator blocks are aligned
            buf[offset + before : offset + before + PROBE_NUMEL] = d
            pieces.append(buf[offset : offset + length])
        launch(pieces)
        result = [p[before : before + PROBE_NUMEL] for p in pieces]
        if first is None:
            first = result
        elif not all(torch.equal(a, b) for a, b in zip(first, result)):
            return False
    return True


def placed_as_torch(views: Sequence[torch.Tensor], numel: int) -> bool:
    """Whether a whole leaf's operand `views` take the kernel path torch's own tensors take.

    torch's tensors are their own allocations (aligned), so on CUDA they take the vectorised
    path iff `numel % KILP == 0`; a view does iff every operand address is a multiple of
    `KILP * itemsize` bytes and `numel % KILP == 0`. On CPU the path depends on the length and
    thread count only, equal for a whole leaf.
    """
    if not views or views[0].device.type != "cuda" or numel % KILP != 0:
        return True
    return all(v.data_ptr() % (KILP * v.element_size()) == 0 for v in views)


_updates: dict[tuple, bool] = {}
UPDATE_PROBE_NUMEL = 96  # three of the CPU kernel's 32-element vectors: body and tail alike


def updates_every_element(key: tuple, launch: Callable[[torch.Tensor, torch.Tensor], None], dtype: torch.dtype,
                          device: torch.device) -> bool:
    """Whether a fused kernel configuration writes the update `p - 0.5 * g` into every element of
    a tensor of ones with gradient ones (0.5 in every floating dtype, no rounding).

    `launch(p, g)` runs the kernel with lr 0.5 and no other term. Found in review: torch 2.11's
    and 2.13's CPU `_fused_sgd_` in bfloat16 / float16 leaves the elements of its vectorised body
    as they were (of 32 elements none changes), so torch.optim.SGD(fused=True) and fzero's
    `impl="fused"`, which calls that kernel, train nothing there. Cached per `(device, dtype, key)`."""
    full = (str(device), dtype, key)
    if full not in _updates:
        p = torch.ones(UPDATE_PROBE_NUMEL, dtype=dtype, device=device)
        launch(p, torch.ones_like(p))
        _updates[full] = bool(torch.all(p == 0.5))
    return _updates[full]
