"""``slotinfer generate``: one prompt streams its text as it comes; many prompts write one JSON
record each (in input order) with a progress bar on stderr."""

from __future__ import annotations

import argparse
import json
import sys
import time


def add_parser(sub):
    from .common import add_speculative_flags, positive_int

    p = sub.add_parser("generate", help="generate for prompts (arguments, or one per stdin line)")
    p.add_argument("--model", required=True, help="a model folder, a GGUF file, or a hub id (org/name, org/name:file.gguf)")
    p.add_argument("prompts", nargs="*", help="prompts; read from stdin, one per line, when none")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, help="prompt i draws with seed + i (reproducible in any batch)")
    p.add_argument("--stop", action="append", help="a stop string (repeat for several)")
    p.add_argument("--logprobs", type=int, nargs="?", const=0, metavar="N",
                   help="record each token (its text and id) with its logprob, and the top N alternatives")
    p.add_argument("--json-schema", metavar="FILE",
                   help="a JSON schema file: every output is JSON valid against it (docs/structured-output.md)")
    p.add_argument("--regex", help="every output matches this regular expression in full")
    p.add_argument("--choice", action="append", help="every output is one of these strings (repeat for each)")
    p.add_argument("--grammar", metavar="FILE", help="a Lark grammar file every output follows")
    p.add_argument("--slots", type=positive_int, default=32)
    add_speculative_flags(p)
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--system", help="a system message (implies --chat)")
    p.add_argument("--output", "-o", help="write the JSON records to this file (one per line)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr over many prompts (default: when stderr is a terminal)")
    return p


def check(parser, args):
    """The run-wide values, checked before the model loads: a usage error (exit 2), not one error per prompt."""
    from .. import request
    from ..errors import InvalidRequestError

    for flag in ("json_schema", "grammar"):  # read once, here: a missing file is a usage error
        path = getattr(args, flag)
        if path is not None:
            try:
                with open(path, encoding="utf-8") as f:
                    setattr(args, flag, f.read())
            except (OSError, UnicodeDecodeError) as e:
                parser.error(f"argument --{flag.replace('_', '-')}: cannot read {path!r}: {e}")
    try:
        request.check({**_params(args), "seed": args.seed})
    except InvalidRequestError as e:
        flag = "--logprobs" if e.param == "top_logprobs" else "--" + e.param.replace("_", "-")
        parser.error(f"argument {flag}: {e}")


def _params(args) -> dict:
    """The generation parameters every prompt of the run shares (each draws with a seed of its own)."""
    params = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                  min_p=args.min_p, repetition_penalty=args.repetition_penalty, stop=args.stop,
                  json_schema=args.json_schema, regex=args.regex, choice=args.choice, grammar=args.grammar)
    if args.logprobs is not None:
        params.update(logprobs=True, top_logprobs=args.logprobs)
    return params


def run(args) -> int:
    """0 when every prompt got its text; a single prompt's error exits 2, and 1 when some of many failed
    (their records carry the error)."""
    import slotinfer
    from ..errors import InvalidRequestError

    model = slotinfer.load(args.model)
    if args.max_tokens >= model.context_length:
        raise InvalidRequestError(f"--max-tokens {args.max_tokens} is beyond the model's context of "
                                  f"{model.context_length} tokens (prompt and output together); give at most "
                                  f"{model.context_length - 1}")
    texts = args.prompts or [line.rstrip("\r\n") for line in sys.stdin if line.strip()]
    chat = args.chat or args.system is not None
    params = _params(args)
    prompts, failed = [], {}
    for i, text in enumerate(texts):
        try:
            prompts.append(model.encode_prompt(_render(model, text, args.system) if chat else text))
        except Exception as e:  # this prompt's own error record; the others still run
            prompts.append(None)
            failed[i] = e
    if len(texts) == 1 and failed:  # the one prompt asked for cannot run: an error, not a record
        raise failed[0]
    live = [ids for ids in prompts if ids is not None]
    out = _open_output(args.output, "-" if not args.prompts else None) if args.output else None
    try:
        if not live:
            return _failures(_write_all(texts, [None] * len(texts), failed, out or sys.stdout), len(texts))
        max_len = max(len(ids) + min(args.max_tokens, model.context_length - len(ids)) for ids in live)
        with slotinfer.Inferencer(model, slots=min(args.slots, len(live)), max_len=max(max_len, 2),
                                  speculative=args.speculative, draft_tokens=args.draft_tokens) as inf:
            handles = [None if ids is None else _submit(inf, ids, params, args.seed, i, failed)
                       for i, ids in enumerate(prompts)]
            if len(texts) == 1 and handles[0] is not None and args.logprobs is None:
                _stream(handles[0])  # one prompt: its text as it comes
                if out is not None:
                    _write_all(texts, handles, failed, out, model=model)
                return 0
            show = args.progress if args.progress is not None else sys.stderr.isatty()
            errors = _write_all(texts, handles, failed, out or sys.stdout, _Progress(len(texts)) if show else None,
                                model=model)
    finally:
        if out is not None:
            out.close()
    return _failures(errors, len(texts))


