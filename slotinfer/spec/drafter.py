"""The drafter: a row's drafting state, the sources asked in order, and the per-step choice.

Each step the engine asks :meth:`Drafter.step` for every live row's draft, verifies the drafts in
its one batched pass, and hands each row the tokens it took with :meth:`Drafter.append`.  Every
draft proposed, verified or not, is scored against the tokens that actually came, so a row whose
gate is shut still learns when copying starts (a shut gate costs a dictionary lookup a step, not
a verified position).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .forced import ForcedTokens
from .gate import Acceptance, CostModel, plan
from .lookup import NgramIndex, PromptLookup
from .pool import SuffixPool


class Row:
    """One request's drafting state: its tokens (prompt and output) with their n-gram index, its
    ``cache_salt``, its constraint's matcher (or None), and the acceptance of each source."""

    __slots__ = ("index", "salt", "matcher", "acceptance", "pending", "fed", "found")

    def __init__(self, index: NgramIndex, *, salt: str | None = None, matcher=None,
                 acceptance: dict[str, Acceptance] | None = None):
        self.index, self.salt, self.matcher = index, salt, matcher
        self.acceptance = acceptance or {}
        # source -> (start, draft, verified, credited): drafts waiting for the tokens that score them,
        # with how many of their first tokens already proved right and were credited to the gate
        self.pending: dict[str, tuple[int, list[int], bool, int]] = {}
        self.fed = 0  # tokens already given to the suffix pool
        # how often a source whose gate is open has had a draft, over recent steps (decayed)
        self.found = 1.0

    @property
    def tokens(self) -> list[int]:
        return self.index.tokens


