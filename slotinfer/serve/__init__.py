"""An OpenAI-compatible HTTP server over one :class:`~slotinfer.Inferencer` (the 'serve' extra:
``pip install -e ".[serve]"`` in the checkout).

    $ slotinfer serve path/to/model --slots 32 --max-queue 64

or, inside a service of your own:

    >>> from slotinfer.serve import build_app
    >>> app = build_app(slotinfer.Inferencer(model, slots=32))   # an ASGI app

See docs/serve.md for the endpoints and parameters.
"""

__all__ = ["build_app", "APIError"]


def __getattr__(name):
    # Lazily, so that the command line (which lists `serve`) works without the 'serve' extra.
    if name == "build_app":
        from .app import build_app
        return build_app
    if name == "APIError":
        from .errors import APIError
        return APIError
    raise AttributeError(name)
