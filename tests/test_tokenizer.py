"""The GGUF-built tokenizer equals HF `tokenizers` loading the checkpoint's tokenizer.json, and decodes stream-safely.

GGUFs come from the converter (conftest `gguf_path`); the reference is `tokenizers.Tokenizer.from_file` on the
fixture's own tokenizer.json (what transformers' GemmaTokenizer wraps)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer

from dgemma_engine.errors import EngineError
from dgemma_engine.tokenizer import Tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
NAMES = ("tiny-a", "tiny-b")

CORPUS = [
    "Hello world",
    "Why is the sky blue?",
    "  leading spaces, trailing spaces   ",
    "runs of    spaces\tand\ttabs\n\n\nand newlines\r\n",
    "\n", " ", "  ", "",
    "héllo wörld: Ελληνικά, кириллица, Tiếng Việt",
    "日本語のテキストと中文和한국어",
    "emoji 🎉👍🏽 and a family 👨‍👩‍👧 and flags 🇫🇷",
    "<|turn>user\nWhy is the sky blue?<turn|>\n<|turn>model\n",
    "<bos><|turn>system\n<|think|>Be brief.<turn|>\n",
    "text<eos>after eos <pad><mask> <unk>",
    "<|tool_call>call:f{x:<|\"|>1<|\"|>}<tool_call|><|tool_response>",
    "<|channel>thought\nhmm<channel|>answer",
    "not special: <|turn <turn| <0x41> <notatoken>",
    "def f(x):\n    return x ** 2  # square\n",
    "numbers 1234567890 3.14159 -42 1e-5",
    "\x00\x01\x7f control bytes and \ufffd replacement",
    "a" * 64 + " " + "ab" * 40,
    "mixed 中文 and English and 🎉 in one line  ",
]


def random_strings(n: int, seed: int) -> list[str]:
    """Random mixes of ASCII, whitespace, accents, CJK, emoji and special-token text."""
    rng = np.random.default_rng(seed)
    pieces = ["a", "the", " ", "  ", "\n", "\t", "é", "ß", "中", "語", "🎉", "👍🏽", "<eos>", "<|turn>", "<turn|>",
              "Hello", "world", "0", "42", ".", ",", "<", "|", ">", "▁", "\u200d", "ー", "🇫🇷"]
    return ["".join(rng.choice(pieces, size=rng.integers(1, 30))) for _ in range(n)]


@pytest.fixture(scope="module", params=NAMES)
def pair(request, gguf_path) -> tuple[Tokenizer, HFTokenizer]:
    ours = Tokenizer.from_gguf(gguf_path(request.param, "f32"))
    reference = HFTokenizer.from_file(str(FIXTURES / request.param / "tokenizer.json"))
    return ours, reference


def test_encode_equals_hf_tokenizers(pair) -> None:
    ours, reference = pair
    for text in CORPUS + random_strings(300, seed=1):
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False).ids, repr(text)


def test_corpus_exercises_byte_fallback_and_special_tokens(pair) -> None:
    """Guard against a corpus that silently stops covering the hard cases."""
    ours, _ = pair
    ids = [i for text in CORPUS for i in ours.encode(text)]
    tokens = {ours.tokens[i] for i in ids}
    assert any(t.startswith("<0x") for t in tokens), "no byte-fallback token in the corpus"
    assert {"<eos>", "<|turn>", "<turn|>", "<|\"|>"} <= tokens
    assert ours.encode("<|turn>") == [105] and ours.encode("<turn|>") == [106]


def test_decode_equals_hf_tokenizers(pair) -> None:
    ours, reference = pair
    for text in CORPUS + random_strings(100, seed=2):
        ids = reference.encode(text, add_special_tokens=False).ids
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=False), repr(text)
        assert ours.decode(ids, skip_special=True) == reference.decode(ids, skip_special_tokens=True), repr(text)
    rng = np.random.default_rng(3)  # arbitrary id sequences, including broken byte sequences
    for _ in range(100):
        ids = rng.integers(0, ours.n_vocab, size=rng.integers(1, 40)).tolist()
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=False)


def test_special_text_can_be_tokenized_literally(pair) -> None:
    ours, _ = pair
    literal = ours.encode("<eos>", special=False)
    assert literal != [1] and 1 not in literal
    assert ours.decode(literal) == "<eos>"


def test_stream_decoder_never_emits_broken_utf8(pair) -> None:
    """Split the ids at every position (as canvases would): the pieces never contain U+FFFD and join to the full
    decode; a flush at the end returns the rest."""
    ours, _ = pair
    text = "日本🎉 héllo 👍🏽 wörld 中文"
    ids = ours.encode(text)
    assert sum(ours.tokens[i].startswith("<0x") for i in ids) >= 4  # multi-byte chars via byte fallback
    full = ours.decode(ids)
    assert full == text
    for cut in range(len(ids) + 1):
        dec = ours.stream_decoder()
        first, second = dec.feed(ids[:cut]), dec.feed(ids[cut:])
        tail = dec.flush()
        assert "\ufffd" not in first + second and first + second + tail == full, cut
    dec = ours.stream_decoder()  # one token at a time
    pieces = [dec.feed([i]) for i in ids] + [dec.flush()]
    assert "".join(pieces) == full and not any("\ufffd" in p for p in pieces)


def test_stream_decoder_flushes_an_incomplete_tail(pair) -> None:
    ours, _ = pair
    ids = ours.encode("ok 🎉")
    dec = ours.stream_decoder()
    shown = dec.feed(ids[:-1])  # the emoji's last byte is missing
    assert shown == "ok "
    assert dec.flush() == ours.decode(ids[:-1])[len("ok "):]  # what a full decode shows: replacement character(s)


def test_bad_metadata_is_a_clear_error() -> None:
    with pytest.raises(EngineError, match="no tokenizer"):
        Tokenizer.from_metadata({})
    with pytest.raises(EngineError, match="unsupported tokenizer model"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(EngineError, match="malformed tokenizer merge"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": ["a", "b", "ab"],
                                 "tokenizer.ggml.merges": ["ab"]})
    tok = Tokenizer.from_metadata({"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": ["a", "b", "ab"],
                                   "tokenizer.ggml.merges": ["a b"]})
    assert tok.encode("ab") == [2]
    with pytest.raises(EngineError):
        tok.decode([3])


def test_sentencepiece_style_vocabulary_equals_sentencepiece() -> None:
    """`tokenizer.ggml.model = llama` (scores, no merges): built from a SentencePiece BPE model trained here, our
    tokenizer must segment and decode exactly as the sentencepiece library does."""
    import io

    import sentencepiece as spm

    training = ["the quick brown fox jumps over the lazy dog", "hello world, hello there, well well",
                "héllo wörld Ελληνικά кириллица", "def f(x): return x * 2", "numbers 123 456 7890 3.14",
                "  spaced   out  text  ", "another line\nwith a newline"] * 40
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(training), model_writer=proto, vocab_size=420, model_type="bpe", byte_fallback=True,
        character_coverage=1.0, user_defined_symbols=["<|turn>", "<turn|>"], add_dummy_prefix=True,
        remove_extra_whitespaces=False, normalization_rule_name="identity", minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    n = sp.get_piece_size()
    tokens = [sp.id_to_piece(i) for i in range(n)]

    def token_type(i: int) -> int:
        if sp.is_unknown(i):
            return 2
        if sp.is_control(i):
            return 3
        if sp.is_byte(i):
            return 6
        return 4 if tokens[i] in ("<|turn>", "<turn|>") else 1

    ours = Tokenizer.from_metadata({
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
        "tokenizer.ggml.token_type": [token_type(i) for i in range(n)],
        "tokenizer.ggml.unknown_token_id": sp.unk_id(), "tokenizer.ggml.add_space_prefix": True})
    texts = [t for t in CORPUS if "\r" not in t and "\x00" not in t] + random_strings(200, seed=4) + [
        "hello<|turn>user", "  two leading", "quick quickest brownish foxes"]
    for text in texts:
        # sentencepiece matches user-defined symbols in text but never control tokens (<s>, <unk>): special=False
        ids = ours.encode(text, special=False)
        assert ids == sp.encode(text), repr(text)
        assert ours.decode(ids) == sp.decode(ids), repr(text)
