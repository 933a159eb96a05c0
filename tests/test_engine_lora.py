"""LoRA adapters in the engine (docs/gguf.md#lora-adapters) against transformers + PEFT, and malformed adapter files.

The goldens are tests/fixtures/lora/<adapter>/ (tests/reference/make_lora_fixtures.py): random PEFT adapters on
tiny-a with different encoder and decoder deltas; `r4-all` adapts attention, dense MLP, router and experts, `r8-attn-mlp`
attention and dense MLP, `r4-self-cond` the self-conditioning MLP (and one q projection). Each is loaded from its PEFT folder (converted by dgemma_convert.lora.peft_as_gguf first) and from the
GGUF LoRA file the converter writes; at F32 the first and the self-conditioned step match PEFT within 1e-4 and the
`--rng torch` generation token for token. At Q8_0 the base is quantized and the adapter applied at run time: the KL
against the F32 result is printed (pytest -s) and bounded like tests/test_engine_quant.py's Q8_0 bound.

Measured (1 thread, the two steps): max |Δlogit| vs PEFT 1.6e-5 (r4-all), 1.2e-5 (r8-attn-mlp), 1.1e-5
(r4-self-cond), tiny-a without an adapter 7.4e-6; Q8_0 base + adapter vs F32 + adapter: mean KL 6.6e-3 nats, top-1
0.75 (r4-all); 3.1e-3, 0.88 (r8-attn-mlp); 1.4e-2, 0.91 (r4-self-cond); the Q8_0 base alone against the F32 base on
the same steps: 1.3e-2.
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import gguf_mutator as gm
from dgemma_convert.lora import peft_as_gguf
from dgemma_engine.debug_generate import debug_generate
from dgemma_engine.errors import EngineError
from dgemma_engine.model import Context, Model
from test_engine_devices import needs_rpc, rpc_endpoint  # noqa: F401 (rpc_endpoint is a fixture)

LORA = Path(__file__).parent / "fixtures" / "lora"
ADAPTERS = ("r4-all", "r8-attn-mlp", "r4-self-cond")
TOLERANCE = 1e-4
THREADS = 1
Q8_MAX_MEAN_KL = 2e-2  # tests/test_engine_quant.py's tiny-a Q8_0 bound (the base alone measures 1.0e-2)


def golden(name: str) -> dict[str, np.ndarray]:
    with np.load(LORA / name / "golden.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def lora_gguf(tmp_path_factory):
    from dgemma_convert.lora import convert_lora

    folder = tmp_path_factory.mktemp("lora")
    files = {}
    for name in ADAPTERS:
        files[name] = folder / f"{name}.gguf"
        convert_lora(LORA / name, files[name])
    return files


def two_steps(model: Model, g: dict[str, np.ndarray]) -> np.ndarray:
    """The golden's two decoder steps: the first of a canvas, then one self-conditioned on it."""
    with Context(model, n_ctx=len(g["prompt"]) + model.hparams.canvas_length, threads=THREADS) as ctx:
        ctx.encode(g["prompt"])
        first = ctx.step(g["canvas"][0]).copy()
        second = ctx.step(g["canvas"][1], sc_temperature=float(g["T"][0])).copy()
    return np.stack([first, second])


@pytest.mark.parametrize("source", ["peft", "gguf"])
@pytest.mark.parametrize("name", ADAPTERS)
def test_first_and_self_conditioned_steps_match_peft(gguf_path, lora_gguf, name, source):
    g = golden(name)
    adapter = LORA / name if source == "peft" else lora_gguf[name]
    with peft_as_gguf([adapter]) as adapters, \
            Model.load(gguf_path("tiny-a", "f32"), threads=THREADS, adapters=adapters) as m:
        assert m.n_adapters == 1
        got = two_steps(m, g)
    err = np.abs(got - g["raw"]).max(axis=(1, 2))
    print(f"{name} from {source}: max |Δlogit| first {err[0]:.2e}, self-conditioned {err[1]:.2e}")
    assert err.max() <= TOLERANCE
    base = np.load(LORA / "base.npz")["raw"]
    assert np.abs(got - base).max() > 100 * TOLERANCE  # the adapter matters


@pytest.mark.parametrize("name", ADAPTERS)
def test_debug_generate_torch_rng_is_token_exact(gguf_path, lora_gguf, name):
    g = golden(name)
    out = debug_generate(gguf_path("tiny-a", "f32"), g["prompt"].tolist(), seed=0, rng="torch", max_new_tokens=32,
                         steps=12, t_max=0.8, t_min=0.4, entropy_bound=0.1, confidence_threshold=0.005,
                         stability_threshold=1, threads=THREADS, out=io.StringIO(), adapters=[(lora_gguf[name], 1.0)])
    assert out["sequence"] == g["seq"].tolist()
    assert out["steps_per_canvas"] == g["steps_per_canvas"].tolist()


