"""Time one decoder step (256-token canvas after a 512-token context) on bench-mid, against transformers, in one run.

    python3 bench/make_bench_model.py                       # once: bench/work/bench-mid (HF, fp32)
    python3 bench/step.py [--threads 2] [--types f32,q8_0,q4_k_m] [--json out.json]

For each GGUF type (converted once into --gguf-dir): load (file size and RSS after load), encode the context, then
time self-conditioned decoder steps (the steady state) and a first step (no self-conditioning). transformers runs its
own decoder step on the same weights, context, canvas and self-conditioning input at the same thread count.
A ggml matmul microbenchmark of the step's weight products (same shapes, same types, same threads) gives the time
ggml's kernels alone would need; the step's achieved rate (all its FLOPs, attention included, per second) is
reported as a fraction of ggml's rate on those products, and the stricter time ratio next to it.
Every figure is given as wall time and as process CPU time: on a shared, oversubscribed machine wall times are
inflated by waiting for a core, while CPU time at --threads 1 is the load-independent comparison.
Where the time goes: self-conditioning = SC step − first step (measured); backbone / LM head split by microbenchmark
share; sampler = one entropy-bound sampler step on the step's logits (measured).
"""
from __future__ import annotations

import ctypes
import gc
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import common


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class Product:
    """One weight matmul of the step: `count` times a [k → m] product over `n` tokens (experts: mul_mat_id)."""
    category: str
    tensor: str
    k: int
    m: int
    n: int
    count: int
    n_expert: int = 0
    n_used: int = 0

    @property
    def flops(self) -> float:
        per_token = self.n_used if self.n_expert else 1
        return 2.0 * self.k * self.m * self.n * per_token * self.count


def step_products(hp, canvas: int) -> list[Product]:
    """The decoder step's weight products (the attention scores/values are not weight products)."""
    H, C = hp.n_embd, canvas
    out: list[Product] = []
    for il in range(hp.n_layer):
        hd, nkv = hp.layer_head_dim[il], hp.layer_n_head_kv[il]
        out += [Product("backbone", f"blk.{il}.attn_q.weight", H, hp.n_head * hd, C, 1),
                Product("backbone", f"blk.{il}.attn_k.weight", H, nkv * hd, C, 1),
                Product("backbone", f"blk.{il}.attn_output.weight", hp.n_head * hd, H, C, 1)]
        if hp.layer_sliding[il]:
            out.append(Product("backbone", f"blk.{il}.attn_v.weight", H, nkv * hd, C, 1))
        out += [Product("backbone", f"blk.{il}.ffn_gate.weight", H, hp.n_ff, C, 1),
                Product("backbone", f"blk.{il}.ffn_up.weight", H, hp.n_ff, C, 1),
                Product("backbone", f"blk.{il}.ffn_down.weight", hp.n_ff, H, C, 1),
                Product("backbone", f"blk.{il}.ffn_gate_up_exps.weight", H, 2 * hp.n_ff_exp, C, 1, hp.n_expert,
                        hp.n_expert_used),
                Product("backbone", f"blk.{il}.ffn_down_exps.weight", hp.n_ff_exp, H, C, 1, hp.n_expert,
                        hp.n_expert_used)]
    out.append(Product("lm_head", "token_embd.weight", H, hp.n_vocab, C, 1))
    out += [Product("self_cond", "token_embd_t", hp.n_vocab, H, C, 1),
            Product("self_cond", "self_cond_gate.weight", H, hp.n_ff, C, 1),
            Product("self_cond", "self_cond_up.weight", H, hp.n_ff, C, 1),
            Product("self_cond", "self_cond_down.weight", hp.n_ff, H, C, 1)]
    return out


def attention_flops(hp, ctx_len: int, canvas: int) -> float:
    total = 0.0
    for il in range(hp.n_layer):
        keys = (min(ctx_len, hp.sliding_window - 1) if hp.layer_sliding[il] else ctx_len) + canvas
        total += 2 * 2 * hp.n_head * hp.layer_head_dim[il] * keys * canvas
    return total


def tensor_types(path: Path) -> dict[str, int]:
    from gguf import GGUFReader

    return {t.name: int(t.tensor_type) for t in GGUFReader(str(path)).tensors}


