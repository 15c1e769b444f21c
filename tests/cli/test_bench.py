"""The run order of `slotinfer bench --mixed`."""

from hypothesis import given
from hypothesis import strategies as st

from slotinfer.cli.bench import alternating_order


@given(st.integers(1, 20))
def test_alternating_order_balances_a_steady_drift(rounds):
    order = alternating_order(rounds)
    assert len(order) == 2 * rounds and order[:2] == ["continuous", "static"]
    at = {m: [i for i, o in enumerate(order) if o == m] for m in ("continuous", "static")}
    assert len(at["continuous"]) == len(at["static"]) == rounds
    # each round runs both; over even rounds both modes' mean positions are equal
    assert all(sorted(order[2 * r:2 * r + 2]) == ["continuous", "static"] for r in range(rounds))
    if rounds % 2 == 0:
        assert sum(at["continuous"]) == sum(at["static"])
