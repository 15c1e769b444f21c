"""The one Jinja sandbox every template slotinfer renders goes through.

Chat templates come with the model (a downloaded folder or GGUF file is untrusted input) and
``slotinfer classify --template`` reads a file the user names; both render here.  The sandbox
(Jinja's :class:`~jinja2.sandbox.ImmutableSandboxedEnvironment`) keeps a template away from
Python's internals (``__class__``, ``__globals__``, ``str.format`` tricks) and from mutating its
inputs.  On top of it every render is bounded:

- **time**: every loop iteration, call, filter and intercepted operator checks a deadline
  (``SLOTINFER_TEMPLATE_SECONDS``, default 2 s), so nested loops and recursive macros stop;
- **size**: no string or list a template builds, and not its output, may exceed
  ``SLOTINFER_TEMPLATE_MAX_CHARS`` (default 8,000,000 characters, more than any context holds).
  Operators and functions that multiply sizes (``*``, ``+``, ``~``, ``%``, ``**``, ``join``,
  ``replace``, ``center``, ``indent``, ``format``...) are checked *before* they allocate.

Either limit raises :class:`slotinfer.errors.TemplateError`, which names the variable to raise.

    >>> env = sandboxed_environment()
    >>> render(compile_template(env, "{{ x * 2 }}"), {"x": "ab"})
    'abab'

Why one module: the sandbox and its limits have to be audited together.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import re
import time
from datetime import datetime
from typing import Any, Mapping

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, optimizeconst
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from .. import settings
from ..errors import InvalidRequestError, TemplateError

# -- limits of one render ----------------------------------------------------------


# Everything one render builds (copies included) may add up to this many times the limit of one value.
TOTAL_FACTOR = 16


class _Budget:
    """The time and size left to one render."""

    __slots__ = ("max_chars", "total", "seconds", "deadline", "built")

    def __init__(self, max_chars: int, seconds: float):
        self.max_chars, self.total, self.seconds = max_chars, TOTAL_FACTOR * max_chars, seconds
        self.deadline = time.perf_counter() + seconds
        self.built = 0  # characters (or list items) made so far

    def tick(self) -> None:
        if time.perf_counter() > self.deadline:
            raise TemplateError(
                f"the template ran longer than {self.seconds:g} s (SLOTINFER_TEMPLATE_SECONDS); simplify its "
                "loops, or raise the limit if a template really needs more time")

    def allow(self, size: int, what: str) -> None:
        """Before making a value of ``size`` characters (or items)."""
        if size > self.max_chars:
            raise TemplateError(
                f"{what} would be {size:,} characters (or items), over the limit of {self.max_chars:,} "
                "(SLOTINFER_TEMPLATE_MAX_CHARS); raise the limit if a template really needs more")
        if self.built + size > self.total:
            raise TemplateError(
                f"the template built over {self.total:,} characters in all "
                f"({TOTAL_FACTOR} x SLOTINFER_TEMPLATE_MAX_CHARS); raise the limit if a template really needs more")

    def made(self, value: Any, what: str) -> Any:
        """After making ``value``: counted against both limits."""
        if isinstance(value, (str, bytes, list, tuple)):
            n = len(value)
            if n > self.max_chars or self.built + n > self.total:
                self.allow(n, what)
            self.built += n
        return value


_ACTIVE: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("slotinfer_template_budget", default=None)


def _new_budget() -> _Budget:
    return _Budget(settings.template_max_chars(), settings.template_seconds())


def _budget() -> _Budget:
    """The budget of the render in progress (a fresh one outside :func:`render`)."""
    return _ACTIVE.get() or _new_budget()


_TOO_DEEP = "the template nests (macros, recursive loops or brackets) too deeply to render"


@contextlib.contextmanager
def _bounded():
    token = _ACTIVE.set(_new_budget())
    try:
        yield
    except RecursionError:
        raise TemplateError(_TOO_DEEP) from None
    finally:
        _ACTIVE.reset(token)


# -- sizes checked before an operation allocates ------------------------------------

def _length(x: Any) -> int:
    return len(x) if isinstance(x, (str, bytes, list, tuple)) else 0


def _format_size(fmt: str, args: Any = ()) -> int:
    """An upper bound on the widths and precisions a ``%`` or ``str.format`` string asks for."""
    size = len(fmt) + sum(int(d) for d in re.findall(r"\d+", fmt))
    if "*" in fmt:  # '%*d': the width is an argument
        values = args if isinstance(args, tuple) else (args,)
        size += sum(abs(v) for v in values if isinstance(v, int) and not isinstance(v, bool))
    return size


def _binop_size(op: str, left: Any, right: Any) -> int:
    if op == "*":
        if isinstance(right, int) and not isinstance(right, bool):
            return _length(left) * right
        if isinstance(left, int) and not isinstance(left, bool):
            return _length(right) * left
    elif op == "+":
        return _length(left) + _length(right)
    elif op == "%" and isinstance(left, str):
        return _format_size(left, right)
    elif op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        return abs(left).bit_length() * right  # bits of the result, at most
    return 0


def _joined_size(items: list, sep: Any) -> int:
    return sum(_length(x) for x in items) + _length(sep) * max(len(items) - 1, 0)


def _replaced_size(s: Any, old: Any, new: Any, count: Any = None) -> int:
    if not isinstance(s, str) or not isinstance(old, str) or not isinstance(new, str):
        return 0
    n = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    return len(s) + n * len(new)


def _lines_size(s: Any, extra: Any) -> int:
    """``s`` with ``extra`` (a string, or a number of spaces) added on every line."""
    lines = s.count("\n") + 1 if isinstance(s, str) else 1
    return _length(s) + lines * (extra if isinstance(extra, int) else _length(extra))


def _int(x: Any) -> int:
    return x if isinstance(x, int) and not isinstance(x, bool) else 0


def _str_method_size(s: str, name: str, args: tuple, kwargs: Mapping) -> int:
    """Size of ``s.name(*args)`` for the str methods that can make more than they are given."""
    if name in ("center", "ljust", "rjust", "zfill") and args:
        return max(len(s), _int(args[0]))
    if name == "replace" and len(args) >= 2:
        return _replaced_size(s, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count"))
    if name == "expandtabs":
        return len(s) + s.count("\t") * _int(args[0] if args else kwargs.get("tabsize", 8))
    if name in ("format", "format_map"):
        size = _format_size(s) + sum(map(_length, args)) + sum(map(_length, kwargs.values()))
        if re.search(r"\{[^{}]*\{", s):  # '{:{}}': a width taken from the arguments
            size += sum(map(_int, args)) + sum(map(_int, kwargs.values()))
        return size
    if name == "translate" and args and isinstance(args[0], Mapping):
        return len(s) * max([_length(v) for v in args[0].values()] + [1])
    return 0


# Filters that can make more than they are given: the size of their result, before it is made.
_FILTER_SIZES = {
    "join": lambda value, d="", attribute=None: _joined_size(value, d),
    "replace": lambda s, old, new, count=None: _replaced_size(s, old, new, count),
    "center": lambda value, width=80: max(_length(value), _int(width)),
    "indent": lambda s, width=4, first=False, blank=False: _lines_size(s, width),
    "wordwrap": lambda s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True:
        _lines_size(s, 0) + (len(s) // max(_int(width), 1) + 1) * _length(wrapstring) if isinstance(s, str) else 0,
    "format": lambda value, *args, **kwargs: _format_size(value, args) + sum(map(_length, args))
        if isinstance(value, str) else 0,
    "batch": lambda value, linecount, fill_with=None: _length(value) + _int(linecount),
    "slice": lambda value, slices, fill_with=None: _length(value) + _int(slices),
}


def _bounded_filter(name: str, fn):
    size_of = _FILTER_SIZES.get(name)
    skip = 2 if getattr(fn, "jinja_pass_arg", None) is not None else 1  # (context,) value, arguments

    @functools.wraps(fn)  # keeps jinja_pass_arg
    def run(*args, **kwargs):
        budget = _budget()
        budget.tick()
        if size_of is not None and len(args) >= skip:
            args = list(args)
            if name == "join":  # a generator is read once: read it here
                args[skip - 1] = list(args[skip - 1])
            try:
                size = size_of(*args[skip - 1:], **kwargs)
            except TypeError:  # wrong arguments: the filter itself says what is wrong
                size = 0
            budget.allow(size, f"the result of the filter {name!r}")
        return budget.made(fn(*args, **kwargs), f"the result of the filter {name!r}")

    return run


# -- the sandbox ---------------------------------------------------------------------

_NUMBERS = frozenset({int, float, bool})

class _BoundedCodeGenerator(CodeGenerator):
    """Compiles ``+``, ``~`` and loops into direct calls of the budget's checks (no sandbox
    ``call`` in between: these are the hot paths of every chat template)."""

    @optimizeconst
    def visit_Add(self, node, frame):
        self.write("environment.add_bounded(")
        self.visit(node.left, frame)
        self.write(", ")
        self.visit(node.right, frame)
        self.write(")")

    @optimizeconst
    def visit_Concat(self, node, frame):
        if frame.eval_ctx.volatile:  # as Jinja's own: Markup-aware join when autoescape may be on
            join = "(markup_join if context.eval_ctx.volatile else str_join)"
        else:
            join = "markup_join" if frame.eval_ctx.autoescape else "str_join"
        self.write(f"environment.join_bounded({join}, (")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def visit_Call(self, node, frame, forward_caller=False):
        if isinstance(node.node, nodes.EnvironmentAttribute) and node.node.name == "loop_guard":
            self.write("environment.loop_guard(")  # (only _GuardLoops makes an EnvironmentAttribute)
            self.visit(node.args[0], frame)
            self.write(")")
        else:
            super().visit_Call(node, frame, forward_caller=forward_caller)


class _GuardLoops(NodeTransformer):
    """Every ``{% for x in ITER %}`` becomes ``{% for x in loop_guard(ITER) %}``."""

    def visit_For(self, node):
        node = self.generic_visit(node)
        guard = nodes.EnvironmentAttribute("loop_guard", lineno=node.iter.lineno)
        node.iter = nodes.Call(guard, [node.iter], [], None, None, lineno=node.iter.lineno)
        return node


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with a time and size budget (see the module's docstring).
    Build it with :func:`sandboxed_environment`."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "%", "**"})  # '+' compiles to add_bounded

    def call_binop(self, context, operator, left, right):
        if operator != "**" and type(left) in _NUMBERS and type(right) in _NUMBERS:  # loop.index % 2
            return self.binop_table[operator](left, right)
        budget = _budget()
        budget.tick()
        budget.allow(_binop_size(operator, left, right), f"the result of {operator!r}")
        return budget.made(self.binop_table[operator](left, right), f"the result of {operator!r}")

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's own signature
        budget = _budget()
        budget.tick()
        receiver = getattr(__obj, "__self__", None)  # a bound method: 'x'.center
        if receiver is None and hasattr(__obj, "__wrapped__"):  # str.format, wrapped by the sandbox
            receiver = getattr(__obj.__wrapped__, "__self__", None)
        if isinstance(receiver, str):
            name = getattr(__obj, "__name__", "")
            if name == "join" and args:
                args = (list(args[0]), *args[1:])  # a generator is read once: read it here
                budget.allow(_joined_size(args[0], receiver), "the result of 'join'")
            else:
                budget.allow(_str_method_size(receiver, name, args, kwargs), f"the result of {name!r}")
        return budget.made(super().call(__context, __obj, *args, **kwargs), "the result of a call")

    def concat(self, parts):
        """Join a template's (or a block's, a macro's) output, sized before it joins."""
        budget, parts = _budget(), list(parts)  # references to strings already counted
        budget.tick()
        budget.allow(sum(map(len, parts)), "the rendered text")
        return budget.made("".join(parts), "the rendered text")

    @staticmethod
    def add_bounded(left, right):
        """``+``: at most twice what exists, so it is counted after."""
        out = left + right
        if type(out) is str:  # the hot path, inlined
            budget = _ACTIVE.get()
            if budget is not None and len(out) <= budget.max_chars and budget.built + len(out) <= budget.total:
                budget.built += len(out)
                return out
        return _budget().made(out, "the result of '+'")

    @staticmethod
    def join_bounded(join, parts: tuple) -> str:
        """``~``, sized before it joins."""
        budget = _budget()
        try:
            size = sum(map(len, parts))
        except TypeError:  # a number among the parts
            size = sum(len(p) if isinstance(p, str) else len(str(p)) for p in parts)
        budget.allow(size, "the result of '~'")
        return budget.made(join(parts), "the result of '~'")

    @staticmethod
    def loop_guard(iterable):
        """Every ``{% for %}`` iterates through this: one deadline check per iteration."""
        budget = _budget()
        for item in iterable:
            budget.tick()
            yield item


