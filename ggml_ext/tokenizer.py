"""Tokenizer built from GGUF metadata on HF `tokenizers` (no hand-written BPE).

`tokenizer.ggml.model = "gemma4"`: the Gemma 4 byte-fallback BPE (tokens + ranked merges), rebuilt exactly as
transformers' `GemmaTokenizer` builds it: normalizer `Replace(" ", "▁")`, the (inert) `Split(" ")` pre-tokenizer,
decoder `▁`->space + ByteFallback + Fuse, no prefix space. `"llama"` (SentencePiece-style vocabularies with scores and
no merges): the same BPE with merges derived from the scores (a merge ranks by its result's score, as SentencePiece
BPE and transformers' slow->fast conversion do), plus the optional prefix space.

Special tokens are added tokens, matched as wholes in text: CONTROL (type 3) tokens as special, USER_DEFINED (4) as
plain added tokens (both unnormalised, as in the checkpoints' tokenizer.json). No BOS is added by `encode`: the chat
template writes `<bos>` itself (docs/model.md#tokenizer).
"""
from __future__ import annotations

import os
from typing import Any, Iterable, Sequence

from tokenizers import AddedToken, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from dgemma_engine.errors import EngineError
from dgemma_engine import gguf_keys

SPACE_MARK = "▁"  # U+2581, SentencePiece's visible space
TYPE_NORMAL, TYPE_UNKNOWN, TYPE_CONTROL, TYPE_USER_DEFINED, TYPE_UNUSED, TYPE_BYTE = 1, 2, 3, 4, 5, 6
# the arrays a tokenizer is built from, read whole (every other array of a header is only summarised)
TOKENIZER_ARRAYS = frozenset({gguf_keys.KEY_TOKENS, gguf_keys.KEY_TOKEN_TYPE, gguf_keys.KEY_SCORES,
                              gguf_keys.KEY_MERGES})


