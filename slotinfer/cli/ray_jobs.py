"""``slotinfer classify --ray`` and ``slotinfer generate --ray``: one file through Ray Data actors.

    slotinfer classify --ray --actors 2 --model PATH --labels positive,negative in.jsonl -o out.jsonl
    slotinfer generate --ray --ray-address HOST:6379 --model PATH --max-tokens 64 in.parquet -o out.parquet

INPUT is read by Ray Data: ``.parquet`` (a file or a folder of them), ``.jsonl``/``.json``,
``.csv``, else text lines (the column ``text``).  Rows are identified by the ``id``
column, or by their 1-based row number when there is none.  OUT is ``.jsonl`` (one
file, appended line by line on the driver, the format and resumability of the
single-process ``classify``: either can resume the other's output) or ``.parquet`` (a
folder of part files written by Ray Data; each run adds its own).  A re-run skips
the ids already in OUT.  Without ``--ray-address`` a local cluster is started on
this machine.  See docs/scale-out.md.
"""

from __future__ import annotations

import json
import os
import sys
import time

from .jobs import UsageError, _key, check_not_input, parse_template, resume, run_id


def run_classify(args) -> int:
    prefix, suffix = parse_template(args.template) if args.template else (args.prefix or None, "")
    kw = {"model": args.model, "labels": [s.strip() for s in args.labels.split(",")], "prefix": prefix,
          "suffix": suffix, "label_prefix": args.label_prefix, "column": args.column or "text"}
    if args.token_budget is not None:
        kw["token_budget"] = args.token_budget
    return _run("classify", args.input, args, kw, args.batch_size or 256, ["label", "scores"])


def run_generate(args) -> int:
    given = [args.input] if getattr(args, "input", None) else list(getattr(args, "prompts", None) or [])
    if len(given) != 1:
        raise UsageError("with --ray, give one INPUT file (a .jsonl, .parquet, .csv or text file) instead of prompts")
    kw = {"model": args.model, "column": args.column or "text", "chat": args.chat, "slots": args.slots,
          "max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
          "top_k": args.top_k, "seed": args.seed}
    return _run("generate", given[0], args, kw, args.batch_size or 4 * args.slots,
                ["prompt", "text", "finish_reason", "tokens"])


def run(command: str, args) -> int:
    """The ``--ray`` branch of ``classify`` / ``generate``; the exit codes of the single-process commands."""
    from ..errors import InvalidRequestError, SlotinferError

    try:
        return (run_classify if command == "classify" else run_generate)(args)
    except ImportError as e:  # slotinfer.ray's own message: what is missing and the extra to install
        print(f"slotinfer {command}: error: {e}", file=sys.stderr)
        return 2
    except (UsageError, InvalidRequestError) as e:
        print(f"slotinfer {command}: error: {e}", file=sys.stderr)
        return 2
    except SlotinferError as e:
        print(f"slotinfer {command}: error: {e}", file=sys.stderr)
        return 1


