"""Files the user names: read and checked up front, so a bad one is one line, not a traceback.

Every error is an ``InputError`` that names the option or file, and the value; the CLI turns
it into exit status 2 before any backend runs.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
import zlib
from functools import cache
from pathlib import Path
from typing import Any

SCHEMAS = Path(__file__).resolve().parent / "schemas"  # shipped in the wheel


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


def read_saved(path: str | Path, what: str, schema: str) -> Any:
    """A file the suite wrote (``.json``, or ``.json.gz``), checked against its published
    schema (``conformance/schemas/<schema>.schema.json``) before anything reads it."""
    path = Path(path)
    if path.suffix != ".gz":
        data = read_json(path, what)
    else:
        if not path.is_file():
            raise InputError(f"{what} {str(path)!r}: no such file")
        try:
            data = json.loads(gzip.decompress(path.read_bytes()).decode("utf-8"))
        except (OSError, EOFError, zlib.error) as exc:
            raise InputError(f"{what} {str(path)!r}: not a whole gzip file ({exc})") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InputError(f"{what} {str(path)!r}: gzipped, but not JSON: {exc}") from None
    from jsonschema.exceptions import best_match

    problem = best_match(_validator(schema).iter_errors(data))
    if problem is not None:
        raise InputError(f"{what} {str(path)!r}: not a {schema} file of this suite: at "
                         f"{problem.json_path}: {problem.message[:200]} (schema: "
                         f"conformance/schemas/{schema}.schema.json)")
    return data


@cache
def _validator(schema: str):
    from jsonschema import Draft202012Validator

    return Draft202012Validator(json.loads((SCHEMAS / f"{schema}.schema.json").read_text()))


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


def check_outputs(args: object, options: tuple[str, ...]) -> None:
    """The files a command's ``options`` (argparse destinations) name: each writable, and no
    two the same file."""
    named = {"--" + option.replace("_", "-"): getattr(args, option, None) for option in options}
    for flag, path in named.items():
        if path is not None:
            check_output(path, flag)
    check_distinct(named)


def check_distinct(paths: dict[str, str | Path | None]) -> None:
    """Refuse one file named for two outputs: the second would overwrite the first."""
    seen: dict[str, str] = {}
    for option, path in paths.items():
        if path is None:
            continue
        real = os.path.realpath(path)
        if real in seen:
            raise InputError(f"{option} {str(path)!r}: the same file as {seen[real]}; give "
                             f"each report its own")
        seen[real] = option


def write_atomically(path: str | Path, text: str) -> None:
    """Write the whole file or nothing: a reader never sees half a report.

    A symbolic link is written through (its target replaced, the link kept); the file gets the
    mode an existing one had, else what the user's umask gives a new file."""
    path = Path(os.path.realpath(path))
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(handle, mode)
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
