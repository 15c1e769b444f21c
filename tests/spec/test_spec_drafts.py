"""Draft sources and the gate of speculative decoding (slotinfer.spec), checked as properties."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import slotinfer
from slotinfer.spec import Acceptance, CostModel, Drafter, ForcedTokens, NgramIndex, PromptLookup, SuffixPool, plan

tokens_st = st.lists(st.integers(0, 4), max_size=60)  # a small alphabet: repeats are common


def brute_force(tokens, k, max_n, min_n):
    """The longest suffix (max_n down to min_n) with an earlier occurrence, most recent first."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for p in range(len(tokens) - n - 1, -1, -1):
            if tokens[p:p + n] == suffix:
                return tokens[p + n:p + n + k]
    return []


@st.composite
def sizes(draw):
    min_n = draw(st.integers(1, 4))
    return draw(st.integers(min_n, 6)), min_n


@given(tokens_st, st.integers(0, 10), sizes())
def test_lookup_proposes_the_continuation_of_the_latest_earlier_occurrence(tokens, k, n):
    index = NgramIndex(tokens, max_n=n[0], min_n=n[1])
    draft = index.propose(k)
    assert draft == brute_force(tokens, k, *n)
    assert len(draft) <= k


@given(tokens_st, st.lists(st.integers(0, 8), max_size=8), sizes(), st.integers(1, 10))
def test_the_incremental_index_equals_one_built_at_once(tokens, cuts, n, k):
    index = NgramIndex(max_n=n[0], min_n=n[1])
    at = 0
    for c in cuts + [len(tokens)]:
        index.extend(tokens[at:at + c])
        at += c
        whole = NgramIndex(tokens[:at], max_n=n[0], min_n=n[1])
        assert index.tokens == whole.tokens
        assert index.entries() == whole.entries()
        assert index.propose(k) == whole.propose(k)


def test_lookup_refuses_bad_sizes():
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramIndex(max_n=2, min_n=3)


salts = st.sampled_from([None, "a", "b"])


@given(st.lists(st.tuples(salts, st.lists(st.integers(0, 5), max_size=30)), max_size=12),
       st.integers(1, 40), st.integers(1, 3), st.lists(st.integers(0, 5), max_size=6), st.integers(0, 8))
def test_the_pool_drafts_only_from_its_salts_text_and_stays_in_budget(inserts, budget, n, context, k):
    pool = SuffixPool(n=n, max_entries=budget)
    seen = {None: [], "a": [], "b": []}
    for salt, text in inserts:
        pool.learn(text, salt)
        seen[salt].append(text)
        assert len(pool) <= budget
    for salt, texts in seen.items():
        draft = pool.follow(context, k, salt)
        assert len(draft) <= k
        grams = {tuple(t[i:i + n + 1]) for t in texts for i in range(len(t) - n)}
        path = list(context) + draft
        for i in range(len(context), len(path)):  # every drafted token followed its window in this salt's text
            assert tuple(path[i - n:i + 1]) in grams
        assert len(pool) <= budget


def test_the_pool_never_crosses_salts():
    pool = SuffixPool(n=2)
    pool.learn([1, 2, 3, 4, 5], "tenant-a")
    assert pool.follow([1, 2], 3, "tenant-a") == [3, 4, 5]
    assert pool.follow([1, 2], 3, "tenant-b") == []
    assert pool.follow([1, 2], 3, None) == []
    pool.learn([1, 2, 9], None)
    assert pool.follow([1, 2], 3, None) == [9]
    assert pool.follow([1, 2], 3, "tenant-a") == [3, 4, 5]


def test_the_pool_evicts_the_least_recently_used():
    pool = SuffixPool(n=1, max_entries=2)
    pool.learn([1, 2], "s")  # 1 -> 2
    pool.learn([3, 4], "s")  # 3 -> 4
    assert pool.follow([1], 1, "s") == [2]  # 1 is now the most recent
    pool.learn([5, 6], "s")  # evicts 3 -> 4
    assert pool.follow([3], 1, "s") == [] and pool.follow([1], 1, "s") == [2] and pool.follow([5], 1, "s") == [6]


# -- the gate ---------------------------------------------------------------------------------

@given(st.floats(0, 1), st.integers(0, 12), st.floats(0.05, 2.0))
def test_best_k_maximizes_the_single_row_gain(a, limit, c):
    cost = CostModel(position_cost=c, max_k=8)
    k = cost.best_k(a, limit)
    gains = [cost.gain(a, j) for j in range(min(limit, 8) + 1)]
    assert gains[k] >= max(gains) - 1e-9


@st.composite
def step_tables(draw, convex=False):
    """A table of steps of 1.. positions in one-row steps: 1.0, then never falling (``convex``: each
    step's rise at least the one before)."""
    rises = draw(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=9))
    if convex:
        rises = sorted(rises)
    table = [1.0]
    for r in rises:
        table.append(table[-1] + r)
    return tuple(table)


