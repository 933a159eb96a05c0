"""Train a small Gemma-style BPE tokenizer with exactly `vocab_size` entries.

Shared by `make_fixtures.py` (tiny test checkpoints) and `bench/make_bench_model.py` (benchmark checkpoint).
Needs `tokenizers` and `transformers` (reference-only dependencies; the tests never import this file).

Layout of the vocabulary (ids), mirroring Gemma 4 where the ids fit:
  * the Gemma-4 special tokens at their real ids (0..107, see SPECIAL_IDS; id 107 is the normal token "\\n"),
  * the image tokens at the top of the vocabulary (`<|image|>`, `<|image>`, `<image|>` at the ids the config uses),
  * the 256 byte-fallback tokens `<0x00>`..`<0xFF>`, in byte order, at the lowest ids not taken by the above
    (5..45, 53..97, 99, 102..104, then 108 onwards),
  * BPE tokens trained on a generated corpus take the remaining ids in trainer order (274 .. vocab_size-4 for the
    fixtures). Byte tokens sit between the special ids, so a consumer cannot assume any block is contiguous.
Text handling is SentencePiece-style (transformers' `GemmaTokenizer`): spaces become "▁" (U+2581), no prefix space,
byte fallback for characters outside the vocabulary, no GPT-2 byte remapping.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

# Gemma-4 control tokens at their released ids (docs/model.md#tokenizer). "\n" (107) is an ordinary vocabulary token.
SPECIAL_IDS: dict[int, str] = {
    0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>",
    46: "<|tool>", 47: "<tool|>", 48: "<|tool_call>", 49: "<tool_call|>",
    50: "<|tool_response>", 51: "<tool_response|>", 52: '<|"|>',
    98: "<|think|>", 100: "<|channel>", 101: "<channel|>", 105: "<|turn>", 106: "<turn|>",
}
NEWLINE_ID = 107
BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]


@dataclass(frozen=True)
class ImageTokenIds:
    """Where the config puts the vision placeholders (all must be < vocab_size)."""

    image_token_id: int  # <|image|>
    boi_token_id: int    # <|image>
    eoi_token_id: int    # <image|>

    def tokens(self) -> dict[int, str]:
        return {self.image_token_id: "<|image|>", self.boi_token_id: "<|image>", self.eoi_token_id: "<image|>"}


# ---------------------------------------------------------------------------------------------------------------
# Corpus: deterministic, small, mixed (English prose, code, numbers, whitespace runs, accents, CJK, emoji).

_WORDS = (
    "the of and to in is that it for was on are as with his they at be this from have or by one had not but what all "
    "were when we there can an your which their said if do will each about how up out them then she many some so "
    "these would other into has more her two like him see time could no make than first been its who now people my "
    "made over did down only way find use may water long little very after words called just where most know model "
    "token canvas sampler diffusion entropy window layer expert router cache engine server prompt stream tensor "
    "weight quantize kernel thread memory sky blue why because light scatter sunlight shorter wavelengths"
).split()
_UNICODE = (
    "café naïve résumé jalapeño Straße über façade Ελληνικά привет мир "
    "你好世界 日本語のテキスト 東京 大規模言語モデル 한국어 문장 "
    "😀 🚀 🎉 ✨ 👍🏽 ❤️ → ≤ ≥ ∑ π ∞ € £ ¥ — … «»"
).split()
_CODE = [
    "def main():\n    return 0\n",
    "for i in range(10):\n    print(i)\n",
    'if x == None:\n    raise ValueError("bad")\n',
    "import numpy as np\nx = np.zeros((4, 4), dtype=np.float32)\n",
    '{"name": "dgemma", "version": "0.1.0", "tags": ["a", "b"]}\n',
    "int main(void) {\n\treturn 0;\n}\n",
    "const f = (a, b) => a + b;\n",
    "SELECT id, name FROM users WHERE id = 42;\n",
]


def generate_corpus(seed: int = 1234, n_lines: int = 3000) -> list[str]:
    """A reproducible list of text lines; the mix decides which merges the BPE trainer learns."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        kind = i % 10
        if kind < 6:
            words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
            words[0] = words[0].capitalize()
            sentence = " ".join(words) + rng.choice([".", ".", "?", "!", ","])
            if rng.random() < 0.3:
                sentence += " " + str(rng.randint(0, 10 ** rng.randint(1, 6)))
            lines.append(sentence)
        elif kind < 8:
            lines.append(rng.choice(_CODE))
        elif kind == 8:
            lines.append(" ".join(rng.choice(_UNICODE) for _ in range(rng.randint(2, 6))))
        else:
            lines.append(" " * rng.randint(2, 8) + rng.choice(_WORDS) + "\n\n" + rng.choice(_WORDS) + "  \t ")
    return lines


_ONSETS = "b c d f g h j k l m n p r s t v w z br ch cl dr fl gr pl pr sh st th tr".split()
_NUCLEI = "a e i o u ai ea ee ie oo ou y".split()
_CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "x"]


