"""Offline jobs on Ray Data: one slotinfer engine per actor, rows in and columns out.

    >>> import ray, slotinfer.ray
    >>> ds = ray.data.read_json("reviews.jsonl")
    >>> ds = ds.map_batches(slotinfer.ray.Classifier,
    ...                     fn_constructor_kwargs={"model": PATH, "labels": ["positive", "negative"],
    ...                                            "prefix": "Review: ", "label_prefix": " "},
    ...                     batch_size=256, batch_format="pyarrow", **slotinfer.ray.actor_options(2))
    >>> ds = ds.map_batches(slotinfer.ray.Generator,
    ...                     fn_constructor_kwargs={"model": PATH, "max_tokens": 64, "chat": True},
    ...                     batch_size=32, batch_format="pyarrow", **slotinfer.ray.actor_options(2))

Ray places the actors and moves the rows; slotinfer runs no cluster of its own.  Each
actor loads the model once, in its constructor.  :class:`Classifier` runs every batch
through the batched classify path; :class:`Generator` keeps one :class:`Inferencer` for
the actor's life and its ``__call__`` is a coroutine, so Ray Data feeds an actor several
batches at once and their rows share the slot table.

The input column is ``text`` (``column=`` changes it) and every input column passes
through.  Classifier adds ``label``, ``scores`` (label -> log-probability) and ``error``;
Generator adds ``text``, ``finish_reason``, ``tokens`` and ``error`` (an input column
named ``text`` is kept as ``prompt``).  A bad row (not a string, empty, too long) gets
its message in ``error`` and nulls elsewhere; the batch and the job go on.  Problems of
the whole job (no such model, bad labels or sampling values) fail the actor's
construction, before any row runs.  See docs/scale-out.md.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np

try:
    import pyarrow as pa
    import ray  # the Ray package itself: absolute imports never resolve to this module
    import ray.data
except ImportError as e:
    raise ImportError(f"slotinfer.ray needs Ray Data ({e}); in the slotinfer checkout: pip install -e '.[ray]'") from e

import slotinfer

from . import _package
from .device import default_device

_package.check()  # in each actor too: Ray starts its workers in the driver's folder

__all__ = ["Classifier", "Generator", "actor_options", "serve_app"]

MLX_GPU = "mlx_gpu"  # the custom resource an Apple-silicon node declares: one per GPU


def serve_app(model, **kw):
    """Online serving on Ray Serve: an application of slotinfer replicas behind an OpenAI ingress,
    for ``serve.run`` (see :func:`slotinfer.serve.ray_app.serve_app` for the arguments).

        >>> from ray import serve
        >>> serve.run(slotinfer.ray.serve_app(PATH, replicas=2), route_prefix="/")
    """
    from .serve.ray_app import serve_app as build

    return build(model, **kw)


def actor_options(actors: int, *, device: str | None = None, cores: int | None = None, nodes: int = 1) -> dict:
    """``map_batches`` keyword arguments that place ``actors`` engines on this kind of device.

    On a GPU, one actor per accelerator: ``num_gpus=1`` with CUDA, the custom resource
    ``{"mlx_gpu": 1}`` on Apple silicon (Ray does not count Metal GPUs; declare it with
    ``ray start --resources '{"mlx_gpu": 1}'``).  On CPU, a node's ``cores`` (default:
    this machine's) are split between the actors that run on it: Ray Data spreads the actors
    over the cluster's ``nodes``, ``ceil(actors / nodes)`` on each, and each actor's BLAS runs
    ``cores // that`` threads (two engines each threading over every core would fight for them);
    the actors on a node together ask Ray for all its CPUs but one.
    """
    if not isinstance(actors, int) or isinstance(actors, bool) or actors < 1:
        raise slotinfer.InvalidRequestError(f"actors must be an int >= 1, got {actors!r}")
    device = device or default_device()
    if device == "gpu":
        import mlx.core as mx

        if mx.metal.is_available():
            return {"compute": ray.data.ActorPoolStrategy(size=actors), "resources": {MLX_GPU: 1}}
        return {"compute": ray.data.ActorPoolStrategy(size=actors), "num_gpus": 1}
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
        raise slotinfer.InvalidRequestError(f"nodes must be an int >= 1, got {nodes!r}")
    cores = cores or os.cpu_count() or 1
    per_node = -(-actors // nodes)  # Ray Data spreads an actor pool over the nodes
    threads = max(1, cores // per_node)
    # Ray's CPU count only schedules; the BLAS threads use the cores.  One logical CPU of each node stays
    # free for Ray Data's read and write tasks, which otherwise wait forever behind actors that hold them all.
    share = max(cores - 1, 1) / per_node
    return {"compute": ray.data.ActorPoolStrategy(size=actors), "num_cpus": share,
            "runtime_env": {"env_vars": {"SLOTINFER_BLAS_THREADS": str(threads)}}}


class _Rows:
    """What both callables share: the model, the input column, the pass-through of columns.

    Batches come in any of Ray Data's formats and leave as Arrow tables: the input columns
    unchanged, the added ones with fixed types, so that every block (and every Parquet part
    file) has one schema even where a batch is all errors or has none.
    """

    def __init__(self, model, column: str, worker_column: str | None):
        self.model = slotinfer.load(model)
        self.column = column
        # An id of this actor on every row it handled: which engine produced a row, when a
        # node misbehaves (and how evenly the rows were spread).
        self.worker_column = worker_column
        self.worker = _worker_id()

    def _texts(self, table: pa.Table) -> list:
        """Each row's input, or the error that row gets instead."""
        if self.column not in table.column_names:
            raise slotinfer.InvalidRequestError(f"the dataset has no column {self.column!r} (columns: "
                                                f"{', '.join(table.column_names)}); choose one with column=")
        return [_text_or_error(v, self.column) for v in table.column(self.column).to_pylist()]

    def _finish(self, table: pa.Table, added: dict) -> pa.Table:
        if self.worker_column:
            added[self.worker_column] = ([self.worker] * table.num_rows, pa.string())
        taken = sorted(set(added) & set(table.column_names))
        if taken:  # the job's set-up, not a row's: an input column is never overwritten silently
            raise slotinfer.InvalidRequestError(
                f"the dataset already has column(s) {', '.join(taken)}, which {type(self).__name__} adds; "
                "rename or drop them first (Dataset.rename_columns / drop_columns)")
        for name, (values, typ) in added.items():
            table = table.append_column(name, pa.array(values, type=typ))
        return table


