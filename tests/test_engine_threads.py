"""Thread counts at the engine's own door. 700 threads overflowed the decoder graph (the dense soft embedding adds
nodes per thread) and aborted the process, whatever the caller: now a count above ggml's limit (512) is a clean
EngineError, and the graph is sized for the slices of any count below it."""
import numpy as np
import pytest

from dgemma_engine.errors import EngineError
from dgemma_engine.model import Context, Model


def test_a_thread_count_past_the_graphs_old_base_runs_a_self_conditioned_step(gguf_path):
    # F16: the dense soft embedding (F32 files take the tiled path, which has no per-thread slices)
    with Model.load(gguf_path("tiny-a", "f16"), threads=500) as m, Context(m, n_ctx=64) as ctx:
        C = m.hparams.canvas_length
        ctx.encode([2, 10, 11])
        first = np.array(ctx.step(list(range(5, 5 + C))), copy=True)
        second = ctx.step(list(range(5, 5 + C)), sc_temperature=0.8)
        assert np.isfinite(first).all() and np.isfinite(second).all()


def test_a_thread_count_above_ggmls_limit_is_an_engine_error(gguf_path):
    with pytest.raises(EngineError, match=r"n_threads must be at most 512 \(ggml's limit\), got 1000"):
        Model.load(gguf_path("tiny-a", "f16"), threads=1000)
    with Model.load(gguf_path("tiny-a", "f16"), threads=1) as m:
        with pytest.raises(EngineError, match="n_threads must be at most 512"):
            Context(m, n_ctx=64, threads=1000)
