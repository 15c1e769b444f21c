"""Placeholder until the BLAS loader lands (being written)."""
from dataclasses import dataclass


@dataclass(frozen=True)
class BlasInfo:
    name: str
    path: str | None
    optimized: bool


def ensure_blas() -> BlasInfo:
    return BlasInfo("reference", None, False)
