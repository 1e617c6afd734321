"""Connecting to a Dask scheduler: the address checked and probed first
(``epbuild.addresses``: a refused or unroutable address fails in seconds, with its reason,
instead of after Dask's retries), and a client that never connected closed at once instead
of after its 40-second close."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from epbuild.addresses import probe
from epbuild.errors import UserError

if TYPE_CHECKING:
    from distributed import Client


def connect(value: str, timeout: float) -> Client:
    """A Dask client of the scheduler at ``value``, probed first; a ``UserError`` where it
    cannot be reached or what answers is not a Dask scheduler. A client that never connected
    is closed at once (Dask's own close of it waits twice the timeout)."""
    from distributed import Client

    class _Client(Client):
        def __del__(self) -> None:
            if self.status == "running":
                super().__del__()  # type: ignore[no-untyped-call]
            else:
                with contextlib.suppress(Exception):
                    self.close(timeout=1)  # type: ignore[no-untyped-call]

    probe(value, timeout)
    try:
        client: Client = _Client(value, timeout=timeout, set_as_default=False)  # type: ignore[no-untyped-call]
    except (
        Exception
    ) as exc:  # what the transport met: OSError, MemoryError from a non-Dask server...
        raise UserError(
            f"cannot connect to the Dask scheduler at {value}: "
            f"{exc if isinstance(exc, (OSError, TimeoutError)) else 'it does not answer as one'}",
            hint="check --scheduler / [workspace] scheduler: the address 'dask scheduler' "
            "prints (its dashboard's http:// address is not it)",
        ) from None
    return client
