"""Adam and AdamW (with amsgrad), bit for bit torch.optim.Adam / AdamW with `foreach=False`,
`foreach=True` or `fused=True` (`impl`); Adam's L2 weight decay on bfloat16 / float16 params on the
CPU ("single", "foreach"): torch's bits but in the scalar tails of torch's own calls, and the same
bits wherever a shard cuts (`ops`)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import fused, ops
from .base import (
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


class AdamState(NamedTuple):
    """`step[L]` ("leaf", float32 like torch's `state["step"]`), `exp_avg[S]`, `exp_avg_sq[S]` ("shard")."""

    step: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


class AmsgradState(NamedTuple):
    """`AdamState`'s `step`, `exp_avg` and `exp_avg_sq`, plus `max_exp_avg_sq[S]` ("shard")."""

    step: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    max_exp_avg_sq: torch.Tensor


def _adam(name, lr, betas, eps, weight_decay, amsgrad, maximize, decoupled, impl) -> Optimizer:
    schedule = as_schedule(lr)
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise OptimizerError(f"{name}: betas must be a pair of floats, got {betas!r}")
    beta1 = check_hyper("betas[0]", betas[0], 0.0, 1.0, hi_open=True)
    beta2 = check_hyper("betas[1]", betas[1], 0.0, 1.0, hi_open=True)
    eps = check_hyper("eps", eps)
    weight_decay = check_hyper("weight_decay", weight_decay)
    impl = check_impl(name, impl)
    amsgrad, maximize = check_flag("amsgrad", amsgrad), check_flag("maximize", maximize)
    State = AmsgradState if amsgrad else AdamState

    def init(param: torch.Tensor, num_leaves: int):
        zeros = [torch.zeros_like(param) for _ in State._fields[1:]]
        return State(torch.zeros(num_leaves, dtype=torch.float32), *zeros)

    def spec(state):
        return State("leaf", *["shard"] * (len(State._fields) - 1))

    def prepare_(state, param, ctx: UpdateContext):
        """Everything but the kernels (`Optimizer.prepare_`): the checks, the step counts (a host
        read of the "leaf" field), the pieces, the views of param and state, the new step field
        (and the fused kernel's step tensors); `launch(grad)` views the grad and runs the kernel
        ("fused": `launch(grad, found_inf)` too, `Launch.skips`)."""
        check_shards(name, None, param, state, spec(state), ctx)
        check_in_place(name, (param, *state))  # the grad: `Launch.__call__`
        hyper = dict(beta1=beta1, beta2=beta2, lr=group_lr(schedule, ctx), eps=eps, maximize=maximize,
                     weight_decay=weight_decay if ctx.group.weight_decay else 0.0, decoupled=decoupled)
        how, per_leaf = resolve_impl(name, impl, param, lambda: _fused_elementwise(hyper, amsgrad, param))
        steps = bumped(state.step.tolist(), ctx.used, state.step.dtype)
        check_fits(name, ctx, param.dtype, _scalars(hyper, steps, ctx.used))
        pieces = used_pieces(ctx, steps, per_segment=per_leaf)
        spans = [(a, b) for a, b, _ in pieces]
        lists = [[t[a:b] for a, b in spans] for t in (param, *state[1:])] + ([] if amsgrad else [[]])
        counts = [k for _, _, k in pieces]  # per piece its step count, after the increment
        keys = fused_counts(counts, param.device) if how == "fused" else counts
        new = State(torch.tensor(steps, dtype=state.step.dtype, device=state.step.device), *state[1:])

        def check(grad):
            check_grad(name, grad, param)
            if per_leaf:
                check_placement(name, ctx, (param, grad, *state[1:]))

        def run(grad, found_inf):
            skip = {} if found_inf is None else {"found_inf": found_inf}
            in_blocks(KERNELS[how], how, [lists[0], [grad[a:b] for a, b in spans], *lists[1:]], keys, **hyper, **skip)
            return new

        def math(grad, state, param):
            """`_math` on each piece of the given (tracked) inputs (`Launch.math`)."""
            fields = [[t[a:b] for a, b in spans] for t in state[1:]] + ([] if amsgrad else [[None] * len(spans)])
            out = [_math(param[a:b], grad[a:b], *f, t, **hyper) for (a, b), *f, t in zip(spans, *fields, counts)]
            parts = list(zip(*out)) if out else [[]] * 4
            return spliced(param, spans, parts[0]), State(None, *[spliced(t, spans, part)
                                                                  for t, part in zip(state[1:], parts[1:])])

        return Launch(run, check, skips=how == "fused", math=math)

    return in_place(init, two_phase(name, prepare_), spec, prepare_=prepare_, lr=schedule)


def _scalars(hyper: dict, steps: list[float], used) -> dict[str, float]:
    """What the kernels take beyond the betas (in [0, 1]) for `base.check_fits`: the lr, eps, the
    weight decay (AdamW: the factor `1 - lr * weight_decay`), and the largest step size
    `lr / (1 - beta1**t)`, at the smallest step count t of a used leaf."""
    lr, wd = hyper["lr"], hyper["weight_decay"]
    out = {"lr * lr_scale": lr, "eps": hyper["eps"]}
    if wd != 0:
        out.update({"1 - lr * lr_scale * weight_decay": 1 - lr * wd} if hyper["decoupled"] else {"weight_decay": wd})
    counts = [s for s, u in zip(steps, used) if u]
    if counts:
        t = min(counts)
        out[f"the step size lr * lr_scale / (1 - beta1**t) at step count t = {t:g}"] = lr / (1 - hyper["beta1"] ** t)
    return out


# The three kernels take per-piece lists (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs
# ([] without amsgrad)) of views of the shard, the pieces' step counts (Python floats, after the
# increment) and torch's scalars, and update the views in place. Each is the body of the torch
# 2.13 function it names (not capturable, not differentiable, real tensors, grad_scale None,
# found_inf None but where the fused kernel is given one), applied to the pieces as torch
# applies it to its parameters.


def _single(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *, beta1, beta2, lr, weight_decay, eps,
            maximize, decoupled) -> None:
    """torch/optim/adam.py `_single_tensor_adam`, with its temporaries (`-grad`, `grad + wd p`,
    `denom`) written into one shard-sized buffer (on the CPU one block's, `base.in_blocks`): the
    same kernels, `out=` another tensor."""
    work = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device) if params else None
    at = 0
    for i, param in enumerate(params):
        w = work[at : at + param.numel()]
        at += param.numel()
        grad = grads[i] if not maximize else torch.neg(grads[i], out=w)
        if weight_decay != 0:
            if decoupled:
                param.mul_(1 - lr * weight_decay)
            else:
                grad = ops.add(grad, param, weight_decay, out=w)
        exp_avgs[i].lerp_(grad, 1 - beta1)
        exp_avg_sqs[i].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step = steps[i]
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5
        if max_exp_avg_sqs:
            torch.maximum(max_exp_avg_sqs[i], exp_avg_sqs[i], out=max_exp_avg_sqs[i])
            denom = torch.sqrt(max_exp_avg_sqs[i], out=w)  # grad is dead: w is free
        else:
            denom = torch.sqrt(exp_avg_sqs[i], out=w)
        denom.div_(bias_correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avgs[i], denom, value=-step_size)


