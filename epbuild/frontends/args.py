"""Checks of command-line values that the API cannot make (it never sees the raw text).

They run before any work, the no-op fast path included, so a bad argument is exit 2 whether
or not anything is stale. Imported on the fast path: heavier modules load only when needed.
"""

from __future__ import annotations

import argparse
import re

from epbuild.errors import UserError


def check_jobs(jobs: int | None) -> int | None:
    """``-j``: at least 1 when given."""
    if jobs is not None and jobs < 1:
        raise UserError("-j must be at least 1")
    return jobs


def seconds(value: float | None, option: str) -> float | None:
    """A duration in seconds (``--lock-timeout``): a finite number, not negative."""
    import math

    if value is not None and (not math.isfinite(value) or value < 0):
        raise UserError(f"{option} {value:g} is not a number of seconds", hint="write e.g. 30")
    return value


NO_LIMIT = ("0", "none")
"""``--timeout`` spellings of no limit."""


def timeout(value: str | None, option: str, default: float) -> float | None:
    """A time limit in seconds (``verify --timeout``): ``default`` when not given, None
    (no limit) for ``0`` or ``none``, else a positive, finite number."""
    import math

    if value is None:
        return default
    text = value.strip().lower()
    if text in NO_LIMIT:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if math.isfinite(seconds) and seconds == 0:
        return None
    if not math.isfinite(seconds) or seconds < 0:
        raise UserError(
            f"{option} {value!r} is not a number of seconds",
            hint=f"write e.g. {option} 1200, or {option} 0 for no limit",
        )
    return seconds


def output_file(value: str, option: str) -> str:
    """A file a command writes (``--html``): a name, not a directory."""
    import os

    if not value or value.endswith(("/", os.sep)) or os.path.isdir(value):
        raise UserError(f"{option} {value!r} is not a file name", hint="write e.g. report.html")
    return value


def size_option(value: str, option: str, example: str) -> int:
    """A size such as ``8G`` given to ``option``; ``example`` goes into the hint."""
    from epbuild.errors import ManifestError
    from epbuild.manifest.load import parse_memory

    try:
        return parse_memory(value, key=option)
    except ManifestError:
        raise UserError(f"{option} {value!r} is not a size", hint=f"write e.g. {example}") from None


def memory_budget(value: str | None) -> int | None:
    """``--memory-budget``: a positive size when given."""
    if value is None:
        return None
    budget = size_option(value, "--memory-budget", "8G or 512M")
    if budget <= 0:
        raise UserError("--memory-budget must be positive", hint="write e.g. 8G or 512M")
    return budget


def cache_option(args: argparse.Namespace) -> str | bool | None:
    """``--cache``/``--no-cache`` as the API's ``cache``: a location, False (off) or None."""
    if args.no_cache and args.cache:
        raise UserError("--cache and --no-cache contradict each other")
    if args.no_cache and getattr(args, "cache_push", False):
        raise UserError("--cache-push needs a cache", hint="drop --no-cache")
    return False if args.no_cache else args.cache


def scheduler(value: str | None) -> str | None:
    """``--scheduler``: a Dask scheduler address when given."""
    if value is not None:
        from epbuild.addresses import parse_address

        parse_address(value)
    return value


def option_value(text: str) -> bool | int | str:
    """An ``--option`` value: ``true``/``false`` and integers (``75``, ``-1``) as TOML would
    read them, a double-quoted value as the string inside, anything else as a string."""
    if text in ("true", "false"):
        return text == "true"
    if re.fullmatch(r"[+-]?(0|[1-9][0-9]*)", text):
        return int(text)
    if len(text) >= 2 and text[0] == text[-1] == '"':
        return text[1:-1]
    return text


def provider_options(values: list[str] | None) -> dict[str, bool | int | str]:
    """``--option KEY=VALUE`` (repeatable) as a mapping; each key once."""
    options: dict[str, bool | int | str] = {}
    for item in values or ():
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UserError(
                f"--option {item!r} is not KEY=VALUE", hint="write e.g. --option htp_arch=75"
            )
        if key in options:
            raise UserError(f"--option {key} is given twice")
        options[key] = option_value(value.strip())
    return options