class Tokenizer:
    """Text <-> token ids for a GGUF vocabulary."""

    def __init__(self, hf: HFTokenizer, tokens: list[str], special_ids: dict[str, int], space_prefix: bool = False,
                 control_ids: frozenset[int] = frozenset()):
        self._hf = hf
        self.control_ids = control_ids  # ids of CONTROL tokens (type 3): markup of the chat format, not text
        # SentencePiece's dummy prefix: one space before the text when encoding (once, not after each special
        # token), removed again at the start of decoded text.
        self._space_prefix = space_prefix
        self._literal: HFTokenizer | None = None  # a copy that treats special-token text as plain text
        self.tokens = tokens
        self.special_ids = special_ids  # role ("bos", "eos", "unk", "pad", "mask") -> id
        self._ids = {tok: i for i, tok in reversed(list(enumerate(tokens)))}  # first id wins for duplicates

    # ---- construction -------------------------------------------------------------------------------------------

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> Tokenizer:
        """Raises EngineError (one line) for any malformed tokenizer metadata (wrong types included)."""
        try:
            return cls._from_metadata(metadata)
        except EngineError:
            raise
        except Exception as exc:  # noqa: BLE001 (ints where strings belong, arrays where ints belong, ...)
            detail = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line: HF errors span several
            raise EngineError(f"malformed tokenizer metadata in the GGUF ({detail})"[:300]) from None

    @classmethod
    def _from_metadata(cls, metadata: dict[str, Any]) -> Tokenizer:
        model = metadata.get(gguf_keys.KEY_TOKENIZER_MODEL)
        tokens = _as_list(metadata.get(gguf_keys.KEY_TOKENS))
        if not tokens:
            raise EngineError("the GGUF has no tokenizer.ggml.tokens: cannot tokenize")
        types = [int(t) for t in _as_list(metadata.get(gguf_keys.KEY_TOKEN_TYPE))] or [TYPE_NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise EngineError("tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length")
        special_ids = {}
        for role, key in gguf_keys.SPECIAL_TOKEN_KEYS.items():
            value = metadata.get(key)
            if value is not None and 0 <= int(value) < len(tokens):
                special_ids[role] = int(value)
        unk = tokens[special_ids["unk"]] if "unk" in special_ids else None
        vocab = {}
        for i, tok in enumerate(tokens):
            vocab.setdefault(tok, i)

        if model == "gemma4":
            merges = [_split_merge(m) for m in _as_list(metadata.get(gguf_keys.KEY_MERGES))]
            add_space_prefix = False
        elif model == "llama":
            scores = [float(s) for s in _as_list(metadata.get(gguf_keys.KEY_SCORES))]
            if len(scores) != len(tokens):
                raise EngineError("tokenizer.ggml.scores and tokenizer.ggml.tokens differ in length")
            merges = _merges_from_scores(tokens, scores, types)
            add_space_prefix = bool(metadata.get(gguf_keys.KEY_ADD_SPACE_PREFIX, True))
        else:
            raise EngineError(f"unsupported tokenizer model {model!r} (expected 'gemma4' or 'llama')")

        hf = HFTokenizer(BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True,
                             dropout=None))
        # Decoding is context-free (what the stream decoder relies on); see space_prefix for SentencePiece.
        hf.decoder = decoders.Sequence([decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()])
        hf.normalizer = normalizers.Replace(" ", SPACE_MARK)
        hf.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")  # inert, as in Gemma's
        added = [AddedToken(tok, special=t == TYPE_CONTROL, normalized=False)
                 for tok, t in zip(tokens, types) if t in (TYPE_CONTROL, TYPE_USER_DEFINED) and tok]
        hf.add_special_tokens([a for a in added if a.special])
        hf.add_tokens([a for a in added if not a.special])
        control = frozenset(i for i, t in enumerate(types) if t == TYPE_CONTROL)
        return cls(hf, tokens, special_ids, space_prefix=add_space_prefix, control_ids=control)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
        """Read only the tokenizer keys of a GGUF file (no model load), with the bounded header reader: the file's
        other keys cost nothing, and a hostile header is refused within the reader's limits."""
        from dgemma_engine.gguf_reader import GGUFError, read_gguf_info

        try:
            metadata = read_gguf_info(path, keep_arrays=TOKENIZER_ARRAYS).metadata
        except GGUFError as exc:
            raise EngineError(str(exc)) from None
        return cls.from_metadata({key: value for key, value in metadata.items() if key.startswith("tokenizer.")})

    # ---- use ----------------------------------------------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._ids.get(token)

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids of `text`; special=True parses special-token text (e.g. "<|turn>") into its id, False
        tokenizes it as plain characters. Never adds BOS."""
        hf = self._hf if special else self._literal_tokenizer()
        if self._space_prefix and text:
            text = " " + text
        return hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special: bool = False, hide: frozenset[int] = frozenset()) -> str:
        """`hide`: ids that write nothing (e.g. control tokens no reader of the text parses)."""
        return self._strip_start(self._decode_piece(ids, skip_special, hide))

    def _decode_piece(self, ids: Sequence[int], skip_special: bool, hide: frozenset[int] = frozenset()) -> str:
        """Decode without start-of-text handling: pieces cut at complete characters concatenate exactly."""
        ids = [int(i) for i in ids]
        if any(i < 0 or i >= len(self.tokens) for i in ids):
            raise EngineError(f"token id outside the vocabulary [0, {len(self.tokens)})")
        if hide:  # a hidden token still ends a run of byte tokens, as it did when it wrote its text
            runs, run = [], []
            for i in ids:
                if i in hide:
                    runs, run = runs + [run], []
                else:
                    run.append(i)
            return "".join(self._hf.decode(r, skip_special_tokens=skip_special) for r in runs + [run] if r)
        return self._hf.decode(ids, skip_special_tokens=skip_special)

    def _strip_start(self, text: str) -> str:
        return text[1:] if self._space_prefix and text.startswith(" ") else text

    def stream_decoder(self, skip_special: bool = False, hide: frozenset[int] = frozenset()) -> StreamDecoder:
        return StreamDecoder(self, skip_special, hide)

    def _literal_tokenizer(self) -> HFTokenizer:
        if self._literal is None:
            self._literal = HFTokenizer.from_str(self._hf.to_str())
            self._literal.encode_special_tokens = True
        return self._literal


class StreamDecoder:
    """Incremental detokenizer: `feed(ids)` returns only text that is final. A UTF-8 character whose byte-fallback
    tokens are split across feeds (canvases) is held back until complete; `flush()` returns whatever is left
    (an incomplete tail becomes U+FFFD, as a full decode would)."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False, hide: frozenset[int] = frozenset()):
        self._tok = tokenizer
        self._skip = skip_special
        self._hide = hide
        self._window: list[int] = []  # ids since the last point where all decoded text was complete
        self._emitted = 0             # characters of decode(window) already returned
        self._at_start = True         # nothing returned yet: the start-of-text rule still applies

    def feed(self, ids: Iterable[int]) -> str:
        self._window.extend(int(i) for i in ids)
        text = self._tok._decode_piece(self._window, self._skip, self._hide)
        complete = text.rstrip("\ufffd")  # a trailing U+FFFD may be a character still missing bytes
        out = complete[self._emitted:]
        self._emitted = max(self._emitted, len(complete))
        if complete == text:  # clean end: later text decodes independently of this window
            self._window, self._emitted = [], 0
        return self._start(out)

    def flush(self) -> str:
        text = self._tok._decode_piece(self._window, self._skip, self._hide) if self._window else ""
        out = text[self._emitted:]
        self._window, self._emitted = [], 0
        return self._start(out)

    def _start(self, out: str) -> str:
        if self._at_start and out:
            self._at_start = False
            return self._tok._strip_start(out)
        return out


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return value.tolist() if hasattr(value, "tolist") else list(value)


def _split_merge(merge: str) -> tuple[str, str]:
    """GGUF stores a merge as "left right"; split at the first space at index >= 1 (as llama.cpp does), so a
    left part that is itself a space-like token stays intact."""
    cut = merge.find(" ", 1)
    if cut < 1:
        raise EngineError(f"malformed tokenizer merge {merge!r}")
    return merge[:cut], merge[cut + 1:]


def _merges_from_scores(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges of a SentencePiece-BPE vocabulary: every split of a normal token into two vocabulary pieces is a
    merge; merges producing higher-scored tokens apply first (ties: shorter left part, then lower result id)."""
    vocab = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    candidates = []
    for i, tok in enumerate(tokens):
        if types[i] not in (TYPE_NORMAL, TYPE_USER_DEFINED) or len(tok) < 2 or vocab[tok] != i:
            continue
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in vocab and right in vocab:
                candidates.append((-scores[i], i, vocab[left], vocab[right], left, right))
    candidates.sort()
    return [(left, right) for *_, left, right in candidates]


__all__ = ["Tokenizer", "StreamDecoder"]