def _raise_from_template(message: Any) -> None:
    raise InvalidRequestError(f"the chat template rejected the messages: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=tuple(separators) if separators else None, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def sandboxed_environment(**options) -> BoundedSandbox:
    """A bounded, sandboxed Jinja environment with the globals chat templates expect
    (``raise_exception``, ``strftime_now``, the ``tojson`` filter).  ``options`` go to Jinja
    (``trim_blocks=True``...).  Compile with :func:`compile_template`, render with :func:`render`."""
    env = BoundedSandbox(**options)
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(name, fn) for name, fn in env.filters.items()}
    env.globals["raise_exception"] = _raise_from_template
    env.globals["strftime_now"] = _strftime_now
    env.globals.pop("lipsum", None)  # lipsum(10**6) writes hundreds of MB in one call
    return env


def compile_template(env: BoundedSandbox, source: str):
    """``source`` compiled by ``env`` with every ``for`` loop routed through the budget.

    Raises ``jinja2.TemplateSyntaxError`` (a ``jinja2.TemplateError``) on invalid Jinja."""
    with _bounded():
        tree = _GuardLoops().visit(env.parse(source))
        tree.set_environment(env)
        return env.from_string(tree)


def render(template, context: Mapping[str, Any]) -> str:
    """``template.render(**context)`` within the time and size limits (:class:`TemplateError` past them)."""
    token = _ACTIVE.set(_new_budget())  # not a contextlib manager: it costs a chat template's render 10%
    try:
        return template.render(**context)
    except RecursionError:
        raise TemplateError(_TOO_DEEP) from None
    finally:
        _ACTIVE.reset(token)
