"""An OpenAI-compatible HTTP server over one :class:`~slotinfer.Inferencer` (``pip install "slotinfer[serve]"``).

    $ slotinfer serve path/to/model --slots 32 --max-queue 64

or, inside a service of your own:

    >>> from slotinfer.serve import build_app
    >>> app = build_app(slotinfer.Inferencer(model, slots=32))   # an ASGI app

See docs/serve.md for the endpoints and parameters.
"""

from .app import build_app  # noqa: F401
from .errors import APIError  # noqa: F401

__all__ = ["build_app", "APIError"]