def _run(command: str, path: str, args, kw: dict, batch_size: int, fields: list[str]) -> int:
    import slotinfer.ray as sr  # first: without Ray it says what to install

    import ray

    if not args.output:
        raise UsageError("--ray needs --output (a .jsonl file or a .parquet folder) to write and resume")
    if not os.path.exists(path):  # before a cluster is started for nothing
        raise UsageError(f"input {path!r} does not exist")
    # Ray Data's tasks read INPUT and write a .parquet OUT in Ray's workers, whose working directory is
    # not this one (on a running cluster): they get absolute paths
    path = os.path.abspath(path)
    parquet = args.output.endswith(".parquet")
    if parquet:
        args.output = os.path.abspath(args.output)
    run = run_id(kw["labels"], kw["label_prefix"], kw["prefix"], kw["suffix"]) if command == "classify" else None
    if parquet:
        done, state = _done_parquet(args.output), None
    else:  # the single-process classify's rules: only its own records are resumed, never the input
        check_not_input(args.output, path)
        state = resume(args.output, run, ("label", "error") if command == "classify" else ("text", "error"))
        done = state.done
    if getattr(args, "quiet", False):  # Ray Data's progress lines too
        import logging
        logging.getLogger("ray.data").setLevel(logging.WARNING)
    started = not ray.is_initialized()
    if started:
        try:
            ray.init(address=args.ray_address, **({} if args.ray_address else _local_resources()),
                     include_dashboard=False, log_to_driver=False, configure_logging=False)
        except (ConnectionError, ValueError, RuntimeError) as e:
            from .common import ray_connect_error

            raise UsageError(ray_connect_error(args.ray_address, e)) from None
    start = time.perf_counter()
    try:
        try:
            ds, total = _with_ids(_read(path))  # counting the rows reads the whole input
        except ray.exceptions.RayTaskError as e:
            raise UsageError(f"cannot read {path!r}: {_cause(e)} (without --ray, classify reports "
                             "each bad line in the output and goes on)") from None
        names, column = ds.schema().names, kw["column"]
        if column not in names:
            raise UsageError(f"{path!r} has no column {column!r} (columns: {', '.join(names)}); choose one with --column")
        ds = ds.select_columns(["id", column])  # the output's columns only: other input columns never collide
        if command == "generate" and column != "prompt":  # the output names the input `prompt`, whatever INPUT did
            ds, kw = ds.rename_columns({column: "prompt"}), {**kw, "column": "prompt"}
        if done:
            ds = ds.map_batches(_Skip(done), batch_format="pyarrow")
        callable_ = sr.Classifier if command == "classify" else sr.Generator
        ds = ds.map_batches(callable_, fn_constructor_kwargs=kw, batch_size=batch_size, batch_format="pyarrow",
                            **sr.actor_options(args.actors, **_node_cores()))
        ds = ds.select_columns(["id", *fields, "error"])
        counts = _write_parquet(ds, args.output) if parquet else _append_jsonl(ds, args.output, fields, run, state)
    except ray.exceptions.RayActorError as e:  # the actors' constructor raised: the model or an option is bad
        raise UsageError(f"the actors could not start: {_last_line(e)}") from None
    finally:
        if started:
            ray.shutdown()
    elapsed = time.perf_counter() - start
    if not getattr(args, "quiet", False):
        rows, errors = counts
        print(f"{command}: {rows - errors} rows, {errors} errors, {total - rows} already done; "
              f"{elapsed:.1f} s ({rows / max(elapsed, 1e-9):.1f}/s) on {args.actors} actor(s) -> {args.output}",
              file=sys.stderr)
    return 0


def _local_resources() -> dict:
    """A local cluster of this machine's cores, with its Apple GPU declared (Ray counts CUDA GPUs itself)."""
    import mlx.core as mx

    import slotinfer.ray as sr

    return {"resources": {sr.MLX_GPU: 1}} if mx.metal.is_available() else {}


def _node_cores() -> dict:
    """Cores of the cluster's largest node and the number of nodes with CPUs: Ray Data spreads the actors
    over the nodes, and those on one node share its cores."""
    import ray

    cpus = [n["Resources"].get("CPU", 0) for n in ray.nodes() if n.get("Alive")]
    return {"cores": int(max(cpus, default=0)) or os.cpu_count() or 1, "nodes": max(sum(c > 0 for c in cpus), 1)}


def _read(path: str):
    import ray

    ext = os.path.splitext(path.rstrip("/"))[1].lower()
    try:
        if ext == ".parquet":
            return ray.data.read_parquet(path)
        if ext in (".jsonl", ".ndjson", ".json"):
            return ray.data.read_json(path, lines=ext != ".json")
        if ext == ".csv":
            return ray.data.read_csv(path)
        return ray.data.read_text(path, drop_empty_lines=False)
    except Exception as e:  # noqa: BLE001 - pyarrow's errors, named by the file they came from
        raise UsageError(f"cannot read {path!r}: {_last_line(e)}") from None