def _failures(errors: int, total: int) -> int:
    if errors:
        print(f"slotinfer generate: {errors} of {total} prompts failed (their records say why)", file=sys.stderr)
    return 1 if errors else 0


def _open_output(path: str, source):
    """``--output`` opened for writing; never the prompts' own file (stdin redirected from it)."""
    from .jobs import UsageError, check_not_input
    from ..errors import InvalidRequestError

    try:
        if source is not None:
            check_not_input(path, source)
        return open(path, "w", encoding="utf-8")
    except UsageError as e:
        raise InvalidRequestError(str(e)) from None
    except OSError as e:
        raise InvalidRequestError(f"--output: cannot write {path!r}: {e.strerror}") from None


def _render(model, text, system):
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user",
                                                                                            "content": text}]
    return model.apply_chat_template(messages)


def _submit(inf, ids, params, seed, i, failed):
    try:
        return inf.submit(ids, seed=None if seed is None else (seed + i) % 2**32, **params)
    except Exception as e:
        failed[i] = e
        return None


def _stream(handle):
    for ev in handle:
        sys.stdout.write(ev.text)
        sys.stdout.flush()
    handle.result()
    sys.stdout.write("\n")
    sys.stdout.flush()  # a closed pipe fails here, inside main, rather than at exit


def _write_all(texts, handles, failed, out, progress=None, model=None) -> int:
    """One record per prompt, in input order (the prompt recorded is the user's text, never the
    template); returns how many are errors.  With logprobs, tokens are shown by their text, as the
    server shows them, with their ids beside."""
    from ..text.token_text import TokenText

    errors, text_of = 0, TokenText(model.tokenizer).text if model is not None else None
    for i, (text, h) in enumerate(zip(texts, handles)):
        rec = {"prompt": text}
        try:
            if h is None:
                raise failed[i]
            c = h.result()
            rec.update(text=c.text, finish_reason=c.finish_reason, prompt_tokens=c.prompt_tokens,
                       completion_tokens=len(c.tokens))
            if c.logprobs is not None:
                rec.update(tokens=[text_of(t) for t in c.tokens], token_ids=c.tokens, logprobs=c.logprobs)
            if c.top_logprobs is not None:
                rec["top_logprobs"] = [[{"token": text_of(t), "id": t, "logprob": v} for t, v in top]
                                       for top in c.top_logprobs]
        except Exception as e:
            rec.update(text="", finish_reason="error", error=str(e))
            errors += 1
        out.write(json.dumps(rec, ensure_ascii=False) + "\n")
        if progress is not None:
            progress.update(i + 1)
    out.flush()
    if progress is not None:
        progress.close()
    return errors


class _Progress:
    """``[#####     ] 50/100  12.3 prompts/s`` on stderr, redrawn at most ten times a second."""

    def __init__(self, total: int):
        self.total, self.t0, self.drawn = total, time.perf_counter(), 0.0

    def update(self, done: int):
        now = time.perf_counter()
        if done < self.total and now - self.drawn < 0.1:
            return
        self.drawn = now
        width = 30
        fill = width * done // self.total
        rate = done / (now - self.t0) if now > self.t0 else 0.0
        sys.stderr.write(f"\r[{'#' * fill}{' ' * (width - fill)}] {done}/{self.total}  {rate:.1f} prompts/s")
        sys.stderr.flush()

    def close(self):
        sys.stderr.write("\n")
        sys.stderr.flush()
