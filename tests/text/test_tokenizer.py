"""Tokenizer: BOS rules, round trips, special ids, chat templates, streaming detokenizer."""

from __future__ import annotations

import json
import shutil
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slotinfer.errors import InvalidRequestError, ModelNotFoundError, TokenizerError
from slotinfer.testing import FAMILIES, make_tiny_model
from slotinfer.text.tokenizer import StreamingDetokenizer, Tokenizer

BOS_FAMILIES = ("llama", "gemma3_text", "gemma3", "gemma2")
NO_BOS_FAMILIES = ("qwen2", "qwen3")

TEXTS = [
    "Hello world",
    "The river was wide and slow.",
    "  leading spaces, trailing spaces  ",
    "line one\nline two\n\n\tindented\r\n",
    "Le café est prêt, où est la gare ? Übung macht den Meister.",
    "今天天气很好，我们去公园散步吧。東京の駅",
    "emoji 🙂🎉🚀 and a family 👩‍👩‍👧 and a flag 🇫🇷 and ❤️",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment",
    "rare chars: ∮ ℵ ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \u0000 \u00ad end",
    "",
    "<not a special token> <|im_sta rt|> <bos",
]

MESSAGES = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Germany? 🙂"},
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {f: make_tiny_model(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="module")
def toks(folders):
    return {f: Tokenizer.from_folder(p) for f, p in folders.items()}


def _copy(folder, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(folder, dst)
    return dst


# -- loading ---------------------------------------------------------------

def test_missing_folder(tmp_path):
    with pytest.raises(ModelNotFoundError):
        Tokenizer.from_folder(tmp_path / "nope")


def test_missing_tokenizer_json(folders, tmp_path):
    d = _copy(folders["llama"], tmp_path)
    (d / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="tokenizer.json") as e:
        Tokenizer.from_folder(d)
    assert "copy it" in str(e.value) or "convert" in str(e.value)


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", json.dumps({"model": {"type": "Nonsense"}})])
def test_malformed_tokenizer_json(folders, tmp_path, content):
    d = _copy(folders["qwen2"], tmp_path)
    (d / "tokenizer.json").write_text(content)
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_folder(d)


def test_malformed_tokenizer_config(folders, tmp_path):
    d = _copy(folders["qwen2"], tmp_path)
    (d / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        Tokenizer.from_folder(d)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"])
def test_tokenizer_file_not_utf8(folders, tmp_path, name):
    d = _copy(folders["qwen2"], tmp_path)
    (d / name).write_bytes(b"\xff\xfe{}")
    with pytest.raises(TokenizerError, match=f"{name} is not valid JSON .*utf-8"):
        Tokenizer.from_folder(d)


def test_errors_are_value_errors():
    assert issubclass(TokenizerError, ValueError)


# -- special ids -------------------------------------------------------------

def test_special_ids(toks):
    t = toks["llama"]
    assert t.bos_id == t.token_to_id("<|begin_of_text|>")
    assert t.eos_ids == {t.token_to_id("<|eot_id|>"), t.token_to_id("<|end_of_text|>")}
    assert t.pad_id is None
    for fam in NO_BOS_FAMILIES:
        t = toks[fam]
        assert t.bos_id is None
        assert t.eos_ids == {t.token_to_id("<|im_end|>")}
        assert t.pad_id == t.token_to_id("<|endoftext|>")
    for fam in ("gemma3_text", "gemma3"):
        t = toks[fam]
        assert (t.bos_id, t.pad_id) == (2, 0)
        assert t.eos_ids == {1, t.token_to_id("<end_of_turn>")}
    assert toks["gemma2"].eos_ids == {1}


@pytest.mark.parametrize("family", FAMILIES)
def test_vocab_and_token_lookup(toks, family):
    t = toks[family]
    assert t.vocab_size == t.backend.get_vocab_size(with_added_tokens=True)
    assert 400 <= t.vocab_size <= 640
    for i in (0, 1, 100, t.vocab_size - 1):
        assert t.token_to_id(t.id_to_token(i)) == i
    assert t.id_to_token(t.vocab_size + 5) is None
    assert t.token_to_id("definitely-not-a-token-\u2603\u2603") is None


def test_eos_only_from_config(folders, tmp_path):
    """No end-of-turn id is guessed: without generation_config/config, Gemma 3 stops on <eos> only."""
    d = _copy(folders["gemma3_text"], tmp_path)
    (d / "generation_config.json").unlink()
    (d / "config.json").unlink()
    assert Tokenizer.from_folder(d).eos_ids == {1}


def test_special_tokens_map_fills_gaps(folders, tmp_path):
    d = _copy(folders["gemma2"], tmp_path)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["bos_token"], cfg["pad_token"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer.from_folder(d)
    assert (t.bos_id, t.pad_id) == (2, 0)  # from special_tokens_map.json ({"content": ...} entries)
    (d / "special_tokens_map.json").unlink()
    t = Tokenizer.from_folder(d)
    assert t.pad_id is None
    assert t.bos_id == 2  # what the post-processor prepends
    assert t.encode("hi").count(2) == 1


# -- BOS ---------------------------------------------------------------------

@pytest.mark.parametrize("family", BOS_FAMILIES)
def test_bos_added_once(toks, family):
    t = toks[family]
    for text in ["Hello world", "", "\u4eca\u5929 🙂"]:
        ids = t.encode(text)
        assert ids[0] == t.bos_id and ids.count(t.bos_id) == 1
        assert ids[1:] == t.encode(text, add_special_tokens=False)
        assert t.bos_id not in t.encode(text, add_special_tokens=False)
        # already starts with the BOS string (as rendered chat templates do): still one BOS
        again = t.encode(t.bos_token + text)
        assert again == ids
    assert t.encode(t.bos_token + "x", add_special_tokens=False).count(t.bos_id) == 1


@pytest.mark.parametrize("family", NO_BOS_FAMILIES)
def test_qwen_adds_nothing(toks, family):
    t = toks[family]
    specials = {t.token_to_id(s) for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    for text in ["Hello world", "\u4eca\u5929 🙂"]:
        ids = t.encode(text)
        assert ids == t.encode(text, add_special_tokens=False)
        assert not specials & set(ids)
    assert t.encode("") == []


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_template_bos_once(toks, family):
    t = toks[family]
    text = t.apply_chat_template(MESSAGES)
    ids = t.apply_chat_template(MESSAGES, tokenize=True)
    assert ids == t.encode(text)
    if family in BOS_FAMILIES:
        assert text.startswith(t.bos_token)
        assert ids[0] == t.bos_id and ids.count(t.bos_id) == 1
    else:
        assert ids[0] == t.token_to_id("<|im_start|>")
        assert t.token_to_id("<|endoftext|>") not in ids
    assert t.decode(ids) == text


# -- round trips -----------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip(toks, family):
    t = toks[family]
    for text in TEXTS:
        ids = t.encode(text, add_special_tokens=False)
        assert t.decode(ids) == text, (family, text)
        with_bos = t.encode(text)
        assert t.decode(with_bos, skip_special_tokens=True) == text
        if family in BOS_FAMILIES:
            assert t.decode(with_bos) == t.bos_token + text


def test_special_tokens_in_text_are_parsed(toks):
    t = toks["qwen2"]
    ids = t.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == t.token_to_id("<|im_start|>") and ids[-1] == t.token_to_id("<|im_end|>")
    assert t.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_byte_fallback_is_used(toks):
    t = toks["gemma3_text"]
    ids = t.encode("ꙮ", add_special_tokens=False)  # not in the tiny vocabulary
    assert [t.id_to_token(i) for i in ids] == ["<0xEA>", "<0x99>", "<0xAE>"]
    assert t.decode(ids) == "ꙮ"


def test_out_of_vocab_ids_decode_to_nothing(toks):
    t = toks["llama"]
    hello = t.encode("Hello", add_special_tokens=False)
    assert t.decode(hello + [t.vocab_size + 3]) == "Hello"


def test_encode_rejects_non_text(toks):
    with pytest.raises(InvalidRequestError):
        toks["llama"].encode(["not", "text"])


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text"])
def test_lone_surrogates_are_invalid_requests(toks, family):
    """'h\\udcffi' is what Python makes of undecodable argv/stdin bytes; tokenizers answers a bare TypeError."""
    t = toks[family]
    phrase = r"not valid Unicode: it contains lone surrogates \('\\udcff' at position 1\).*pass valid UTF-8"
    for special in (True, False):
        with pytest.raises(InvalidRequestError, match=phrase):
            t.encode("h\udcffi", add_special_tokens=special)
    with pytest.raises(InvalidRequestError, match="not valid Unicode"):
        t.apply_chat_template([{"role": "user", "content": "\ud800"}], tokenize=True)
    assert t.token_to_id("\udcff") is None  # no token is spelled so
    assert t.decode(t.encode("h\u00ffi", add_special_tokens=False)) == "h\u00ffi"  # valid text still encodes


# -- chat templates --------------------------------------------------------

def test_llama_template(toks):
    t = toks["llama"]
    text = t.apply_chat_template(MESSAGES)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou answer in one line.<|eot_id|>")
    assert "<|start_header_id|>user<|end_header_id|>\n\nAnd of Germany? 🙂<|eot_id|>" in text
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    no_prompt = t.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert no_prompt.endswith("<|eot_id|>") and text.startswith(no_prompt)
    with pytest.raises(InvalidRequestError, match="role"):
        t.apply_chat_template([{"role": "wizard", "content": "hi"}])


def test_qwen2_default_system(toks):
    t = toks["qwen2"]
    text = t.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    text = t.apply_chat_template(MESSAGES)
    assert text.count("<|im_start|>system") == 1 and "helpful assistant" not in text


def test_qwen3_template_and_extra_kwargs(toks):
    t = toks["qwen3"]
    msgs = [{"role": "user", "content": "hi"}]
    assert t.apply_chat_template(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    off = t.apply_chat_template(msgs, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = t.apply_chat_template(msgs, tokenize=True, enable_thinking=False)
    assert t.token_to_id("<think>") in ids


def test_gemma_template(toks):
    t = toks["gemma3"]
    text = t.apply_chat_template(MESSAGES)
    assert text == ("<bos><start_of_turn>user\nYou answer in one line.\n\nWhat is the capital of France?<end_of_turn>\n"
                    "<start_of_turn>model\nParis.<end_of_turn>\n"
                    "<start_of_turn>user\nAnd of Germany? 🙂<end_of_turn>\n<start_of_turn>model\n")
    parts = [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image"},
                                          {"type": "text", "text": " here"}]}]
    assert "<start_of_turn>user\nlook here<end_of_turn>" in t.apply_chat_template(parts)
    with pytest.raises(InvalidRequestError, match="alternate"):
        t.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


@pytest.mark.parametrize("bad", ["just a string", [{"content": "no role"}], [1, 2], None])
def test_bad_messages(toks, bad):
    with pytest.raises(InvalidRequestError):
        toks["qwen2"].apply_chat_template(bad)


def test_no_template(folders, tmp_path):
    d = _copy(folders["llama"], tmp_path)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer.from_folder(d)
    assert t.chat_template is None
    with pytest.raises(TokenizerError, match="no chat template"):
        t.apply_chat_template(MESSAGES)
    # ...but plain encoding still works
    assert t.encode("hi")[0] == t.bos_id


def test_template_sources(folders, tmp_path):
    d = _copy(folders["qwen2"], tmp_path)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "TOOLS"},
                            {"name": "default", "template": "{% for m in messages %}[{{ m.role }}]{% endfor %}"}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer.from_folder(d)
    assert t.apply_chat_template(MESSAGES[:2]) == "[system][user]"
    # chat_template.jinja wins over tokenizer_config.json
    (d / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}")
    t = Tokenizer.from_folder(d)
    assert t.apply_chat_template([{"role": "user", "content": "é \"q\""}]) == '"é \\"q\\""' + ">"
    assert t.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False) == '"x"'


def test_template_syntax_error(folders, tmp_path):
    d = _copy(folders["qwen2"], tmp_path)
    (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    t = Tokenizer.from_folder(d)
    with pytest.raises(TokenizerError, match="not valid Jinja"):
        t.apply_chat_template(MESSAGES)


def test_template_is_sandboxed(folders, tmp_path):
    d = _copy(folders["qwen2"], tmp_path)
    (d / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}")
    t = Tokenizer.from_folder(d)
    with pytest.raises((TokenizerError, InvalidRequestError)):
        t.apply_chat_template(MESSAGES)
    (d / "chat_template.jinja").write_text("{% set _ = messages.append(1) %}x")
    with pytest.raises((TokenizerError, InvalidRequestError)):
        Tokenizer.from_folder(d).apply_chat_template(MESSAGES)


def test_template_raise_exception_and_trim(folders, tmp_path):
    d = _copy(folders["qwen2"], tmp_path)
    (d / "chat_template.jinja").write_text(
        "{% for m in messages %}\n  {% if m.role == 'tool' %}\n    {{ raise_exception('no tools here') }}\n"
        "  {% endif %}\n{{ m.content }}|\n{% endfor %}")
    t = Tokenizer.from_folder(d)
    # trim_blocks + lstrip_blocks: block tags leave no whitespace behind
    assert t.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a|\nb|\n"
    with pytest.raises(InvalidRequestError, match="no tools here"):
        t.apply_chat_template([{"role": "tool", "content": "x"}])


# -- streaming detokenizer ---------------------------------------------------

def _stream(t: Tokenizer, ids, **kw):
    d = t.detokenizer(**kw)
    deltas = [d.add(i) for i in ids]
    tail = d.flush()
    return deltas, tail, d


def _byte_level_map() -> dict[int, str]:
    """byte -> the one-character token a byte-level BPE vocabulary spells it with."""
    printable = [b for b in range(256) if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _byte_ids(t: Tokenizer, data: bytes) -> list[int]:
    if t.token_to_id("<0x41>") is not None:  # byte-fallback vocabulary
        return [t.token_to_id(f"<0x{b:02X}>") for b in data]
    m = _byte_level_map()
    return [t.token_to_id(m[b]) for b in data]


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@SETTINGS
@given(data=st.data())
def test_detokenizer_random_ids(toks, family, data):
    t = toks[family]
    byte_tokens = [t.token_to_id(f"<0x{b:02X}>") for b in range(256)] if family.startswith("gemma") else \
        [t.token_to_id(c) for c in _byte_level_map().values()]
    id_strategy = st.one_of(
        st.integers(0, t.vocab_size + 8),  # any id, out-of-vocabulary ones included
        st.sampled_from(byte_tokens),  # lone bytes: broken UTF-8 on purpose
        st.sampled_from(sorted(t.eos_ids | {t.bos_id})),
    )
    ids = data.draw(st.lists(id_strategy, max_size=40))
    skip = data.draw(st.booleans())
    deltas, tail, d = _stream(t, ids, skip_special_tokens=skip)
    expected = t.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) + tail == expected
    assert d.text == expected


TEXT_ALPHABET = st.one_of(
    st.characters(codec="utf-8", exclude_categories=("Cs",)),
    st.sampled_from(list("aé今天🙂🎉👩‍💻🇫🇷❤️ \n中ꙮ𝔘")),
)


@pytest.mark.parametrize("family", FAMILIES)
@SETTINGS
@given(text=st.text(TEXT_ALPHABET, max_size=40))
def test_detokenizer_text(toks, family, text):
    t = toks[family]
    if family.startswith("qwen"):
        text = unicodedata.normalize("NFC", text)  # Qwen's normalizer
    if family.startswith("gemma"):
        text = text.replace("\u2581", "_")  # Gemma spells spaces as U+2581
    ids = t.encode(text, add_special_tokens=False)
    deltas, tail, _ = _stream(t, ids)
    assert "".join(deltas) + tail == text
    assert not any("\ufffd" in x for x in deltas + [tail]) or "\ufffd" in text


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
def test_detokenizer_every_byte_split(toks, family):
    """Emoji/CJK text spelled one byte per token: no delta ever holds half a character."""
    t = toks[family]
    text = "a今天🙂é👩‍💻🇫🇷中z\u00ad𝔘!"
    ids = _byte_ids(t, text.encode("utf-8"))
    assert t.decode(ids) == text
    d = t.detokenizer()
    out = ""
    for i in ids:
        delta = d.add(i)
        assert "\ufffd" not in delta
        out += delta
        assert text.startswith(out)
    out += d.flush()
    assert out == text
    if not family.startswith("gemma"):
        # byte-level BPE: each character comes out as soon as its last byte arrives
        d = t.detokenizer()
        pos = 0
        for ch in text:
            nbytes = len(ch.encode("utf-8"))
            deltas = [d.add(i) for i in ids[pos:pos + nbytes]]
            pos += nbytes
            assert deltas == [""] * (nbytes - 1) + [ch]
    else:
        # byte fallback: a byte run is released when the next piece arrives
        space_a = t.encode(" a", add_special_tokens=False)
        assert [t.id_to_token(i) for i in space_a] == ["\u2581a"]
        d = t.detokenizer()
        held = [d.add(i) for i in _byte_ids(t, "🙂".encode())]
        assert held == ["", "", "", ""]
        assert d.add(space_a[0]) == "🙂 a"


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_detokenizer_window_stays_small(toks, family):
    t = toks[family]
    text = ("The cache stores keys and values 🙂 so that old tokens 今天 are never computed twice. " * 40)
    ids = t.encode(text, add_special_tokens=False)
    assert len(ids) > 1000
    d = t.detokenizer()
    longest = 0
    pieces = []
    for i in ids:
        pieces.append(d.add(i))
        longest = max(longest, len(d._window))
    pieces.append(d.flush())
    assert "".join(pieces) == text
    assert longest <= 12  # re-anchored: each step decodes a handful of ids, not the whole text
    assert isinstance(d, StreamingDetokenizer)


def test_detokenizer_reset_and_empty(toks):
    t = toks["qwen2"]
    d = t.detokenizer()
    assert d.flush() == ""
    d.add(t.encode("hi")[0])
    d.reset()
    assert d.text == "" and d.flush() == ""
