"""Build the tiny DiffusionGemma reference checkpoints and golden recordings under tests/fixtures/.

    python3 tests/reference/make_fixtures.py            # writes tests/fixtures/tiny-a and tests/fixtures/tiny-b

Needs torch==2.13.0 and transformers==5.23.0 (CPU); the tests only read the files this script writes (numpy + json).
The recipe follows docs/model.md#fixture-recipe; the file formats are documented in tests/fixtures/README.md.
Running the script twice produces byte-identical files on the same machine: it rewrites tests/fixtures/SHA256SUMS,
so after a regeneration `git diff --stat tests/fixtures` (or `sha256sum -c SHA256SUMS` in that folder) shows any change.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from transformers import (
    DiffusionGemmaConfig,
    DiffusionGemmaForBlockDiffusion,
    DiffusionGemmaGenerationConfig,
    EntropyBoundSamplerConfig,
)
from transformers.cache_utils import DynamicCache
from transformers.models.diffusion_gemma import generation_diffusion_gemma as hf_gen

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tokenizer_trainer import ImageTokenIds, train_gemma_tokenizer  # noqa: E402

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parent / "fixtures"
CHAT_TEMPLATE = (HERE / "chat_template.jinja").read_text()
RELEASED_GENERATION_CONFIG = {  # bench/configs/generation_config.json (the released sampler values)
    "max_denoising_steps": 48, "t_min": 0.4, "t_max": 0.8,
    "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1},
    "stability_threshold": 1, "confidence_threshold": 0.005,
    "eos_token_id": [1, 106, 50], "pad_token_id": 0, "max_new_tokens": 256,
}
SEEDS = (0, 1, 7, 42)
# The vision tower is never used by the text path; a small position table keeps the checkpoints small.
VISION = dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=2, head_dim=16, global_head_dim=16, patch_size=4,
              pooling_kernel_size=2, position_embedding_size=16)
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class FixtureSpec:
    name: str
    text: dict              # text_config in form A (head_dim/num_key_value_heads + global_* for full layers)
    image_ids: ImageTokenIds
    primary_form: str       # "A" or "B": which form config.json holds; the other goes to config_form_{x}.json
    init_seed: int
    long_prompt: list[int]
    short_prompt: list[int]
    canvas_length: int = 16
    logit_gain: float = 1.0  # extra factor on the final norm weight: sharper logits, lower entropies, active softcap
    # Conditioning knobs (see tests/fixtures/README.md, section 1): with the ×4 recipe alone, self-conditioning
    # amplified a 1e-5 logit difference 5-35x per denoising step and large q/k norm weights made attention scores so
    # sharp that fp32 rounding alone moved tiny-b's logits by ~1e-3; no fp32 implementation could then follow
    # transformers.
    self_conditioning_gain: float = 0.25  # on the self-conditioning down_proj: its weights stay at init scale
    qk_norm_gain: float = 1.0  # on q_norm/k_norm weights: softer attention scores (each score scales with gain²)
    vision: dict | None = None  # vision_config; None = the small unused tower VISION (make_vision_fixtures.py sets one)

    @property
    def vocab_size(self) -> int:
        return self.text["vocab_size"]


TINY_A = FixtureSpec(
    name="tiny-a",
    text=dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=4, layer_types=[SLIDING, FULL] * 2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,       # sliding: GQA 2:1, hd 16
              global_head_dim=32, num_global_key_value_heads=1,                # full: GQA 4:1, hd 32, 4 rotated pairs
              num_experts=4, top_k_experts=2, sliding_window=8, max_position_embeddings=1024,
              pad_token_id=0, eos_token_id=1, bos_token_id=2),
    image_ids=ImageTokenIds(image_token_id=509, boi_token_id=510, eoi_token_id=511),
    primary_form="B", init_seed=0,
    long_prompt=[2] + list(range(10, 30)), short_prompt=[2, 10, 11, 12, 13],
)
TINY_B = FixtureSpec(
    name="tiny-b",
    text=dict(vocab_size=384, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
              num_hidden_layers=6, layer_types=([SLIDING] * 2 + [FULL]) * 2,
              num_attention_heads=2, num_key_value_heads=2, head_dim=32,       # sliding: no GQA, hd 32
              global_head_dim=64, num_global_key_value_heads=1,                # full: GQA 2:1, hd 64, 8 rotated pairs
              num_experts=6, top_k_experts=3, sliding_window=6, max_position_embeddings=1024,
              pad_token_id=0, eos_token_id=1, bos_token_id=2),
    image_ids=ImageTokenIds(image_token_id=381, boi_token_id=382, eoi_token_id=383),
    primary_form="A", init_seed=1, logit_gain=6.0, qk_norm_gain=0.35,
    long_prompt=[2] + list(range(10, 30)), short_prompt=[2, 10, 11, 12, 13],
)


# ---------------------------------------------------------------------------------------------------------------
# Generation configs (docs/model.md#fixture-recipe). Every field is set explicitly so the checkpoint's
# generation_config.json (released values) never leaks into a recording.

@dataclass(frozen=True)
class GenSpec:
    name: str
    max_new_tokens: int = 48
    max_denoising_steps: int = 12
    entropy_bound: float = 0.1
    t_min: float = 0.4
    t_max: float = 0.8
    stability_threshold: int = 1
    confidence_threshold: float = 0.005
    eos_token_id: tuple[int, ...] = (1,)
    pad_token_id: int = 0

    def to_hf(self) -> DiffusionGemmaGenerationConfig:
        return DiffusionGemmaGenerationConfig(
            max_new_tokens=self.max_new_tokens, max_denoising_steps=self.max_denoising_steps,
            sampler_config=EntropyBoundSamplerConfig(entropy_bound=self.entropy_bound),
            t_min=self.t_min, t_max=self.t_max, stability_threshold=self.stability_threshold,
            confidence_threshold=self.confidence_threshold, eos_token_id=list(self.eos_token_id),
            pad_token_id=self.pad_token_id)

    def to_json(self) -> dict:
        return {"max_new_tokens": self.max_new_tokens, "max_denoising_steps": self.max_denoising_steps,
                "entropy_bound": self.entropy_bound, "t_min": self.t_min, "t_max": self.t_max,
                "stability_threshold": self.stability_threshold, "confidence_threshold": self.confidence_threshold,
                "eos_token_id": list(self.eos_token_id), "pad_token_id": self.pad_token_id}


G1 = GenSpec("G1")


# ---------------------------------------------------------------------------------------------------------------
# Deterministic file writers


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """np.savez with a fixed zip timestamp, so identical arrays give identical bytes (np.savez stamps 'now')."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for key in sorted(arrays):
            info = zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            with zf.open(info, "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.ascontiguousarray(arrays[key]), allow_pickle=False)


# ---------------------------------------------------------------------------------------------------------------
# Checkpoint


def build_config(spec: FixtureSpec) -> DiffusionGemmaConfig:
    ids = spec.image_ids
    return DiffusionGemmaConfig(text_config=copy.deepcopy(spec.text), vision_config=dict(spec.vision or VISION),
                                canvas_length=spec.canvas_length, image_token_id=ids.image_token_id,
                                boi_token_id=ids.boi_token_id, eoi_token_id=ids.eoi_token_id)


def load_model(path: Path) -> DiffusionGemmaForBlockDiffusion:
    return DiffusionGemmaForBlockDiffusion.from_pretrained(
        path, attn_implementation="eager", experts_implementation="eager").eval()


def build_model(spec: FixtureSpec) -> DiffusionGemmaForBlockDiffusion:
    torch.manual_seed(spec.init_seed)
    model = DiffusionGemmaForBlockDiffusion._from_config(
        build_config(spec), attn_implementation="eager", experts_implementation="eager").eval()
    with torch.no_grad():  # make every constant-initialised parameter informative (docs/model.md#fixture-recipe)
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("scale"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.mul_(4.0)  # sharper logits
        for name, b in model.named_buffers():  # encoder and decoder layer_scalar get DIFFERENT values
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(1))
        model.model.decoder.norm.weight.mul_(spec.logit_gain)
        model.model.decoder.self_conditioning.down_proj.weight.mul_(spec.self_conditioning_gain)
        for name, p in model.model.named_parameters():
            if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")) and "vision" not in name:
                p.mul_(spec.qk_norm_gain)
    return model


def form_a(config_b: dict, spec: FixtureSpec) -> dict:
    """Released form: global_head_dim / num_global_key_value_heads instead of per_layer_config."""
    cfg = copy.deepcopy(config_b)
    text = cfg["text_config"]
    overrides = text.pop("per_layer_config")
    full = [i for i, t in enumerate(text["layer_types"]) if t == FULL]
    assert sorted(int(k) for k in overrides) == full, overrides
    text["global_head_dim"] = spec.text["global_head_dim"]
    text["num_global_key_value_heads"] = spec.text["num_global_key_value_heads"]
    return cfg


def write_checkpoint(spec: FixtureSpec, out: Path, model: DiffusionGemmaForBlockDiffusion | None = None,
                     reload_atol: float = 0.0) -> None:
    model = model if model is not None else build_model(spec)
    model.save_pretrained(out)
    config_b = json.loads((out / "config.json").read_text())
    assert "per_layer_config" in config_b["text_config"], "transformers no longer writes form B"
    config_a = form_a(config_b, spec)
    primary, other = (config_b, config_a) if spec.primary_form == "B" else (config_a, config_b)
    write_json(out / "config.json", primary)
    write_json(out / f"config_form_{'a' if spec.primary_form == 'B' else 'b'}.json", other)
    released = Path(__file__).resolve().parents[2] / "bench" / "configs" / "generation_config.json"
    assert json.loads(released.read_text()) == RELEASED_GENERATION_CONFIG, f"update the copy from {released}"
    write_json(out / "generation_config.json", RELEASED_GENERATION_CONFIG)

    tokenizer = train_gemma_tokenizer(spec.vocab_size, spec.image_ids, chat_template=CHAT_TEMPLATE)
    tokenizer.save_pretrained(out)
    check_tokenizer(out, spec)
    check_reload(model, out, spec, reload_atol)


def check_tokenizer(path: Path, spec: FixtureSpec) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == spec.vocab_size, len(tok)
    messages = [{"role": "user", "content": "Why is the sky blue?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<bos><|turn>user\nWhy is the sky blue?<turn|>\n<|turn>model\n<|channel>thought\n<channel|>", text
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert ids[:2] == [2, 105] and ids.count(2) == 1 and ids[-1] == 101, ids
    thinking = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    assert thinking.startswith("<bos><|turn>system\n<|think|><turn|>\n") and thinking.endswith("<|turn>model\n")
    sample = "Hello world, café 你好 😀\n\n  def main():\treturn 42"
    assert tok.decode(tok.encode(sample, add_special_tokens=False)) == sample
    assert tok.encode("hi")[0] == 2, "plain encode() should prepend <bos> (add_bos_token)"


def teacher_forced_logits(model, spec: FixtureSpec) -> torch.Tensor:
    """Prefill the long prompt, then one decoder step with a fixed canvas and SC input (for the reload check)."""
    c, v = spec.canvas_length, spec.vocab_size
    prompt = torch.tensor([spec.long_prompt])
    n = prompt.shape[1]
    canvas = (torch.arange(c) * 7 % v).unsqueeze(0)
    sc = torch.linspace(-3.0, 3.0, c * v).reshape(1, c, v)
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    with torch.no_grad():
        model.model.encoder(input_ids=prompt, past_key_values=cache)
        out = model(decoder_input_ids=canvas, decoder_position_ids=torch.arange(n, n + c).unsqueeze(0),
                    past_key_values=cache, self_conditioning_logits=sc)
    return out.logits[0].float()


def check_reload(model, path: Path, spec: FixtureSpec, atol: float = 0.0) -> None:
    """from_pretrained must give identical logits, from either config form.

    atol > 0 (tiny-v): the in-memory model may differ from the reloaded one at rounding level (the reloads agree
    bit for bit); the other config form must still match the reload exactly.
    """
    reference = teacher_forced_logits(model, spec)
    reloaded = teacher_forced_logits(load_model(path), spec)
    if atol > 0:
        assert torch.allclose(reloaded, reference, rtol=0, atol=atol), "reload changed the logits"
        reference = reloaded
    assert torch.equal(reloaded, reference), "reload changed the logits"
    other = next(path.glob("config_form_*.json"))
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(path / "model.safetensors", tmp)
        shutil.copy(other, Path(tmp) / "config.json")
        assert torch.equal(teacher_forced_logits(load_model(Path(tmp)), spec), reference), f"{other.name} differs"


# ---------------------------------------------------------------------------------------------------------------
# Recording


@dataclass
class Run:
    """One model.generate call and what happened at each decoder call."""

    seq: np.ndarray
    calls: list[dict] = field(default_factory=list)

    def stacked(self, key: str) -> np.ndarray:
        return np.stack([c[key] for c in self.calls])

    @property
    def steps_per_canvas(self) -> list[int]:
        counts: list[int] = []
        for call in self.calls:
            if not call["has_sc"]:
                counts.append(0)
            counts[-1] += 1
        return counts


@contextmanager
def recording(model):
    """Patch the model's forward and the sampler pieces of transformers' generate loop to record every step.

    Nothing here draws random numbers, so the RNG stream (and the generated sequence) is unchanged.
    """
    calls: list[dict] = []
    forward = model.forward
    processor_call = hf_gen.LinearTemperatureScheduleLogitsProcessor.__call__
    accept = hf_gen.EntropyBoundSampler.accept_canvas
    renoise = hf_gen.EntropyBoundSampler.renoise_canvas
    stop = hf_gen.StableAndConfidentStoppingCriteria.__call__

    def recording_forward(*args, **kw):
        out = forward(*args, **kw)
        if kw.get("decoder_input_ids") is not None:  # decoder calls only
            sc = kw.get("self_conditioning_logits")
            calls.append(dict(canvas=kw["decoder_input_ids"][0].numpy().copy(),
                              pos=kw["decoder_position_ids"][0].numpy().copy(),
                              has_sc=sc is not None, raw=out.logits[0].float().numpy().copy(),
                              sc=None if sc is None else sc[0].float().numpy().copy()))
        return out

    def recording_processor(self, input_ids, scores, cur_step):
        out = processor_call(self, input_ids, scores, cur_step=cur_step)
        temperature = self.t_min + ((self.t_max - self.t_min) * (cur_step / self.max_denoising_steps))
        assert torch.equal(out, scores / temperature)
        calls[-1].update(step=int(cur_step), T=np.float32(temperature.item()))
        return out

    def recording_accept(self, current, denoiser, logits, cur_step):
        accepted = accept(self, current, denoiser, logits, cur_step)
        entropy = torch.distributions.Categorical(logits=logits).entropy()
        calls[-1].update(sampled=denoiser[0].numpy().copy(), accept=self.accepted_token_mask[0].numpy().copy(),
                         argmax=torch.argmax(logits, dim=-1)[0].numpy().copy(),
                         entropy=entropy[0].float().numpy().copy(),
                         mean_entropy=np.float32(torch.mean(entropy, dim=-1)[0].item()))
        return accepted

    def recording_renoise(self, accepted_canvas, cur_step):
        out = renoise(self, accepted_canvas, cur_step)
        calls[-1]["next_canvas"] = out[0].numpy().copy()
        return out

    def recording_stop(self, argmax_canvas, logits, **kw):
        out = stop(self, argmax_canvas, logits, **kw)
        calls[-1]["stop"] = bool(out[0])
        return out

    model.forward = recording_forward
    hf_gen.LinearTemperatureScheduleLogitsProcessor.__call__ = recording_processor
    hf_gen.EntropyBoundSampler.accept_canvas = recording_accept
    hf_gen.EntropyBoundSampler.renoise_canvas = recording_renoise
    hf_gen.StableAndConfidentStoppingCriteria.__call__ = recording_stop
    try:
        yield calls
    finally:
        del model.forward
        hf_gen.LinearTemperatureScheduleLogitsProcessor.__call__ = processor_call
        hf_gen.EntropyBoundSampler.accept_canvas = accept
        hf_gen.EntropyBoundSampler.renoise_canvas = renoise
        hf_gen.StableAndConfidentStoppingCriteria.__call__ = stop


def generate(model, prompt: list[int], gen: GenSpec, seed: int, greedy: bool = False, **model_kwargs) -> Run:
    """model_kwargs go to model.generate as they are (pixel_values, image_position_ids, mm_token_type_ids)."""
    with recording(model) as calls:
        torch.manual_seed(seed)
        multinomial = torch.multinomial
        if greedy:  # categorical draw -> argmax; canvas init and renoise stay MT19937-seeded
            torch.multinomial = lambda p, *a, **k: p.argmax(-1, keepdim=True)
        try:
            seq = model.generate(torch.tensor([prompt]), generation_config=gen.to_hf(), **model_kwargs).sequences[0]
        finally:
            torch.multinomial = multinomial
    run = Run(seq=seq.numpy().copy(), calls=list(calls))
    check_run(run, prompt, gen, model.config.canvas_length)
    return run


def check_run(run: Run, prompt: list[int], gen: GenSpec, c: int) -> None:
    """Internal consistency of a recording (catches a hook that missed or misattributed something)."""
    n_p = len(prompt)
    assert (run.seq[:n_p] == prompt).all() and (len(run.seq) - n_p) % c == 0
    canvas_index = -1
    for k, call in enumerate(run.calls):
        if not call["has_sc"]:
            canvas_index += 1
            assert call["step"] == gen.max_denoising_steps
        else:
            prev = run.calls[k - 1]
            assert call["step"] == prev["step"] - 1
            assert np.array_equal(call["canvas"], prev["next_canvas"])
            assert np.array_equal(call["sc"], prev["raw"] / prev["T"]), "SC input is not raw_prev / T_prev"
        call["canvas_index"] = canvas_index
        assert np.array_equal(call["pos"], np.arange(n_p + canvas_index * c, n_p + (canvas_index + 1) * c))
        assert np.array_equal(call["argmax"], (call["raw"] / call["T"]).argmax(-1))
    assert canvas_index + 1 == (len(run.seq) - n_p) // c
    for i, steps in enumerate(run.steps_per_canvas):  # commit = argmax of the last executed step (up to padding)
        last = [call for call in run.calls if call["canvas_index"] == i][-1]
        committed = run.seq[n_p + i * c: n_p + (i + 1) * c]
        keep = np.ones(c, bool)
        eos_hits = np.flatnonzero(np.isin(committed, gen.eos_token_id))
        if len(eos_hits):
            keep[eos_hits[0] + 1:] = False
            assert (committed[~keep] == gen.pad_token_id).all()
        assert np.array_equal(committed[keep], last["argmax"][keep])
        assert last["stop"] or steps == gen.max_denoising_steps


def run_arrays(run: Run, prompt: list[int], with_raw: bool) -> dict[str, np.ndarray]:
    arrays = {
        "prompt": np.asarray(prompt, np.int32), "seq": run.seq.astype(np.int32),
        "steps_per_canvas": np.asarray(run.steps_per_canvas, np.int32),
        "canvas": run.stacked("canvas").astype(np.int32), "pos": run.stacked("pos").astype(np.int32),
        "has_sc": run.stacked("has_sc").astype(bool), "canvas_index": run.stacked("canvas_index").astype(np.int32),
        "step": run.stacked("step").astype(np.int32), "T": run.stacked("T").astype(np.float32),
        "argmax": run.stacked("argmax").astype(np.int32), "entropy": run.stacked("entropy").astype(np.float32),
        "mean_entropy": run.stacked("mean_entropy").astype(np.float32),
        "sampled": run.stacked("sampled").astype(np.int32), "accept": run.stacked("accept").astype(bool),
        "next_canvas": run.stacked("next_canvas").astype(np.int32), "stop": run.stacked("stop").astype(bool),
    }
    if with_raw:
        arrays["raw"] = run.stacked("raw").astype(np.float32)
    return arrays


def tune_early_stop(model, spec: FixtureSpec, g1_run: Run) -> GenSpec:
    """G2: stability 0 and a confidence threshold that makes the steps per canvas vary (seed 0).

    Candidates are quantiles of the mean entropies seen in the G1 seed-0 run (for the recipe model that is close
    to the 0.88·ln V of docs/model.md#fixture-recipe); the first that gives 3 canvases, unequal step counts and at most
    ~70 % of G1's decoder calls wins (fewer calls also keep the golden files small).
    """
    mean_entropy = np.array([call["mean_entropy"] for call in g1_run.calls], np.float64)
    for q in (0.5, 0.6, 0.4, 0.7, 0.3, 0.8, 0.2, 0.9):
        gen = GenSpec("G2", stability_threshold=0, confidence_threshold=round(float(np.quantile(mean_entropy, q)), 2))
        steps = generate(model, spec.long_prompt, gen, seed=0).steps_per_canvas
        if len(steps) == 3 and len(set(steps)) > 1 and sum(steps) <= 0.7 * len(g1_run.calls):
            return gen
    raise RuntimeError("no confidence_threshold made the steps per canvas vary; widen the search")


def choose_eos(g1_run: Run, spec: FixtureSpec) -> tuple[int, ...]:
    """G3 stop ids: tokens of the second committed canvas of G1 seed 0 that are absent from the first canvas.

    Preferably one id that occurs twice (the later occurrence must become pad); otherwise two different ids, the
    first near a third of the canvas and the second after it (the later EOS id must become pad too).
    """
    n_p, c = len(spec.long_prompt), spec.canvas_length
    first = set(g1_run.seq[n_p:n_p + c].tolist())
    second = g1_run.seq[n_p + c:n_p + 2 * c].tolist()
    candidates = [t for t in dict.fromkeys(second) if t not in first and t != 0]
    twice = [t for t in candidates if second.count(t) >= 2 and second.index(t) < c - 2]
    if twice:
        return (twice[0],)
    positions = sorted(second.index(t) for t in candidates)
    early = [p for p in positions if c // 4 <= p < c // 2] or positions
    late = [p for p in positions if p > early[0]]
    if not late:
        raise RuntimeError("second canvas has too few tokens absent from the first")
    return (second[early[0]], second[late[-1]])


def encoder_cache_arrays(model, prompt: list[int]) -> dict[str, np.ndarray]:
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    with torch.no_grad():
        model.model.encoder(input_ids=torch.tensor([prompt]), past_key_values=cache)
    arrays = {"prompt": np.asarray(prompt, np.int32)}
    for i, layer in enumerate(cache.layers):
        arrays[f"k_{i}"] = layer.keys[0].float().numpy().copy()
        arrays[f"v_{i}"] = layer.values[0].float().numpy().copy()
    return arrays


def write_goldens(spec: FixtureSpec, ckpt: Path) -> None:
    model = load_model(ckpt)  # record with the weights exactly as stored on disk
    out = ckpt / "golden"
    out.mkdir(exist_ok=True)
    index: dict = {"fixture": spec.name, "canvas_length": spec.canvas_length, "vocab_size": spec.vocab_size,
                   "sliding_window": spec.text["sliding_window"], "long_prompt": spec.long_prompt,
                   "short_prompt": spec.short_prompt, "generation_configs": {}, "runs": {}}

    def record(name: str, prompt: list[int], gen: GenSpec, seed: int, greedy: bool = False,
               with_raw: bool = False, raw_same_as: str | None = None) -> Run:
        run = generate(model, prompt, gen, seed, greedy)
        save_npz(out / f"{name}.npz", run_arrays(run, prompt, with_raw))
        index["generation_configs"][gen.name] = gen.to_json()
        index["runs"][name] = {"file": f"{name}.npz", "generation_config": gen.name, "seed": seed,
                               "greedy": greedy, "prompt": "long" if prompt == spec.long_prompt else "short",
                               "n_calls": len(run.calls), "steps_per_canvas": run.steps_per_canvas,
                               "has_raw": with_raw, "raw_same_as": raw_same_as}
        return run

    runs: dict[str, Run] = {}
    for seed in SEEDS:
        runs[f"g1_seed{seed}"] = record(f"g1_seed{seed}", spec.long_prompt, G1, seed, with_raw=seed == 0)
    g2 = tune_early_stop(model, spec, runs["g1_seed0"])
    g3 = GenSpec("G3", eos_token_id=choose_eos(runs["g1_seed0"], spec))
    g4 = GenSpec("G4", max_new_tokens=20)
    for seed in SEEDS:
        record(f"g2_seed{seed}", spec.long_prompt, g2, seed, with_raw=seed == 0)
        for gen in (g3, g4):
            name = f"{gen.name.lower()}_seed{seed}"
            run = record(name, spec.long_prompt, gen, seed, raw_same_as="g1_seed0" if seed == 0 else None)
            if seed == 0:  # EOS and length only act after a canvas is committed: same decoder calls as G1
                for a, b in zip(run.calls, runs["g1_seed0"].calls):
                    assert np.array_equal(a["raw"], b["raw"]) and np.array_equal(a["canvas"], b["canvas"])
    g3_steps = index["runs"]["g3_seed0"]["steps_per_canvas"]
    assert len(g3_steps) == 2, f"G3 should stop in the second canvas, got {g3_steps}"
    greedy = GenSpec("G1_greedy", max_new_tokens=32)
    record("greedy_seed0", spec.long_prompt, greedy, 0, greedy=True, with_raw=True)
    short = GenSpec("G2_short", max_new_tokens=20, stability_threshold=0,
                    confidence_threshold=g2.confidence_threshold)
    record("short_seed0", spec.short_prompt, short, 0, with_raw=True)
    save_npz(out / "encoder_cache.npz", encoder_cache_arrays(model, spec.long_prompt))
    write_json(out / "index.json", index)


# ---------------------------------------------------------------------------------------------------------------


def make_fixture(spec: FixtureSpec, root: Path, goldens: bool) -> None:
    out = root / spec.name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    write_checkpoint(spec, out)
    if goldens:
        write_goldens(spec, out)


def write_checksums(root: Path) -> None:
    """SHA256SUMS in `sha256sum` format, so `cd tests/fixtures && sha256sum -c SHA256SUMS` checks a regeneration."""
    import hashlib

    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != "SHA256SUMS" and p.name != "README.md")
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(root).as_posix()}" for p in files]
    (root / "SHA256SUMS").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=FIXTURES, help="fixtures root (default: tests/fixtures)")
    parser.add_argument("--only", choices=["tiny-a", "tiny-b"], help="build one fixture")
    parser.add_argument("--no-goldens", action="store_true", help="checkpoints only")
    args = parser.parse_args()
    torch.set_num_threads(1)  # deterministic reductions and modest CPU use
    for spec in (TINY_A, TINY_B):
        if args.only in (None, spec.name):
            make_fixture(spec, args.out, goldens=not args.no_goldens)
            print(f"wrote {args.out / spec.name}")
    write_checksums(args.out)


if __name__ == "__main__":
    main()
