"""fzero.testing as a team adopting fzero uses it: an equivalence suite for their own model.

The model is a small language model of the team's own (a tied embedding and head, LayerNorms, a
frozen positional table and an int64 buffer of position ids), tested with the public API only:
the hypothesis strategies, `examples`, a `Pool` of torchrun workers and `assert_trees_equal`.
The last part holds the tests of what this review found in `fzero.testing` (each failed before
its fix).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import fzero
from fzero import optim
from fzero.testing import (LazyPool, PoolError, RemoteError, assert_trees_equal, ddp_trajectory, examples, fzero_trajectory,
                           integer_valued, seed_per_case, trajectory_differences, world_sizes)

# ---------------------------------------------------------------------------------------------
# The team's model and its two trainings (module level: the pool's workers import them by name)

VOCAB, WIDTH, LENGTH = 16, 8, 4


class TinyLM(nn.Module):
    """tokens[B, LENGTH] -> logits[B, LENGTH, VOCAB]: head tied to the embedding, a frozen
    positional table, an int64 buffer of position ids read by the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(LENGTH, WIDTH) * 0.1, requires_grad=False)
        self.register_buffer("positions", torch.arange(LENGTH))
        self.ln = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens) + self.pos[self.positions]
        h = h + self.mlp(self.ln(h))
        return self.head(self.ln_f(h))


def build() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batches_for(n: int, steps: int, seed: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """`batches[rank][step] = (tokens, targets)`, drawn in the test process."""
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randint(0, VOCAB, (2, LENGTH), generator=g), torch.randint(0, VOCAB, (2, LENGTH), generator=g))
             for _ in range(steps)] for _ in range(n)]


def team_loss(model, batch) -> torch.Tensor:
    """The loss as `fzero.testing.ddp`'s trajectories take it: `model` is DDP's module or fzero's
    apply bound to the step's params."""
    tokens, targets = batch
    return lm_loss(model(tokens), targets)


def fzero_run(mesh, stage: int, batches: list, *, micro_batches: int = 1, clip_norm: float | None = None,
              precision: fzero.Precision = fzero.Precision()) -> list[dict[str, torch.Tensor]]:
    """fzero at `stage`: the gathered params after every step on this rank."""
    params, apply, info = fzero.from_module(build(), units=fzero.units_by_prefix(build(), ""))
    state = fzero.init(params, optim.adamw(1e-2, weight_decay=0.1), stage=stage, mesh=mesh, units=info.units,
                       groups=info.groups, precision=precision)
    step = fzero.train_step(lambda p, b: lm_loss(apply(p, b[0]), b[1]), micro_batches=micro_batches,
                            clip_norm=clip_norm)
    out = []
    for batch in batches:
        state, _ = step(state, batch)
        out.append(dict(fzero.gather(state)))
    return out


def ddp_and_every_stage(mesh, batches: list) -> tuple[list, dict[int, list]]:
    """On one worker: DDP + torch.optim.AdamW(foreach=False)'s trajectory and fzero's at each
    stage, on the same process group (`fzero.testing.ddp`)."""
    adamw = (lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1,
                                         foreach=False))
    ref = ddp_trajectory(mesh, build, adamw, team_loss, batches)
    return ref, {stage: fzero_trajectory(mesh, build, optim.adamw(1e-2, weight_decay=0.1), team_loss, batches,
                                         stage=stage, units="") for stage in (0, 1, 2, 3)}


def raise_on_rank_1(mesh):
    """Rank 1 raises outside `mesh.run`; rank 0 waits for it in a collective (until the group's
    120 s timeout)."""
    if mesh.rank == 1:
        raise ValueError("my model broke on rank 1 only")
    return fzero.collectives.all_reduce(torch.ones(2), mesh)


def rank_of(mesh):
    return mesh.rank


@dataclasses.dataclass
class Moments:
    """A leaf of the team's optimizer state, not registered as a pytree node."""

    m: torch.Tensor


@pytest.fixture(scope="module")
def pool2():
    """The team's fixture: a pool restarted after a failed call closed it. A call may take 60 s;
    the other ranks of a call get 2 s once one rank raised."""
    with LazyPool(2, timeout=60, error_grace=2) as pool:
        yield pool


# ---------------------------------------------------------------------------------------------
# The team's equivalence tests