class Classifier(_Rows):
    """A ``map_batches`` callable class: the best of ``labels`` for every row's text.

    Constructor keywords (``fn_constructor_kwargs``): ``model`` (a path or hub id, as
    :func:`slotinfer.load` takes), ``labels``, and those of :func:`slotinfer.classify.classify`
    (``prefix``, ``label_prefix``, ``token_budget``, ``temperature``...); ``suffix`` is
    appended to every row's text (a template's tail); ``column`` names the input column.
    """

    def __init__(self, model, labels, *, column: str = "text", suffix: str = "", worker_column: str | None = None,
                 **classify_kw):
        from .classify import classify, encode_labels

        super().__init__(model, column, worker_column)
        self.labels = list(labels)
        self.suffix = suffix
        self.kw = classify_kw
        self.scores_type = pa.struct([(name, pa.float64()) for name in self.labels])
        # the job's options fail here, once, before any row: bad labels, a misspelt keyword
        encode_labels(self.model, self.labels, classify_kw.get("label_prefix", ""))
        _check_keywords(classify, ("model", "prompts", "labels", "on_result"), classify_kw, "classify")

    def __call__(self, batch):
        table = _table(batch)
        texts = self._texts(table)
        n = len(texts)
        label, scores, error = [None] * n, [None] * n, [None] * n
        good = [i for i, t in enumerate(texts) if isinstance(t, str)]
        for i in set(range(n)) - set(good):
            error[i] = _message(texts[i])
        results = self.model.classify([texts[i] + self.suffix for i in good], labels=self.labels, **self.kw) \
            if good else []
        for i, r in zip(good, results):
            if r.error is not None:
                error[i] = _message(r.error)
            else:
                label[i], scores[i] = r.label, dict(r.scores)
        return self._finish(table, {"label": (label, pa.string()), "scores": (scores, self.scores_type),
                                    "error": (error, pa.string())})


