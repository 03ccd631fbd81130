"""SGD with momentum, dampening, Nesterov and L2 weight decay, bit for bit torch.optim.SGD with
`foreach=False`, `foreach=True` or `fused=True` (`impl`); for bfloat16 / float16 params on the CPU
("single", "foreach"), torch's bits but in the scalar tails of torch's own calls, and the same bits
wherever a shard cuts (`ops`)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import fused, ops
from .base import (
    EmptyState,
    Impl,
    Launch,
    LearningRate,
    Optimizer,
    OptimizerError,
    UpdateContext,
    as_schedule,
    bumped,
    check_grad,
    check_fits,
    check_flag,
    check_hyper,
    check_impl,
    check_in_place,
    check_placement,
    check_shards,
    group_lr,
    in_blocks,
    in_place,
    refuses_torch_only_keywords,
    resolve_impl,
    spliced,
    two_phase,
    used_pieces,
    written_by_kernel,
)


class SgdMomentumState(NamedTuple):
    """`count[L]` ("leaf"): momentum updates so far per bucket leaf (0: no buffer yet, as torch's
    `momentum_buffer is None`); `momentum_buffer[S]` ("shard")."""

    count: torch.Tensor
    momentum_buffer: torch.Tensor


@refuses_torch_only_keywords
def sgd(
    lr: LearningRate,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    *,
    maximize: bool = False,
    impl: Impl | None = None,
) -> Optimizer:
    r"""Stochastic gradient descent, bit for bit `torch.optim.SGD`.

    Per element of a used leaf, with $\eta$ = `lr(step) * group.lr_scale` and $\lambda$ =
    `weight_decay` (0 where the group masks weight decay off):

    $$g \leftarrow \pm g + \lambda p, \qquad
      b \leftarrow \begin{cases} g & \text{first momentum update of the leaf} \\
                                 \mu b + (1 - \tau) g & \text{otherwise} \end{cases}, \qquad
      d = \begin{cases} g + \mu b & \text{nesterov} \\ b & \text{otherwise} \end{cases}, \qquad
      p \leftarrow p - \eta d$$

    ($-g$ if `maximize`; the momentum lines only when $\mu \ne 0$.)

    Args:
      lr: a float, a callable `step -> float`, or a sequence of per-step floats.
      momentum, dampening, nesterov, weight_decay, maximize: as torch.optim.SGD.
      impl: "single" = `SGD(foreach=False)`, "foreach" = `SGD(foreach=True)`, "fused" =
        `SGD(fused=True)` (where torch's kernel rounds by placement, CPU always, on CUDA as
        `fused.elementwise` finds: every updated leaf whole and aligned in the shard); None:
        "fused" on CUDA where element-wise, else "foreach" (`base.resolve_impl`).

    Returns:
      An `Optimizer`; its state is `EmptyState()` without momentum, else `SgdMomentumState`.
      `update_` writes `param` and `momentum_buffer` in place and returns a new `count`; it
      allocates at most one shard-sized buffer (on the CPU one block's: `base.in_blocks`; "fused": none).

    Example:
      >>> import torch, fzero.optim as fo
      >>> from fzero._src.layout import ParamGroup, Segment
      >>> opt = fo.sgd(0.5, momentum=0.9)
      >>> p, g = torch.ones(4), torch.ones(4)
      >>> ctx = fo.UpdateContext(0, ParamGroup(), (Segment(0, 0, 0, 3),), (0,), (True,))
      >>> p, s = opt.update(g, opt.init(p, 1), p, ctx)
      >>> p.tolist()  # the 4th element is padding
      [0.5, 0.5, 0.5, 1.0]
    """
    schedule = as_schedule(lr)
    momentum = check_hyper("momentum", momentum)
    dampening = check_hyper("dampening", dampening)
    weight_decay = check_hyper("weight_decay", weight_decay)
    impl = check_impl("sgd", impl)
    nesterov, maximize = check_flag("nesterov", nesterov), check_flag("maximize", maximize)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise OptimizerError(
            f"Nesterov momentum requires a momentum > 0 and zero dampening, got momentum={momentum}, "
            f"dampening={dampening}"
        )

    def init(param: torch.Tensor, num_leaves: int) -> EmptyState | SgdMomentumState:
        if momentum == 0:
            return EmptyState()
        return SgdMomentumState(torch.zeros(num_leaves, dtype=torch.float32), torch.zeros_like(param))

    def spec(state):
        return EmptyState() if momentum == 0 else SgdMomentumState("leaf", "shard")

    def prepare_(state, param, ctx: UpdateContext):
        """Everything but the kernels (`Optimizer.prepare_`): the checks, the momentum counts (a
        host read of the "leaf" field), the pieces, the views of param and buffer, the new count;
        `launch(grad)` views the grad and runs the kernel ("fused": `launch(grad, found_inf)` too,
        `Launch.skips`)."""
        check_shards("sgd", None, param, state, spec(state), ctx)
        check_in_place("sgd", (param, *state))  # the grad: `Launch.__call__`
        hyper = dict(lr=group_lr(schedule, ctx), weight_decay=weight_decay if ctx.group.weight_decay else 0.0,
                     momentum=momentum, dampening=dampening, nesterov=nesterov, maximize=maximize)
        damped = {"1 - dampening": 1 - dampening} if momentum else {}  # torch reads dampening only with momentum
        check_fits("sgd", ctx, param.dtype, {"lr * lr_scale": hyper["lr"], "weight_decay": hyper["weight_decay"],
                                             "momentum": momentum, **damped})
        held = (param,) if momentum == 0 else (param, state.momentum_buffer)
        how, per_leaf = resolve_impl("sgd", impl, param, lambda: _fused_elementwise(hyper, param))
        if how == "fused":
            _check_fused_updates(param)
        counts = state.count.tolist() if momentum != 0 else [0.0] * len(ctx.leaves)
        pieces = used_pieces(ctx, [c == 0 for c in counts], per_segment=per_leaf)
        spans = [(a, b) for a, b, _ in pieces]
        lists = [[t[a:b] for a, b in spans] for t in held] + ([[]] if momentum == 0 else [])
        first = [k for _, _, k in pieces]
        # torch's foreach branch, decided on the bucket's used leaves, not this shard's (`_foreach`)
        branch = {"every_buffer": all(c != 0 for c, u in zip(counts, ctx.used) if u)} if how == "foreach" else {}
        new = state if momentum == 0 else SgdMomentumState(
            torch.tensor(bumped(counts, ctx.used), dtype=state.count.dtype, device=state.count.device),
            state.momentum_buffer)

        def check(grad):
            check_grad("sgd", grad, param)
            if per_leaf:
                check_placement("sgd", ctx, (param, grad, *held[1:]))

        def run(grad, found_inf):
            skip = {} if found_inf is None else {"found_inf": found_inf}
            in_blocks(KERNELS[how], how, [lists[0], [grad[a:b] for a, b in spans], *lists[1:]], first, **hyper,
                      **branch, **skip)
            return new

        def math(grad, state, param):
            """`_math` on each piece of the given (tracked) inputs (`Launch.math`)."""
            bufs = [None] * len(spans) if momentum == 0 else [state.momentum_buffer[a:b] for a, b in spans]
            out = [_math(param[a:b], grad[a:b], buf, f, **hyper) for (a, b), buf, f in zip(spans, bufs, first)]
            p = spliced(param, spans, [o[0] for o in out])
            if momentum == 0:
                return p, state
            return p, SgdMomentumState(None, spliced(state.momentum_buffer, spans, [o[1] for o in out]))

        return Launch(run, check, skips=how == "fused", math=math)

    return in_place(init, two_phase("sgd", prepare_), spec, prepare_=prepare_, lr=schedule)


# The three kernels take per-piece lists (params, grads, momentum buffers ([] without momentum))
# of views of the shard, and per piece whether it is the leaf's first momentum update (torch:
# `momentum_buffer is None`), and update the views in place. Each is the body of the torch 2.13
# function it names (grad_scale None, found_inf None but where the fused kernel is given one,
# dense grads, lr a Python float).


def _single(params, grads, bufs, first, *, lr, weight_decay, momentum, dampening, nesterov, maximize) -> None:
    """torch/optim/sgd.py `_single_tensor_sgd`, its temporaries (`-grad`, `grad + wd p`,
    `grad + mu b`) written into one shard-sized buffer (on the CPU one block's, `base.in_blocks`; the
    same kernels, `out=` it)."""
    need = params and (maximize or weight_decay != 0 or nesterov)
    work = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device) if need else None
    at = 0
    for i, param in enumerate(params):
        w = work[at : at + param.numel()] if need else None
        at += param.numel()
        grad = grads[i] if not maximize else torch.neg(grads[i], out=w)
        if weight_decay != 0:
            grad = ops.add(grad, param, weight_decay, out=w)
        if momentum != 0:
            buf = bufs[i]
            if first[i]:
                buf.copy_(grad)  # torch: buf = grad.detach().clone()
            else:
                ops.add_(buf.mul_(momentum), grad, 1 - dampening)
            grad = ops.add(grad, buf, momentum, out=w) if nesterov else buf
        ops.add_(param, grad, -lr)


def _foreach(params, grads, bufs, first, *, lr, weight_decay, momentum, dampening, nesterov, maximize,
             every_buffer=False) -> None:
    """torch/optim/sgd.py `_multi_tensor_sgd`. torch's branch on "every buffer exists" (in its
    group of one dtype) is `every_buffer`, whether every used leaf of the bucket has one -- the
    same on every rank and stage, and torch's where the param group is one bucket (one unit) --
    never this shard's pieces: the branches scale the buffers by `momentum` differently for
    bfloat16 / float16 (`_foreach_mul_` by `momentum` rounded to the dtype, `buf.mul_` by it in
    float32; alike for float32 / float64), so a shard's own choice made the stages differ (found
    with the half-precision stage test). Where torch adds into `p.grad` itself (Nesterov, no maximize, no weight decay)
    fzero adds out of place: the grad shard is never written."""
    if not params:
        return
    given = grads
    if maximize:
        grads = torch._foreach_neg(grads)
    if weight_decay != 0:
        if maximize:
            ops.foreach_add_(grads, params, weight_decay)
        else:
            grads = ops.foreach_add(grads, params, weight_decay)
    if momentum != 0:
        if every_buffer:  # no piece is a first update
            torch._foreach_mul_(bufs, momentum)
            ops.foreach_add_(bufs, grads, 1 - dampening)
        else:
            for buf, g, f in zip(bufs, grads, first):
                if f:
                    buf.copy_(g)  # torch: device_grads[i].detach().clone()
                else:
                    ops.add_(buf.mul_(momentum), g, 1 - dampening)
        if not nesterov:
            grads = bufs
        elif grads is given:
            grads = ops.foreach_add(grads, bufs, momentum)
        else:
            ops.foreach_add_(grads, bufs, momentum)
    ops.foreach_add_(params, grads, -lr)


def _fused(params, grads, bufs, first, *, lr, weight_decay, momentum, dampening, nesterov, maximize,
           found_inf=None) -> None:
    """torch/optim/sgd.py `_fused_sgd`: `torch._fused_sgd_` with `is_first_step` (torch: every
    buffer of the group is None; the kernel then sets `b = g`). torch raises on a group that
    mixes leaves with and without a buffer; fzero then makes one call per kind, which gives
    each leaf what torch gives it in a group of its own. `found_inf` (`Launch.skips`): where it is
    1 each call returns before writing. The tensors each call writes have their version counters
    moved first (`base.written_by_kernel`: torch's kernel moves none)."""
    if momentum == 0:
        if params:
            written_by_kernel(params)  # the kernel moves no version counter
            torch._fused_sgd_(params, grads, [], weight_decay=weight_decay, momentum=momentum, lr=lr,
                              dampening=dampening, nesterov=nesterov, maximize=maximize, is_first_step=False,
                              grad_scale=None, found_inf=found_inf)
        return
    for kind in (True, False):
        sel = [i for i, f in enumerate(first) if f == kind]
        if sel:
            written_by_kernel([params[i] for i in sel], [bufs[i] for i in sel])
            torch._fused_sgd_([params[i] for i in sel], [grads[i] for i in sel], [bufs[i] for i in sel],
                              weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=dampening,
                              nesterov=nesterov, maximize=maximize, is_first_step=kind, grad_scale=None,
                              found_inf=found_inf)


KERNELS = {"single": _single, "foreach": _foreach, "fused": _fused}


def _math(param, grad, buf, first, *, lr, weight_decay, momentum, dampening, nesterov, maximize):
    """One piece's update out of place, `(new param, new buffer or None)`: `_single`'s ops (torch's
    single-tensor SGD), each a new tensor, so that autograd and torch.func differentiate them
    (`Launch.math`). The first momentum update's buffer is the gradient itself, not a detached
    copy as in torch's `differentiable=True` SGD: the derivative of what the step computes."""
    grad = torch.neg(grad) if maximize else grad
    if weight_decay != 0:
        grad = torch.add(grad, param, alpha=weight_decay)
    if momentum != 0:
        buf = grad if first else torch.add(buf * momentum, grad, alpha=1 - dampening)
        grad = torch.add(grad, buf, alpha=momentum) if nesterov else buf
    return torch.add(param, grad, alpha=-lr), buf


def _check_fused_updates(param: torch.Tensor) -> None:
    """`OptimizerError` where torch's fused SGD kernel on this device and dtype does not update
    every element (`fused.updates_every_element`: torch 2.11's and 2.13's CPU kernel in bfloat16 /
    float16, found in review; torch.optim.SGD(fused=True) trains nothing there either)."""

    def launch(p, g):
        _fused([p], [g], [], [False], lr=0.5, weight_decay=0.0, momentum=0.0, dampening=0.0, nesterov=False,
               maximize=False)

    if not fused.updates_every_element(("sgd",), launch, param.dtype, param.device):
        raise OptimizerError(
            f"sgd: impl='fused' on {param.dtype} shards on {param.device.type}: torch {torch.__version__}'s fused SGD "
            f"kernel there leaves elements unchanged (an lr 0.5 step of ones by ones left some at 1.0; "
            f"torch.optim.SGD(fused=True) trains nothing there either); use impl='foreach' or 'single' (the "
            f"default picks 'foreach' off CUDA)")


def _fused_elementwise(hyper: dict, param: torch.Tensor) -> bool:
    """`fused.elementwise` for this configuration, first and later momentum steps alike (the lr
    of the first call probes it)."""
    with_buffer = hyper["momentum"] != 0

    def launch(first):
        return lambda ts: _fused([ts[0]], [ts[1]], [ts[2]] if with_buffer else [], [first], **hyper)

    key = ("sgd", *sorted((k, v) for k, v in hyper.items() if k != "lr"))
    return all(fused.elementwise((*key, first), launch(first), 3 if with_buffer else 2, (), param.dtype, param.device)
               for first in ((True, False) if with_buffer else (False,)))
