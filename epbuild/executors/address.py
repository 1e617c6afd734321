"""A Dask scheduler address (``tcp://HOST:PORT``): checked before anything starts, and
probed with one plain connection before Dask's client is made (a refused or unroutable
address fails in seconds, with its reason, instead of after Dask's retries and its
client's 40-second close). Imports only the standard library (the CLI checks on its fast
path)."""

from __future__ import annotations

import contextlib
import re
from typing import TYPE_CHECKING

from epbuild.errors import UserError

if TYPE_CHECKING:
    from distributed import Client

SCHEMES = ("tcp", "tls", "ws", "wss")
"""The transports accepted (Dask's own, less ``inproc`` and ``ucx``)."""
_ADDRESS = re.compile(
    r"(?:(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://)?(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>[0-9]{1,5})/?"
)
_HINT = "write tcp://HOST:PORT (the address 'dask scheduler' prints), e.g. tcp://10.0.0.5:8786"


def parse_address(value: str, *, what: str = "--scheduler") -> tuple[str, str, int]:
    """``(scheme, host, port)`` of a scheduler address; a ``UserError`` naming ``what``
    for anything else."""
    match = _ADDRESS.fullmatch(value.strip())
    if match is None:
        raise UserError(f"{what} {value!r} is not a scheduler address", hint=_HINT)
    scheme = (match["scheme"] or "tcp").lower()
    if scheme not in SCHEMES:
        raise UserError(
            f"{what} {value!r}: {scheme}:// is not a Dask transport",
            hint=f"use one of {', '.join(s + '://' for s in SCHEMES)}; {_HINT}",
        )
    port = int(match["port"])
    if not 0 < port < 65536:
        raise UserError(f"{what} {value!r}: port {port} is out of range", hint=_HINT)
    return scheme, match["host"].strip("[]"), port


def probe(value: str, timeout: float) -> None:
    """Open and close one connection to the scheduler's port; a ``UserError`` saying why
    that failed."""
    import socket

    _, host, port = parse_address(value)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else exc.strerror or str(exc)
        raise UserError(
            f"cannot reach the Dask scheduler at {value}: {reason}",
            hint="check --scheduler / [workspace] scheduler and that the scheduler is running "
            "(dask scheduler; dask worker ADDRESS --nthreads 1)",
        ) from None


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
