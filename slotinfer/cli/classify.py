"""``slotinfer classify``: label every line of a file, resumably; :data:`DESCRIPTION` (the
command's help) says what it reads and writes, and :mod:`slotinfer.classify` how prompts are
tokenized.

Why one module: the command's input formats (lines, JSONL, CSV), progress and run loop belong to
it alone.
"""

from __future__ import annotations

import argparse
import codecs
import csv
import io
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Iterator

from .jobs import UsageError, _key, check_not_input, parse_template, resume, run_id

FORMATS = ("auto", "lines", "jsonl", "csv")

DESCRIPTION = """\
Label every sentence of a file with one of a set of labels, resumably.

    slotinfer classify --model PATH --labels positive,negative \\
        --template prompt.txt --output out.jsonl reviews.jsonl

Input is read by extension (or --format): plain text (one sentence per line), JSONL (the
"text" field, or --column; "id" when present) or CSV (--column, default text; "id" when
present); a leading UTF-8 byte-order mark is dropped.

Each sentence gets one JSON line {"id", "label", "scores", "run"}; the id is the line number
(the record's line for CSV) when the input has none. A bad line (empty, not UTF-8, malformed
JSON, no such column, too long for the context) gets {"id", "error", "run"} instead and the
run goes on. "run" is a fingerprint of the labels, label prefix, prefix and template.

--output is appended: a re-run skips the ids already written, so an interrupted run (Ctrl-C
writes what is done and exits 130) resumes where it stopped. It resumes only a file of its own
records with the same run; anything else (another file, the input itself, another label set
or prompt) stops with exit code 2 and the file untouched. A pipe or device (/dev/stdout) is
written as it comes, with nothing to resume.

--template FILE holds the prompt around each sentence, with {text} (or {{ text }}) where the
sentence goes: the part before it is the shared prefix (encoded once), the part after is
appended to every sentence. One final newline of the file is dropped.
"""


@dataclass
class Record:
    """One input sentence, or why its line could not be read."""

    line: int
    id: object
    text: str | None = None
    error: str | None = None


def fused_label(model, labels, label_prefix: str, before: str) -> str | None:
    """The end of ``before`` and a label as the model scores them, when the label runs on from a word or
    a sentence's end with no space between ("sent off.sport"): a label is scored as the tokens of
    ``label_prefix + label`` right after the text (:func:`slotinfer.classify.encode_labels`), and a
    tokenizer that marks a word's leading space in its tokens scores "sport" there as no word starts.
    None when every label starts a word of its own (after a space, a newline, an opening quote, or a
    tokenizer that adds the space itself)."""
    tok = model.tokenizer
    ctx = tok.encode(before, add_special_tokens=False)
    shown = tok.decode(ctx)
    if not shown or not (shown[-1].isalnum() or shown[-1] in ".,:;!?"):
        return None
    for label in labels:
        joined = tok.decode(ctx + tok.encode(label_prefix + label, add_special_tokens=False))
        added = joined[len(shown):] if joined.startswith(shown) else ""
        if added[:1].isalnum():
            return joined[max(0, len(shown) - 12):]
    return None


# -- argument parsing ----------------------------------------------------------------