@pytest.mark.dist
def test_my_model_equals_ddp_bit_for_bit_at_every_stage_n2(pool2):
    batches = batches_for(2, steps=2, seed=3)
    results = pool2.run(ddp_and_every_stage, [(batches[r],) for r in range(2)])
    for rank, (ddp, stages) in enumerate(results):
        trained = ["emb.weight", "ln.weight", "ln.bias", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias",
                   "ln_f.weight", "ln_f.bias"]
        assert len(ddp) == 2 and set(ddp[0]) == {*trained, "pos", "buffer:positions", *(  # pos is frozen: no state
            f"opt:{p}.{f}" for p in trained for f in ("step", "exp_avg", "exp_avg_sq"))}
        for stage, got in stages.items():
            assert trajectory_differences(ddp, got) == [], stage  # every leaf, the frozen one too
            for t in range(2):
                assert_trees_equal(got[t], ddp[t], bitwise=True)
    assert_trees_equal(results[0], results[1], bitwise=True)  # the ranks agree


@examples(3)
@given(world_sizes(3), st.sampled_from([1, 2]), st.sampled_from([None, 0.05]),
       st.sampled_from([None, torch.bfloat16]), st.integers(0, 2**16))
def test_my_model_every_stage_equals_stage_0_on_a_simmesh(n, k, clip, compute, seed):
    """Stages 1-3 give stage 0's bits with the team's options: micro-batches, clipping, a bf16
    compute policy; any world size."""
    mesh = fzero.SimMesh(n)
    precision = fzero.Precision() if compute is None else fzero.Precision(compute, torch.float32)
    flat = batches_for(n, steps=2 * k, seed=seed)
    per_rank = [[r[i:i + k] if k > 1 else r[i] for i in range(0, 2 * k, k)] for r in flat]
    runs = {stage: mesh.run(lambda b, stage=stage: fzero_run(mesh, stage, b, micro_batches=k, clip_norm=clip,
                                                             precision=precision),
                            [(b,) for b in per_rank])
            for stage in (0, 1, 2, 3)}
    for stage in (1, 2, 3):
        assert_trees_equal(runs[stage], runs[0], bitwise=True)


@examples(5)
@given(integer_valued(dtypes=(torch.float32, torch.bfloat16)))
def test_integer_valued_sums_do_not_depend_on_the_order(x):
    """The docs' promise for `integer_valued`: sums of up to 16 are exact in every dtype."""
    terms = [x] * 16
    forward, backward = torch.zeros_like(x), torch.zeros_like(x)
    for t in terms:
        forward = forward + t
    for t in reversed(terms):
        backward = backward + t
    assert_trees_equal(forward, backward, bitwise=True)
    assert_trees_equal(forward, (x.double() * 16).to(x.dtype), bitwise=True)


# ---------------------------------------------------------------------------------------------
# What the review found (each failed before its fix)


@pytest.mark.dist
def test_a_rank_that_raises_while_its_peer_waits_is_reported_within_error_grace(pool2):
    """Before, the call waited out the pool's timeout (here 60 s; 120 s by default) and raised a
    PoolError naming only rank 0, which did not answer: rank 1's ValueError, the cause, was lost.
    Now the PoolError comes `error_grace` seconds after rank 1's reply and leads with it; the
    LazyPool starts a new pool for the next call."""
    assert pool2.run(rank_of) == [0, 1]
    t0 = time.monotonic()
    with pytest.raises(PoolError) as info:
        pool2.run(raise_on_rank_1)
    elapsed = time.monotonic() - t0
    assert elapsed < 2 + 2 * 2.0 + 10, elapsed  # error_grace, then SIGTERM / SIGKILL of the workers
    assert [(e.rank, e.type_name) for e in info.value.errors] == [(1, "builtins.ValueError")]
    message = str(info.value)
    assert message.startswith("tests.test_testing_user:raise_on_rank_1: rank(s) [1] raised and rank(s) [0] did "
                              "not answer within 2 s of rank 1's error (error_grace); waiting, most likely, in a "
                              "collective"), message
    assert "my model broke on rank 1 only" in message and "the pool is closed" in message
    assert pool2.run(rank_of) == [0, 1]  # a new pool


def raise_on_rank_0_while_rank_1_works(mesh, seconds: float):
    """Rank 0 raises at once an error the test expects; rank 1 works `seconds` (no collective)."""
    if mesh.rank == 0:
        raise ValueError("expected on rank 0")
    time.sleep(seconds)
    return "done"


