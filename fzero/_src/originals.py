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

import functools
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .errors import ConfigError, LayoutError, outside_stacklevel
from .layout import _group_of, _unit_of, unwrapped
from .tree import flatten_with_paths

_ORIGINALS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # original parameter -> (its name, the module's type)


def note_originals(module: torch.nn.Module, canonical: dict[int, str], aliases: dict[str, list[str]]) -> None:
    """Remember `module`'s trainable parameters (held weakly) under their first names, as
    `from_module` names them in params (`canonical`: id -> name), a tied one's other names
    (`aliases`) beside it in messages."""
    for p in module.parameters():
        if p.requires_grad:
            name = canonical[id(p)]
            _ORIGINALS[p] = (name, type(module).__name__ + _also(_others(aliases, name)))


def _others(aliases: dict[str, list[str]], name: str) -> tuple[str, ...]:
    """The other names of the parameter first named `name` (a tied weight's), from `from_module`'s
    `aliases` (first name -> every name)."""
    return tuple(n for n in aliases.get(name, ()) if n != name)


def _also(others: tuple[str, ...]) -> str:
    """`, also 'b'` for a tied weight's other names (found in review: a message naming
    'emb.weight' where the user froze 'head.weight', the same parameter), else ''."""
    return f", also {', '.join(repr(n) for n in others)}" if others else ""


_BORN: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a params tensor from_module returned -> `_Born`
_LINKS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a state's layout -> its leaves' `_Link`s


class _Born(NamedTuple):
    """Where a params tensor `from_module` returned comes from: the module (held weakly), the
    parameter's name there, the submodule that held it then (weakly), its attribute name there,
    the parameter itself (weakly), its `requires_grad` then, and its other names then (a tied
    weight's)."""

    module: weakref.ref
    name: str
    owner: weakref.ref
    attr: str
    param: weakref.ref
    flag: bool
    ties: tuple[str, ...] = ()


class _Link(NamedTuple):
    """A leaf of a state made by `fzero.init` of a `_Born` tensor: its path, whether the state
    trains it, where it came from, and the module's parameter as `fzero.init` copied it (`_seen`;
    None where the module then held another than the tensor `init` copied)."""

    path: str
    trains: bool
    born: _Born
    copied: tuple | None


class ModuleWrittenAfterInit(UserWarning):
    """Warned by the first step of a state `fzero.init` made of `from_module`'s params, on each
    rank, where parameters of the module were written or replaced since `init` copied them, with
    values other than the state's (`model.load_state_dict(pretrained)` after `init`): the state
    trains `init`'s copies. Load weights into the module before `fzero.init`, or pass them to it
    (`fzero.init({name: sd[name] for name in params}, ...)`). docs/bad-input.md row 248."""