def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``classify`` on an ``argparse`` subparsers object; dispatch to :func:`run`."""
    p = subparsers.add_parser(
        "classify", help="label every sentence of a file with one of a set of labels",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", metavar="INPUT", help="text lines, .jsonl or .csv file ('-' reads text lines from stdin)")
    p.add_argument("--model", required=True,
                   help="a model folder, a GGUF file, or a hub id (org/name, org/name:file.gguf)")
    p.add_argument("--labels", required=True, help="comma-separated labels, e.g. positive,negative,neutral")
    p.add_argument("--label-prefix", default="",
                   help="text put before each label when tokenizing it, e.g. ' ' when the prompt ends with "
                        "'Answer:' (default: none)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prefix", help="instruction text put before every sentence (encoded once)")
    src.add_argument("--template", metavar="FILE", help="prompt template with {text} where the sentence goes")
    p.add_argument("--column", help="JSONL field / CSV column holding the sentence (default: text)")
    p.add_argument("--format", choices=FORMATS, default="auto", help="input format (default: by extension)")
    p.add_argument("--output", "-o", help="JSONL output, appended and resumable (default: stdout)")
    p.add_argument("--token-budget", type=int, default=None, help="padded tokens per forward (default: library's)")
    p.add_argument("--chunk", type=int, default=2048, help="sentences read and sorted together (default 2048)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    from .common import add_ray_flags
    add_ray_flags(p)
    p.set_defaults(func=run)
    return p


def main(argv=None) -> int:
    """Run ``classify`` on its own: ``python -m slotinfer.cli.classify --model ... INPUT``."""
    parser = argparse.ArgumentParser(prog="slotinfer")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["classify", *(sys.argv[1:] if argv is None else argv)])
    return run(args)  # run reports slotinfer's typed errors, as the ``slotinfer`` entry point does


# -- input ---------------------------------------------------------------------------

def _format_of(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    ext = os.path.splitext(path)[1].lower()
    return {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv"}.get(ext, "lines")


def read_records(path: str, fmt: str = "auto", column: str | None = None) -> Iterator[Record]:
    """Yield a :class:`Record` per line (per CSV record) of ``path``."""
    fmt = _format_of(path, fmt)
    if path != "-" and os.path.isdir(path):
        raise UsageError(f"input {path!r} is a directory, not a file; give the file to classify")
    if path != "-" and not os.path.isfile(path):
        raise UsageError(f"input file {path!r} does not exist")
    try:
        f = sys.stdin.buffer if path == "-" else open(path, "rb")
    except OSError as e:
        raise UsageError(f"cannot read {path!r}: {e.strerror}") from None
    with f:
        if fmt == "csv":
            yield from _read_csv(f, column or "text")
        else:
            yield from _read_lines(f, fmt, column or "text")


def _read_lines(f, fmt: str, column: str) -> Iterator[Record]:
    for n, raw in enumerate(f, 1):
        raw = raw.rstrip(b"\r\n")
        if n == 1 and raw.startswith(codecs.BOM_UTF8):
            raw = raw[len(codecs.BOM_UTF8):]  # a byte-order mark (Windows editors, Excel) is no text
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield Record(n, n, error=f"line {n}: not valid UTF-8 ({e.reason} at byte {e.start})")
            continue
        if fmt == "lines":
            if line.strip():
                yield Record(n, n, text=line)
            else:
                yield Record(n, n, error=f"line {n}: empty line")
            continue
        if not line.strip():
            yield Record(n, n, error=f"line {n}: empty line (expected a JSON object)")
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            yield Record(n, n, error=f"line {n}: not valid JSON ({e.msg} at column {e.colno})")
            continue
        if not isinstance(obj, dict):
            yield Record(n, n, error=f"line {n}: expected a JSON object, got {type(obj).__name__}")
            continue
        rid = obj.get("id", n)
        yield _checked(n, rid, obj.get(column), column, column in obj)


def _checked(n: int, rid, text, column: str, present: bool) -> Record:
    if not present:
        return Record(n, rid, error=f"line {n}: no field {column!r} (choose another with --column)")
    if not isinstance(text, str):
        return Record(n, rid, error=f"line {n}: field {column!r} is {type(text).__name__}, not a string")
    if not text.strip():
        return Record(n, rid, error=f"line {n}: field {column!r} is empty")
    if any("\udc80" <= ch <= "\udcff" for ch in text):
        return Record(n, rid, error=f"line {n}: not valid UTF-8")
    return Record(n, rid, text=text)


def _read_csv(f, column: str) -> Iterator[Record]:
    text = io.TextIOWrapper(f, encoding="utf-8-sig", errors="surrogateescape", newline="")  # -sig: drop a BOM
    reader = csv.reader(text)
    try:
        header = next(reader)
    except StopIteration:
        return
    except csv.Error as e:
        raise UsageError(f"line 1: cannot read the CSV header ({e})") from None
    if column not in header:
        raise UsageError(f"the CSV has no column {column!r} (columns: {', '.join(header)}); choose one with --column")
    col, id_col = header.index(column), header.index("id") if "id" in header else None
    while True:
        start = reader.line_num + 1
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            yield Record(start, start, error=f"line {start}: malformed CSV ({e})")
            continue
        if not row:
            continue  # csv gives [] for a blank line between records
        rid = start
        if id_col is not None:  # cells are strings: so is the line number standing in for a blank one
            rid = row[id_col] if id_col < len(row) and row[id_col] != "" else str(start)
        present = col < len(row)
        yield _checked(start, rid, row[col] if present else None, column, present)


class Progress:
    """``done/total sentences  rate/s  ETA`` on stderr (redrawn in place on a terminal)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled
        self.tty = enabled and sys.stderr.isatty()
        self.done = self.errors = 0
        self.start = self.last = time.perf_counter()

    def step(self, n: int = 1, error: bool = False):
        self.done += n
        self.errors += int(error)
        now = time.perf_counter()
        if self.enabled and (now - self.last >= (0.2 if self.tty else 10.0) or self.done == self.total):
            self.last = now
            self._draw(now)

    def _draw(self, now):
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        frac = self.done / self.total if self.total else 1.0
        bar = "#" * int(frac * 24)
        msg = (f"[{bar:<24}] {self.done}/{self.total} sentences  {rate:.1f}/s  "
               f"ETA {_clock(eta)}  errors {self.errors}")
        sys.stderr.write(("\r" + msg + "  ") if self.tty else msg + "\n")
        sys.stderr.flush()

    def close(self):
        if self.tty:
            sys.stderr.write("\n")
            self.tty = False  # once


