"""The Sudoku model's vocabulary and its Gemma-style tokenizer files.

Ids 0-4 are DiffusionGemma's specials (<pad> <eos> <bos> <unk> <mask>), then the digits '0'-'9' (the canvas writes
'1'-'9'), then one token per (cell, given) pair, `<c{cell}={digit}>` (digit 0 = blank). The RoPE-only architecture has no
absolute positions; giving every prompt cell its own token lets the canvas find its row, column and box by attending to
the prompt cell at a fixed relative offset.
"""
from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
DIGITS = [str(d) for d in range(10)]
CELL_TOKENS = [f"<c{cell}={digit}>" for cell in range(81) for digit in range(10)]
TOKENS = SPECIALS + DIGITS + CELL_TOKENS
VOCAB_SIZE = len(TOKENS)  # 825
BOS, EOS, PAD = 2, 1, 0
DIGIT_BASE = len(SPECIALS)  # id of '0'
CELL_BASE = DIGIT_BASE + 10

# Renders the latest user message of 81 digits ('0' = blank) as the cell tokens; the engine tokenizes the result.
# Only the latest one: each puzzle is answered on its own, so earlier turns of a chat (and `tools`) are ignored.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages if message['role'] == 'user' %}{% if loop.last %}"
    "{% for ch in message['content'] %}<c{{ loop.index0 }}={{ ch }}>{% endfor %}{% endif %}{% endfor %}"
)


def prompt_ids(puzzle: str) -> list[int]:
    return [BOS] + [CELL_BASE + cell * 10 + int(ch) for cell, ch in enumerate(puzzle)]


def answer_ids(solution: str) -> list[int]:
    return [DIGIT_BASE + int(ch) for ch in solution]


def ids_to_grid(ids: list[int]) -> str:
    """Canvas ids -> 81-char grid; anything that is not a digit token becomes '0' (an invalid answer)."""
    return "".join(str(i - DIGIT_BASE) if DIGIT_BASE <= i < DIGIT_BASE + 10 else "0" for i in ids)


def write_tokenizer(out_dir: Path) -> None:
    """tokenizer.json (BPE, no merges, specials and cell tokens as added tokens), tokenizer_config.json, chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE(vocab={t: i for i, t in enumerate(TOKENS)}, merges=[], unk_token="<unk>", byte_fallback=False))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS + CELL_TOKENS])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "GemmaTokenizer",
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<mask>",
        "add_bos_token": False, "add_eos_token": False, "model_max_length": 4096,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
