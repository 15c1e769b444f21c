"""classify: batched, prefix-sharing, label-scoring prefill against the one-prompt reference forward."""

from __future__ import annotations

import io
import json

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import slotinfer
from slotinfer.cache import SequenceCache
from slotinfer.classify import classify, encode_labels
from slotinfer.cli.classify import main
from slotinfer.cli.jobs import parse_template, resume
from slotinfer.encoder import SegmentView, plan_batches
from slotinfer.errors import InvalidRequestError, PromptTooLongError
from slotinfer.testing import FAMILIES, make_tiny_model

ATOL = 2e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("classify")
    paths = {fam: make_tiny_model(fam, root / fam) for fam in FAMILIES}
    return {fam: (p, slotinfer.load(p)) for fam, p in paths.items()}


_ref_cache: dict = {}


def ref_logits(model, ids) -> np.ndarray:
    """Full-vocab log-softmax at every position of one unpadded forward of ``ids`` alone: [len, vocab]."""
    key = (id(model), tuple(ids))
    if key not in _ref_cache:
        h = model.net(mx.array([list(ids)]), SequenceCache(model.config.num_layers))
        _ref_cache[key] = np.array(model.net.head(h[0]).astype(mx.float32))
    return _ref_cache[key]


def ref_label_scores(model, ids, label_ids) -> np.ndarray:
    """Exact sequence log-probs of each label after ``ids``, one label at a time, normalized over the set."""
    seq = []
    for lab in label_ids:
        z = ref_logits(model, list(ids) + list(lab))
        lp = z - np.logaddexp.reduce(z.astype(np.float64), axis=-1, keepdims=True)
        seq.append(sum(lp[len(ids) - 1 + j, t] for j, t in enumerate(lab)))
    seq = np.array(seq)
    return seq - np.logaddexp.reduce(seq)


ids_st = st.lists(st.integers(3, 250), min_size=1, max_size=40)


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=st.lists(ids_st, min_size=1, max_size=7), budget=st.integers(1, 160),
       prefix=st.one_of(st.none(), st.lists(st.integers(3, 250), min_size=1, max_size=20)))
def test_logits_equal_the_single_unpadded_forward(tiny, family, prompts, budget, prefix):
    model = tiny[family][1]
    results = classify(model, prompts, return_logits=True, token_budget=budget, prefix=prefix)
    assert len(results) == len(prompts)
    for ids, r in zip(prompts, results):
        full = (prefix or []) + ids
        want = ref_logits(model, full)[-1]
        assert r.error is None and r.logits.dtype == np.float32 and r.logits.shape == want.shape
        np.testing.assert_allclose(r.logits, want, atol=ATOL, rtol=1e-4)
        assert r.token == int(np.argmax(r.logits))
        assert r.prompt_tokens == len(full)


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=st.lists(ids_st, min_size=1, max_size=6), prefix=st.lists(st.integers(3, 250), min_size=1, max_size=24),
       shared_budget=st.integers(1, 120), plain_budget=st.integers(1, 200), multi=st.booleans())
