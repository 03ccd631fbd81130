"""The parameters of a module given to `fzero.from_module` ("originals"), and the check that a
loss does not train through them.

`from_module` reads a module's parameters and never writes them: the step trains fzero's own
copy, which `apply` reads from the params the step hands the loss. A loss that also reads a
parameter of the original module in grad mode (`model[0].weight.pow(2).sum()` as a penalty, a
head tied by hand to `model.wte.weight`) read the value `from_module` copied, never trained, and
its gradient went nowhere: `torch.autograd.grad` takes only the step's inputs, so the term was
silently dropped from training (found in review). `refuse_original_reads` finds such a read in
the loss's graph: an `AccumulateGrad` node whose variable is an original. It walks the graph of
each micro-batch's loss in the first step a `train_step` runs on a thread (`Once`), before that
loss's backward, so that every rank raises there (they run the same loss) and nothing is
updated.

The registry is process-wide: a module given to any `from_module` call is covered, also where
this step's loss runs it as a fixed function (a discriminator or teacher that another state
trains, its values loaded back into it): there the way out is `requires_grad_(False)` on its
parameters, which keeps the gradient flowing through it to the params (found in review).

Reads that are not seen: one with no graph (under `torch.no_grad()`, a frozen original, or
`from_module`'s own returned params, which are detached: reading them for the step's `p` trains
nothing through them), which trains nothing and is what a constant read is; a read in
`fzero.evaluate`'s function, which takes no gradient; a read that first happens after the first
step on the thread (a penalty switched on after a warm-up); and one inside a reentrant
`torch.utils.checkpoint` (`use_reentrant=True`), whose graph is built in the backward. The
module's docs say the original keeps the values it had.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .errors import ConfigError
from .layout import unwrapped

_ORIGINALS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # original parameter -> (its name, the module's type)


def note_originals(module: torch.nn.Module, canonical: dict[int, str]) -> None:
    """Remember `module`'s trainable parameters (held weakly) under their first names, as
    `from_module` names them in params (`canonical`: id -> name)."""
    for p in module.parameters():
        if p.requires_grad:
            _ORIGINALS[p] = (canonical[id(p)], type(module).__name__)


def note_flags(module: torch.nn.Module, canonical: dict[int, str]) -> tuple[tuple[weakref.ref, str, bool], ...]:
    """Each distinct parameter of `module` (held weakly), its name in params (`canonical`) and
    its `requires_grad` as `from_module` reads it: what `refuse_changed_flags` compares."""
    return tuple((weakref.ref(p), canonical[id(p)], p.requires_grad) for p in module.parameters())


def refuse_changed_flags(noted: tuple[tuple[weakref.ref, str, bool], ...], module: str) -> None:
    """Raise `ConfigError` where a parameter's `requires_grad` differs from the one `from_module`
    read (`note_flags`; a parameter freed since is passed over): `from_module` chose the frozen
    leaves then (`info.groups`, fixed at `fzero.init`), so a layer frozen or thawed on the module
    afterwards, as torch users do between steps, went on training as before, silently (found in
    review of a LoRA user: a module frozen after `from_module` trained every leaf). Host reads
    only; `apply` calls it in grad mode, so `fzero.evaluate` and `torch.no_grad()` reads pass."""
    changed = []
    for ref, name, flag in noted:
        p = ref()
        if p is not None and p.requires_grad is not flag:
            changed.append((name, flag))
    if not changed:
        return
    more = f" and {len(changed) - 6} more" if len(changed) > 6 else ""
    shown = ", ".join(f"{name!r} ({'trainable' if flag else 'frozen'} then, {'frozen' if flag else 'trainable'} now)"
                      for name, flag in changed[:6]) + more
    raise ConfigError(
        f"apply: the requires_grad of parameter {shown} of the {module} given to fzero.from_module changed since "
        f"from_module read it. from_module chose the frozen leaves when it ran (info.groups, fixed at fzero.init), "
        f"so the state would go on training the leaves it trained before, not the ones the module now marks, "
        f"silently. To train another set: params from the state (model.load_state_dict(info.state_dict("
        f"fzero.gather(state)))), set requires_grad on the module, then fzero.from_module(model) again and "
        f"fzero.init with its params and info.groups (the optimizer state restarts at zero and step 0 for every "
        f"leaf). Where this module is a fixed function in another loss (requires_grad_(False) there), set the flags "
        f"back before this state's step, as a torch GAN loop does")


class Once(threading.local):
    """Per thread: whether this `train_step` ran a step, its losses checked (`refuse_original_reads`)."""

    done = False


def refuse_original_reads(loss: torch.Tensor, once: Once) -> None:
    """Raise `ConfigError` where `loss`'s graph reaches a parameter of a module given to
    `from_module` as a leaf: every micro-batch's loss of the first step this `train_step` runs on
    this thread (`once`, set by the step after its micro-batches' backward, so that a step called
    again after a refusal is refused again: found in review, a caught refusal then trained
    without the term)."""
    if once.done:
        return
    read = _originals_in(unwrapped(loss).grad_fn) if len(_ORIGINALS) and isinstance(loss, torch.Tensor) else []
    if read:
        more = f" and {len(read) - 8} more" if len(read) > 8 else ""
        names = ", ".join(f"{name!r} ({module})" for name, module in read[:8]) + more
        raise ConfigError(
            f"the loss read parameter {names} of a module given to fzero.from_module directly, in grad mode. "
            f"fzero trains its own copy of each (what apply reads from the params the step hands the loss); the "
            f"module's own parameter keeps the value from_module read, or the last one loaded into it, and gets no "
            f"gradient, so where it is meant to be trained its term of the loss would be dropped from training, "
            f"silently. Read it from the params the step hands the loss (p[{read[0][0]!r}]). Where the module is "
            f"a fixed function here (trained by another state, a teacher) and the gradient should flow through "
            f"it to the params, set requires_grad_(False) on its parameters for this loss (and back before the step of "
            f"the state that trains it: its apply refuses flags changed since from_module); to read a value as a "
            f"constant, "
            f".detach() it or read it under torch.no_grad(). Nothing was updated")


def _originals_in(fn: object) -> list[tuple[str, str]]:
    """`(name, module type)` of each original whose `AccumulateGrad` node the graph from `fn`
    reaches, in the order found."""
    found, seen, stack = [], set(), [fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)
        if isinstance(leaf, torch.Tensor) and leaf in _ORIGINALS:
            found.append(_ORIGINALS[leaf])
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return found