def generate_large_corpus(seed: int, n_words: int, n_lines: int) -> list[str]:
    """The small corpus plus Zipf-distributed pseudo-words: enough distinct pairs for a vocabulary of ~10^4-10^5."""
    rng = random.Random(seed)

    def pseudo_word() -> str:
        return "".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS)
                       for _ in range(rng.randint(1, 4)))

    lexicon = [pseudo_word() for _ in range(n_words)]
    cum_weights = list(itertools.accumulate(1.0 / (rank + 1) for rank in range(n_words)))
    lines = generate_corpus(seed)
    for _ in range(n_lines):
        words = rng.choices(lexicon, cum_weights=cum_weights, k=rng.randint(5, 20))
        lines.append(" ".join(w.capitalize() if rng.random() < 0.1 else w for w in words) + rng.choice(".,?!;:"))
    return lines


# ---------------------------------------------------------------------------------------------------------------


def _reserved_ids(vocab_size: int, image_ids: ImageTokenIds) -> dict[int, str]:
    reserved = dict(SPECIAL_IDS)
    for token_id, token in image_ids.tokens().items():
        if not 0 <= token_id < vocab_size or token_id in reserved or token_id == NEWLINE_ID:
            raise ValueError(f"image token id {token_id} collides or is out of range for vocab {vocab_size}")
        reserved[token_id] = token
    return reserved


def _train_bpe(corpus: list[str], n_tokens: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Return (tokens in trainer order, merges in rank order) with len(tokens) == n_tokens."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Replace(" ", "▁")
    # Training-time word splitting only (SentencePiece does not merge across word starts or newlines); the final
    # GemmaTokenizer applies the learned merges to the whole normalised text.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split("\n+", behavior="isolated"),
        pre_tokenizers.Split("▁", behavior="merged_with_next"),
    ])
    trainer = trainers.BpeTrainer(
        vocab_size=n_tokens, min_frequency=2, show_progress=False, special_tokens=[],
        initial_alphabet=["▁", "\n"], limit_alphabet=max(2, min(120, n_tokens // 3)),
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    model = json_model(tok)
    vocab: dict[str, int] = model["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    if len(tokens) != n_tokens:
        raise ValueError(f"BPE trainer produced {len(tokens)} tokens, wanted {n_tokens}: enlarge the corpus")
    return tokens, merges


def json_model(tok) -> dict:
    import json

    return json.loads(tok.to_str())["model"]


def train_gemma_tokenizer(vocab_size: int, image_ids: ImageTokenIds, chat_template: str | None = None,
                          corpus_seed: int = 1234):
    """Build a transformers `GemmaTokenizer` whose vocabulary has exactly `vocab_size` entries.

    Vocabularies up to 1024 train on the small mixed corpus; larger ones add pseudo-words so the trainer finds
    enough merges.
    """
    from tokenizers import AddedToken
    from transformers import GemmaTokenizer

    reserved = _reserved_ids(vocab_size, image_ids)
    free_ids = [i for i in range(vocab_size) if i not in reserved and i != NEWLINE_ID]
    if len(free_ids) < len(BYTE_TOKENS) + 16:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for byte fallback plus a BPE vocabulary")
    byte_ids, bpe_ids = free_ids[: len(BYTE_TOKENS)], free_ids[len(BYTE_TOKENS):]

    # The trainer's vocabulary includes "\n", which goes to its fixed id 107; all other tokens fill bpe_ids.
    if vocab_size <= 1024:
        corpus = generate_corpus(corpus_seed)
    else:
        corpus = generate_large_corpus(corpus_seed, n_words=vocab_size, n_lines=4 * vocab_size)
    trained, merges = _train_bpe(corpus, len(bpe_ids) + 1)
    vocab: dict[str, int] = {token: token_id for token_id, token in reserved.items()}
    vocab.update(zip(BYTE_TOKENS, byte_ids))
    vocab["\n"] = NEWLINE_ID
    for token, token_id in zip([t for t in trained if t != "\n"], bpe_ids):
        if token in vocab:
            raise ValueError(f"trained token {token!r} collides with a reserved token")
        vocab[token] = token_id
    assert sorted(vocab.values()) == list(range(vocab_size)), "vocabulary ids must be exactly 0..vocab_size-1"

    tokenizer = GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)  # like Gemma: encode() prepends <bos>
    extra = [token for token_id, token in sorted(reserved.items()) if token_id > 4]
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in extra], special_tokens=True)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    _check_layout(tokenizer, reserved, vocab_size)
    return tokenizer


def _check_layout(tokenizer, reserved: dict[int, str], vocab_size: int) -> None:
    """Fail loudly if transformers moved any special token or grew the vocabulary."""
    if len(tokenizer) != vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens, expected {vocab_size}")
    for token_id, token in reserved.items():
        if tokenizer.convert_tokens_to_ids(token) != token_id:
            raise ValueError(f"{token} landed at id {tokenizer.convert_tokens_to_ids(token)}, expected {token_id}")
    if tokenizer.convert_tokens_to_ids("\n") != NEWLINE_ID:
        raise ValueError("'\\n' is not at id 107")
