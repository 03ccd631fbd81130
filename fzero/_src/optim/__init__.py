"""Pure optimizers over flat shards; see `base` for the interface."""

from .adafactor import AdafactorState as AdafactorState, adafactor as adafactor
from .adam import AdamState as AdamState, AmsgradState as AmsgradState, adam as adam, adamw as adamw
from .base import (
    IMPLS as IMPLS,
    FACTORED as FACTORED,
    SPECS as SPECS,
    EmptyState as EmptyState,
    Impl as Impl,
    Launch as Launch,
    Optimizer as Optimizer,
    OptimizerError as OptimizerError,
    UpdateContext as UpdateContext,
    as_schedule as as_schedule,
    check_grad as check_grad,
    check_hyper as check_hyper,
    check_impl as check_impl,
    check_placement as check_placement,
    check_shards as check_shards,
    field_numel as field_numel,
    field_shapes as field_shapes,
    group_lr as group_lr,
    in_place as in_place,
    join_blocks as join_blocks,
    leaf_blocks as leaf_blocks,
    init_state as init_state,
    pure as pure,
    resolve_impl as resolve_impl,
    runs as runs,
    two_phase as two_phase,
    used_pieces as used_pieces,
)
from .exact import leaf_sums_of_squares as leaf_sums_of_squares
from .lamb import LambState as LambState, lamb as lamb
from .schedule import (
    constant as constant,
    cosine as cosine,
    linear_warmup as linear_warmup,
    sequence as sequence,
    step_decay as step_decay,
)
from .sgd import SgdMomentumState as SgdMomentumState, sgd as sgd
