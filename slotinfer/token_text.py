"""Each token's own text and bytes, as logprobs show them (the server's and ``slotinfer generate``'s)."""

from __future__ import annotations


class TokenText:
    """Each token's own bytes and text, for logprobs (cached: bounded by the vocabulary).

    A byte-level BPE token (GPT-2's byte-to-character map) or a ``<0xNN>`` byte token may hold
    part of a UTF-8 character: its ``bytes`` are exact, its text shows what decodes.
    """

    def __init__(self, tokenizer):
        import tokenizers

        self.tokenizer, self._cache = tokenizer, {}
        self._byte_level = isinstance(tokenizer.backend.decoder, tokenizers.decoders.ByteLevel)
        self._unbyte = {c: b for b, c in _bytes_to_unicode().items()}

    def __call__(self, token: int) -> tuple[str, bytes]:
        got = self._cache.get(token)
        if got is None:
            got = self._cache[token] = self._compute(token)
        return got

    def text(self, token: int) -> str:
        return self(token)[0]

    def _compute(self, token: int) -> tuple[str, bytes]:
        tok = self.tokenizer
        piece = tok.id_to_token(token) if 0 <= token < tok.vocab_size else None
        data = None
        if piece is not None and tok.is_byte_token(token):
            data = bytes([int(piece[3:5], 16)])
        elif piece is not None and self._byte_level and all(c in self._unbyte for c in piece):
            data = bytes(self._unbyte[c] for c in piece)
        text = tok.decode([token])
        return text, data if data is not None else text.encode("utf-8")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 byte values to printable characters (byte-level BPE vocabularies)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out