def _clock(seconds: float) -> str:
    if seconds == float("inf"):
        return "--:--"
    s = int(seconds + 0.5)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"


# -- the run -------------------------------------------------------------------------

def run(args) -> int:
    """Carry out ``slotinfer classify``; returns the exit code (0 done, 1 model failed or stdout closed, 2 usage)."""
    from ..errors import InvalidRequestError, SlotinferError

    if getattr(args, "ray", False):
        from . import ray_jobs
        return ray_jobs.run("classify", args)
    try:
        return _run(args)
    except (UsageError, InvalidRequestError) as e:
        print(f"slotinfer classify: error: {e}", file=sys.stderr)
        return 2
    except SlotinferError as e:
        print(f"slotinfer classify: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # stdout's reader went away (`| head`): stop writing, quietly
        from .common import stdout_closed
        return stdout_closed()


def _run(args) -> int:
    from .. import load
    from ..classify import classify, encode_labels
    from ..errors import InvalidRequestError, SlotinferError

    labels = [s.strip() for s in args.labels.split(",")]
    empty = [i + 1 for i, s in enumerate(labels) if not s]
    if empty:
        raise UsageError(f"--labels: label {empty[0]} is empty in {args.labels!r}")
    if args.chunk < 1:
        raise UsageError("--chunk must be >= 1")
    if args.token_budget is not None and args.token_budget < 1:
        raise UsageError("--token-budget must be >= 1")
    prefix, suffix = (parse_template(args.template) if args.template else (args.prefix or None, ""))
    run = run_id(labels, args.label_prefix, prefix, suffix)
    if args.output:  # before anything is read or loaded: an output that is not ours stops the run
        check_not_input(args.output, args.input)
        state = resume(args.output, run)
    records = list(read_records(args.input, args.format, args.column))

    try:
        model = load(args.model)
    except SlotinferError as e:
        print(f"slotinfer classify: cannot load the model: {e}", file=sys.stderr)
        return 1
    try:
        label_set = encode_labels(model, labels, args.label_prefix)  # fail before any line is written
    except InvalidRequestError as e:
        raise UsageError(f"--labels: {e}") from None
    before = suffix or next((r.text for r in records if r.error is None and r.text), "")
    fused = fused_label(model, labels, args.label_prefix, before)
    if fused is not None:
        where = "the template's end" if suffix else "each sentence"
        print(f"slotinfer classify: warning: the labels run on from {where} with no space between (scored as "
              f"{fused!r}); pass --label-prefix ' ' to score each label as a word of its own", file=sys.stderr)
    if prefix is not None:  # so does a prefix that leaves no room for a sentence
        opt = f"--template {args.template!r}" if args.template else "--prefix"
        try:
            n = len(model.encode_prompt(prefix, what="prefix"))
        except InvalidRequestError as e:
            raise UsageError(f"{opt}: {e}") from None
        if n + label_set.longest >= model.context_length:  # + 1 sentence token + the label's continuation
            raise UsageError(f"{opt}: the prefix ({n} tokens) and the longest label ({label_set.longest} tokens) "
                             f"leave no room for a sentence in the model's context of {model.context_length}: "
                             "shorten the prefix")

    out = sys.stdout
    done = set()
    if args.output:
        done = state.done
        try:
            out = open(args.output, "a", encoding="utf-8")
        except OSError as e:
            raise UsageError(f"cannot write {args.output!r}: {e.strerror}") from None
        if state.needs_newline:
            out.write("\n")
    seen: dict[str, int] = {}
    todo: list[Record] = []
    skipped = 0
    for r in records:
        k = _key(r.id)
        if k in done:
            skipped += 1
            continue
        if r.error is None and k in seen:
            r.error = f"line {r.line}: id {r.id!r} was already used on line {seen[k]}"
        seen.setdefault(k, r.line)
        todo.append(r)

    progress = Progress(len(todo), not args.quiet)
    budget = args.token_budget

    def write(obj):
        out.write(json.dumps(obj, ensure_ascii=False) + "\n")

    try:
        for s in range(0, len(todo), args.chunk):
            chunk = todo[s:s + args.chunk]
            for r in chunk:
                if r.error is not None:
                    write({"id": r.id, "error": r.error, "run": run})
                    progress.step(error=True)
            good = [r for r in chunk if r.error is None]

            def on_result(i, res, good=good):
                r = good[i]
                if res.error is not None:
                    write({"id": r.id, "error": f"line {r.line}: {res.error}", "run": run})
                else:
                    write({"id": r.id, "label": res.label,
                           "scores": {k: round(v, 6) for k, v in res.scores.items()}, "run": run})
                progress.step(error=res.error is not None)

            if good:  # interrupted, it still writes the batches its queued work finishes
                classify(model, [r.text + suffix for r in good], labels=labels, label_prefix=args.label_prefix,
                         prefix=prefix, token_budget=budget, on_result=on_result)
            out.flush()
    except KeyboardInterrupt:  # one line, and the shell's 128 + SIGINT
        progress.close()  # ends the bar's line on a terminal
        where = f"in {args.output}; the same command resumes after them" if args.output else "on stdout"
        print(f"slotinfer classify: interrupted: {progress.done} sentences written {where}", file=sys.stderr)
        return 130
    finally:
        progress.close()
        if out is not sys.stdout:
            out.close()
    elapsed = time.perf_counter() - progress.start
    if not args.quiet:
        rate = progress.done / elapsed if elapsed > 0 else 0.0
        print(f"classified {progress.done - progress.errors} sentences, {progress.errors} errors, "
              f"{skipped} already done; {elapsed:.1f} s ({rate:.1f}/s)"
              + (f" -> {args.output}" if args.output else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
