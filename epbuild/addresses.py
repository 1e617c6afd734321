"""A Dask scheduler address (``tcp://HOST:PORT``): checked before anything starts (the
CLI's ``--scheduler``, the manifest's ``[workspace] scheduler``), and probed with one plain
connection before Dask's client is made (``executors.address``). Standard library only."""

from __future__ import annotations

import re

from epbuild.errors import UserError

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
