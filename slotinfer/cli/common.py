"""Small pieces every command uses: argparse types, a closed stdout, the ``--ray`` options."""

from __future__ import annotations

import argparse
import os
import sys


class DefaultsShown(argparse.RawDescriptionHelpFormatter):
    """--help that ends each option's text with its default, where it has one worth showing (not None or
    off) that the text does not already give."""

    def _get_help_string(self, action):
        text = action.help or ""
        if not action.option_strings or action.default in (None, False, argparse.SUPPRESS) or "(default" in text:
            return text
        return text + " (default: %(default)s)"


def positive_int(text: str) -> int:
    """argparse ``type`` of a count: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "t": 1000**4, "tb": 1000**4}


def draft_tokens(text: str) -> int:
    """argparse ``type`` of ``--draft-tokens``: an int in 1..32."""
    n = positive_int(text)
    if n > 32:
        raise argparse.ArgumentTypeError(f"expected an int in 1..32, got {text!r}")
    return n


def add_speculative_flags(parser):
    """``--speculative`` and ``--draft-tokens`` (docs/speculative.md)."""
    parser.add_argument("--speculative", nargs="?", const="ngram", choices=["ngram"], default=None,
                        help="draft tokens from n-grams of the request's own text, of other requests with the same "
                             "cache_salt and from a constraint's forced tokens, and verify them inside the batched "
                             "step where a gate expects it to pay; the output is the same (default: off)")
    parser.add_argument("--draft-tokens", type=draft_tokens, default=8, metavar="N",
                        help="the longest draft a request verifies in one step, 1..32, with --speculative")


def byte_size(text: str) -> int:
    """argparse ``type`` of a size in bytes: ``2GiB``, ``512MiB``, ``1.5GB``, ``1000000`` (>= 0)."""
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    try:
        value = float(num) * _UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"expected a size such as 2GiB, 512MiB or 1000000, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a size >= 0, got {text!r}")
    return int(value)


def stdout_closed() -> int:
    """stdout's reader went away (``| head``): stop writing and exit 1 without a traceback.

    stdout is pointed at devnull so that the interpreter's final flush does not fail again.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 1


def add_ray_flags(parser, *, generate: bool = False):
    """The ``--ray`` options of ``classify`` (or ``generate``, which also gets INPUT's column and OUT)."""
    g = parser.add_argument_group("scale-out on Ray Data (the 'ray' extra: pip install -e '.[ray]' in the checkout)")
    g.add_argument("--ray", action="store_true", help="run the file through Ray Data actors (docs/scale-out.md)")
    g.add_argument("--ray-address", metavar="ADDR", help="a running cluster's address (default: start a local one)")
    g.add_argument("--actors", type=positive_int, default=1, help="engines, one per actor (default 1)")
    g.add_argument("--batch-size", type=positive_int, default=None,
                   help="rows per actor call (default: 256 to classify, 4 x --slots to generate)")
    if generate:  # other options of generate may already name these
        have = parser._option_string_actions
        if "--output" not in have:
            g.add_argument("--output", "-o", help="with --ray: .jsonl or .parquet output, resumable")
        if "--column" not in have:
            g.add_argument("--column", help="with --ray: the input column holding the prompt (default: text)")


def ray_connect_error(address: str | None, e: BaseException) -> str:
    """What to tell a user whose ``ray.init(address=...)`` failed: a cluster that wants its token
    (Ray's token authentication, on by default for ``ray start --head`` since Ray 2.59) or no cluster."""
    from ray.exceptions import AuthenticationError

    cause: BaseException | None = e
    token = False
    for _ in range(8):  # Ray wraps the cause: a ConnectionError from a RuntimeError that quotes the
        if cause is None:  # AuthenticationError's traceback in its message
            break
        token = token or isinstance(cause, AuthenticationError) or "InvalidAuthToken" in str(cause)
        cause = cause.__cause__ or cause.__context__
    if token:
        return (f"the Ray cluster at {address!r} asks for its token: set RAY_AUTH_MODE=token here, with the token "
                "that 'ray get-auth-token' prints on its head node in RAY_AUTH_TOKEN (or in ~/.ray/auth_token)")
    return (f"cannot reach a Ray cluster at {address!r}: {e}; start one with 'ray start --head' "
            "(or leave out --ray-address to start a local one)")
