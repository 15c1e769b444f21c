"""Stop strings: where the earliest one begins in generated text (the reference generate and the engine alike)."""


def find_stop(text: str, stops) -> int | None:
    """Index where the earliest stop string begins in ``text``, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None