def test_debug_cli_takes_lora_with_a_scale(gguf_path, tmp_path):
    """`--lora PATH:SCALE` on both debug commands: generate from the PEFT folder, logits from it at scale 1.0."""
    name = "r4-all"
    g = golden(name)
    gguf = gguf_path("tiny-a", "f32")
    prompt = ",".join(map(str, g["prompt"].tolist()))
    base = [sys.executable, "-m", "dgemma_cli.main", "debug"]
    cmd = base + ["generate", str(gguf), "--prompt-ids", prompt, "--seed", "0", "--rng", "torch", "--max-new-tokens",
                  "32", "--steps", "12", "--t-max", "0.8", "--t-min", "0.4", "--entropy-bound", "0.1",
                  "--confidence-threshold", "0.005", "--stability-threshold", "1", "--threads", str(THREADS),
                  "--lora", f"{LORA / name}:1.0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["sequence"] == g["seq"].tolist()
    out = tmp_path / "logits.npy"
    cmd = base + ["logits", str(gguf), "--prompt-ids", prompt, "--canvas-ids", ",".join(map(str, g["canvas"][0])),
                  "--out", str(out), "--threads", str(THREADS), "--lora", str(LORA / name)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert np.abs(np.load(out) - g["raw"][0]).max() <= TOLERANCE


def test_scales_fold_like_the_arithmetic(gguf_path, lora_gguf):
    """Scale 0 leaves the base logits exactly; the same adapter twice at 0.5 is the adapter once; two different
    adapters stack (their deltas add: each one's effect is visible in the sum)."""
    g = golden("r4-all")
    base_gguf = gguf_path("tiny-a", "f32")
    with Model.load(base_gguf, threads=THREADS) as m:
        base = two_steps(m, g)
    with Model.load(base_gguf, threads=THREADS, adapters=[(lora_gguf["r4-all"], 0.0)]) as m:
        assert np.array_equal(two_steps(m, g), base)
    with Model.load(base_gguf, threads=THREADS, adapters=[(lora_gguf["r4-all"], 0.5), (lora_gguf["r4-all"], 0.5)]) as m:
        assert m.n_adapters == 2
        assert np.abs(two_steps(m, g) - g["raw"]).max() <= TOLERANCE
    with Model.load(base_gguf, threads=THREADS, adapters=[lora_gguf["r4-all"], lora_gguf["r8-attn-mlp"]]) as m:
        both = two_steps(m, g)
    assert np.abs(both - g["raw"]).max() > 100 * TOLERANCE and np.abs(both - golden("r8-attn-mlp")["raw"]).max() > 0.01


def test_standard_op_graph_applies_adapters_too(gguf_path, lora_gguf, monkeypatch):
    """What an accelerator runs (no fused GELU, no tiled experts), forced on the CPU."""
    monkeypatch.setenv("DGEMMA_STANDARD_OPS", "1")
    g = golden("r4-all")
    with Model.load(gguf_path("tiny-a", "f32"), threads=THREADS, adapters=[lora_gguf["r4-all"]]) as m:
        assert np.abs(two_steps(m, g) - g["raw"]).max() <= TOLERANCE


@needs_rpc
def test_adapters_follow_their_weights_onto_an_rpc_device(gguf_path, lora_gguf, rpc_endpoint):
    """Layers 2-3 and the output on a loopback RPC device, layer 2's experts on the CPU: each folded delta is copied
    with the weight it adapts; `--rng torch` stays token-exact."""
    g = golden("r4-all")
    cmd = [sys.executable, "-m", "dgemma_cli.main", "debug", "generate", str(gguf_path("tiny-a", "f32")),
           "--prompt-ids", ",".join(map(str, g["prompt"].tolist())), "--seed", "0", "--rng", "torch",
           "--max-new-tokens", "32", "--steps", "12", "--t-max", "0.8", "--t-min", "0.4", "--entropy-bound", "0.1",
           "--confidence-threshold", "0.005", "--stability-threshold", "1", "--threads", "1", "--num-gpu", "3",
           "--num-cpu-moe", "3", "--lora", str(lora_gguf["r4-all"])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "DGEMMA_RPC": rpc_endpoint})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["sequence"] == g["seq"].tolist()


def split_gate_up(tensors: list[gm.Tensor], fused: str, gate: str, up: str) -> list[gm.Tensor]:
    """Every F32 tensor named `…fused…` [n, 2F(, E)] (ne) as the two halves of its rows; A factors (`lora_a`, whose
    rows are the input) are kept whole for both."""
    out = []
    for t in tensors:
        if fused not in t.name:
            out.append(t)
            continue
        if t.name.endswith(".lora_a"):
            out += [replace(t, name=t.name.replace(fused, gate)), replace(t, name=t.name.replace(fused, up))]
            continue
        x = np.frombuffer(t.data, np.float32).reshape(tuple(reversed(t.ne)))  # numpy order: (E, 2F, n)
        half = x.shape[1] // 2
        ne = (t.ne[0], half) + t.ne[2:]
        out += [gm.Tensor(t.name.replace(fused, name), ne, t.ggml_type, np.ascontiguousarray(part).tobytes())
                for name, part in ((gate, x[:, :half]), (up, x[:, half:]))]
    return out


def test_one_adapter_fits_both_expert_layouts(gguf_path, lora_gguf, tmp_path):
    """The fused gate_up expert delta on a base with split gate/up experts, and split deltas on the fused base."""
    g = golden("r4-all")
    fused, gate, up = "ffn_gate_up_exps.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight"
    split_base = rewrite(gguf_path("tiny-a", "f32"), tmp_path / "split.gguf",
                         tensors=lambda ts: split_gate_up(ts, fused, gate, up))
    split_adapter = rewrite(lora_gguf["r4-all"], tmp_path / "split-lora.gguf",
                            tensors=lambda ts: split_gate_up(ts, fused, gate, up))
    for base, adapter in ((split_base, lora_gguf["r4-all"]), (gguf_path("tiny-a", "f32"), split_adapter),
                          (split_base, split_adapter)):
        with Model.load(base, threads=THREADS, adapters=[adapter]) as m:
            assert m.hparams.split_experts == (base == split_base)
            assert np.abs(two_steps(m, g) - g["raw"]).max() <= TOLERANCE


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def mean_kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    p, q = log_softmax(p_logits), log_softmax(q_logits)
    return float((np.exp(p) * (p - q)).sum(-1).mean())


@pytest.mark.parametrize("name", ADAPTERS)
def test_q8_0_base_with_adapter_stays_close_to_f32(gguf_path, lora_gguf, name):
    g = golden(name)
    with Model.load(gguf_path("tiny-a", "q8_0"), threads=THREADS, adapters=[lora_gguf[name]]) as m:
        q8 = two_steps(m, g)
    with Model.load(gguf_path("tiny-a", "q8_0"), threads=THREADS) as m:
        q8_base = two_steps(m, g)
    kl, kl_base = mean_kl(g["raw"], q8), mean_kl(np.load(LORA / "base.npz")["raw"], q8_base)
    top1 = float((q8.argmax(-1) == g["raw"].argmax(-1)).mean())
    print(f"{name}: Q8_0 base + adapter vs F32 + adapter: mean KL {kl:.2e} nats, top-1 {top1:.3f} "
          f"(Q8_0 base alone vs F32 base: {kl_base:.2e})")
    assert kl <= Q8_MAX_MEAN_KL


# ---- malformed adapters: one clear EngineError each --------------------------------------------------------------

def rewrite(src: Path, dst: Path, kvs=None, tensors=None) -> Path:
    old_kvs, old_tensors = gm.read(src)
    return gm.write(dst, kvs(old_kvs) if kvs else old_kvs, tensors(old_tensors) if tensors else old_tensors)


def set_key(key: str, vtype: int, value):
    return lambda kvs: [kv for kv in kvs if kv.key != key] + [gm.KV(key, vtype, value)]


def drop_key(key: str):
    return lambda kvs: [kv for kv in kvs if kv.key != key]


def with_rank(ts: list[gm.Tensor], name: str, rank: int) -> list[gm.Tensor]:
    """lora_b of `name` with another rank (and data to match, so only the rank is wrong)."""
    out = []
    for t in ts:
        if t.name == name + ".lora_b":
            ne = (rank,) + t.ne[1:]
            t = replace(t, ne=ne, data=bytes(4 * int(np.prod(ne))))
        out.append(t)
    return out


Q = "dec.blk.0.attn_q.weight"
MALFORMED = {
    "truncated": (lambda raw: raw[:-100], "lies past the end of the file"),
    "lying tensor count": (lambda raw: raw[:8] + (1 << 40).to_bytes(8, "little") + raw[16:], "cannot fit in a"),
    "lora_b missing": (dict(tensors=lambda ts: [t for t in ts if t.name != Q + ".lora_b"]),
                       f"adapter tensor '{Q}.lora_b' is missing"),
    "rank mismatch": (dict(tensors=lambda ts: with_rank(ts, Q, 3)), "lora_a has rank 4 but lora_b has rank 3"),
    "wrong shape": (dict(tensors=lambda ts: [replace(t, ne=(32,) + t.ne[1:], data=t.data[: len(t.data) // 2])
                                             if t.name == Q + ".lora_a" else t for t in ts]),
                    f"adapter '{Q}' has lora_a [32, 4, 1]"),
    "wrong architecture": (dict(kvs=set_key("general.architecture", gm.STRING, "llama")),
                           "general.architecture is 'llama', expected 'diffusion-gemma'"),
    "a base model, not an adapter": (dict(kvs=set_key("general.type", gm.STRING, "model")),
                                     "general.type is 'model', expected 'adapter'"),
    "alpha missing": (dict(kvs=drop_key("adapter.lora.alpha")), "no adapter.lora.alpha float"),
    "alpha as a string": (dict(kvs=set_key("adapter.lora.alpha", gm.STRING, "8")), "no adapter.lora.alpha float"),
    "alpha negative": (dict(kvs=set_key("adapter.lora.alpha", gm.F32, -1.0)), "out of range"),
    "unknown target": (dict(tensors=lambda ts: [replace(t, name=t.name.replace("attn_q", "attn_z")) for t in ts]),
                       "is not a LoRA factor of a weight this model has"),
    "layer out of range": (dict(tensors=lambda ts: [replace(t, name=t.name.replace("blk.0.", "blk.9.")) for t in ts]),
                           "is not a LoRA factor of a weight this model has"),
    "attn_v of a full layer": (dict(tensors=lambda ts: [replace(t, name=t.name.replace("blk.1.attn_k", "blk.1.attn_v"))
                                                        for t in ts]),
                               "blk.1.attn_v.weight', which this model does not have"),
    "both pass forms of one weight": (dict(tensors=lambda ts: ts + [replace(t, name=t.name[len("dec."):])
                                                                    for t in ts if t.name.startswith(Q)]),
                                      "has both blk.0.attn_q.weight.* and enc.blk.0.attn_q.weight.*"),
    "encoder self-conditioning": (dict(tensors=lambda ts: [
        replace(t, name=t.name.replace("dec.blk.0.ffn_gate.weight", "enc.self_cond_gate.weight")) for t in ts]),
        "the encoder has no self-conditioning"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_adapter_is_one_clear_error(gguf_path, lora_gguf, tmp_path, case):
    src = lora_gguf["r4-all"]
    dst = tmp_path / "bad.gguf"
    how, message = MALFORMED[case]
    if callable(how):  # the file's bytes
        dst.write_bytes(how(src.read_bytes()))
    else:
        rewrite(src, dst, **how)
    base = gguf_path("tiny-a", "f32")
    with pytest.raises(EngineError) as exc:
        Model.load(base, threads=THREADS, adapters=[dst])
    text = str(exc.value)
    assert text.startswith("cannot load adapter bad.gguf: ") and message in text and "\n" not in text
    with pytest.raises(EngineError) as checked:  # the allocation-free check says the same
        Model.check_adapter(base, dst)
    assert message in str(checked.value)


def test_a_base_gguf_is_not_an_adapter(gguf_path):
    base = gguf_path("tiny-a", "f32")
    with pytest.raises(EngineError, match="not a LoRA adapter: general.type is 'model', expected 'adapter'"):
        Model.load(base, threads=THREADS, adapters=[base])


def test_adapter_paths_and_scales_are_checked(gguf_path, tmp_path, lora_gguf):
    base = gguf_path("tiny-a", "f32")
    with pytest.raises(EngineError, match="adapter not found"):
        Model.load(base, adapters=[tmp_path / "nope.gguf"])
    with pytest.raises(EngineError, match="no adapter_config.json"):
        Model.load(base, adapters=[tmp_path])
    with pytest.raises(EngineError, match="scale must be finite"):
        Model.load(base, adapters=[(lora_gguf["r4-all"], float("nan"))])
    with pytest.raises(EngineError, match=r"^adapter r4-all is a PEFT adapter folder: convert it to a GGUF LoRA"):
        Model.load(base, adapters=[LORA / "r4-all"])  # the engine reads GGUF; the converter converts
    Model.check_adapter(base, lora_gguf["r4-all"])  # a good one passes


def test_parse_adapter_arg(tmp_path):
    from dgemma_engine.adapters import parse_adapter_arg

    assert parse_adapter_arg("a/b.gguf") == ("a/b.gguf", 1.0)
    assert parse_adapter_arg("a/b.gguf:0.5") == ("a/b.gguf", 0.5)
    assert parse_adapter_arg("a/b:c.gguf") == ("a/b:c.gguf", 1.0)
    odd = tmp_path / "x:2"
    odd.write_bytes(b"")
    assert parse_adapter_arg(str(odd)) == (str(odd), 1.0)  # an existing path wins over the scale suffix
    assert os.path.exists(odd)
