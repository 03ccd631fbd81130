"""A user's exception whose `__str__` raises, raised in the loss (or in `evaluate`'s fn) at every
stage: the step raises that exception. fzero's error paths read torch's words (`str(e)`) to
explain them; before, the `str()`'s own error took the user's place and the user saw a
`ValueError` from their `__str__` (found in review). `errors.said` reads the words without
raising (docs/bad-input.md row 224)."""

from __future__ import annotations

import pytest
import torch

import fzero


class _Unprintable(RuntimeError):
    def __str__(self):
        raise ValueError("this error's str raises")


class _Raises(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(3, 2)
        self.b = torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.b(self.a(x)) * _raise()


def _raise():
    raise _Unprintable()


def _own_error(stage: int, call: str) -> list[str]:
    mesh = fzero.SimMesh(2)

    def rank():
        params, apply, info = fzero.from_module(_Raises(), units=lambda path: path.split(".")[0])
        state = fzero.init(params, fzero.optim.adam(0.5), stage=stage, mesh=mesh, units=info.units,
                           groups=info.groups)
        loss = (lambda p, x: apply(p, x).sum()) if call != "plain" else (lambda p, x: _raise())
        run = {"plain": lambda: fzero.train_step(loss),
               "module": lambda: fzero.train_step(loss),
               "donate": lambda: fzero.train_step(loss, donate=True),
               "autograd": lambda: fzero.train_step(loss, engine="autograd"),
               "evaluate": lambda: fzero.evaluate(loss),
               "evaluate-eager": lambda: fzero.evaluate(loss, gather="eager")}[call]()
        try:
            run(state, torch.ones(3))
        except _Unprintable:
            return "own"
        except BaseException as e:  # noqa: BLE001 - the test names whatever took its place
            return type(e).__name__
        return "returned"

    return mesh.run(rank)


@pytest.mark.parametrize("call", ["plain", "module", "donate", "autograd", "evaluate", "evaluate-eager"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_an_error_whose_str_raises_reaches_the_user_as_itself(stage, call):
    assert _own_error(stage, call) == ["own", "own"]


def test_a_copy_of_the_module_that_raises_one_is_fzeros_error_from_it():
    """`from_module` copies the module; an attribute whose `__deepcopy__` raises such an exception
    gives fzero's error, chained from the user's (before: the `__str__`'s ValueError; found in review
    of the first fix)."""
    class Odd:
        def __deepcopy__(self, memo):
            raise _Unprintable()

    module = torch.nn.Linear(2, 2)
    module.odd = Odd()
    with pytest.raises(fzero.FzeroError, match=r"copy.deepcopy\), which failed:  A module holding") as e:
        fzero.from_module(module)
    assert isinstance(e.value.__cause__, _Unprintable)
