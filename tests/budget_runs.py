"""Seeded structured-output generations under small token budgets, for tests/test_structured_budget.py and
bench/structured_budget.py: tiny-a with another canvas length, one budget per seed, and one generation checked the
way a client would (it ends on EOS within `num_predict`, and the text parses and validates)."""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np

from gguf_mutator import read, write

MAX_CANVASES = 16  # the server's default DGEMMA_MAX_CANVASES
STEPS = {8: 2, 256: 1}  # denoising steps per canvas; one at C = 256 for time (the rule acts on the last step's logits)


def with_canvas_length(src: Path, dst: Path, canvas_length: int) -> Path:
    """A copy of a GGUF with another canvas length (the weights do not depend on it)."""
    kvs, tensors = read(src)
    kvs = [replace(kv, value=canvas_length) if kv.key == "diffusion.canvas_length" else kv for kv in kvs]
    return write(dst, kvs, tensors)


def budget(seed: int, C: int, shortest: int) -> tuple[int | None, int, int]:
    """(num_predict or None, canvases the budget allows, canvases the context holds) for one seeded generation: each
    of num_predict, the context and DGEMMA_MAX_CANVASES ends it in turn, a few tokens past the shortest value."""
    rng = np.random.default_rng(seed)
    fewest = math.ceil((shortest + 1) / C)  # canvases holding the shortest value and its stop id
    if C >= 64 and seed % 40 == 1:  # one whole canvas, ended by the context
        return None, MAX_CANVASES, 1
    if C >= 64 or seed % 3 == 0:  # num_predict; the server budgets one more position for the stop id
        limit = shortest + int(rng.integers(0, min(2 * C, 24) + 1))
        canvases = math.ceil((limit + 1) / C)
        return limit, canvases, canvases + int(rng.integers(0, 3))
    extra = int(rng.integers(0, 4))
    if seed % 3 == 1:  # the context ends it
        return None, MAX_CANVASES, fewest + extra
    return None, fewest + extra, fewest + extra + 2  # DGEMMA_MAX_CANVASES ends it


def run_seed(model: Any, tokenizer: Any, automaton: Any, schema: dict | None, seed: int,
             contexts: dict[int, Any]) -> str | None:
    """One constrained generation under `budget(seed, ...)`; None when it ended on EOS within num_predict with text
    that parses and validates, else what went wrong. `contexts` keeps one engine context per size (closed by the
    caller)."""
    from dgemma_engine.constrained import CanvasConstraint, check_room
    from dgemma_engine.events import CanvasEvent, DoneEvent
    from dgemma_engine.generate import SamplerParams, eos_ids_from_metadata, generate
    from dgemma_engine.model import Context

    C = int(model.hparams.canvas_length)
    prompt = tokenizer.encode("Answer in JSON.")
    limit, canvases, room = budget(seed, C, automaton.shortest_value)
    check_room(automaton, min(canvases, room) * C, limit)  # what the server checks before generating
    n_ctx = len(prompt) + room * C
    if n_ctx not in contexts:
        contexts[n_ctx] = Context(model, n_ctx=n_ctx, threads=1)
    ctx = contexts[n_ctx]
    ctx.reset()
    params = replace(SamplerParams.from_metadata(model.metadata, seed=seed), max_steps=STEPS.get(C, 1))
    events = list(generate(ctx, prompt, params, max_new_tokens=canvases * C,
                           eos_ids=eos_ids_from_metadata(model.metadata), tokenizer=tokenizer,
                           constraint=CanvasConstraint(automaton, token_limit=limit)))
    ids = [t for e in events if isinstance(e, CanvasEvent) for t in e.ids]
    text = "".join(e.text for e in events if isinstance(e, CanvasEvent))
    where = f"seed {seed}, num_predict {limit}, {canvases} canvases, context for {room}: {text!r}"
    done = events[-1]
    if not isinstance(done, DoneEvent) or done.reason != "eos":
        return f"ended by {getattr(done, 'reason', done)}; {where}"
    if limit is not None and len(ids) > limit:
        return f"{len(ids)} tokens; {where}"
    try:
        jsonschema.validate(json.loads(text), schema or {"type": "object"})
    except (ValueError, jsonschema.ValidationError) as exc:
        return f"{str(exc).splitlines()[0]}; {where}"
    return None