def test_shared_prefix_equals_the_concatenated_prompts_whatever_the_batching(
        tiny, family, prompts, prefix, shared_budget, plain_budget, multi):
    """The prefix's K/V computed once and reused by every batch gives what running prefix + prompt does."""
    model = tiny[family][1]
    labels = ["the", "and", "the cat"] if multi else ["the", "and"]
    kw = dict(labels=labels, label_prefix=" ", return_logits=True)
    shared = classify(model, prompts, prefix=prefix, token_budget=shared_budget, **kw)
    plain = classify(model, [prefix + p for p in prompts], token_budget=plain_budget, **kw)
    for a, b in zip(shared, plain):
        assert a.error is None and b.error is None and a.prompt_tokens == b.prompt_tokens
        np.testing.assert_allclose(a.logits, b.logits, atol=ATOL, rtol=1e-4)
        np.testing.assert_allclose([a.scores[x] for x in labels], [b.scores[x] for x in labels], atol=ATOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_label_scores_are_exact_sequence_logprobs(tiny, family):
    model = tiny[family][1]
    labels = ["the", "and", "the cat", "hello world again"]  # single- and multi-token, a shared first token
    prefix = "Decide about the following sentence, then answer: "
    sentences = ["a short one", "the quick brown fox jumps over the lazy dog and keeps running far away", "x"]
    lab_ids = [model.tokenizer.encode(" " + s, add_special_tokens=False) for s in labels]
    assert any(len(t) > 1 for t in lab_ids) and any(len(t) == 1 for t in lab_ids)
    pre_ids = model.tokenizer.encode(prefix)
    shared = classify(model, sentences, labels=labels, label_prefix=" ", prefix=prefix, token_budget=24)
    alone = classify(model, sentences, labels=labels, label_prefix=" ", prefix=prefix, share_prefix=False,
                     token_budget=64)
    # a budget of 3 tokens: every (sentence, label) continuation is a forward of its own
    split = classify(model, sentences, labels=labels, label_prefix=" ", prefix=prefix, token_budget=3)
    for s, a, b, c in zip(sentences, shared, alone, split):
        ids = pre_ids + model.tokenizer.encode(s, add_special_tokens=False)
        want = ref_label_scores(model, ids, lab_ids)
        for r in (a, b, c):
            got = np.array([r.scores[name] for name in labels])
            np.testing.assert_allclose(got, want, atol=ATOL)
            assert r.label == labels[int(np.argmax(want))] and r.token == lab_ids[labels.index(r.label)][0]


@pytest.mark.parametrize("family", FAMILIES)
def test_single_token_labels_without_prefix(tiny, family):
    model = tiny[family][1]
    vocab = model.tokenizer.backend.get_vocab(with_added_tokens=False)
    labels = []
    for piece, tid in sorted(vocab.items(), key=lambda kv: kv[1])[300:]:
        text = model.tokenizer.decode([tid])
        if text.strip() and text not in labels and model.tokenizer.encode(text, add_special_tokens=False) == [tid]:
            labels.append(text)
        if len(labels) == 3:
            break
    lab_ids = [model.tokenizer.encode(s, add_special_tokens=False) for s in labels]
    prompts = ["one", "two words here", "and a much longer prompt, longer than the window of sixteen tokens"]
    for p, r in zip(prompts, classify(model, prompts, labels=labels, token_budget=8)):
        np.testing.assert_allclose([r.scores[s] for s in labels],
                                   ref_label_scores(model, model.encode_prompt(p), lab_ids), atol=ATOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_sharing_equals_recomputing(tiny, family):
    model = tiny[family][1]
    rng = np.random.default_rng(1)
    prefix = "Here is a fairly long instruction that runs past the sliding window of the model: "
    assert len(model.tokenizer.encode(prefix)) > 16
    prompts = [rng.integers(3, 250, n).tolist() for n in (1, 5, 17, 30)] + ["some text", "more text here"]
    a = classify(model, prompts, prefix=prefix, return_logits=True, token_budget=40)
    b = classify(model, prompts, prefix=prefix, return_logits=True, share_prefix=False, token_budget=40)
    for ra, rb in zip(a, b):
        np.testing.assert_allclose(ra.logits, rb.logits, atol=ATOL, rtol=1e-4)
        assert ra.prompt_tokens == rb.prompt_tokens


def test_prefix_ids_are_prefix_then_sentence_without_special_tokens(tiny):
    model = tiny["llama"][1]  # adds a BOS
    tok = model.tokenizer
    r = classify(model, ["world"], prefix="Hello", return_logits=True)[0]
    ids = tok.encode("Hello") + tok.encode("world", add_special_tokens=False)
    assert ids.count(tok.bos_id) == 1
    np.testing.assert_allclose(r.logits, ref_logits(model, ids)[-1], atol=ATOL, rtol=1e-4)
    plain = classify(model, ["Hello world"], return_logits=True)[0]  # no prefix: encode_prompt's ids
    np.testing.assert_allclose(plain.logits, ref_logits(model, model.encode_prompt("Hello world"))[-1], atol=ATOL)


def test_sampled_tokens_match_generate_with_seed_plus_index(tiny):
    model = tiny["qwen3"][1]
    prompts = ["alpha beta", "gamma", "a somewhat longer prompt of several tokens", "delta epsilon zeta"]
    for kw in (dict(temperature=1.3), dict(temperature=0.8, top_k=5), dict(temperature=1.0, top_p=0.7, min_p=0.05)):
        rs = classify(model, prompts, seed=11, token_budget=12, **kw)
        for i, (p, r) in enumerate(zip(prompts, rs)):
            assert r.token == model.generate(p, max_tokens=1, seed=11 + i, **kw).tokens[0]
    again = classify(model, prompts, seed=11, temperature=1.3, token_budget=1000)
    assert [r.token for r in again] == [model.generate(p, max_tokens=1, seed=11 + i, temperature=1.3).tokens[0]
                                        for i, p in enumerate(prompts)]


def test_label_sampling_stays_in_the_set_and_is_reproducible(tiny):
    model = tiny["gemma2"][1]
    labels = ["red", "green", "blue sky"]
    prompts = [f"item number {i}" for i in range(12)]
    a = classify(model, prompts, labels=labels, temperature=5.0, seed=3, token_budget=7)
    b = classify(model, prompts, labels=labels, temperature=5.0, seed=3, token_budget=500)
    assert [r.label for r in a] == [r.label for r in b]
    assert {r.label for r in a} <= set(labels) and len({r.label for r in a}) > 1


def test_bad_prompts_fail_alone(tiny):
    model = tiny["llama"][1]
    long = [5] * model.context_length
    rs = classify(model, ["fine", "", long, [10 ** 7], 42, "also fine"], labels=["a", "bc"], prefix="P:")
    assert rs[0].error is None and rs[5].error is None and rs[0].label in ("a", "bc")
    assert isinstance(rs[1].error, InvalidRequestError) and "empty" in str(rs[1].error)
    assert isinstance(rs[2].error, PromptTooLongError)
    assert isinstance(rs[3].error, InvalidRequestError) and "vocabulary" in str(rs[3].error)
    assert isinstance(rs[4].error, InvalidRequestError)
    assert classify(model, []) == []


def test_bad_requests_raise(tiny):
    model = tiny["qwen2"][1]
    with pytest.raises(InvalidRequestError, match="'yes'"):
        classify(model, ["x"], labels=["yes", "no", "yes"])
    with pytest.raises(InvalidRequestError, match="''"):
        classify(model, ["x"], labels=["yes", ""])
    with pytest.raises(InvalidRequestError):
        classify(model, ["x"], labels="yes")
    with pytest.raises(InvalidRequestError, match="token_budget"):
        classify(model, ["x"], token_budget=0)
    with pytest.raises(InvalidRequestError, match="temperature"):
        classify(model, ["x"], temperature=-1)
    with pytest.raises(InvalidRequestError, match="prefix"):
        classify(model, ["x"], prefix="")
    with pytest.raises(InvalidRequestError, match="single prompt"):
        classify(model, "x")
    assert encode_labels(model, ["a", "b c"]).multi == [1]


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 60), max_size=40), budget=st.integers(1, 300))
def test_plan_batches_covers_each_prompt_once_within_budget(lengths, budget):
    batches = plan_batches(lengths, budget)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        width = max(lengths[i] for i in b)
        assert len(b) == 1 or width * len(b) <= budget
        assert lengths[b[0]] == width