def microbench(products: list[Product], types: dict[str, int], threads: int) -> tuple[dict, dict]:
    """Wall and CPU seconds ggml's own matmul needs for each category's products (each distinct shape/type once)."""
    from dgemma_engine._lib import load_library

    lib = load_library("engine_tests")  # the engine's test hooks (ggml_ext/csrc/engine_tests)
    fn = lib.dg_bench_mul_mat
    fn.restype = ctypes.c_double
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_double), ctypes.c_char_p,
                   ctypes.c_size_t]
    err = ctypes.create_string_buffer(256)
    f32, f16 = 0, 1
    cache: dict[tuple, tuple[float, float]] = {}
    seconds: dict[str, float] = {}
    cpu_seconds: dict[str, float] = {}
    for p in products:
        if p.tensor == "token_embd_t":  # the engine's transposed copy: F32 for F32 files, else F16
            t = f32 if types["token_embd.weight"] == f32 else f16
        else:
            t = types[p.tensor]
        key = (t, p.k, p.m, p.n, p.n_expert, p.n_used)
        if key not in cache:
            cpu = ctypes.c_double(0)
            wall = fn(t, p.k, p.m, p.n, p.n_expert, p.n_used, 0, threads, 3, ctypes.byref(cpu), err, len(err))
            if wall < 0:
                raise RuntimeError(err.value.decode())
            cache[key] = (wall, cpu.value)
        seconds[p.category] = seconds.get(p.category, 0.0) + cache[key][0] * p.count
        cpu_seconds[p.category] = cpu_seconds.get(p.category, 0.0) + cache[key][1] * p.count
    return seconds, cpu_seconds


def time_engine(path: Path, ctx_ids: np.ndarray, canvas: np.ndarray, threads: int, repeats: int) -> dict:
    from dgemma_engine.model import Context, Model

    gc.collect()
    rss0 = rss_mib()
    t0 = time.perf_counter()
    m = Model.load(path, threads=threads)
    load_s = time.perf_counter() - t0
    rss_load = rss_mib() - rss0
    ctx = Context(m, n_ctx=len(ctx_ids) + len(canvas), threads=threads)
    t0 = time.perf_counter()
    ctx.encode(ctx_ids)
    encode_s = time.perf_counter() - t0
    first, sc, sc_cpu = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ctx.step(canvas)
        first.append(time.perf_counter() - t0)
        t0, c0 = time.perf_counter(), time.process_time()
        logits = ctx.step(canvas, sc_temperature=0.8)
        sc.append(time.perf_counter() - t0)
        sc_cpu.append(time.process_time() - c0)
    sampler_s = time_sampler(logits, threads)
    res = dict(file_mib=m.file_size / 2**20, load_s=load_s, rss_after_load_mib=rss_load, encode_s=encode_s,
               first_step_s=statistics.median(first), sc_step_s=statistics.median(sc),
               sc_step_cpu_s=statistics.median(sc_cpu), sampler_s=sampler_s,
               rss_after_steps_mib=rss_mib() - rss0, hparams=m.hparams)
    ctx.close()
    m.close()
    return res


def time_sampler(logits: np.ndarray, threads: int) -> float | None:
    try:
        from dgemma_engine.sampler import Sampler
    except ImportError:
        return None
    s = Sampler(logits.shape[0], logits.shape[1], max_steps=48, t_min=0.4, t_max=0.8, entropy_bound=0.1,
                confidence_threshold=0.005, stability_threshold=1, seed=0, rng="fast", threads=threads)
    s.begin_canvas()
    t0 = time.perf_counter()
    s.step(np.ascontiguousarray(logits))
    dt = time.perf_counter() - t0
    s.close()
    return dt


def time_transformers(model_dir: Path, ctx_ids: np.ndarray, canvas: np.ndarray, threads: int,
                      repeats: int) -> tuple[float, float]:
    """Median wall and CPU seconds of transformers' self-conditioned decoder step."""
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.cache_utils import DynamicCache

    torch.set_num_threads(threads)
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(model_dir, dtype=torch.float32).eval()
    V = model.config.text_config.vocab_size
    with torch.no_grad():
        cache = DynamicCache(config=model.config.text_config)
        model.model.encoder(input_ids=torch.tensor(ctx_ids[None].astype(np.int64)), past_key_values=cache)
        ids = torch.tensor(canvas[None].astype(np.int64))
        pos = torch.arange(len(ctx_ids), len(ctx_ids) + len(canvas))[None]
        sc = torch.randn(1, len(canvas), V, generator=torch.Generator().manual_seed(0)) * 3 / 0.8
        times, cpu = [], []
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            model(decoder_input_ids=ids, decoder_position_ids=pos, past_key_values=cache, self_conditioning_logits=sc)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    del model, cache
    gc.collect()
    return statistics.median(times), statistics.median(cpu)


