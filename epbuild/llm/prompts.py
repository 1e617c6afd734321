"""Text prompts an LLM's quantization calibrates with: ``.txt`` files, one prompt a line,
read and checked alike by the manifest (each file named by its key, before anything runs)
and by the calibration's worker. Standard library only."""

from __future__ import annotations

import os
import stat

PROMPT_SUFFIX = ".txt"
"""A prompts file: UTF-8 text, one prompt a line (blank lines skipped)."""
MAX_PROMPT_BYTES = 1 << 20
"""A prompts file larger than this is refused (prompts are sentences, not corpora)."""


class PromptError(Exception):
    """A prompts file that cannot calibrate: ``message`` says which file and why."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def read_prompts(path: str, shown: str) -> list[str]:
    """The prompts of one text file (``shown``: how messages name it): one a line, blank
    lines skipped. A missing, unreadable, non-UTF-8, oversized or blank file is a
    ``PromptError``."""
    try:  # a FIFO or a device would never end: only a regular file is opened
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
            raise PromptError(f"{shown} is not a regular file (a FIFO, a device or a socket)")
        with open(path, "rb") as f:
            data = f.read(MAX_PROMPT_BYTES + 1)
    except FileNotFoundError:
        raise PromptError(f"{shown} does not exist") from None
    except IsADirectoryError:
        raise PromptError(f"{shown} is a folder, not a text file of prompts") from None
    except OSError as exc:
        raise PromptError(f"{shown} cannot be read ({exc.strerror})") from exc
    if len(data) > MAX_PROMPT_BYTES:
        raise PromptError(f"{shown} is larger than {MAX_PROMPT_BYTES >> 20} MiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PromptError(
            f"{shown} is not UTF-8 text (byte {exc.start}: {data[exc.start : exc.start + 1]!r})"
        ) from None
    prompts = [line.strip() for line in text.lstrip("\ufeff").splitlines()]
    prompts = [p for p in prompts if p]
    if not prompts:
        raise PromptError(f"{shown} holds no prompt (one a line)")
    return prompts