def test_segment_view_masks_padding_of_earlier_segments():
    ctx = SegmentView(1, 2, offset=mx.array([3, 5]), past_pos=mx.array([[0, 1, 2, 1 << 30, 1 << 30],
                                                                         [0, 1, 2, 3, 4]]))
    m = np.array(ctx.mask(0, 2, None))[:, 0]
    assert m.shape == (2, 2, 7)
    assert m[0, 0].tolist() == [True, True, True, False, False, True, False]
    assert m[1, 1].tolist() == [True] * 7
    assert np.array(ctx.mask(0, 2, 2))[1, 0, 0].tolist() == [False] * 4 + [True, True, False]


# -- the command line ---------------------------------------------------------------

def _run_cli(tiny, tmp_path, name, content, *extra, labels="yes,no,maybe so"):
    src = tmp_path / name
    src.write_bytes(content if isinstance(content, bytes) else content.encode())
    out = tmp_path / "out.jsonl"
    rc = main(["--model", str(tiny["qwen3"][0]), "--labels", labels, "--label-prefix", " ", "-q",
               "--output", str(out), *extra, str(src)])
    lines = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    return rc, {json.dumps(x["id"]): x for x in lines}, out


def test_cli_text_lines_with_bad_lines(tiny, tmp_path):
    rc, recs, _ = _run_cli(tiny, tmp_path, "in.txt", b"good one\n\nanother\n\xff\xfe\nlast\n")
    assert rc == 0 and len(recs) == 5
    assert recs["1"]["label"] in ("yes", "no", "maybe so") and set(recs["1"]["scores"]) == {"yes", "no", "maybe so"}
    assert "line 2" in recs["2"]["error"] and "empty" in recs["2"]["error"]
    assert "line 4" in recs["4"]["error"] and "UTF-8" in recs["4"]["error"]
    assert "label" in recs["5"]