@given(st.floats(0, 1), st.integers(0, 12), step_tables(convex=True), st.floats(0.05, 2.0))
def test_best_k_on_a_table_of_steps_maximizes_the_gain(a, limit, table, c):
    """On measured step costs (convex ones), the draft length maximizes tokens per unit of cost, past
    the table too (where the line of ``position_cost`` goes on from the table's last step)."""
    cost = CostModel(position_cost=max(c, table[-1] - table[-2]), max_k=12, step_costs=table)
    k = cost.best_k(a, limit)
    gains = [cost.gain(a, j) for j in range(min(limit, 12) + 1)]
    assert gains[k] >= max(gains) - 1e-9
    assert cost.step_cost(len(table) + 2) == pytest.approx(table[-1] + 2 * cost.position_cost)


@given(st.floats(0, 1), st.integers(1, 12), step_tables())
def test_a_draft_stops_where_one_more_token_would_not_pay(a, limit, table):
    """On any table the plan stops where one more position would lower the expected tokens per unit
    of cost, and a row whose first position costs more than its acceptance never drafts."""
    cost = CostModel(position_cost=0.5, max_k=12, step_costs=table)
    k = cost.best_k(a, limit)
    if k < min(limit, 12) and a > 0:
        assert cost.gain(a, k + 1) <= cost.gain(a, k) + 1e-12
    if len(table) > 1 and a <= table[1] - 1.0:
        assert k == 0 and not cost.opens(a)


def test_a_table_where_a_line_misleads():
    """A cheap second position and a dear third (a row tile's edge): a line through the table would
    draft two tokens at a = 0.9; the table drafts one."""
    table = (1.0, 1.05, 3.0)
    assert CostModel(position_cost=1.0, max_k=2, step_costs=table).best_k(0.9) == 1
    assert CostModel(position_cost=1.0, max_k=2).best_k(0.9) == 0  # the line from 1 to 3: not even one
    assert CostModel(position_cost=0.05, max_k=2).best_k(0.9) == 2  # the line of the first rise: two


@pytest.mark.parametrize("table", [(1.2, 1.5), (1.0, 1.5, 1.4), (0.0,)])
def test_a_bad_table_of_steps_is_refused(table):
    with pytest.raises(ValueError, match="step_costs"):
        CostModel(step_costs=table)


@given(st.lists(st.tuples(st.floats(0, 1), st.integers(0, 10)), max_size=20), st.integers(0, 40),
       st.integers(1, 32), st.integers(0, 8))
def test_plan_stays_in_its_bounds(candidates, extra, bandwidth, max_k):
    cost = CostModel(bandwidth_rows=bandwidth, max_k=max_k)
    live = len(candidates) + extra
    ks = plan(candidates, live, cost)
    assert all(0 <= k <= min(n, max_k) for k, (_, n) in zip(ks, candidates))
    if live >= bandwidth:
        assert not any(ks)
    else:
        assert live + sum(ks) <= bandwidth


def _repetitive(length=40):
    return [7, 8, 9, 10, 11] * (length // 5)


@given(st.integers(2, 40), st.integers(0, 4))
def test_no_row_drafts_in_a_compute_bound_step(rows, extra):
    cost = CostModel(bandwidth_rows=rows)  # rows + extra live rows: compute-bound
    drafter = Drafter(cost=cost)
    batch = [drafter.row(_repetitive()) for _ in range(rows)]
    for r in batch:
        r.acceptance["lookup"] = Acceptance(accepted=50.0, rejected=0.0)  # would draft if it could
    assert drafter.step(batch, live=rows + extra) == [[]] * rows
    assert drafter.step(batch[:1], live=1)[0]  # the same row drafts when the step is bandwidth-bound


@given(st.floats(0, 100), st.floats(0, 5))
def test_sustained_rejection_turns_a_row_off(accepted, rejected):
    drafter = Drafter()
    row = drafter.row(_repetitive())
    row.acceptance["lookup"] = Acceptance(accepted=accepted, rejected=rejected)
    fresh = 100
    for _ in range(60):  # every draft is wrong at its first token
        drafter.step([row])
        drafter.append(row, [fresh])
        fresh += 1
        drafter.append(row, _repetitive(10))  # the pattern comes back, so lookup keeps proposing
    assert drafter.step([row]) == [[]]
    assert row.acceptance["lookup"].rate < 0.05


def test_shadow_drafts_open_the_gate_when_copying_starts():
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 20, 21, 22, 23]
    truth = prompt * 2  # the output copies the prompt
    drafter = Drafter()
    row = drafter.row(prompt)
    pos, drafts, accepted = len(prompt), [], 0
    while pos < len(truth):  # a verify pass: the draft's right prefix, then the model's own token
        draft = drafter.step([row])[0]
        assert draft == brute_force(row.tokens, len(draft), 4, 2)
        right = 0
        while right < len(draft) and pos + right < len(truth) and draft[right] == truth[pos + right]:
            right += 1
        drafter.append(row, truth[pos:pos + right + 1])
        pos += right + 1
        drafts.append(draft)
        accepted += right
    drafter.finish(row)  # the row ends (its last draft may reach past it)
    assert drafts[0] == []  # no evidence yet: nothing verified
    assert any(drafts) and row.acceptance["lookup"].rate > 0.5  # shadow drafts opened the gate
    assert drafter.drafted == sum(map(len, drafts)) and drafter.accepted == accepted > 0
    assert len(drafts) < len(prompt)  # fewer verify passes than tokens