@pytest.mark.dist
def test_by_default_a_slow_peer_of_a_rank_that_raised_is_waited_for():
    """`error_grace` is off by default: with `return_exceptions=True` the caller gets rank 0's
    error and rank 1's result, though rank 1 answers 3 s after rank 0 raised, and the pool stays
    up (with `error_grace=1` it is killed and the call raises `PoolError`; found in review)."""
    with LazyPool(2, timeout=60) as pool:
        got = pool.run(raise_on_rank_0_while_rank_1_works, [(3.0,)] * 2, return_exceptions=True)
        assert isinstance(got[0], RemoteError) and isinstance(got[0].exception, ValueError) and got[1] == "done"
        assert pool.pool.alive
    with LazyPool(2, timeout=60, error_grace=1) as pool, pytest.raises(PoolError, match="within 1 s of rank 0's"):
        pool.run(raise_on_rank_0_while_rank_1_works, [(3.0,)] * 2, return_exceptions=True)


def test_error_grace_must_be_positive_seconds():
    for bad in (0, -1.0, True, "2"):
        with pytest.raises(ValueError, match=r"Pool: error_grace must be a number of seconds > 0"):
            LazyPool(2, error_grace=bad).run(rank_of)


def test_register_profiles_makes_a_suite_deterministic_without_fzeros_conftest(tmp_path):
    """A fresh interpreter, as a suite of the team's own outside fzero's tests/ (so without its
    conftest.py): after `register_profiles()` a property under `examples(8)` draws the same
    examples each time it runs, and a slow example is not failed by a deadline. Before, the
    profiles lived in fzero's tests/conftest.py only: `examples(n)` ran under hypothesis's
    default profile (random seeds, a 200 ms deadline) although `example_count` took
    HYPOTHESIS_PROFILE as "ci"."""
    code = "\n".join([
        "import time",
        "from hypothesis import given, strategies as st",
        "import fzero.testing",
        "assert fzero.testing.register_profiles() == 'ci'",
        "def draw():",
        "    out = []",
        "    @fzero.testing.examples(8)",
        "    @given(st.integers(0, 10**9))",
        "    def prop(x):",
        "        out.append(x)",
        "        if len(out) == 1:",
        "            time.sleep(0.25)  # a slow step: past hypothesis's default 200 ms deadline",
        "    prop()",
        "    return out",
        "first, second = draw(), draw()",
        "assert len(first) == 8 and first == second, (first, second)",
        "print('deterministic')",
    ])
    env = {k: v for k, v in os.environ.items() if k != "HYPOTHESIS_PROFILE"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "deterministic", out.stdout + out.stderr


def test_seed_per_case_reads_the_propertys_own_settings():
    """A property derandomized by its own `@settings` under a random profile: before,
    `seed_per_case` read only the loaded profile's `derandomize` and left the property alone, so
    each case drew the same examples."""
    from hypothesis import settings

    settings.register_profile("test-random", derandomize=False, database=None, deadline=None)
    settings.load_profile("test-random")
    try:
        drawn: dict[int, list[int]] = {}
        for case in (1, 2):
            seen = drawn.setdefault(case, [])

            @seed_per_case(case)
            @settings(derandomize=True, max_examples=5)
            @given(st.integers(0, 10**9))
            def prop(x):
                seen.append(x)

            prop()
    finally:
        settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
    assert drawn[1] != drawn[2], drawn


def test_assert_trees_equal_compares_numpy_leaves():
    """numpy leaves went through `==`: arrays of two or more elements raised numpy's ValueError,
    equal or not, and one-element arrays of another dtype or shape passed."""
    a = {"rng": np.arange(3, dtype=np.int64), "scale": np.ones(1, dtype=np.float32)}
    assert_trees_equal(a, {"rng": np.arange(3, dtype=np.int64), "scale": np.ones(1, dtype=np.float32)})
    with pytest.raises(AssertionError, match=r"leaf 'rng' \(numpy int64\[3\]\): 1 of 3 elements differ; first at "
                                             r"index \[2\]"):
        assert_trees_equal(a, {"rng": np.array([0, 1, 5]), "scale": np.ones(1, dtype=np.float32)})
    with pytest.raises(AssertionError, match=r"leaf 'scale': numpy float32\[1\] != float64\[1, 1\]"):
        assert_trees_equal(a, {"rng": np.arange(3), "scale": np.ones((1, 1))})
    with pytest.raises(AssertionError, match=r"leaf 'z' \(numpy float64\[2\]\): 1 of 2"):
        assert_trees_equal({"z": np.zeros(2)}, {"z": np.array([0.0, -0.0])}, bitwise=True)
    assert_trees_equal({"z": np.zeros(2)}, {"z": np.array([0.0, -0.0])})  # by value
    with pytest.raises(AssertionError, match=r"leaf 'n' \(numpy float64\[\]\): 1 of 1 elements differ"):
        assert_trees_equal({"n": np.array(np.nan)}, {"n": np.array(np.nan)})  # NaN differs, as in torch.equal


class Held:
    """A leaf of the team's state that is neither a registered node nor a dataclass."""

    def __init__(self, m: torch.Tensor) -> None:
        self.m = m

    def __eq__(self, other: object) -> object:
        return self.m == other.m if isinstance(other, Held) else NotImplemented


def test_assert_trees_equal_on_a_leaf_that_cannot_be_compared_names_its_path():
    """An unregistered object holding tensors: torch's "Boolean value of Tensor ... is
    ambiguous" RuntimeError, not an AssertionError naming the leaf."""
    a, b = {"opt": {"moments": Held(torch.zeros(3))}}, {"opt": {"moments": Held(torch.zeros(3))}}
    with pytest.raises(AssertionError, match=r"at 'opt\.moments': Held leaves cannot be compared with != "
                                             r"\(RuntimeError: .*register the type as a pytree node"):
        assert_trees_equal(a, b)


def test_assert_trees_equal_compares_an_unregistered_dataclass_field_by_field():
    """A dataclass leaf went through `!=`: one-element tensors of another dtype or shape, or 0.0
    against -0.0 under bitwise, passed (found in review of fzero.testing). Its fields are now
    compared as a node's children, by name."""
    with pytest.raises(AssertionError, match=r"^leaf 'opt\.moments\.m': torch\.float32\[\] on cpu != "
                                             r"torch\.float64\[\] on cpu$"):
        assert_trees_equal({"opt": {"moments": Moments(torch.tensor(1.0))}},
                           {"opt": {"moments": Moments(torch.tensor(1.0, dtype=torch.float64))}})
    with pytest.raises(AssertionError, match=r"leaf 'm' \(torch\.float32\[1\]\): 1 of 1 elements differ; .*bits "
                                             r"00000000 != 80000000"):
        assert_trees_equal(Moments(torch.zeros(1)), Moments(-torch.zeros(1)), bitwise=True)
    assert_trees_equal(Moments(torch.ones(3)), Moments(torch.ones(3)))

    @dataclasses.dataclass
    class Counted:  # a field the dataclass does not compare
        m: torch.Tensor
        calls: int = dataclasses.field(default=0, compare=False)

    @dataclasses.dataclass(eq=False)
    class Named:  # its own __eq__ says what equal means
        name: str
        blob: object

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Named) and self.name == other.name

    @dataclasses.dataclass
    class Node:  # holds itself: compared with !=, which cannot end
        m: int
        parent: object = None

    assert_trees_equal(Counted(torch.ones(2), 3), Counted(torch.ones(2), 5))
    assert_trees_equal({"c": Named("a", object()), "w": torch.ones(1)}, {"c": Named("a", object()), "w": torch.ones(1)})
    a, b = Node(1), Node(1)
    a.parent, b.parent = a, b
    with pytest.raises(AssertionError, match=r"at 'parent': Node leaves cannot be compared with != \(RecursionError"):
        assert_trees_equal(a, b)
    with pytest.raises(AssertionError, match=r"\(bits [0-9a-f]+ != [0-9a-f]+\)$"):  # (its bytes: a KeyError before)
        assert_trees_equal(np.array([1.0], dtype=np.longdouble), np.array([2.0], dtype=np.longdouble), bitwise=True)