def test_cli_jsonl_and_resume(tiny, tmp_path):
    data = '{"id": "a", "text": "first"}\n{"text": "no id"}\nnot json\n{"other": 1}\n{"id": "b", "text": "b"}\n'
    rc, recs, out = _run_cli(tiny, tmp_path, "in.jsonl", data)
    assert rc == 0 and set(recs) == {'"a"', "2", "3", "4", '"b"'}
    assert "JSON" in recs["3"]["error"] and "'text'" in recs["4"]["error"]
    before = out.read_text()
    rc, recs, _ = _run_cli(tiny, tmp_path, "in.jsonl", data + '{"id": "c", "text": "new"}\n')
    after = out.read_text()
    assert after.startswith(before) and len(after.splitlines()) == len(before.splitlines()) + 1
    assert recs['"c"']["label"] in ("yes", "no", "maybe so")


def test_cli_resume_cuts_an_unfinished_last_line(tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_text('{"id": 1, "label": "x"}\n{"id": 2, "lab')
    assert resume(str(out)).done == {"1"}
    assert out.read_text() == '{"id": 1, "label": "x"}\n'


def test_cli_csv_with_template_matches_the_library(tiny, tmp_path):
    (tmp_path / "t.txt").write_text("Review: {{ text }}\nVerdict:\n")
    assert parse_template(str(tmp_path / "t.txt")) == ("Review: ", "\nVerdict:")
    data = 'id,body\nr1,"great, really"\nr2,\nr3,"two\nlines"\n'
    rc, recs, _ = _run_cli(tiny, tmp_path, "in.csv", data, "--template", str(tmp_path / "t.txt"),
                           "--column", "body", labels="good,bad")
    assert rc == 0 and "empty" in recs['"r2"']["error"] and "line 3" in recs['"r2"']["error"]
    model = tiny["qwen3"][1]
    want = classify(model, ["great, really\nVerdict:"], prefix="Review: ", labels=["good", "bad"],
                    label_prefix=" ")[0]
    assert recs['"r1"']["label"] == want.label
    assert recs['"r1"']["scores"]["good"] == pytest.approx(want.scores["good"], abs=1e-4)
    assert "label" in recs['"r3"']


@pytest.mark.parametrize("label_prefix, template, warned", [
    ("", None, "'as sent off.sport'"), (" ", None, None), ("", "Text: {text}\nTopic:\n", "Topic:sport'"),
    ("", 'Text: {text}\nTopic: "', None), ("", "{text}\n\n", None), ("\n", None, None)])
def test_cli_warns_once_when_labels_would_run_on_from_the_text(tiny, tmp_path, capsys, label_prefix, template,
                                                                warned):
    """Labels are scored right after each sentence (or the template's end): without a space between, a
    byte-level tokenizer scores "off.sport", which no model writes, and the answers are noise."""
    src, out = tmp_path / "in.txt", tmp_path / "out.jsonl"
    src.write_text("The goalkeeper was sent off.\nParliament passed the bill.\n")
    extra = []
    if template is not None:
        (tmp_path / "t.txt").write_text(template)
        extra = ["--template", str(tmp_path / "t.txt")]
    rc = main(["--model", str(tiny["qwen3"][0]), "--labels", "sport,politics", "--label-prefix", label_prefix, "-q",
               "--output", str(out), *extra, str(src)])
    err = capsys.readouterr().err
    assert rc == 0 and len(out.read_text().splitlines()) == 2
    lines = [x for x in err.splitlines() if "warning" in x]
    if warned is None:
        assert lines == [], err
    else:
        [line] = lines
        assert warned in line and "--label-prefix ' '" in line, line


def test_cli_usage_errors(tiny, tmp_path, capsys):
    rc, _, _ = _run_cli(tiny, tmp_path, "in.txt", "x\n", labels="yes,no,yes")
    assert rc == 2 and "duplicate label 'yes'" in capsys.readouterr().err
    rc, _, _ = _run_cli(tiny, tmp_path, "in.txt", "x\n", labels="yes,,no")
    assert rc == 2 and "label 2 is empty" in capsys.readouterr().err
    rc = main(["--model", str(tiny["qwen3"][0]), "--labels", "a,b", str(tmp_path / "missing.txt")])
    assert rc == 2 and "does not exist" in capsys.readouterr().err
    rc, _, _ = _run_cli(tiny, tmp_path, "in.csv", "id,body\n1,x\n", labels="a,b")
    assert rc == 2 and "no column 'text'" in capsys.readouterr().err


def _classify_stdin(tiny, monkeypatch, data: bytes, *extra):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data)))
    return main(["--model", str(tiny["qwen3"][0]), "--labels", "yes,no,maybe so", "--label-prefix", " ", "-q",
                 *extra, "-"])


