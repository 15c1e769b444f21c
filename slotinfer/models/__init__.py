"""Decoder models: one transformer, per-family switches read from config.json."""

from .config import SUPPORTED_MODEL_TYPES, ModelConfig, expected_shapes, parse_config
from .transformer import Transformer

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelConfig", "Transformer", "expected_shapes", "parse_config"]
