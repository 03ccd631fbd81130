"""Fake collectives for the unit-level tests of the waits on the error paths (`Inflight`,
`Gathering`, `Mesh.abandon`): a pending whose `wait()` is logged and can raise once, a one-phase
flight over it, and a mesh that logs what it is handed (a frozen or dead peer would take the
group's timeout per wait)."""

from __future__ import annotations

import torch


class Stop(BaseException):
    """An interrupt (a `KeyboardInterrupt`-like exception that is not an `Exception`)."""


class FakePending:
    """A collective in flight: `wait()` is logged in `log` (by `name`) and raises `raises` once if
    given; `done` once a wait returned or failed, as `mesh.Pending` (not after an interrupt). Its
    result is `ord(name)`, one element."""

    def __init__(self, name: str, log: list[str], raises: BaseException | None = None) -> None:
        self.name, self.log, self.raises = name, log, raises
        self.result = torch.full((1,), float(ord(name)))
        self.done = False

    def wait(self) -> torch.Tensor:
        self.log.append(self.name)
        raises, self.raises = self.raises, None
        self.done = raises is None or isinstance(raises, RuntimeError)
        if raises is not None:
            raise raises
        return self.result

    def __repr__(self) -> str:
        return f"FakePending({self.name!r})"


class FakeFlight:
    """A one-phase `stages.Flight` over a `FakePending`."""

    then = ()

    def __init__(self, pending: FakePending) -> None:
        self.pending = pending

    def wait(self) -> torch.Tensor:
        return self.pending.wait()

    def __repr__(self) -> str:
        return f"FakeFlight({self.pending.name!r})"


class FakeMesh:
    """What `Inflight.settle` and `Gathering.finish` ask of a mesh: `waits_after(error)` is `waits`,
    and `abandon` logs the names of the pendings it is handed (flattened; a flight by its
    `pending`)."""

    def __init__(self, waits: bool = False) -> None:
        self.waits, self.abandoned = waits, []

    def waits_after(self, error: BaseException) -> bool:
        return self.waits

    def abandon(self, held) -> None:
        if isinstance(held, (list, tuple)):
            for h in held:
                self.abandon(h)
        else:
            self.abandoned.append(getattr(held, "pending", held).name)


def flights(names: str, log: list[str], failing: str = "", raises: BaseException | None = None) -> list[FakeFlight]:
    """One `FakeFlight` per character of `names`; those in `failing` raise `raises` once when waited."""
    return [FakeFlight(FakePending(n, log, raises if n in failing else None)) for n in names]