class Generator(_Rows):
    """A ``map_batches`` callable class: a completion for every row's prompt.

    Constructor keywords: ``model``; ``chat`` (wrap each prompt in the model's chat
    template as a user message); ``slots``, ``max_len``, ``prefill_tokens`` (the
    Inferencer's table: ``slots`` rows of up to ``max_len`` tokens, their K/V in a pool of blocks);
    and the generation parameters of :meth:`Model.generate` (``max_tokens``,
    ``temperature``, ``seed``, ``stop``...), the same for every row.
    """

    def __init__(self, model, *, column: str = "text", chat: bool = False, slots: int = 32, max_len: int = 2048,
                 prefill_tokens: int = 512, worker_column: str | None = None, **params):
        super().__init__(model, column, worker_column)
        self.chat = chat
        self.params = params
        _check_params(params)  # the job's values, not a row's: a bad one fails here, before any row runs
        self.inferencer = slotinfer.Inferencer(self.model, slots=slots, max_len=max_len,
                                               prefill_tokens=prefill_tokens)

    async def __call__(self, batch):
        table = _table(batch)
        texts = self._texts(table)
        n = len(texts)
        handles: list = [None] * n
        error: list = [None] * n
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                error[i] = _message(t)
                continue
            try:
                prompt = self.model.apply_chat_template([{"role": "user", "content": t}]) if self.chat else t
                handles[i] = self.inferencer.submit(prompt, **self.params)
            except Exception as e:  # noqa: BLE001 - a bad row fails alone
                error[i] = _message(e)
        live = [i for i in range(n) if handles[i] is not None]
        done = await asyncio.gather(*(_await(handles[i]) for i in live), return_exceptions=True)
        text, reason, tokens = [None] * n, [None] * n, [[] for _ in range(n)]
        for i, c in zip(live, done):
            if isinstance(c, BaseException):
                error[i] = _message(c)
            else:
                text[i], reason[i], tokens[i] = c.text, c.finish_reason, list(c.tokens)
        names = table.column_names
        if "text" in names:  # the generated text takes its name; the input stays, as the CLI's generate names it
            if "prompt" in names:
                raise slotinfer.InvalidRequestError(
                    "the dataset has columns 'text' and 'prompt': the output's 'text' (the generated text) would "
                    "overwrite one of them; rename or drop one first (Dataset.rename_columns)")
            table = table.rename_columns(["prompt" if c == "text" else c for c in names])
        return self._finish(table, {"text": (text, pa.string()), "finish_reason": (reason, pa.string()),
                                    "tokens": (tokens, pa.list_(pa.int64())), "error": (error, pa.string())})

    def __del__(self):
        inf = getattr(self, "inferencer", None)
        if inf is not None:
            inf.close(drain=False)


async def _await(handle):
    return await handle


def _text_or_error(value, column: str):
    """The row's text, or an exception whose message says why the row cannot run."""
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as e:
            return slotinfer.InvalidRequestError(f"{column!r} is not valid UTF-8 ({e.reason} at byte {e.start})")
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return slotinfer.InvalidRequestError(f"{column!r} is missing")
    if not isinstance(value, str):
        return slotinfer.InvalidRequestError(f"{column!r} is {type(value).__name__}, not a string")
    if not value.strip():
        return slotinfer.InvalidRequestError(f"{column!r} is empty")
    return value


def _message(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _table(batch) -> pa.Table:
    """A batch in any of Ray Data's formats (Arrow, pandas, a dict of numpy columns) as an Arrow table."""
    if isinstance(batch, pa.Table):
        return batch
    if isinstance(batch, dict):
        return pa.table({k: pa.array(list(v)) for k, v in batch.items()})
    return pa.Table.from_pandas(batch, preserve_index=False)


def _check_keywords(fn, taken: tuple, given: dict, what: str):
    """Every keyword in ``given`` is one that ``fn`` takes and that is not set by this module."""
    import inspect

    allowed = set(inspect.signature(fn).parameters) - set(taken)
    unknown = sorted(set(given) - allowed)
    if unknown:
        raise slotinfer.InvalidRequestError(f"unknown {what} parameter(s) {', '.join(unknown)}; "
                                            f"the {what} parameters are {', '.join(sorted(allowed))}")


def _check_params(params: dict):
    """Generation parameters as :meth:`Engine.make_item` checks them, without making a request."""
    from .request import ENGINE, check

    check(params, names=tuple(n for n in ENGINE if n not in ("on_token", "loop")), what="generation")


def _worker_id() -> str:
    if not ray.is_initialized():  # called outside Ray: asking Ray would start a local cluster
        return f"pid-{os.getpid()}"
    ctx = ray.get_runtime_context()
    return ctx.get_actor_id() or ctx.get_worker_id()
