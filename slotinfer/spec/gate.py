"""When drafting pays: each row's measured acceptance, and a cost model of the verify step.

**Acceptance.**  A draft's tokens are accepted one after another until the first one the model
would not have produced.  With a per-token acceptance ``a`` (the chance a draft token is right
given the ones before it were), a verify pass of ``k`` drafted tokens yields

    E(a, k) = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)

tokens: the accepted ones plus the token the model samples after them.  :class:`Acceptance`
estimates ``a`` per row from every draft scored (``accepted`` successes and one failure when the
draft stopped short), with older drafts decaying, which is the maximum-likelihood estimate of that
geometric model rather than accepted / drafted (tokens after a miss were never tested).  A draft
is credited token by token as the row's tokens come, not once it is settled: a shut gate opens
the step after a shadow draft's first token proves right, where waiting for the whole draft (up to
``max_k`` tokens) kept it shut through most of a short copied span.

**Cost.**  A step over ``P`` positions costs ``1 + c (P - 1)`` in units of a one-row step, with
``c = position_cost``, or what a table of measured steps says (``step_costs``): on the 2-core CPU
the verify step of SmolLM2-135M costs 1.15, 1.24, 1.52, 1.74, 2.14, 2.35 and 2.65 one-row steps at
2..8 positions, and 4.1 at 9, which no line fits.  A single row drafting ``k`` tokens gains
``E(a, k) / cost(k + 1)``: on that table 1.77x at a = 0.7 (k = 2), 2.59x at a = 0.95 (k = 4).

**Policy.**  Past ``bandwidth_rows`` live rows the step is compute-bound and every verified
position costs as much as a row's token: nobody drafts.  Below it, :func:`plan` hands out verified
positions one at a time to the row whose next position is most likely accepted (``a^j`` for its
``j``-th draft token) while that raises the step's expected tokens per unit of cost, and never
past ``bandwidth_rows`` positions in all.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


def expected_tokens(a: float, k: int) -> float:
    """``E(a, k)``: tokens a verify pass of ``k`` drafted tokens yields at acceptance ``a``."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass(frozen=True)
class CostModel:
    """The constants of the verify step's cost; see the module docstring.

    ``position_cost``: one extra verified position as a fraction of a one-row step.
    ``bandwidth_rows``: positions per step below which a step is bandwidth-bound.
    ``max_k``: the longest draft a row verifies in one step.
    ``sync_cost``: what a step loses, as a fraction of a one-row step, when the host reads the step
    before it back first (to draft from its tokens) instead of building it while that one runs.
    ``step_costs``: measured costs of steps of 1, 2, ... positions in one-row steps (the first 1.0,
    each at least the one before), where a line fits them badly; past the table, and with none, the
    line ``1 + position_cost (P - 1)``.
    """

    position_cost: float = 0.31
    bandwidth_rows: int = 16
    max_k: int = 8
    sync_cost: float = 0.0
    step_costs: tuple[float, ...] = ()

    def __post_init__(self):
        if not self.position_cost > 0 or self.bandwidth_rows < 1 or self.max_k < 0 or not self.sync_cost >= 0:
            raise ValueError("need position_cost > 0, bandwidth_rows >= 1, max_k >= 0 and sync_cost >= 0, got "
                             f"{self.position_cost}, {self.bandwidth_rows}, {self.max_k}, {self.sync_cost}")
        c = tuple(self.step_costs)
        if c and (c[0] != 1.0 or any(not b >= a for a, b in zip(c, c[1:]))):
            raise ValueError(f"step_costs must start at 1.0 and never fall (one-row steps), got {c}")
        object.__setattr__(self, "step_costs", c)

    def step_cost(self, positions: int) -> float:
        c = self.step_costs
        if positions <= len(c):
            return c[positions - 1]
        last = len(c) or 1
        return (c[-1] if c else 1.0) + self.position_cost * (positions - last)

    def gain(self, a: float, k: int) -> float:
        """Tokens per unit of cost for one row alone, against one token per one-row step."""
        return expected_tokens(a, k) / self.step_cost(k + 1)

    def best_k(self, a: float, limit: int | None = None) -> int:
        """The draft length, ``0..min(limit, max_k)``, that maximizes :meth:`gain` (0: do not draft)."""
        limit = self.max_k if limit is None else min(limit, self.max_k)
        return plan([(a, limit)], 1, self)[0]

    def draft_value(self, a: float) -> float:
        """What a step in which a lone row drafts at acceptance ``a`` gains over one that does not,
        in one-row steps: ``gain(a, best_k(a)) - 1`` (0 where drafting does not pay)."""
        return max(0.0, self.gain(a, self.best_k(a, self.bandwidth_rows - 1)) - 1.0)

    def opens(self, a: float) -> bool:
        """Whether a row alone would draft at acceptance ``a``: its first position pays iff ``a`` is
        more than what the position adds to a one-row step."""
        added = self.step_costs[1] - 1.0 if len(self.step_costs) > 1 else self.position_cost
        return a > added and self.max_k > 0

    def compute_bound(self, live: int) -> bool:
        return live >= self.bandwidth_rows


def plan(candidates: list[tuple[float, int]], live: int, cost: CostModel) -> list[int]:
    """How many draft tokens each candidate row verifies this step.

    ``candidates``: ``(acceptance, proposed length)`` for each row that has a draft; ``live``: the
    rows in the step, drafting or not.  Returns one ``k`` per candidate, each at most its proposed
    length and ``cost.max_k``; all 0 when the step is compute-bound.
    """
    ks = [0] * len(candidates)
    if cost.compute_bound(live):
        return ks
    positions, tokens = live, float(live)
    heap = [(-a, i, a) for i, (a, n) in enumerate(candidates) if n > 0 and a > 0 and cost.max_k > 0]
    heapq.heapify(heap)
    while heap and positions < cost.bandwidth_rows:
        neg, i, a = heap[0]
        value = -neg  # a^j: the chance the row's next draft position is accepted
        # one more position must raise the step's expected tokens per unit of cost
        if (tokens + value) * cost.step_cost(positions) <= tokens * cost.step_cost(positions + 1):
            break
        ks[i] += 1
        positions += 1
        tokens += value
        if ks[i] < min(candidates[i][1], cost.max_k):
            heapq.heapreplace(heap, (neg * a, i, a))
        else:
            heapq.heappop(heap)
    return ks


class Acceptance:
    """A row's per-token acceptance ``a`` for one draft source, from the drafts scored so far.

    Starts at 0 (``rejected=1``): a row drafts only once drafts scored in the shadow (proposed,
    not verified, compared with the tokens that came) show it would pay.
    """

    __slots__ = ("accepted", "rejected", "decay")

    def __init__(self, decay: float = 0.9, *, accepted: float = 0.0, rejected: float = 1.0):
        self.decay, self.accepted, self.rejected = decay, accepted, rejected

    def record(self, drafted: int, accepted: int) -> None:
        """One draft of ``drafted`` tokens whose first ``accepted`` were right."""
        if drafted <= 0:
            return
        self.update(accepted, accepted < drafted)

    def update(self, right: int, missed: bool) -> None:
        """A draft's next ``right`` tokens proved right, then (``missed``) one proved wrong."""
        self.accepted = self.decay * self.accepted + right
        self.rejected = self.decay * self.rejected + (1.0 if missed else 0.0)

    @property
    def rate(self) -> float:
        total = self.accepted + self.rejected
        return self.accepted / total if total > 0 else 0.0