@pytest.mark.parametrize("name,content", [
    ("in.txt", "hello there\nsecond one\n"),
    ("in.jsonl", '{"text": "hello there"}\n{"text": "second one"}\n'),
    ("in.csv", "text\nhello there\nsecond one\n"),
    ("-", "hello there\nsecond one\n"),  # stdin
])
def test_cli_strips_a_byte_order_mark(tiny, tmp_path, monkeypatch, capsys, name, content):
    def run(data: bytes):
        if name == "-":
            rc = _classify_stdin(tiny, monkeypatch, data)
            return rc, {json.dumps(x["id"]): x for x in map(json.loads, capsys.readouterr().out.splitlines())}
        rc, recs, out = _run_cli(tiny, tmp_path, name, data)
        out.unlink()
        return rc, recs

    rc, plain = run(content.encode())
    rc_bom, bom = run(b"\xef\xbb\xbf" + content.encode())
    assert rc == rc_bom == 0 and len(bom) == 2 and all("label" in r for r in bom.values())
    assert bom == plain  # the mark changed neither a column name, a JSON line nor sentence 1's result


def test_cli_csv_ids_are_all_strings(tiny, tmp_path):
    src, out = tmp_path / "in.csv", tmp_path / "out.jsonl"
    src.write_text("id,text\n3,alpha\n,beta\n,gamma\n")  # line 3's blank id stands in as "3": taken
    rc = main(["--model", str(tiny["qwen3"][0]), "--labels", "a,b", "-q", "--output", str(out), str(src)])
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert rc == 0 and all(isinstance(r["id"], str) for r in recs) and sorted(r["id"] for r in recs) == ["3", "3", "4"]
    err = [r for r in recs if "error" in r]
    assert len(err) == 1 and "line 3" in err[0]["error"] and "already used on line 2" in err[0]["error"]


@pytest.mark.parametrize("case", ["input is a directory", "output is a directory"])
def test_cli_directories_are_usage_errors(tiny, tmp_path, capsys, case):
    src = tmp_path / "in.txt"
    src.write_text("x\n")
    argv = ["--model", str(tiny["qwen3"][0]), "--labels", "a,b", "-q"]
    if case == "input is a directory":
        rc, want = main([*argv, str(tmp_path)]), "is a directory, not a file"
    else:
        rc, want = main([*argv, "--output", str(tmp_path), str(src)]), f"cannot write {str(tmp_path)!r}"
    err = capsys.readouterr().err
    assert rc == 2 and want in err and err.startswith("slotinfer classify: error:") and len(err.splitlines()) == 1