def test_assert_trees_equal_never_passes_having_compared_nothing():
    """Two trees of no leaf (what `mesh.run` returns for a rank function given no batches), and
    one object given twice, passed (found in review of fzero.testing; `trajectory_differences`
    reported "nothing compared"); `allow_empty=True` accepts empty trees where they are meant."""
    with pytest.raises(AssertionError, match=r"^nothing compared: both trees hold no leaf \(\[\[\], \[\]\]\)"):
        assert_trees_equal([[], []], [[], []])
    assert_trees_equal([[], []], [[], []], allow_empty=True)
    run = {"w": torch.ones(2)}
    with pytest.raises(AssertionError, match=r"^the same dict object was given as both trees: nothing compared"):
        assert_trees_equal(run, run)


def test_assert_trees_equal_names_the_largest_difference_and_ieee_bits():
    """A one-ulp difference first hid a large one after it (found in review of fzero.testing):
    the message names the largest finite |difference| and where; a Python float's bits read as
    IEEE 754 writes them (they were its little-endian bytes), and numpy's are shown too."""
    a = torch.linspace(-1, 1, 12).reshape(3, 4)
    b = a.clone()
    b[0, 0] = torch.nextafter(b[0, 0], torch.tensor(0.0))
    b[2, 3] += 100
    with pytest.raises(AssertionError, match=r"2 of 12 elements differ; first at index \[0, 0\]: -1\.0 != "
                                             r"-0\.9999999403953552; largest \|difference\| 100 at index \[2, 3\]$"):
        assert_trees_equal(a, b)
    with pytest.raises(AssertionError, match=r"\(bitwise: 3fb999999999999a != 3fb999999999999b\)$"):
        assert_trees_equal(0.1, 0.10000000000000002, bitwise=True)
    with pytest.raises(AssertionError, match=r"\(bits 7fc00000 != 00000000\)$"):
        assert_trees_equal(np.array([np.float32("nan")]), np.array([np.float32(0)]), bitwise=True)