_PRINTS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a layout no step has run under yet -> {path: `_printed` of
# the leaf as init kept it}


def _seen(t: torch.Tensor) -> tuple:
    """What tells a write or a replacement of parameter `t` apart: its storage, view and version
    counter (which an in-place write, `load_state_dict`'s `copy_`, moves; an inference tensor has
    none, and torch raises where it is read)."""
    return t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, None if t.is_inference() else t._version


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _printed(t: torch.Tensor) -> torch.Tensor | None:
    """A print of `t`'s values, exact whatever their order or layout: the sums of its elements'
    bit patterns and of their squares, in int64 (wrapping), on its device (no host sync at
    `init`). What a rank holding none of a leaf compares a written parameter with: the state's own
    values of it are another rank's. Widened 4M elements at a time (at most 64 MiB beside a leaf
    as `init` keeps it). None for a meta tensor."""
    if t.is_meta:
        return None
    with torch.no_grad():
        total = torch.zeros(2, dtype=torch.int64, device=t.device)
        for chunk in t.detach().reshape(-1).view(_BITS[t.element_size()]).split(1 << 22):
            wide = chunk.to(torch.int64)
            total += torch.stack([wide.sum(), (wide * wide).sum()])
        return total


def note_synced(layout: Any, b: int, flat: torch.Tensor) -> None:
    """At `fzero.init`, bucket b's values as the state keeps them (`flat`, after `sync`'s
    broadcast of rank 0's: found in review, a print of this rank's own values before it made a
    write-back of the state's values warn where ranks start from different seeds): `_printed` of
    each of its leaves, where the layout has leaves `from_module` returned (`link_layout`)."""
    if layout in _LINKS:
        prints = _PRINTS.setdefault(layout, {})
        for spec in (layout.leaves[i] for i in layout.buckets[b].leaves):
            prints[spec.path] = _printed(flat[spec.offset:spec.offset + spec.numel])


class UnitsNotPassed(UserWarning):
    """Warned by `fzero.init` given no `units` for params that `fzero.from_module(..., units=...)`
    returned, where those units split them: the whole model is then one unit, so stage 3 gathers
    every parameter at once (no ZeRO-3 saving of memory) and stages 1-2 reduce it as one. Pass
    `units=info.units` (docs/bad-input.md row 263)."""


_UNITS_GIVEN: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a from_module param -> (the units it was given, its name)


def note_born(module: torch.nn.Module, params: dict[str, torch.Tensor], aliases: dict[str, list[str]],
              units: Any = None) -> None:
    """Remember where each tensor of `params` (`from_module`'s, by its names) comes from in
    `module`, and its other names there (`aliases`: first name -> every name), for the states
    `fzero.init` makes of them (`link_layout`); and the `units` `from_module` was given, for
    `warn_units_not_passed`."""
    root = weakref.ref(module)
    if units is not None:
        for name, t in params.items():
            _UNITS_GIVEN[t] = (units, name)
    for name, t in params.items():
        path, _, attr = name.rpartition(".")
        owner = _submodule(module, path)
        p = None if owner is None else owner._parameters.get(attr)
        if p is not None:  # (else not linked: a module that hides its own submodules; found in review)
            _BORN[t] = _Born(root, name, weakref.ref(owner), attr, weakref.ref(p), p.requires_grad,
                             _others(aliases, name))


def warn_units_not_passed(params: Any) -> None:
    """At `fzero.init` without `units`: `UnitsNotPassed` where leaves of `params` came from a
    `from_module` given units that put them in more than one unit (found in review: `init` made
    them one unit, silently, and stage 3 gathered the whole model at once)."""
    _, leaves, _ = flatten_with_paths(params)
    given = [_UNITS_GIVEN[leaf] for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf in _UNITS_GIVEN]
    if not given:
        return
    unit_of = _unit_of(given[0][0])
    names = {unit_of(name) for units, name in given if units is given[0][0]}
    if len(names) > 1:
        warnings.warn(UnitsNotPassed(
            f"fzero.init was given no units for params that fzero.from_module(..., units=...) split into {len(names)} "
            f"units ({sorted(names)[:4]}{' ...' if len(names) > 4 else ''}): they are one unit here, so stage 3 "
            f"gathers every parameter at once, and every stage reduces them as one unit's buckets (no reduction "
            f"overlaps the backward). Pass units=info.units (and groups=info.groups) to fzero.init"),
            stacklevel=outside_stacklevel())


def link_layout(layout: Any, params: Any, groups: Any = ()) -> None:
    """At `fzero.init`: the leaves of `params` that `from_module` returned, linked to their
    module's parameters under `layout` (the state's, kept by every step), with whether the state
    trains them (its groups); a tied leaf whose `groups` settings differ by name refused
    (`_refuse_groups_by_alias`). Host metadata only."""
    paths, leaves, _ = flatten_with_paths(params)
    by_path = dict(zip(paths, leaves))
    born = [(spec, _BORN[leaf]) for spec in layout.leaves
            if isinstance(leaf := by_path.get(spec.path), torch.Tensor) and leaf in _BORN]
    links = tuple(_Link(spec.path, not spec.group.frozen, b, _copied(b, by_path[spec.path])) for spec, b in born)
    tied = [(spec, b) for spec, b in born if b.ties]
    if tied and groups:
        _refuse_groups_by_alias(tied, by_path, groups)
    if links:
        _LINKS[layout] = links


def _written(link: _Link, holds: Callable[[str, torch.Tensor], bool | None], prints: dict) -> bool:
    """Whether the module's parameter of `link` was written or replaced since `init` copied it,
    with other values than the state's (`warn_written_module`; `prints`: `note_synced`'s)."""
    p = _now(link.born)
    if p is None or (link.copied is not None and _seen(p) == link.copied):
        return False
    held = holds(link.path, p)
    if held is not None:
        return not held
    then, now = prints.get(link.path), _printed(p)
    return then is None or now is None or now.tolist() != then.tolist()


def _copied(born: _Born, leaf: torch.Tensor) -> tuple | None:
    """`_seen` of the module's parameter of `born` as `fzero.init` copies `leaf`, None where the
    module holds another tensor there now (replaced between `from_module` and `init`)."""
    p = _now(born)
    return _seen(p) if p is not None and _same_storage(p, leaf) else None


def warn_written_module(state: Any, holds: Callable[[Any, dict, str, torch.Tensor], bool | None]) -> None:
    """At the first step under `state`'s layout: `ModuleWrittenAfterInit` (at the user's line) naming the
    module's parameters that are not as `fzero.init` copied them -- written in place since
    (`model.load_state_dict(pretrained)` after `init`) or replaced (`assign=True`, before or after
    `init`) -- and whose values the state does not hold (`holds(state, read, path, p)`: this rank's part of the
    leaf, compared only where a write or a replacement was seen; on a rank holding none of it,
    `_printed` of its values then and now: only the rank whose module was written sees a write,
    as DDP's habit of loading on rank 0 alone, and it may hold none of the leaf, found in review).
    The state trains `init`'s copies, so pretrained weights loaded there were not trained from, silently (found in review
    of a user migrating a torch script). The state's own values written back (`load_state_dict(
    info.state_dict(fzero.gather(state)))` to evaluate with torch before training, a GAN loop
    syncing its critic first) pass: found in review of the first version, which warned on any
    write. Not seen: a write through `.data` (`p.data.copy_(...)`), which moves no version counter
    of `p`. Later steps are not checked: the module keeps `from_module`'s values while the state
    trains, and writing trained values back into it between steps is how it is used. A warning,
    not an error: the state is as `init` made it, which may be what was meant."""
    layout = state.layout
    prints = _PRINTS.pop(layout, None)  # (made at init where the layout has links: none after the first step)
    if prints is None:
        return
    held_by = functools.partial(holds, state, {})  # (its dict: each bucket's values, read once for every leaf in it)
    written = [link for link in _LINKS.get(layout, ()) if _written(link, held_by, prints)]
    if written:
        names = ", ".join(repr(link.born.name) for link in written[:4]) + (
            f" and {len(written) - 4} more" if len(written) > 4 else "")
        warnings.warn(ModuleWrittenAfterInit(
            f"parameters {names} of the {_kind(written[0].born)} given to fzero.from_module were written or replaced "
            f"since fzero.init copied them (model.load_state_dict(...) after init?), with values other than the "
            f"state's: the state trains init's copies, so those values are not trained from. Load weights into the module before fzero.init (from_module's "
            f"params share its storage until init copies them), or init from them: fzero.init({{name: sd[name] for "
            f"name in params}}, ...)"), stacklevel=outside_stacklevel())


def tied_names(layout: Any) -> dict[str, str]:
    """`{other name: first name}` of the tied leaves of the state made under `layout` of
    `from_module`'s params (none for another params pytree): `checkpoint.load`'s words for a
    checkpoint of a model that did not tie them."""
    return {alias: link.born.name for link in _LINKS.get(layout, ()) for alias in link.born.ties}


def _settings(group: Any) -> tuple:
    return (True,) if group.frozen else (False, group.weight_decay, group.lr_scale)


def _refuse_groups_by_alias(tied: list, by_path: dict[str, Any], groups: Any) -> None:
    """`LayoutError` where `groups` give a tied leaf other settings under another of its names
    than under its first (`ParamGroup("frozen-head", match=lambda p: p.startswith("lm_head"),
    frozen=True)` over a head tied to the embedding): groups go by the first name, as the params
    name the leaf, so that group matched nothing and the head trained, where torch's group of
    `lm_head.weight` freezes it (found in review of a tied-weights user). Where the other name
    falls to a catch-all group (no `match`: the default, or an explicit one), the first name's
    group is taken, as torch's groups from
    `named_parameters()` (which lists a tied weight once, by its first name) do: a no-decay group
    naming the embedding was refused (found in review)."""
    group_of = _group_of(groups)  # (checked by `fzero.init`, which hands the tuple it checked)
    for spec, born in tied:
        for alias in born.ties:
            other = group_of(alias, by_path[spec.path])
            if other.match is not None and _settings(other) != _settings(spec.group):  # the other name falling
                # to a catch-all group (the default, or an explicit `ParamGroup("decay")` last) is torch's own
                # choice: its groups list a tied weight once, by its first name (found in review)
                raise LayoutError(
                    f"parameter {spec.path!r} is tied (also {alias!r}), one leaf under its first name, and the groups "
                    f"give it other settings by each name: ParamGroup {spec.group.name!r} by {spec.path!r} (which "
                    f"fzero uses), ParamGroup {other.name!r} by {alias!r} (frozen={other.frozen}, weight_decay="
                    f"{other.weight_decay}, lr_scale={other.lr_scale}). Make the groups agree: a match that takes "
                    f"both names, or neither (a catch-all group with match=None, ParamGroup('decay') last, leaves "
                    f"the first name's group in place; match=lambda p: True is a match like any other)")


def refuse_changed_module(layout: Any) -> None:
    """Raise `ConfigError` where the module the state of `layout` was made from changed since
    `from_module` read it in a way the state would not follow, silently: a flag (`_changed_flag`)
    or a tie (`_refuse_changed_tie`). Each linked parameter is read where the module holds it now
    (`_now`: a parameter replaced in its module, `load_state_dict(..., assign=True)`, a submodule
    replaced; found in review: held weakly, the old one was read where something else kept it
    alive, and a frozen layer trained); a module freed is passed over. The step's own check,
    eager: a few dict lookups and a flag read per linked leaf, and per tie."""
    links = _LINKS.get(layout)
    if not links:
        return
    walk, passed = _QUICK.get(layout) or (None, None)
    if passed is not None and _unchanged(walk, passed):
        return
    changed, seen = [], {}
    for link in links:
        p = _now(link.born)
        if p is None:
            continue
        if _changed_flag(link, p):
            changed.append(link)
        if p.numel():  # (a tie of no elements trains nothing and overwrites nothing: found in review)
            _refuse_changed_tie(link, p, seen)
    if changed:
        raise ConfigError(_changed_words(changed))
    walk = walk or _walk(links)
    _QUICK[layout] = walk, _passed(walk)


class _Walk(NamedTuple):
    """What `refuse_changed_module`'s quick pass reads, made once from a layout's links that share
    one root module: the submodule paths to resolve (each after its parent: path, parent's path,
    attribute), each link's (submodule path, attribute), the links whose flag `_changed_flag`
    watches (those the state trains as their flag was then: index, that flag), and each other
    name of a tied leaf (index, submodule path, attribute)."""

    root: weakref.ref | None  # None where the links' roots differ: no quick pass
    modules: tuple[tuple[str, str, str], ...] = ()
    leaves: tuple[tuple[str, str], ...] = ()
    flags: tuple[tuple[int, bool], ...] = ()
    ties: tuple[tuple[int, str, str], ...] = ()


_QUICK: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a state's layout -> (`_Walk`, the parameters the last
# full check passed with, held weakly; None where one was not found by its path)
_NO_CHILDREN: dict = {}


def _walk(links: tuple[_Link, ...]) -> _Walk:
    roots = {id(link.born.module()) for link in links}
    if len(roots) != 1 or links[0].born.module() is None:
        return _Walk(None)
    split = lambda name: tuple(name.rpartition(".")[::2])  # noqa: E731  ('a.b.w' -> ('a.b', 'w'))
    leaves = tuple(split(link.born.name) for link in links)
    ties = tuple((i, *split(name)) for i, link in enumerate(links) for name in link.born.ties)
    paths = {path for path, _ in leaves} | {path for _, path, _ in ties}
    prefixes = {".".join(parts[:k]) for parts in (p.split(".") for p in paths if p) for k in range(1, len(parts) + 1)}
    modules = tuple((path, *split(path)) for path in sorted(prefixes, key=lambda p: p.count(".")))
    flags = tuple((i, link.trains) for i, link in enumerate(links) if link.born.flag is link.trains)
    return _Walk(links[0].born.module, modules, leaves, flags, ties)


def _by_path(walk: _Walk) -> tuple[list, dict] | None:
    """The parameter at each link's name, and each submodule on the way, as `_param_at` finds them
    from the root; None where the root is gone."""
    root = None if walk.root is None else walk.root()
    if root is None:
        return None
    at = {"": root}
    for path, parent, attr in walk.modules:
        m = at[parent]
        at[path] = None if m is None else getattr(m, "_modules", _NO_CHILDREN).get(attr)
    params = [None if (m := at[path]) is None else m._parameters.get(attr) for path, attr in walk.leaves]
    return params, at


def _passed(walk: _Walk) -> tuple[weakref.ref, ...] | None:
    """After a full check passed: the parameters it read, held weakly, where each was found by its
    path (`_now`'s first choice) and there are no two the same; else None (every step checks in full)."""
    found = _by_path(walk)
    if found is None or any(p is None for p in found[0]) or len(set(map(id, found[0]))) != len(found[0]):
        return None
    return tuple(weakref.ref(p) for p in found[0])


def _unchanged(walk: _Walk, passed: tuple[weakref.ref, ...]) -> bool:
    """Whether the full check would pass as it last did: each link's name still finds, by its path
    from the root, the very parameter the last full check read there, each flag it watches is
    the flag that passed, and each other name of a tied leaf finds that leaf's parameter itself.
    A few dict lookups per submodule and per leaf (the full check resolved each name from the root)."""
    found = _by_path(walk)
    if found is None:
        return False
    params, at = found
    return (all(p is ref() for p, ref in zip(params, passed))
            and all(params[i].requires_grad is flag for i, flag in walk.flags)
            and all((m := at[path]) is not None and m._parameters.get(attr) is params[i] for i, path, attr in walk.ties))


def _changed_flag(link: _Link, p: torch.Tensor) -> bool:
    """Whether the state trains a leaf whose module parameter `p` is now frozen, or keeps frozen
    one whose parameter is now trainable, and `p`'s `requires_grad` changed since `from_module`
    read it. `from_module` chose the frozen leaves then (`info.groups`, fixed at `fzero.init`), so
    a module frozen after `from_module` (a LoRA user's `model.requires_grad_(False)` with the
    adapters re-enabled) trained every leaf, and a layer thawed or frozen between steps went on
    as before, silently (found in review of a LoRA user). A flag the user never changed passes,
    whatever the state does with the leaf (a frozen `ParamGroup` over a trainable parameter); so
    does a module run as a fixed function elsewhere (row 208's `requires_grad_(False)`), if its
    flags are back by its own state's step, as in a torch GAN loop."""
    now = p.requires_grad
    return now is not link.born.flag and now is not link.trains


def _refuse_changed_tie(link: _Link, p: torch.Tensor, seen: dict[int, str]) -> None:
    """`ConfigError` where the module ties `p` (the leaf of `link`, as it holds it now) otherwise
    than when `from_module` read it: two leaves now one parameter (`seen`: id -> the first
    leaf's name; `model.head.weight = model.emb.weight` after `from_module`), or one leaf's names
    now different parameters (the tie broken, `model.head.weight = nn.Parameter(...)`). `apply`
    runs the module as `from_module` copied it, so the step trained the old ties, and
    `model.load_state_dict(info.state_dict(...))` wrote one trained leaf over the other, silently
    (found in review of a tied-weights user). A name whose parameter is another object over the
    same storage is still tied (`load_state_dict(..., assign=True)` makes one `Parameter` per name
    of the one tensor `info.state_dict` gives). Parameters only: a buffer tied or untied after
    `from_module` is not seen."""
    born = link.born
    other = seen.setdefault(id(p), born.name)
    if other != born.name:
        raise ConfigError(_tie_words(born, f"{other!r} and {born.name!r} were two parameters when from_module read "
                                           f"the module and are one now"))
    root = born.module()
    for name in born.ties:
        q = None if root is None else _param_at(root, name)
        if q is not None and q is not p and not _same_storage(p, q):
            raise ConfigError(_tie_words(born, f"{born.name!r} and {name!r} were one (tied) parameter when "
                                               f"from_module read the module and are two now"))


def _same_storage(p: torch.Tensor, q: torch.Tensor) -> bool:
    return (p.device == q.device and p.data_ptr() == q.data_ptr() and p.shape == q.shape
            and p.stride() == q.stride() and p.dtype == q.dtype)


def _kind(born: _Born) -> str:
    """The type name of the module `born` came from, for messages ("module" where it is freed)."""
    module = born.module()
    return type(module).__name__ if module is not None else "module"


def _tie_words(born: _Born, what: str) -> str:
    return (f"the parameters of the {_kind(born)} given to fzero.from_module are tied otherwise than when "
            f"from_module read it: {what}. apply runs the module as from_module copied it, so this step would "
            f"train the ties it read, not the module as it is now, and model.load_state_dict(info.state_dict(...)) "
            f"would write one trained value over another, silently. Nothing was updated. Tie (or untie) before "
            f"fzero.from_module, then fzero.init with its params; to keep what this state trained, first put its "
            f"values into the module as from_module read it (model.load_state_dict(info.state_dict(fzero.gather("
            f"state))) before changing the ties)")


def _now(born: _Born) -> torch.Tensor | None:
    """The parameter `born` names as the module holds it now: by its path from the root (a
    submodule replaced since, its old one kept alive elsewhere: found in review), else in the
    submodule that held it (a wrapper put in its place, holding it), else the parameter itself
    (moved within its submodule: `parametrize` makes it `parametrizations.<name>.original`, found
    in review); None where all are gone."""
    root = born.module()
    for p in (None if root is None else _param_at(root, born.name), born.owner()):
        if isinstance(p, torch.nn.Module):  # the submodule that held it
            p = p._parameters.get(born.attr)
        if p is not None:
            return p
    return born.param()


def _param_at(root: torch.nn.Module, name: str) -> torch.Tensor | None:
    """The parameter `root` holds at dotted `name` by its registered children, or None."""
    path, _, attr = name.rpartition(".")
    owner = _submodule(root, path)
    return None if owner is None else owner._parameters.get(attr)


def _submodule(module: torch.nn.Module, path: str) -> torch.nn.Module | None:
    """The submodule at dotted `path` by the registered children (`_modules`), or None."""
    for part in path.split(".") if path else ():
        module = getattr(module, "_modules", {}).get(part)
        if module is None:
            return None
    return module


def _changed_words(changed: list[_Link]) -> str:
    more = f" and {len(changed) - 6} more" if len(changed) > 6 else ""
    shown = ", ".join(f"{link.path!r} ({'trainable' if link.born.flag else 'frozen'} then, "
                      f"{'frozen' if link.born.flag else 'trainable'} now{_also(link.born.ties)})"
                      for link in changed[:6]) + more
    does = ('trains' if changed[0].trains else 'freezes') + ' it' if len(changed) == 1 else 'trains or freezes each'
    return (f"the requires_grad of parameter {shown} of the {_kind(changed[0].born)} given to fzero.from_module "
            f"changed since from_module read it, and this state, made of its params, {does}"
            f" as before: from_module chose the frozen leaves when it ran "
            f"(info.groups, fixed at fzero.init), so this step would train another set than the module now marks, "
            f"silently. Nothing was updated. To train the set the module marks: its trained values back into it "
            f"(model.load_state_dict(info.state_dict(fzero.gather(state)))), then fzero.from_module(model, units=...) "
            f"again and fzero.init with its params and info.groups (the optimizer state restarts at zero and step 0 "
            f"for every leaf). Where the module is run as a fixed function in another loss (requires_grad_(False) "
            f"there), set its flags back before this state's step, as a torch GAN loop does")


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
            f"a fixed function here, trained by another state (a GAN's discriminator, a teacher), run it through "
            f"its own apply with that state's params, its_apply(fzero.gather(its_state), x): the gradient flows "
            f"through it to these params (not fzero.evaluate, which runs under torch.no_grad(): its output is a "
            f"constant). The module itself still holds "
            f"the values from_module read, not what its state trained, until "
            f"model.load_state_dict(its_info.state_dict(fzero.gather(its_state))) puts them back (found in review: "
            f"a generator trained against the untrained discriminator); with those values in it, "
            f"requires_grad_(False) on its parameters for this loss works too (and back before its own state's step, "
            f"which refuses flags changed since from_module). To read a value as a constant, .detach() it or read "
            f"it under torch.no_grad(). Nothing was updated")


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
