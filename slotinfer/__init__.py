"""slotinfer: continuous-batching inference of decoder LLMs on MLX.

    >>> import slotinfer
    >>> model = slotinfer.load("path/to/hf-folder")
    >>> model.generate("Hello", max_tokens=16).text
"""

import sys as _sys

from .cpu import blas as _blas

# An optimized BLAS must be loaded globally before mlx.core is first imported:
# MLX's f32 matmul on Linux CPU links a reference BLAS otherwise (~30x slower).
BLAS = _blas.ensure_blas()

from .errors import *  # noqa: E402,F401,F403
from .loading.loader import load  # noqa: E402,F401
from .model import Model  # noqa: E402,F401
from .types import BatchResult, ClassifyResult, Completion  # noqa: E402,F401
from .handle import Handle, StreamEvent  # noqa: E402,F401
from .inferencer import Inferencer  # noqa: E402,F401
from .queues import QueuedRequest as Request  # noqa: E402,F401  (the serve_queue record)
from .text import tools  # noqa: E402  (text/tools.py, also at slotinfer.tools: the path earlier docs showed)

_sys.modules[__name__ + ".tools"] = tools

__version__ = "0.1.0"

__all__ = ["load", "Model", "Inferencer", "Request", "Handle", "StreamEvent", "Completion", "BatchResult",
           "ClassifyResult", "BLAS", "SlotinferError", "InvalidRequestError", "PromptTooLongError", "QueueFull",
           "EngineClosed", "ModelLoadError", "ModelNotFoundError", "UnsupportedModelError", "ConfigError",
           "WeightError", "TokenizerError", "EngineError", "Cancelled", "OutOfMemoryError", "GrammarError",
           "GrammarBusy"]
