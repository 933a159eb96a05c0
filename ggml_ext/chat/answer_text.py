"""Which control tokens an answer's text may hold.

An answer is decoded from the model's tokens. A control token (tokenizer type 3) is chat markup, not text: written as
text it reaches clients as `<mask>`, `<|image>` or `<tool_response|>` in the middle of an answer. The text keeps only
the control tokens that its readers parse and then remove: the thinking channel's markers (the server moves that
block to `thinking`) and the tool-call syntax (parsed into tool calls). Every other control token writes nothing, as
llama.cpp's server renders control tokens by default. User-defined tokens (type 4) are text and stay.
"""
from __future__ import annotations

from typing import Any

from dgemma_engine.chat.tool_calls import CALL_TOKENS

CHANNEL_TOKENS = frozenset({"<|channel>", "<channel|>"})  # the thinking block's markers
KEPT_CONTROL_TOKENS = CHANNEL_TOKENS | CALL_TOKENS


def hidden_control_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of `tokenizer` (dgemma_engine.tokenizer.Tokenizer) that an answer's text leaves out."""
    return frozenset(i for i in tokenizer.control_ids if tokenizer.tokens[i] not in KEPT_CONTROL_TOKENS)