def test_assert_trees_equal_says_which_keys_differ():
    """A key missing on one side was reported as both whole key lists; the order, likewise."""
    ddp = {f"layers.{i}.weight": torch.zeros(1) for i in range(40)}
    mine = {k: v for k, v in ddp.items() if k != "layers.7.weight"} | {"layers.7.w": torch.zeros(1)}
    with pytest.raises(AssertionError, match=r"^at '<root>': dict keys differ: only in the first: "
                                             r"\['layers\.7\.weight'\]; only in the second: \['layers\.7\.w'\]$"):
        assert_trees_equal(ddp, mine)
    swapped = dict(reversed(ddp.items()))
    with pytest.raises(AssertionError, match=r"the same 40 keys in another order; first at position 0: "
                                             r"'layers\.0\.weight' != 'layers\.39\.weight'$"):
        assert_trees_equal(ddp, swapped)


def test_assert_trees_equal_bitwise_shows_the_bits_that_differ():
    """Two NaNs of different payloads (or 0.0 and -0.0) print alike: the message said `nan != nan`.
    A Parameter against a plain tensor now says how to compare them."""
    a = torch.tensor([1.0, float("nan")])
    b = a.view(torch.int32).add(torch.tensor([0, 1], dtype=torch.int32)).view(torch.float32)  # another payload
    with pytest.raises(AssertionError, match=r"first at index \[1\]: nan != nan \(bits 7fc00000 != 7fc00001\)"):
        assert_trees_equal(a, b, bitwise=True)
    with pytest.raises(AssertionError, match=r"Parameter != Tensor \(both tensors: compare `\.detach\(\)`"):
        assert_trees_equal({"w": nn.Parameter(torch.ones(1))}, {"w": torch.ones(1)})


def test_trajectory_differences_names_a_per_rank_list_or_a_lone_snapshot():
    """What `mesh.run` / `pool.run` return (one trajectory per rank), or one snapshot alone, gave
    torch's "Boolean value of Tensor ... is ambiguous" or "string indices must be integers"
    (found in review of fzero.testing)."""
    from fzero.testing import trajectory_differences

    run = [{"w": torch.ones(2)}, {"w": torch.zeros(2)}]
    with pytest.raises(ValueError, match=r"ref\[0\] is a list, not a \{name: tensor\} snapshot \(one trajectory per "
                                         r"rank, as mesh\.run and pool\.run return\? compare each rank's"):
        trajectory_differences([run, run], [run, run])
    with pytest.raises(ValueError, match=r"got is one snapshot \(dict\); give a list of them, one per step"):
        trajectory_differences(run, run[0])
    assert trajectory_differences(run, run) == []


def test_integer_valued_keeps_within_max_abs_and_refuses_what_it_cannot_draw():
    """bfloat16 rounded 1023 up to 1024, past `max_abs`; a negative `max_abs` failed at draw time
    with torch's error; `float_tensors` drew int64 tensors (found in review of fzero.testing)."""
    from hypothesis import given, settings

    from fzero.testing import float_tensors, integer_valued

    from hypothesis import strategies as st

    @settings(max_examples=5, derandomize=True, database=None, deadline=None)
    @given(integer_valued(dtypes=(torch.bfloat16,), max_abs=1023, shape=st.just((20000,))))
    def within(t):  # (20,000 draws: some of 1022 and 1023, which bfloat16 rounds to 1024)
        assert float(t.abs().max()) <= 1023

    within()
    with pytest.raises(ValueError, match=r"integer_valued: max_abs must be an int >= 0 and below 2\*\*62, got -1"):
        integer_valued(max_abs=-1)
    with pytest.raises(ValueError, match=r"float_tensors: dtypes must be floating \(or complex\) torch dtypes"):
        float_tensors(dtypes=(torch.int64,))
