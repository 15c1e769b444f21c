"""What the offline job commands share (``classify``, ``generate --output``, ``--ray``): usage
errors, the prompt template file, and output files of records that a re-run resumes, never one
this tool did not write."""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import sys
from dataclasses import dataclass

_SENTINEL = "\x00slotinfer-text\x00"


class UsageError(Exception):
    """A problem of the whole run (bad option, unreadable file): reported and exit code 2."""


def parse_template(path: str) -> tuple[str | None, str]:
    """(prefix, suffix) of a template file: the text before and after ``{text}``."""
    try:
        with open(path, encoding="utf-8-sig") as fh:
            tpl = fh.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read template {path!r}: {e}") from None
    if tpl.endswith("\n"):
        tpl = tpl[:-1]
    if re.search(r"\{\{|\{%", tpl):
        import jinja2

        from ..errors import InvalidRequestError
        from ..text.templates import compile_template, render, sandboxed_environment

        try:  # the chat templates' sandbox: a template file may come from anyone
            env = sandboxed_environment(keep_trailing_newline=True)
            rendered = render(compile_template(env, tpl), {"text": _SENTINEL})
        except (jinja2.TemplateError, InvalidRequestError) as e:  # InvalidRequestError: past a limit
            raise UsageError(f"template {path!r}: {e}") from None
        except (TypeError, KeyError, AttributeError, ValueError, IndexError, ArithmeticError) as e:
            raise UsageError(f"template {path!r} failed to render: {e!r}") from None
    else:
        rendered = tpl.replace("{text}", _SENTINEL)
    parts = rendered.split(_SENTINEL)
    if len(parts) != 2:
        raise UsageError(f"template {path!r} must contain {{text}} exactly once (found {len(parts) - 1})")
    return (parts[0] or None), parts[1]


# -- output --------------------------------------------------------------------------

def _key(rid) -> str:
    return json.dumps(rid, sort_keys=True)


def run_id(labels: list[str], label_prefix: str, prefix: str | None, suffix: str) -> str:
    """What decides a run's scores, as 12 hex digits: every record carries it as ``run``, so a
    re-run with other labels, label prefix, prefix or template never mixes into the same file."""
    blob = json.dumps([labels, label_prefix, prefix, suffix], ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:12]


@dataclass
class Resume:
    """What an existing ``--output`` holds: the ids done, and how to go on writing it."""

    done: set
    regular: bool = True  # False: a pipe, /dev/stdout, a device: written as it is, nothing read back
    needs_newline: bool = False  # the last record lacks its newline: write one first


_RECORD_START = b'{"id": '  # how every record this tool writes begins (json.dumps, id first)


def check_not_input(output: str, source) -> None:
    """Refuse an ``--output`` that is the input itself (by inode: a symlink or hard link too).
    ``source`` is a path, or ``"-"`` for stdin."""
    try:
        out = os.stat(output)
        src = os.fstat(sys.stdin.fileno()) if source == "-" else os.stat(source)
    except (OSError, ValueError, AttributeError):  # no output yet, no such input, no real stdin
        return
    if stat.S_ISREG(out.st_mode) and (out.st_dev, out.st_ino) == (src.st_dev, src.st_ino):
        what = "standard input" if source == "-" else f"the input {source!r}"
        raise UsageError(f"--output {output!r} is {what}: writing there would destroy what is being read; "
                         "choose another output file")


def resume(path: str, run: str | None = None, fields=("label", "error")) -> Resume:
    """Read an existing output file before appending to it, refusing any file this tool did not write.

    Every line must be a JSON record with an ``id`` and one of ``fields`` (and, when ``run`` is
    given, that ``run``); else :class:`UsageError`, and the file is left as it is.  An unfinished
    last line (a crash mid-write: the start of a record, not a whole JSON object) is cut off.
    A pipe or device (``/dev/stdout``) is not read: it is written as it is, nothing resumed.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return Resume(set())
    except OSError as e:
        raise UsageError(f"cannot write {path!r}: {e.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise UsageError(f"cannot write {path!r}: it is a directory; give a file name")
    if not stat.S_ISREG(st.st_mode):
        return Resume(set(), regular=False)
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as e:
        raise UsageError(f"cannot write {path!r}: {e.strerror}") from None
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    keep, needs_newline = len(data), False
    if tail:
        if _record(tail, run, fields) is not None:
            lines.append(tail)
            needs_newline = True
        elif tail.startswith(_RECORD_START) or _RECORD_START.startswith(tail):
            keep = len(data) - len(tail)  # a record cut short by a crash
        else:
            lines.append(tail)  # reported below
    done = set()
    for n, line in enumerate(lines, 1):
        rid = _record(line, run, fields)
        if rid is None:
            raise UsageError(_foreign(path, n, line, run, fields))
        done.add(rid)
    if keep < len(data):
        with open(path, "r+b") as fh:
            fh.truncate(keep)
    return Resume(done, needs_newline=needs_newline)


def _record(line: bytes, run, fields):
    """The id key of one output line, or None when it is not a record of this run."""
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    if not isinstance(obj, dict) or "id" not in obj or not any(f in obj for f in fields):
        return None
    if run is not None and obj.get("run") != run:
        return None
    return _key(obj["id"])


def _foreign(path: str, n: int, line: bytes, run, fields) -> str:
    try:
        obj = json.loads(line)
    except ValueError:
        obj = None
    if isinstance(obj, dict) and "id" in obj and any(f in obj for f in fields):
        return (f"--output {path!r} was written by a run with other labels, --label-prefix, --prefix or "
                f"--template (line {n} has run {obj.get('run')!r}, this run is {run!r}); resuming would mix "
                "their scores: choose another output file, or remove this one to start over")
    return (f"--output {path!r} is not an output of this command (line {n} is not one of its records); "
            "it was left as it is: choose another output file, or remove this one")