def _with_ids(ds):
    """The dataset with an ``id`` column (its own, or the 1-based row number), and its row count.

    Row numbers must name the same rows on every run, or a resume would skip the wrong ones: the
    input is read once in its own order (``preserve_order``), and each block is numbered from the
    rows of the blocks before it.  (``Dataset.zip`` with a range, the older way, relies on an order
    Ray Data does not promise, warns on every run since Ray 2.60 and is gone in 2.64.)"""
    import itertools

    import ray

    if "id" in ds.schema().names:
        return ds, ds.count()
    ds.context.execution_options.preserve_order = True  # this read only: the actors after it stay unordered
    blocks = ds.materialize().to_arrow_refs()
    sizes = ray.get([ray.remote(_num_rows).remote(b) for b in blocks])
    numbered = ray.remote(_numbered)
    firsts = itertools.accumulate([1, *sizes[:-1]])
    return ray.data.from_arrow_refs([numbered.remote(b, first) for b, first in zip(blocks, firsts)]), sum(sizes)


def _num_rows(table) -> int:
    return table.num_rows


def _numbered(table, first: int):
    import pyarrow as pa

    return table.append_column("id", pa.array(range(first, first + table.num_rows), pa.int64()))


class _Skip:
    """Drop the rows whose id is already in the output."""

    def __init__(self, done: set[str]):
        self.done = done

    def __call__(self, batch):
        import pyarrow as pa

        return batch.filter(pa.array([_key(x) not in self.done for x in batch.column("id").to_pylist()]))


def _append_jsonl(ds, path: str, fields: list[str], run, state) -> tuple[int, int]:
    """Stream the rows to the driver and append them to ``path`` as they come (a crash keeps what was written)."""
    rows = errors = 0
    try:
        out = open(path, "a", encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot write {path!r}: {e.strerror}") from None
    with out:
        if state.needs_newline:
            out.write("\n")
        for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
            for row in batch.to_pylist():
                if row["error"] is not None:
                    rec = {"id": row["id"], "error": row["error"]}
                    errors += 1
                else:
                    rec = {"id": row["id"], **{f: row[f] for f in fields}}
                    if "scores" in rec:  # rounded as the single-process classify writes them
                        rec["scores"] = {k: round(v, 6) for k, v in rec["scores"].items()}
                if run is not None:
                    rec["run"] = run
                out.write(json.dumps(rec, ensure_ascii=False) + "\n")
                rows += 1
            out.flush()
    return rows, errors


def _write_parquet(ds, path: str) -> tuple[int, int]:
    """Ray Data writes the part files; the rows and errors are counted from the files this run added."""
    import pyarrow.parquet as pq

    before = set(os.listdir(path)) if os.path.isdir(path) else set()
    ds.write_parquet(path)
    rows = errors = 0
    for name in sorted(set(os.listdir(path)) - before):
        errs = pq.read_table(os.path.join(path, name), columns=["error"]).column("error")
        rows, errors = rows + len(errs), errors + len(errs) - errs.null_count
    return rows, errors


def _done_parquet(path: str) -> set[str]:
    """Ids in the part files of a ``.parquet`` output folder (none when it does not exist yet)."""
    if not os.path.exists(path):
        return set()
    import pyarrow.parquet as pq

    try:
        ids = pq.read_table(path, columns=["id"]).column("id").to_pylist()
    except Exception as e:  # noqa: BLE001 - a part file cut short by a crash, or a folder of something else
        raise UsageError(f"cannot read the ids already in {path!r}: {e}; move the unreadable part file away") from None
    return {_key(x) for x in ids}


def _cause(e: BaseException) -> str:
    """The exception a Ray task raised, without Ray's traceback and retry advice around it."""
    for _ in range(8):  # a chain of wrappers, never a loop
        inner = getattr(e, "cause", None) or e.__cause__
        if inner is None:
            break
        e = inner
    return f"{type(e).__name__}: {e}"


def _last_line(e: BaseException) -> str:
    lines = [s for s in str(e).strip().splitlines() if s.strip()]
    return lines[-1] if lines else type(e).__name__
