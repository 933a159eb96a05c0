"""Build random PEFT LoRA adapters for the tiny-a fixture and record transformers + PEFT goldens under tests/fixtures/lora/.

    python3 tests/reference/make_lora_fixtures.py        # ~10 s; writes tests/fixtures/lora/<name>/ and SHA256SUMS

Needs torch==2.13.0, transformers==5.23.0 and peft==0.21.2 (CPU, one thread); the tests read the files with
numpy/json only (docs/gguf.md#lora-adapters for the GGUF side). Each adapter is `get_peft_model` on tiny-a with
every LoRA factor then set from a seeded generator, so the delta is far from zero and the encoder's and decoder's
copies of each target (PEFT wraps `model.encoder.language_model.layers.N…` and `model.decoder.layers.N…`
separately) get different deltas. Each B is scaled so that ‖ΔW‖ = DELTA_GAIN·‖W‖ for its target: large enough to
move every logit, small enough that the recorded generation stays as robust to fp32 noise as tiny-a's own goldens.

Files per adapter folder: `adapter_config.json`, `adapter_model.safetensors` (as `save_pretrained` writes them) and
`golden.npz`:
  prompt int32 [21]               the long prompt of tiny-a's goldens
  canvas int32 [2, 16]            decoder input of the first step (no SC) and of the self-conditioned step
  T float32 [1]                   temperature of the SC input: step 2 is self-conditioned on raw[0] / T
  raw float32 [2, 16, V]          softcapped decoder logits of the two steps (prompt encoded once before)
`base.npz` (next to the folders): `raw` of the same two steps without an adapter (how far the adapters move them).
  seq int32 [n]                   generate(...).sequences[0], G1 sampler settings, max_new_tokens 32, eos
                                  [1, 106, 50], seed 0
  steps_per_canvas int32 [k]
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fixtures import FIXTURES, TINY_A, GenSpec, generate, load_model, save_npz, write_json  # noqa: E402

from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402

OUT = FIXTURES / "lora"
DELTA_GAIN = 0.25
# eos as the GGUF's stop ids, so `dgemma debug generate` (which stops on those) replays the run as recorded
GEN = GenSpec("G1_lora", max_new_tokens=32, eos_token_id=(1, 106, 50))
GEN_SEED = 0
SC_T = 0.8
PASS_PATTERN = r".*(?:encoder\.language_model|decoder)\.layers\.\d+\."


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    r: int
    alpha: float
    modules: str                  # PEFT's target_modules (a regex over module paths)
    experts: bool                 # also target the routed experts (target_parameters)
    seed: int


ADAPTERS = (
    AdapterSpec("r4-all", r=4, alpha=8.0, experts=True, seed=11,
                modules=PASS_PATTERN + r"(?:self_attn\.(?:q|k|v|o)_proj|mlp\.(?:gate|up|down)_proj|router\.proj)$"),
    AdapterSpec("r8-attn-mlp", r=8, alpha=4.0, experts=False, seed=12,
                modules=PASS_PATTERN + r"(?:self_attn\.(?:q|k|v|o)_proj|mlp\.(?:gate|up|down)_proj)$"),
    # the decoder's self-conditioning MLP and one attention projection per pass
    AdapterSpec("r4-self-cond", r=4, alpha=4.0, experts=False, seed=13,
                modules=r".*decoder\.self_conditioning\.(?:gate|up|down)_proj$|"
                        r".*(?:encoder\.language_model|decoder)\.layers\.0\.self_attn\.q_proj$"),
)


def peft_model(spec: AdapterSpec, base_dir: Path):
    model = load_model(base_dir)
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=spec.modules,
                        target_parameters=["experts.gate_up_proj", "experts.down_proj"] if spec.experts else None,
                        init_lora_weights=False, lora_dropout=0.0)
    pm = get_peft_model(model, config)
    randomize(pm, spec)
    return pm.eval()


def randomize(pm, spec: AdapterSpec) -> None:
    """Every factor from one seeded generator; B scaled to ‖B·A‖ = DELTA_GAIN·‖W‖ of the weight it adapts."""
    g = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, module in sorted(pm.named_modules()):
            if not hasattr(module, "lora_A") or "default" not in module.lora_A:
                continue
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            a.copy_(torch.randn(a.shape, generator=g) / a.shape[1] ** 0.5)
            b.copy_(torch.randn(b.shape, generator=g))
            # experts (ParamWrapper): the [E, out, in] parameter and its per-expert delta
            base = module.get_param() if hasattr(module, "get_param") else module.base_layer.weight
            delta = module.get_delta_weight("default")
            b.mul_(DELTA_GAIN * base.norm() / delta.norm())


def two_steps(model, spec_prompt: list[int], canvases: torch.Tensor) -> np.ndarray:
    """Encode the prompt, one decoder step on canvases[0], one on canvases[1] self-conditioned on raw[0] / SC_T."""
    prompt = torch.tensor([spec_prompt])
    n, c = prompt.shape[1], canvases.shape[1]
    pos = torch.arange(n, n + c).unsqueeze(0)
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    with torch.no_grad():
        model.model.encoder(input_ids=prompt, past_key_values=cache)
        raw0 = model(decoder_input_ids=canvases[:1], decoder_position_ids=pos, past_key_values=cache).logits
        sc = raw0 / torch.tensor(SC_T, dtype=torch.float32)
        raw1 = model(decoder_input_ids=canvases[1:], decoder_position_ids=pos, past_key_values=cache,
                     self_conditioning_logits=sc).logits
    return np.stack([raw0[0].float().numpy(), raw1[0].float().numpy()])


def fixed_canvases(v: int, c: int) -> torch.Tensor:
    return torch.stack([torch.arange(c) * 7 % v, (torch.arange(c) * 13 + 5) % v])


def write_adapter(spec: AdapterSpec, base_dir: Path, base_raw: np.ndarray) -> None:
    pm = peft_model(spec, base_dir)
    out = OUT / spec.name
    if out.exists():
        shutil.rmtree(out)
    with tempfile.TemporaryDirectory() as tmp:
        pm.save_pretrained(tmp)
        out.mkdir(parents=True)
        config = json.loads((Path(tmp) / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = "tests/fixtures/tiny-a"  # not the temporary path of this run
        write_json(out / "adapter_config.json", config)
        shutil.copy(Path(tmp) / "adapter_model.safetensors", out / "adapter_model.safetensors")
    model = pm.base_model.model  # LoRA layers are injected in place: the plain model's forward uses them
    canvases = fixed_canvases(TINY_A.vocab_size, TINY_A.canvas_length)
    raw = two_steps(model, TINY_A.long_prompt, canvases)
    moved = np.abs(raw - base_raw).max()
    assert moved > 0.05, f"{spec.name} hardly moves the logits ({moved:.3g})"
    run = generate(model, TINY_A.long_prompt, GEN, GEN_SEED)
    save_npz(out / "golden.npz", {
        "prompt": np.asarray(TINY_A.long_prompt, np.int32), "canvas": canvases.numpy().astype(np.int32),
        "T": np.float32(SC_T), "raw": raw.astype(np.float32),
        "seq": run.seq.astype(np.int32), "steps_per_canvas": np.asarray(run.steps_per_canvas, np.int32),
    })
    print(f"{spec.name}: max |Δ logit| vs base {moved:.3f}; steps {run.steps_per_canvas}")


def write_checksums() -> None:
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(OUT)}"
             for p in sorted(OUT.rglob("*")) if p.is_file() and p.name != "SHA256SUMS"]
    (OUT / "SHA256SUMS").write_text("\n".join(lines) + "\n")


def main() -> None:
    torch.set_num_threads(1)
    base_dir = FIXTURES / TINY_A.name
    base = load_model(base_dir)
    base_raw = two_steps(base, TINY_A.long_prompt, fixed_canvases(TINY_A.vocab_size, TINY_A.canvas_length))
    OUT.mkdir(parents=True, exist_ok=True)
    save_npz(OUT / "base.npz", {"raw": base_raw.astype(np.float32)})
    for spec in ADAPTERS:
        write_adapter(spec, base_dir, base_raw)
    write_checksums()


if __name__ == "__main__":
    main()
