"""`tokenizer.json` + `tokenizer_config.json` / `chat_template.jinja` -> the GGUF `tokenizer.*` keys (gemma4 model).

The vocabulary is a byte-fallback BPE over raw UTF-8 with `▁` for spaces (docs/gguf.md#tokenizer-keys). Token types
follow the PR #24423 converter: `<0xNN>` byte tokens are BYTE; special tokens, `<s>`, `</s>` and every token shaped
`<|…>` or `<…|>` are CONTROL; other added tokens USER_DEFINED; the rest NORMAL. Scores are placeholders (-1000, as in
the published files): BPE ranks come from the order of the merges. Runtimes must decide stopping by id, not by type.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import TokenType

from dgemma_convert.errors import ConvertError
from dgemma_convert.hf_config import ModelConfig, read_json

TOKENIZER_MODEL = "gemma4"
PLACEHOLDER_SCORE = -1000.0
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
SPECIAL_ROLES = ("bos", "eos", "unk", "pad", "mask")


@dataclass(frozen=True)
class TokenizerMeta:
    tokens: list[str]
    scores: list[float]
    token_types: list[int]
    merges: list[str]  # "left right", in rank order
    special_ids: dict[str, int]  # role ("bos", "eos", ...) -> id, for the roles the tokenizer defines
    chat_template: str | None

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


def looks_like_control(token: str) -> bool:
    return token in ("<s>", "</s>") or (token.startswith("<|") and token.endswith(">")) or (
        token.startswith("<") and token.endswith("|>"))


def load_tokenizer(hf_dir: Path, cfg: ModelConfig) -> TokenizerMeta:
    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        raise ConvertError(f"tokenizer.json not found in {hf_dir} (the GGUF must carry the vocabulary)")
    tokenizer = read_json(path, "tokenizer.json")
    config_path = hf_dir / "tokenizer_config.json"
    tok_config = read_json(config_path, "tokenizer_config.json") if config_path.is_file() else {}

    id_to_token, added = _vocabulary(tokenizer)
    token_to_id = {tok: i for i, tok in enumerate(id_to_token)}
    special_ids = _special_ids(tok_config, token_to_id, cfg)
    control_ids = set(special_ids.values()) | {i for i, special in added.items() if special}
    control_ids |= {token_to_id[t] for t in _extra_special_tokens(tok_config) if t in token_to_id}

    types = [int(TokenType.NORMAL)] * len(id_to_token)
    for i, tok in enumerate(id_to_token):
        bracketed = tok.startswith("<")  # byte and control-shaped tokens all start with "<" (a fast pre-check)
        if bracketed and BYTE_TOKEN.fullmatch(tok):
            types[i] = int(TokenType.BYTE)
        elif i in control_ids or (bracketed and looks_like_control(tok)):
            types[i] = int(TokenType.CONTROL)
        elif i in added:
            types[i] = int(TokenType.USER_DEFINED)

    return TokenizerMeta(
        tokens=id_to_token,
        scores=[PLACEHOLDER_SCORE] * len(id_to_token),
        token_types=types,
        merges=_merges(tokenizer),
        special_ids=special_ids,
        chat_template=_chat_template(hf_dir, tok_config),
    )


def _vocabulary(tokenizer: dict[str, Any]) -> tuple[list[str], dict[int, bool]]:
    """Token strings by id (base vocab + added tokens; ids must be 0..n-1) and {added id: special}."""
    model = tokenizer.get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE":
        raise ConvertError("tokenizer.json: expected a BPE model (Gemma 4 tokenizer)")
    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or not vocab:
        raise ConvertError("tokenizer.json: model.vocab must be a non-empty object")
    by_id: dict[int, str] = {}
    for tok, i in vocab.items():
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ConvertError(f"tokenizer.json: bad id {i!r} for token {tok!r}")
        if i in by_id:
            raise ConvertError(f"tokenizer.json: id {i} is used by two tokens")
        by_id[i] = tok
    added: dict[int, bool] = {}
    for entry in tokenizer.get("added_tokens") or []:
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise ConvertError("tokenizer.json: malformed added_tokens entry")
        i = entry.get("id")
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ConvertError(f"tokenizer.json: bad added token id {i!r}")
        by_id[i] = entry["content"]  # an added token may restate a vocab entry; its content wins
        added[i] = bool(entry.get("special", False))
    n = len(by_id)
    if max(by_id) != n - 1:
        missing = next(i for i in range(n) if i not in by_id)
        raise ConvertError(f"tokenizer.json: token ids are not contiguous (id {missing} is missing)")
    return [by_id[i] for i in range(n)], added


def _merges(tokenizer: dict[str, Any]) -> list[str]:
    merges = tokenizer["model"].get("merges") or []
    if not isinstance(merges, list):
        raise ConvertError("tokenizer.json: model.merges must be a list")
    out = []
    for m in merges:
        if isinstance(m, str):  # legacy "left right", already in the stored form
            if m.find(" ", 1) < 1:
                raise ConvertError(f"tokenizer.json: merge {m!r} has no separator")
            out.append(m)
            continue
        if not (isinstance(m, list) and len(m) == 2 and all(isinstance(p, str) and p for p in m)):
            raise ConvertError(f"tokenizer.json: malformed merge {m!r}")
        left, right = m
        if " " in left[1:]:  # readers split "left right" at the first space at index >= 1
            raise ConvertError(f"tokenizer.json: merge {m!r} cannot be stored as 'left right'")
        out.append(f"{left} {right}")
    return out


def _token_content(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):  # serialized AddedToken
        return value["content"]
    return None


def _extra_special_tokens(tok_config: dict[str, Any]) -> list[str]:
    names = []
    for key in ("additional_special_tokens", "extra_special_tokens"):
        value = tok_config.get(key)
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
        names.extend(c for c in map(_token_content, items) if c is not None)
    return names


def _special_ids(tok_config: dict[str, Any], token_to_id: dict[str, int], cfg: ModelConfig) -> dict[str, int]:
    """bos/eos/unk/pad/mask ids: named in tokenizer_config.json, else config.json's ids (bos, eos, pad)."""
    fallback = {"bos": cfg.bos_token_id, "eos": cfg.eos_token_id, "pad": cfg.pad_token_id}
    ids: dict[str, int] = {}
    for role in SPECIAL_ROLES:
        content = _token_content(tok_config.get(f"{role}_token"))
        if content is not None and content in token_to_id:
            ids[role] = token_to_id[content]
        elif fallback.get(role) is not None and fallback[role] < len(token_to_id):
            ids[role] = fallback[role]
    return ids


def _chat_template(hf_dir: Path, tok_config: dict[str, Any]) -> str | None:
    path = hf_dir / "chat_template.jinja"
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConvertError(f"cannot read {path}: {exc}") from None
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: keep the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return template if isinstance(template, str) else None