def test_a_free_row_has_no_gate_for_forced_tokens_and_does_not_make_steps_wait():
    drafter = Drafter()
    row = drafter.row(list(range(30)))  # nothing to copy, no constraint
    assert "forced" not in row.acceptance and set(row.acceptance) == {"lookup", "pool"}
    assert not drafter.may_draft(row)  # every gate shut: the engine keeps its steps pipelined


@given(st.floats(0.01, 0.5), st.integers(60, 90))
def test_drafts_that_rarely_come_stop_making_steps_wait_and_copying_brings_them_back(sync_cost, fresh_steps):
    cost = CostModel(position_cost=0.2, bandwidth_rows=4, sync_cost=sync_cost)
    drafter = Drafter(cost=cost)
    row = drafter.row(list(range(100, 140)))
    row.acceptance["lookup"] = Acceptance(accepted=50.0, rejected=1.0)  # an open gate, right when it drafts
    value = cost.draft_value(row.acceptance["lookup"].rate)
    assert value > 0.5 and drafter.may_draft(row) == (value > sync_cost)
    token = 1000
    for _ in range(fresh_steps):  # new text every step: no source has a draft
        assert drafter.step([row]) == [[]]
        drafter.append(row, [token])
        token += 1
    assert not drafter.may_draft(row)  # its steps stay pipelined; the gate itself is still open
    assert row.acceptance["lookup"].rate > 0.9
    assert Drafter(cost=CostModel(position_cost=0.2, bandwidth_rows=4)).may_draft(row)  # with no sync cost
    tail = row.tokens[-8:]
    for _ in range(25):  # the row starts copying its own text: lookup drafts again
        drafter.step([row])
        drafter.append(row, tail)
    assert drafter.may_draft(row)


# -- forced tokens from a real matcher ----------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"enum": ["red", "blue"]}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
REGEX = r"ID-[0-9]{3}-(alpha|beta)-END"


@pytest.fixture(scope="module")
def tokenizers(model_dir):
    """Real tokenizers: a tiny model's trained byte-level BPE, and SmolLM2's where installed."""
    from slotinfer import default_model

    found = {"llama": slotinfer.load(model_dir("llama"))}
    if default_model.path() is not None:
        found["smollm2"] = slotinfer.load(default_model.path())
    return found


def _check_forced(model, kind, value, text):
    constraint = model.grammars.constraint({kind: value})
    constraint.wait()  # the mask thread is done with the matcher: it is this test's alone
    matcher, lltok = constraint.matcher, model.grammars.tokenizer
    drafter = Drafter()
    row = drafter.row([0], matcher=matcher)
    forced = ForcedTokens()
    total = 0
    for t in model.tokenizer.encode(text, add_special_tokens=False) + [None]:
        draft = forced.propose(row, 16)
        total += len(draft)
        assert matcher.compute_ff_tokens()[:16] == draft  # proposing left the matcher as it was
        assert lltok.decode_bytes(draft) == matcher.compute_ff_bytes()[:len(lltok.decode_bytes(draft))]
        copy = matcher.deep_copy()
        for d in draft:  # each forced token is accepted, one after another
            assert copy.consume_token(d), copy.get_error()
        if t is None:
            break
        assert matcher.consume_token(t), matcher.get_error()
    assert matcher.is_accepting()
    return total


def test_a_constrained_row_has_a_forced_gate_open_from_the_start(tokenizers):
    constraint = tokenizers["llama"].grammars.constraint({"json_schema": json.dumps(SCHEMA)})
    constraint.wait()
    drafter = Drafter()
    row = drafter.row([0], matcher=constraint.matcher)
    assert row.acceptance["forced"].rate == pytest.approx(0.9) and drafter.may_draft(row)
    assert drafter.step([row])[0] == constraint.matcher.compute_ff_tokens()[:8]  # '{"name":"' forced


names = st.text(st.characters(codec="ascii", categories=["L", "N"]), min_size=1, max_size=12)


