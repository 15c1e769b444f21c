"""Reading a model folder's JSON files, with typed errors (shared by the loader and the tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import ModelNotFoundError


def read_json(file: Path, *, error: type[Exception], required: bool = False):
    """The JSON in ``file`` ({} when absent and not required); ``error`` is the type raised when it is unreadable."""
    if not file.exists():
        if required:
            raise ModelNotFoundError(f"{file.name} is missing from {str(file.parent)!r}; a model folder needs it")
        return {}
    if file.is_dir():
        raise error(f"{file} is a directory, not a file; replace it with the checkpoint's {file.name}")
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{file} is not valid JSON ({e}); re-download it or copy it again from the original checkpoint") from None
    except OSError as e:
        raise error(f"cannot read {file}: {e.strerror or e}; check the file and its permissions") from None