@pytest.mark.parametrize("how", ["--prefix", "--template", "prefix and label"])
def test_cli_prefix_too_long_stops_before_any_output(tiny, tmp_path, capsys, how):
    model = tiny["qwen3"][1]
    ctx = model.context_length
    labels = "yes,no"
    if how == "prefix and label":  # the prefix alone fits; with the longest label no sentence does
        lo, hi = 1, ctx  # the longest "word word ..." prefix shorter than ctx - 1 tokens
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if len(model.tokenizer.encode("word " * mid)) < ctx - 1 else (lo, mid)
        extra, long_label = ["--prefix", "word " * lo], " ".join(["yes"] * 8)
        n = len(model.tokenizer.encode(extra[1]))
        assert n < ctx - 1 and n + len(model.tokenizer.encode(" " + long_label, add_special_tokens=False)) >= ctx
        labels += "," + long_label
        want = "leave no room for a sentence"
    elif how == "--template":
        (tmp_path / "t.txt").write_text("word " * ctx + "{text}\nAnswer:\n")
        extra, want = ["--template", str(tmp_path / "t.txt")], "shorten the prefix"
    else:
        extra, want = ["--prefix", "word " * ctx], "shorten the prefix"
    rc, recs, out = _run_cli(tiny, tmp_path, "in.txt", "good one\n\nanother\n", *extra, labels=labels)
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists() and err.startswith(f"slotinfer classify: error: {extra[0]}") and want in err


def test_cli_into_a_closed_pipe_exits_quietly(tiny, head_1):
    lines = "".join(f"sentence number {i}\n" for i in range(3000)).encode()
    rc, first, err = head_1(["classify", "--model", tiny["qwen3"][0], "--labels", "a,b", "-q", "-"], lines)
    assert rc == 1 and "label" in json.loads(first)
    assert "Traceback" not in err and "BrokenPipe" not in err


def test_a_shared_prefix_is_computed_once_across_calls(tiny, monkeypatch):
    """An offline job calls classify batch after batch with one instruction: its K/V is computed on
    the first call only, and the kept prefixes stay bounded."""
    from slotinfer import classify as classify_module

    model = tiny["qwen3"][1]
    made = []
    real = classify_module.SharedPrefix

    def counting(*a, **kw):
        made.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(classify_module, "SharedPrefix", counting)
    prefix = "Label the topic of this sentence: "
    first = classify(model, ["the match ended", "rates rose"], prefix=prefix, return_logits=True)
    again = classify(model, ["the match ended", "rates rose"], prefix=prefix, return_logits=True)
    assert len(made) == 1
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a.logits, b.logits)
    for i in range(classify_module.PREFIXES_KEPT + 3):
        classify(model, ["x"], prefix=f"Instruction number {i}: ", return_logits=True)
    assert len(classify_module._PREFIXES[model]) <= classify_module.PREFIXES_KEPT


def test_label_continuations_are_sliced_longest_first_without_padding(tiny, monkeypatch):
    """Continuations of two lengths, listed alternately, run in slices of one length each: no padded
    token, however the labels are ordered, and each slice within the budget; the scores stay exact."""
    from slotinfer import classify as classify_module

    model = tiny["qwen3"][1]
    short = ["blue", "cloud", "cat dog", "cat sun", "cat red", "dog cat"]
    long = ["blue cloud", "cloud blue", "cat dog blue", "cat dog cloud", "cat sun blue", "cat sun cloud"]
    labels = [lab for pair in zip(long, short) for lab in pair]
    lab_ids = [model.tokenizer.encode(" " + s, add_special_tokens=False) for s in labels]
    lengths = {len(t) for t in lab_ids}
    assert len(lengths) == 2 and min(lengths) > 1, lengths  # the tokenizer gives the two lengths assumed
    width = max(lengths) - 1
    budget = 3 * width  # three long continuations fill a slice
    calls = []
    real = classify_module.forward

    def recording(net, rows, *a, **kw):
        calls.append([len(r) for r in rows])
        return real(net, rows, *a, **kw)

    monkeypatch.setattr(classify_module, "forward", recording)
    prompt = "the weather today"
    (r,) = classify(model, [prompt], labels=labels, label_prefix=" ", token_budget=budget)
    conts = calls[1:]  # after the prompt's own forward
    assert sum(map(len, conts)) == len(labels)
    for rows in conts:
        assert len(rows) * max(rows) <= budget and len(set(rows)) == 1, conts
    want = ref_label_scores(model, model.encode_prompt(prompt), lab_ids)
    np.testing.assert_allclose([r.scores[name] for name in labels], want, atol=ATOL)