class Drafter:
    """Draft sources asked cheapest first, behind a per-row gate and a per-step policy.

        >>> drafter = Drafter()
        >>> row = drafter.row(prompt_ids, salt=None, matcher=None)
        >>> drafts = drafter.step([row])          # [[d1, ..., dk]] or [[]], one list per row
        >>> drafter.append(row, taken)            # the tokens the verify pass accepted, plus its own
        >>> drafter.finish(row)

    ``sources``: objects with ``name`` and ``propose(row, k) -> list[int]``, and optionally
    ``prior``, the ``(accepted, misses)`` a new row's acceptance starts from (default ``(0, 1)``:
    shut until shadow drafts show it pays), and ``applies(row)``, whether it can ever draft for a row
    (default: always; a row has a gate only for the sources that apply to it); by default forced tokens, then prompt lookup, then a
    suffix pool shared by this drafter's rows.  A constrained row's drafts from other sources are
    cut where its grammar would refuse them (``LLMatcher.validate_tokens``).
    """

    def __init__(self, sources: Sequence | None = None, *, lookup: PromptLookup | None = None,
                 pool: SuffixPool | None = None, cost: CostModel | None = None, decay: float = 0.9):
        self.lookup = lookup or PromptLookup()
        self.pool = pool if pool is not None else SuffixPool()
        self.sources = list(sources) if sources is not None else [ForcedTokens(), self.lookup, self.pool]
        self._learns = any(s is self.pool for s in self.sources)
        self.cost = cost or CostModel()
        self.decay = decay
        self.drafted = self.accepted = 0  # tokens of verified drafts, and those accepted

    def row(self, prompt: Iterable[int], *, salt: str | None = None, matcher=None) -> Row:
        row = Row(self.lookup.index(prompt), salt=salt, matcher=matcher)
        for s in self.sources:
            if hasattr(s, "applies") and not s.applies(row):
                continue  # e.g. forced tokens for a row without a constraint: no gate, never asked
            accepted, misses = getattr(s, "prior", (0.0, 1.0))
            row.acceptance[s.name] = Acceptance(self.decay, accepted=accepted, rejected=misses)
        self._feed(row)
        return row

    def propose(self, row: Row, k: int) -> tuple[str, list[int]] | None:
        """The first source with a draft for ``row``, and that draft (at most ``k`` tokens)."""
        for source in self.sources:
            if source.name not in row.acceptance:
                continue
            draft = self._draft(row, source, k)
            if draft:
                return source.name, draft
        return None

    def step(self, rows: Sequence[Row], live: int | None = None,
             limits: Sequence[int] | None = None) -> list[list[int]]:
        """This step's draft for each row (``[]`` where it does not speculate).

        ``live``: rows in the step (``len(rows)`` by default; more when rows that never draft share
        it).  ``limits``: the longest draft each row may verify (its tokens left, its table's room;
        default ``cost.max_k``).  A row drafts from the first source whose gate is open; the drafts
        of shut sources are kept in the shadow and scored when the tokens come.
        """
        live = len(rows) if live is None else live
        chosen: list[tuple[Row, str, list[int]] | None] = []
        candidates, at = [], []
        for i, row in enumerate(rows):
            pick = None
            limit = self.cost.max_k if limits is None else min(self.cost.max_k, limits[i])
            for source in self.sources:
                if source.name not in row.acceptance:
                    continue
                draft = self._draft(row, source, limit) if limit > 0 else []
                if not draft:
                    continue
                a = row.acceptance[source.name].rate
                if self.cost.opens(a):
                    pick = (row, source.name, draft)
                    break
                self._shadow(row, source.name, draft)
            row.found = self.decay * row.found + (1.0 - self.decay) * (pick is not None)
            chosen.append(pick)
            if pick is not None:
                at.append(len(chosen) - 1)
                candidates.append((row.acceptance[pick[1]].rate, len(pick[2])))
        ks = plan(candidates, live, self.cost)
        out: list[list[int]] = [[] for _ in rows]
        for i, k in zip(at, ks):
            row, name, draft = chosen[i]
            if k == 0:
                self._shadow(row, name, draft)
                continue
            out[i] = draft[:k]
            row.pending[name] = (len(row.tokens), out[i], True, 0)
            self.drafted += k
        return out

    def may_draft(self, row: Row) -> bool:
        """Whether reading ``row``'s tokens back before the next step pays: some source's gate is
        open for it (else :meth:`step` only shadows it), and the share of steps in which an open
        source has had a draft, times what a draft gains, outweighs the host and device work that
        the read-back keeps from overlapping (``cost.sync_cost``)."""
        best = max((a.rate for a in row.acceptance.values() if self.cost.opens(a.rate)), default=None)
        return best is not None and row.found * self.cost.draft_value(best) > self.cost.sync_cost

    def withdraw(self, row: Row) -> None:
        """The draft :meth:`step` gave ``row`` is not verified after all (no room for it): it is
        scored in the shadow instead."""
        for name, (start, draft, verified, credited) in list(row.pending.items()):
            if verified:
                row.pending[name] = (start, draft, False, credited)
                self.drafted -= len(draft)

    def append(self, row: Row, tokens: Iterable[int]) -> None:
        """The tokens ``row`` took this step (accepted draft tokens and the one sampled after)."""
        row.index.extend(tokens)
        self._score(row, ended=False)
        self._feed(row)

    def finish(self, row: Row) -> None:
        """The row ended.  A draft it ended inside counts what it got right among the verified
        tokens, and its gate keeps the tokens already credited, but takes no miss: what would have
        come next is unknown."""
        self._score(row, ended=True)
        row.pending.clear()
        self._feed(row)

    def _score(self, row: Row, ended: bool) -> None:
        have = row.tokens
        for name, (start, draft, verified, credited) in list(row.pending.items()):
            seen = have[start:start + len(draft)]
            right = 0
            while right < len(seen) and seen[right] == draft[right]:
                right += 1
            missed = right < len(seen)
            if right > credited or missed:  # credited as the tokens come (see slotinfer.spec.gate)
                row.acceptance[name].update(right - credited, missed)
            if missed or len(seen) == len(draft) or ended:  # a miss, the whole draft seen, or the row's end
                self.accepted += right if verified else 0
                del row.pending[name]
            else:
                row.pending[name] = (start, draft, verified, right)

    @staticmethod
    def _draft(row: Row, source, k: int) -> list[int]:
        draft = source.propose(row, k)
        if draft and row.matcher is not None and not isinstance(source, ForcedTokens):
            draft = draft[:row.matcher.validate_tokens(draft)]
        return draft

    def _shadow(self, row: Row, name: str, draft: list[int]) -> None:
        if name not in row.pending:
            row.pending[name] = (len(row.tokens), draft, False, 0)

    def _feed(self, row: Row) -> None:
        if self._learns and row.fed < len(row.tokens):
            self.pool.learn(row.tokens, row.salt, start=row.fed)
            row.fed = len(row.tokens)
