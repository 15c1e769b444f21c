"""A grammar compile child: run as a script by path (``python .../_grammar_worker.py``), importing
llguidance (and tokenizers) alone, never the slotinfer package.

It reads requests from stdin and answers on stdout, each a length-prefixed pickle:

- ``("tokenizer", key, (tokenizer_json, n_vocab, eos_ids))`` builds a tokenizer (:func:`build_tokenizer`):
  answer ``("ready",)``;
- ``("compile", key, kind, value, json_options, limits)``: answer ``("ok", grammar_text)`` or
  ``("invalid", message)``.

It compiles the constraint and computes its first token mask, as the server will, on a thread
whose stack is ``STACK_BYTES`` (the same as the server's compile threads): a constraint that
overflows it kills this child alone (the parent sees the pipe close and refuses the constraint),
and one that runs past the time bound is killed by the parent.
"""

import json
import pickle
import struct
import sys
import threading

STACK_BYTES = 512 << 20  # reserved lazily; about 5 KB a link of a chain: ~100,000 links, past what 1 MiB holds


def read(stream):
    head = stream.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack("<I", head)
    return pickle.loads(stream.read(n))


def write(stream, obj):
    data = pickle.dumps(obj)
    stream.write(struct.pack("<I", len(data)) + data)
    stream.flush()


def grammar_text(llguidance, kind, value, json_options):
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=json_options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":  # Lark string literals take JSON's escapes
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value))
    if kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(value)
    raise AssertionError(kind)


def build_tokenizer(llguidance, text, n_vocab, eos):
    """The llguidance tokenizer of a ``tokenizer.json`` text, with its added tokens that are not special
    (Qwen 3's ``<think>``, ``</think>``, ``<tool_call>``) as the text they are.

    Read from the JSON alone, llguidance marks every added token as special: no regex, schema or
    grammar text matches its bytes, while its tokenizing of a constraint's forced text (``</think>`` in
    a regex) finds the token, so the mask allows it and the matcher refuses it a step later.  Such a
    token's text is part of the output (only special tokens are left out), so the constraint must see
    it as text: llguidance is then given each token's bytes itself, and a tokenizer that spells
    special tokens' text as text."""
    base = llguidance.LLTokenizer(text, n_vocab=n_vocab, eos_token=eos)
    from tokenizers import Tokenizer

    hf = Tokenizer.from_str(text)
    added = hf.get_added_tokens_decoder()
    if all(t.special for t in added.values()):
        return base
    hf.encode_special_tokens = True  # "<|im_end|>" in a regex is text, as its special token's marker is not

    class Vocabulary:  # what llguidance.TokenizerWrapper reads
        def __init__(self):
            self.eos_token_id, self.bos_token_id = eos[0], None
            self.tokens = [base.decode_bytes([i]) for i in range(n_vocab)]
            for i, t in added.items():
                if i < n_vocab:
                    self.tokens[i] = t.content.encode()
            self.special_token_ids = sorted(i for i, t in added.items() if t.special and i < n_vocab)

        def __call__(self, data: bytes):
            return hf.encode(data.decode("utf-8", errors="replace"), add_special_tokens=False).ids

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocabulary()), n_vocab=n_vocab, eos_token=eos)


def compile_checked(llguidance, tokenizer, text, limits):
    """(matcher, None) with its first mask computed, or (None, the error)."""
    import llguidance.numpy as lnp
    import numpy as np

    matcher = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=limits)
    if matcher.is_error():
        return None, matcher.get_error()
    mask = np.zeros((1, (tokenizer.vocab_size + 31) // 32), dtype=np.int32)
    lnp.fill_next_token_bitmask(matcher, mask, 0)
    if matcher.is_error():
        return None, matcher.get_error()
    if not mask.any():
        return None, "no token can start an output it accepts"
    return matcher, None


def serve():
    import llguidance

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    tokenizers = {}
    while True:
        request = read(stdin)
        if request is None:
            return
        if request[0] == "tokenizer":
            _, key, (text, n_vocab, eos) = request
            tokenizers[key] = build_tokenizer(llguidance, text, n_vocab, eos)
            write(stdout, ("ready",))
            continue
        _, key, kind, value, json_options, limits = request
        try:
            grammar = grammar_text(llguidance, kind, value, json_options)
        except ValueError as e:
            write(stdout, ("invalid", f"could not be read: {e}"))
            continue
        _, error = compile_checked(llguidance, tokenizers[key], grammar,
                                   llguidance.LLParserLimits(**limits) if limits else None)
        write(stdout, ("ok", grammar) if error is None else ("invalid", error))


if __name__ == "__main__":
    threading.stack_size(int(sys.argv[1]) if len(sys.argv) > 1 else STACK_BYTES)
    worker = threading.Thread(target=serve)
    worker.start()
    worker.join()