def main() -> None:
    ap = common.bench_parser(__doc__)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--canvas", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    vocab = common.model_vocab_size(args.model)
    rng = np.random.default_rng(0)
    ctx_ids = rng.integers(0, vocab, args.ctx).astype(np.int32)
    canvas = rng.integers(0, vocab, args.canvas).astype(np.int32)
    report: dict = {"threads": args.threads, "ctx": args.ctx, "canvas": args.canvas, "types": {}}

    if not args.skip_transformers:
        wall, cpu = time_transformers(args.model, ctx_ids, canvas, args.threads, args.repeats)
        report["transformers_step_s"], report["transformers_step_cpu_s"] = wall, cpu
        print(f"transformers fp32 decoder step (SC): {wall:.3f} s wall, {cpu:.3f} s CPU")

    from dgemma_convert import convert

    args.gguf_dir.mkdir(parents=True, exist_ok=True)
    for outtype in args.types.split(","):
        path = args.gguf_dir / f"{args.model.name}-{outtype}.gguf"
        if not path.exists():
            convert(args.model, path, outtype, threads=args.threads)
        r = time_engine(path, ctx_ids, canvas, args.threads, args.repeats)
        hp = r.pop("hparams")
        products = step_products(hp, args.canvas)
        ideal, ideal_cpu = microbench(products, tensor_types(path), args.threads)
        flops = {c: sum(p.flops for p in products if p.category == c) for c in ("backbone", "lm_head", "self_cond")}
        weight_flops = sum(flops.values())
        total_flops = weight_flops + attention_flops(hp, args.ctx, args.canvas)
        ideal_s, ideal_cpu_s = sum(ideal.values()), sum(ideal_cpu.values())
        no_sc = r["first_step_s"]
        backbone_share = ideal["backbone"] / (ideal["backbone"] + ideal["lm_head"])
        r.update(
            gflop_per_step=total_flops / 1e9,
            achieved_gflops=total_flops / 1e9 / r["sc_step_s"],
            matmul_ideal_s=ideal_s,
            # the measure: achieved rate / ggml's matmul rate (weight-product FLOPs / microbench seconds)
            fraction_of_ggml_matmul=(total_flops / r["sc_step_s"]) / (weight_flops / ideal_s),
            fraction_of_ggml_matmul_cpu=(total_flops / r["sc_step_cpu_s"]) / (weight_flops / ideal_cpu_s),
            # stricter: weight products alone at ggml's rate / the whole step (attention, norms, softmax count against)
            ideal_time_fraction=ideal_s / r["sc_step_s"],
            microbench_s=ideal, microbench_cpu_s=ideal_cpu,
            time_split_s={"backbone": no_sc * backbone_share, "lm_head": no_sc * (1 - backbone_share),
                          "self_cond": r["sc_step_s"] - no_sc, "sampler": r["sampler_s"]},
        )
        if "transformers_step_s" in report:
            r["speedup_vs_transformers"] = report["transformers_step_s"] / r["sc_step_s"]
            r["speedup_vs_transformers_cpu"] = report["transformers_step_cpu_s"] / r["sc_step_cpu_s"]
        report["types"][outtype] = r
        split = ", ".join(f"{k} {v:.3f}" for k, v in r["time_split_s"].items() if v is not None)
        print(f"{outtype:7s} file {r['file_mib']:.0f} MiB, RSS after load +{r['rss_after_load_mib']:.0f} MiB, "
              f"encode {r['encode_s']:.2f} s | step {r['sc_step_s']:.3f} s (first {no_sc:.3f}) "
              f"{r['achieved_gflops']:.1f} GFLOP/s = {100 * r['fraction_of_ggml_matmul']:.0f}% of ggml's matmul rate "
              f"{weight_flops / 1e9 / ideal_s:.0f} GFLOP/s (weight products alone at that rate: {ideal_s:.3f} s = "
              f"{100 * r['ideal_time_fraction']:.0f}% of the step); CPU {r['sc_step_cpu_s']:.3f} s = "
              f"{100 * r['fraction_of_ggml_matmul_cpu']:.0f}% of ggml's rate"
              + (f" | {r['speedup_vs_transformers']:.2f}x transformers (CPU time "
                 f"{r['speedup_vs_transformers_cpu']:.2f}x)" if "speedup_vs_transformers" in r else "")
              + f" | split s: {split}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=float))


if __name__ == "__main__":
    main()