def _math(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, *, beta1, beta2, lr, weight_decay, eps, maximize,
          decoupled):
    """One piece's update out of place, `(param, exp_avg, exp_avg_sq, max_exp_avg_sq or None)`:
    `_single`'s ops (torch's single-tensor Adam), each a new tensor, so that autograd and
    torch.func differentiate them (`Launch.math`)."""
    grad = torch.neg(grad) if maximize else grad
    if weight_decay != 0:
        if decoupled:
            param = param * (1 - lr * weight_decay)
        else:
            grad = torch.add(grad, param, alpha=weight_decay)
    exp_avg = torch.lerp(exp_avg, grad, 1 - beta1)
    exp_avg_sq = torch.addcmul(exp_avg_sq * beta2, grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    if max_exp_avg_sq is not None:
        max_exp_avg_sq = torch.maximum(max_exp_avg_sq, exp_avg_sq)
    denom = torch.sqrt(exp_avg_sq if max_exp_avg_sq is None else max_exp_avg_sq) / bias_correction2_sqrt + eps
    return torch.addcdiv(param, exp_avg, denom, value=-step_size), exp_avg, exp_avg_sq, max_exp_avg_sq


def _foreach(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *, beta1, beta2, lr, weight_decay, eps,
             maximize, decoupled) -> None:
    """torch/optim/adam.py `_multi_tensor_adam`: each op once over all pieces, per-piece scalars.
    Its temporaries (`-grads` or `grads + wd p`, then `sqrt(v)`) are never alive together."""
    if not params:
        return
    if maximize:
        grads = torch._foreach_neg(grads)
    if weight_decay != 0:
        if decoupled:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        elif maximize:
            ops.foreach_add_(grads, params, weight_decay)
        else:
            grads = ops.foreach_add(grads, params, weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    del grads
    bias_correction1 = [1 - beta1**step for step in steps]
    bias_correction2 = [1 - beta2**step for step in steps]
    step_size = [(lr / bc) * -1 for bc in bias_correction1]
    bias_correction2_sqrt = [bc**0.5 for bc in bias_correction2]
    if max_exp_avg_sqs:
        torch._foreach_maximum_(max_exp_avg_sqs, exp_avg_sqs)
        denom = torch._foreach_sqrt(max_exp_avg_sqs)
    else:
        denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)


def _fused(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *, beta1, beta2, lr, weight_decay, eps,
           maximize, decoupled, found_inf=None) -> None:
    """torch/optim/adam.py `_fused_adam`: one `torch._fused_adam_` / `_fused_adamw_` call; each
    piece's step count is a float32 0-d tensor on the shard's device (`fused_counts`: torch's
    `state["step"]` under `fused=True`, incremented before the call), lr a Python float.
    `found_inf` (`Launch.skips`): where it is 1 the kernel returns before writing. The tensors it
    writes have their version counters moved first (`base.written_by_kernel`: torch's kernel moves
    none; a skipped call's move is harmless)."""
    if not params:
        return
    fn = torch._fused_adamw_ if decoupled else torch._fused_adam_
    written_by_kernel(params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs)  # the kernel moves no version counter
    fn(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
       amsgrad=bool(max_exp_avg_sqs), lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
       maximize=maximize, grad_scale=None, found_inf=found_inf)


def fused_counts(steps: list[float], device: torch.device) -> list[torch.Tensor]:
    """Per piece, its step count (after the increment) as the float32 0-d tensor on `device` the
    fused kernel reads: one tensor per distinct count, shared by the pieces that have it."""
    counts = {s: torch.full((), s, dtype=torch.float32, device=device) for s in set(steps)}
    return [counts[s] for s in steps]


KERNELS = {"single": _single, "foreach": _foreach, "fused": _fused}


def _fused_elementwise(hyper: dict, amsgrad: bool, param: torch.Tensor) -> bool:
    """`fused.elementwise` for this configuration (the lr of the first call probes it)."""

    def launch(ts):
        _fused([ts[0]], [ts[1]], [ts[2]], [ts[3]], [ts[4]] if amsgrad else [], fused_counts([3.0], ts[0].device),
               **hyper)

    key = ("adam", amsgrad, *sorted((k, v) for k, v in hyper.items() if k != "lr"))
    return fused.elementwise(key, launch, 5 if amsgrad else 4, (3, 4) if amsgrad else (3,), param.dtype, param.device)


@refuses_torch_only_keywords
def adam(
    lr: LearningRate = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    impl: Impl | None = None,
) -> Optimizer:
    r"""Adam with L2 weight decay, bit for bit `torch.optim.Adam`.

    Per element of a used leaf, with $t$ the leaf's own step count (after increment),
    $\eta$ = `lr(step) * group.lr_scale` (`lr`: a float, a callable `step -> float` or a sequence
    of per-step floats, `as_schedule`), $\lambda$ = `weight_decay` (0 where masked),
    $(\beta_1, \beta_2)$ = `betas`, $\epsilon$ = `eps`, and $-g$ where `maximize`:

    $$g \leftarrow \pm g + \lambda p,\quad m \leftarrow \mathrm{lerp}(m, g, 1-\beta_1),\quad
      v \leftarrow \beta_2 v + (1-\beta_2) g^2,\quad \hat v = \max(\hat v, v)\ \text{(amsgrad) else } v,$$
    $$p \leftarrow p - \frac{\eta}{1-\beta_1^t}\cdot
      \frac{m}{\sqrt{\hat v}/\sqrt{1-\beta_2^t} + \epsilon}$$

    with the bias corrections in Python float math, as torch. State: `AdamState`, or
    `AmsgradState` if `amsgrad`.

    `impl` picks torch's implementation, and so the bits: "single" = `Adam(foreach=False)`,
    "foreach" = `Adam(foreach=True)`, "fused" = `Adam(fused=True)`, each bit for bit, per
    element, for any N and shard cut, except "fused" where torch's kernel rounds by placement
    (CPU always; on CUDA as `fused.elementwise` finds): there every updated leaf must lie whole
    and aligned in the shard. None: "fused" on CUDA where element-wise, else "foreach"
    (`base.resolve_impl`). `update_` writes
    `param`, `exp_avg`, `exp_avg_sq` (and `max_exp_avg_sq`) in place and returns a new `step`;
    it allocates one shard-sized buffer ("single", "foreach"; on the CPU one block's: `base.in_blocks`)
    or none ("fused").
    """
    return _adam("adam", lr, betas, eps, weight_decay, amsgrad, maximize, False, impl)


@refuses_torch_only_keywords
def adamw(
    lr: LearningRate = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    impl: Impl | None = None,
) -> Optimizer:
    r"""AdamW (decoupled weight decay), bit for bit `torch.optim.AdamW` (`impl` as in `adam`).

    `lr`, `betas`, `eps`, `amsgrad`, `maximize` as in `adam`; `weight_decay` is $\lambda$ below
    (default 0.01, torch.optim.AdamW's).

    As `adam` with $\lambda = 0$ in the gradient, and first $p \leftarrow p\,(1 - \eta\lambda)$
    (the factor a Python float).
    """
    return _adam("adamw", lr, betas, eps, weight_decay, amsgrad, maximize, True, impl)
