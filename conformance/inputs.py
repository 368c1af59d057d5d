"""Files the user names: read and checked up front, so a bad one is one line, not a traceback.

Every error is an ``InputError`` that names the option or file, and the value; the CLI turns
it into exit status 2 before any backend runs.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


class InputError(ValueError):
    """A file or option the user gave that cannot be used; the message names it."""


def read_text(path: str | Path, what: str) -> str:
    """The text of a file, or an ``InputError`` saying why it cannot be read as text."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{what} {str(path)!r}: no such file")
    if path.is_dir():
        raise InputError(f"{what} {str(path)!r}: is a directory, not a file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{what} {str(path)!r}: cannot be read ({exc.strerror})") from None
    if b"\0" in data:
        raise InputError(f"{what} {str(path)!r}: is a binary file, not text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{what} {str(path)!r}: is not UTF-8 text (byte {exc.start})") from None


def read_json(path: str | Path, what: str) -> Any:
    text = read_text(path, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{what} {str(path)!r}: not valid JSON: {exc}") from None


def check_directory(path: str | Path, what: str) -> None:
    path = Path(path)
    if not path.is_dir():
        raise InputError(f"{what} {str(path)!r}: no such directory")


def check_output(path: str | Path, what: str) -> None:
    """A file the run will write: its folder must exist and be writable, and it no folder."""
    path = Path(path)
    folder = path.parent
    if path.is_dir():
        raise InputError(f"{what} {str(path)!r}: is a directory; give a file name")
    if not folder.is_dir():
        raise InputError(f"{what} {str(path)!r}: the directory {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise InputError(f"{what} {str(path)!r}: the directory {str(folder)!r} is not writable")


def write_atomically(path: str | Path, text: str) -> None:
    """Write the whole file or nothing: a reader never sees half a report."""
    path = Path(path)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
