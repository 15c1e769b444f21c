"""Opening a model folder's files, with typed errors (shared by the loader, the GGUF reader and the tokenizer).

Whatever a folder holds is untrusted: every file is opened without blocking and read only when it
is a regular file (a FIFO in place of config.json would block forever, /dev/zero would never end),
JSON files only up to :data:`MAX_JSON_BYTES`, and no message ever quotes a file's bytes.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

from .errors import ModelNotFoundError

# tokenizer.json is the largest JSON file a checkpoint carries (Gemma 3's: 33 MB)
MAX_JSON_BYTES = 256 * 2**20


def open_regular(file: Path, *, error: type[Exception], limit: int | None = None):
    """``file`` opened for binary reading, when it is a regular file (through symlinks) of at most
    ``limit`` bytes; else ``error``."""
    try:
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise error(_os_problem(file, e)) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            what = "a directory, not a file" if stat.S_ISDIR(mode) else "not a regular file (a pipe, socket or device)"
            raise error(f"{file} is {what}; replace it with the checkpoint's {Path(file).name}")
        size = os.fstat(fd).st_size
        if limit is not None and size > limit:
            raise error(f"{file} is {size} bytes, more than the {limit} a model's {Path(file).suffix or 'text'} "
                        f"file may hold; it is not the checkpoint's {Path(file).name}, restore it")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def check_regular(file: Path, *, error: type[Exception], limit: int | None = MAX_JSON_BYTES) -> None:
    """Raise ``error`` unless ``file`` (when there is one) is a readable regular file of at most ``limit``
    bytes, for files another reader opens (see :func:`open_regular`)."""
    if os.path.lexists(file):
        open_regular(file, error=error, limit=limit).close()


def _os_problem(file: Path, e: OSError) -> str:
    if e.errno == errno.ELOOP:
        return f"{file} is a symlink loop (or a chain of too many symlinks); point it at the real file"
    if e.errno in (errno.ENOENT, errno.ENOTDIR):
        return f"{file} does not exist (or is a broken symlink); restore it from the checkpoint"
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"cannot read {file}: permission denied; make it readable (chmod a+r) for the user running slotinfer"
    return f"cannot read {file}: {e.strerror or e}; check the file and its permissions"


def where_missing(path) -> str:
    """Why no file or folder is at ``path``, from the last part that does exist: "there is no 'models'
    in /home/me" (a relative path is read from the current folder, which it names)."""
    path = Path(path).expanduser()
    full = path if path.is_absolute() else Path.cwd() / path
    parent = full
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    missing = full.relative_to(parent).parts[0] if parent != full else full.name
    here = f"{str(parent)!r}" + ("" if path.is_absolute() else ", the current folder" if parent == Path.cwd() else "")
    return f"there is no {missing!r} in {here}"


def read_json(file: Path, *, error: type[Exception], required: bool = False):
    """The JSON in ``file`` ({} when absent and not required); ``error`` is the type raised when it is unreadable."""
    if not os.path.lexists(file):
        if required:
            raise ModelNotFoundError(f"{file.name} is missing from {str(file.parent)!r}; a model folder needs it")
        return {}
    with open_regular(file, error=error, limit=MAX_JSON_BYTES) as fh:
        try:
            data = fh.read(MAX_JSON_BYTES + 1)
        except OSError as e:
            raise error(_os_problem(file, e)) from None
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise error(f"{file} is not valid JSON (not utf-8 text: a bad byte at offset {e.start}); re-download it "
                    "or copy it again from the original checkpoint") from None
    except json.JSONDecodeError as e:  # its message gives the position, never the text
        raise error(f"{file} is not valid JSON ({e.msg}: line {e.lineno} column {e.colno}); re-download it "
                    "or copy it again from the original checkpoint") from None
    except RecursionError:
        raise error(f"{file} nests its JSON too deeply to be a checkpoint's {file.name}; restore it") from None
