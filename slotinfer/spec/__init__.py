"""Draft sources for exact speculative decoding, and the gate that decides when drafting pays.

Nothing here touches the model or the engine: a draft is a list of token ids, proposed from what
a row has seen (:class:`PromptLookup`), from what rows with the same ``cache_salt`` have seen
(:class:`SuffixPool`), or from what the row's constraint forces (:class:`ForcedTokens`);
:class:`Drafter` asks them in order behind each row's measured acceptance and the step's cost model
(:mod:`slotinfer.spec.gate`).  docs/speculative.md describes them and their measured acceptance.
"""

from .drafter import Drafter, Row
from .forced import ForcedTokens
from .gate import Acceptance, CostModel, expected_tokens, plan
from .lookup import NgramIndex, PromptLookup
from .pool import SuffixPool

__all__ = ["Acceptance", "CostModel", "Drafter", "ForcedTokens", "NgramIndex", "PromptLookup", "Row",
           "SuffixPool", "expected_tokens", "plan"]