@settings(max_examples=6)
@given(names, st.integers(0, 10**6), st.lists(st.sampled_from(["red", "blue"]), max_size=3))
def test_forced_tokens_are_accepted_one_by_one(tokenizers, name, age, tags):
    doc = json.dumps({"name": name, "age": age, "tags": tags}, separators=(",", ":"))
    for model in tokenizers.values():
        assert _check_forced(model, "json_schema", json.dumps(SCHEMA), doc) > 0  # keys are forced


@settings(max_examples=6)
@given(st.from_regex(REGEX, fullmatch=True))
def test_forced_tokens_of_a_regex(tokenizers, text):
    for model in tokenizers.values():
        assert _check_forced(model, "regex", REGEX, text) > 0


def test_a_free_row_has_no_forced_tokens():
    drafter = Drafter()
    assert ForcedTokens().propose(drafter.row([1, 2, 3]), 8) == []


def test_the_drafts_stand_apart_from_the_engine():
    """slotinfer.spec imports the standard library and itself only: the engine calls it, never the reverse."""
    import ast
    import sys
    from pathlib import Path

    for path in (Path(slotinfer.__file__).parent / "spec").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 1 or node.module.split(".")[0] in sys.stdlib_module_names, (path, node.module)
            elif isinstance(node, ast.Import):
                assert all(a.name.split(".")[0] in sys.stdlib_module_names for a in node.names), path


@settings(max_examples=6)
@given(names, st.integers(0, 10**6), st.lists(st.integers(0, 300), max_size=20))
def test_a_constrained_row_drafts_only_what_its_grammar_allows(tokenizers, name, age, noise):
    """Lookup and pool drafts copy text the grammar may refuse there; they are cut where it would."""
    model = tokenizers["llama"]
    doc = json.dumps({"name": name, "age": age, "tags": ["red"]}, separators=(",", ":"))
    ids = model.tokenizer.encode(doc, add_special_tokens=False)
    constraint = model.grammars.constraint({"json_schema": json.dumps(SCHEMA)})
    constraint.wait()  # the mask thread is done with the matcher: it is this test's alone
    matcher = constraint.matcher
    drafter = Drafter()
    row = drafter.row(noise + ids + noise + ids[:3], matcher=matcher)  # the prompt holds the document
    for a in row.acceptance.values():
        a.accepted, a.rejected = 50.0, 0.0  # every gate open
    drafted = 0
    for t in ids:
        draft = drafter.step([row])[0]
        drafted += len(draft)
        copy = matcher.deep_copy()
        for d in draft:
            assert copy.consume_token(d), (draft, copy.get_error())
        assert matcher.consume_token(t)
        drafter.append(row, [t])
    assert drafted > 0


@given(st.lists(st.integers(0, 5), min_size=1, max_size=40), st.lists(st.integers(0, 5), max_size=60),
       st.integers(0, 8), st.booleans())
def test_the_drafter_drafts_what_its_sources_propose_and_counts_what_was_right(prompt, output, max_k, open_):
    drafter = Drafter(cost=CostModel(max_k=max_k))
    row = drafter.row(prompt)
    if open_:
        for a in row.acceptance.values():
            a.accepted, a.rejected = 50.0, 0.0
    pos = drafted = accepted = 0
    while pos < len(output):
        lookup = drafter.lookup.propose(row, max_k)
        pool = drafter.pool.propose(row, max_k)
        draft = drafter.step([row])[0]
        assert len(draft) <= max_k
        assert draft == lookup[:len(draft)] or draft == pool[:len(draft)]  # the first source whose gate is open
        right = 0
        while right < len(draft) and pos + right < len(output) and draft[right] == output[pos + right]:
            right += 1
        drafter.append(row, output[pos:pos + right + 1])
        pos += right + 1
        drafted += len(draft)
        accepted += right
        assert all(0.0 <= a.rate <= 1.0 for a in row.acceptance.values())
    drafter.finish(row)
    assert (drafter.drafted, drafter.accepted) == (drafted, accepted)
    assert row.tokens == prompt + output and not row.pending


def test_a_shadow_draft_is_credited_as_its_tokens_come():
    """A shut gate opens once a shadow draft's first token proves right, not after all its tokens."""
    drafter = Drafter(sources=[PromptLookup()])
    row = drafter.row(list(range(1, 40)))  # distinct tokens: nothing to copy yet
    drafter.append(row, [3, 4])  # the row starts copying its prompt: lookup proposes 5, 6, ...
    assert drafter.step([row]) == [[]]  # no evidence yet: the draft is scored in the shadow
    drafter.append(row, [5])  # its first token was right; seven more are still to come
    assert row.acceptance["lookup"].rate > drafter.cost.position_cost
    draft = drafter.step([row])[0]
    assert draft and draft[0] == 6
    drafter.append(row, [6, 99])  # one right, then a miss
    assert drafter.accepted == 1 and drafter.drafted == len(draft)
