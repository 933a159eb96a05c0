"""GGUFs that `create` accepts can run (issues 14 and 36): every mutant of a valid model file and of a valid vision
projector (tests/gguf_mutator.py) is either refused by `/api/create` with a one-line 400 naming the problem, or
accepted and then answers a generate (streamed, with no error line) on a real server with the real engine: the
sampler starts from the file's own defaults, and a projector's model answers a request with an image. The engine's
own loader refuses the same files without ggml's log lines, and a header's cost is bounded whatever it claims."""
from __future__ import annotations

import base64
import hashlib
import json
import struct
import time
import tracemalloc
from pathlib import Path

import httpx
import pytest

from dgemma_cli.create import create_model
from dgemma_cli.errors import DgemmaError
from dgemma_cli.modelfile import parse_modelfile
from dgemma_cli.server.config import ServerConfig
from dgemma_cli.store import Store
from dgemma_engine import gguf_reader
from dgemma_engine.errors import EngineError
from dgemma_engine.model import Model
from dgemma_engine.tokenizer import Tokenizer
from gguf_mutator import MUTANTS, PROJECTOR_MUTANTS, mutate
from server_harness import InProcessServer

TINY_V = Path(__file__).parent / "fixtures" / "tiny-v"
NOT_GGUF = "supplied file was not in GGUF format"  # the server's refusal of a header that does not parse
CANNOT_RUN = "model file cannot be run: "

# mutant -> words the refusal must contain (None: create accepts it, and then it must run)
EXPECTED = {
    "unchanged": None,
    "an extra unknown key": None,
    "tokens as i32": "tokenizer.ggml.tokens must be a non-empty array of strings",
    "tokens as f32": "tokenizer.ggml.tokens must be a non-empty array of strings",
    "tokens all empty": "tokenizer.ggml.tokens are all the same string",
    "tokens all identical": "tokenizer.ggml.tokens are all the same string",
    "tokens empty array": "tokenizer.ggml.tokens must be a non-empty array of strings",
    "eos_token_id as an array": "tokenizer.ggml.eos_token_id must be an integer",
    "eos_token_id as a string": "tokenizer.ggml.eos_token_id must be an integer",
    "bos_token_id out of range": "tokenizer.ggml.bos_token_id 1073741824 is outside the vocabulary",
    "merges as i32": "tokenizer.ggml.merges must be an array of strings",
    "token_type too short": "tokenizer.ggml.token_type has 2 entries",
    "unknown tokenizer model": "unsupported tokenizer.ggml.model 'bpe2000'",
    "context_length missing": "diffusion-gemma.context_length is missing or zero",
    "context_length zero": "diffusion-gemma.context_length is missing or zero",
    "context_length smaller than a canvas": "context_length 4 leaves no room",
    "canvas_length 65536": NOT_GGUF,
    "canvas_length zero": NOT_GGUF,
    "canvas_length as a string": NOT_GGUF,
    "duplicate key": NOT_GGUF,
    "empty key": NOT_GGUF,
    "duplicate tokenizer key": NOT_GGUF,
    "a million one-byte keys": NOT_GGUF,
    "tokenizer model missing": "tokenizer.ggml.model is missing",
    "tokens missing": "tokenizer.ggml.tokens is missing",
    "tokenizer model as an integer": "unsupported tokenizer.ggml.model '4'",
    "tokenizer model empty": "unsupported tokenizer.ggml.model ''",
    "llama tokenizer without scores": "tokenizer.ggml.scores is missing",
    "vocabulary shorter than the embeddings": "tokenizer.ggml.tokens does not have 512 entries (token_embd rows)",
    "vocabulary longer than the embeddings": "tokenizer.ggml.tokens does not have 512 entries (token_embd rows)",
    "merges missing": None,
    "merge without a space": "malformed tokenizer merge 'ab'",
    "merge of unknown tokens": "Token `zzq` out of vocabulary",
    "token_type as strings": "tokenizer.ggml.token_type must be an array of integers",
    "token_type values out of range": None,
    "eos_token_id missing": None,
    "eos_token_id negative": "tokenizer.ggml.eos_token_id -1 is outside the vocabulary",
    "mask_token_id missing": None,
    "mask_token_id out of range": "tokenizer.ggml.mask_token_id 1048576 is outside the vocabulary",
    "bos_token_id as a float": "tokenizer.ggml.bos_token_id must be an integer",
    "add_space_prefix as a string": None,
    "chat template as an integer": None,
    "chat template empty": None,
    "chat template that does not parse": "template error: TemplateSyntaxError",
    "chat template that raises": "template error: TemplateError: no",
    "chat template missing": None,
    "eb_max_steps zero": "diffusion.eb_max_steps is out of range: invalid value for diffusion_steps: 0",
    "eb_max_steps negative": "diffusion.eb_max_steps is out of range: invalid value for diffusion_steps: -5",
    "eb_max_steps huge": None,  # clipped to the server's step cap, as a request's value
    "eb_max_steps NaN": "diffusion.eb_max_steps is nan, not a finite number",
    "eb_max_steps infinite": "diffusion.eb_max_steps is inf, not a finite number",
    "eb_max_steps as a string": None,  # not a number: the released default applies
    "eb_t_min NaN": "diffusion.eb_t_min is nan, not a finite number",
    "eb_t_min negative": "diffusion.eb_t_min is out of range: invalid value for diffusion_t_min: -0.5",
    "eb_t_max infinite": "diffusion.eb_t_max is inf, not a finite number",
    "eb_t_max below eb_t_min": "diffusion.eb_t_max is out of range",
    "eb_t_max equal to eb_t_min": "must be greater than diffusion_t_min (0.4)",
    "eb_entropy_bound zero": "diffusion.eb_entropy_bound is out of range",
    "eb_entropy_bound NaN": "diffusion.eb_entropy_bound is nan",
    "eb_confidence_threshold negative": "diffusion.eb_confidence_threshold is out of range",
    "eb_confidence_threshold NaN": "diffusion.eb_confidence_threshold is nan",
    "eb_stability_threshold zero": "diffusion.eb_stability_threshold is out of range",
    "eb_stability_threshold as a bool": None,
    "unknown task": "the model's task 'chess' is not one this dgemma knows",
    "task as an integer": "the model's task '7' is not one this dgemma knows",
    "task empty": None,
    "sudoku task on a text vocabulary": "names the task 'sudoku' but its vocabulary lacks the cell tokens",
    "block_count larger than the tensors": "expected block_count = 8",
    "head_count zero": "'diffusion-gemma.attention.head_count' = 0 is out of range",
    "rms epsilon NaN": "'diffusion-gemma.attention.layer_norm_rms_epsilon' = nan is out of range",
    "rms epsilon zero": "'diffusion-gemma.attention.layer_norm_rms_epsilon' = 0 is out of range",
    "rope freq_base zero": "'diffusion-gemma.rope.freq_base' = 0 is out of range",
    "rope freq_base NaN": "'diffusion-gemma.rope.freq_base' = nan is out of range",
    "logit softcapping NaN": "'diffusion-gemma.final_logit_softcapping' = nan is out of range",
    "logit softcapping zero": "'diffusion-gemma.final_logit_softcapping' = 0 is out of range",
    "sliding_window zero": "'diffusion-gemma.attention.sliding_window' = 0 is out of range",
    "expert_used_count above expert_count": "expert_used_count 9 exceeds expert_count 4",
    "context_length 2^31": "'diffusion-gemma.context_length' = 2147483648 is out of range",
    "canvas_length 4096 in a 1024 context": "context_length 1024 leaves no room for a prompt and a canvas of 4096",
    "general.type adapter": "the model file is a LoRA adapter",
    "file_type unknown": None,
}
PROJECTOR_EXPECTED = {
    "unchanged": None,
    "patch_size zero": "'clip.vision.patch_size' = 0 is out of range",
    "patch_size larger than the tensors": "tensor 'v.patch_embd.weight' has shape [4, 4, 3, 32], expected [8, 8, 3, 32]",
    "head_count zero": "'clip.vision.attention.head_count' = 0 is out of range",
    "head_count not dividing the width": "head_count 3 a multiple of head_count_kv 2",
    "head_count_kv zero": "'clip.vision.attention.head_count_kv' = 0 is out of range",
    "head_dim zero": "'clip.vision.attention.head_dim' = 0 is out of range",
    "head_dim not a multiple of 4": "vision head_dim 6 must be a multiple of 4",
    "layer_norm_epsilon NaN": "'clip.vision.attention.layer_norm_epsilon' = nan is out of range",
    "layer_norm_epsilon missing": "missing the required key 'clip.vision.attention.layer_norm_epsilon'",
    "layer_norm_epsilon as an integer": "'clip.vision.attention.layer_norm_epsilon' has type u32, expected a float",
    "block_count larger than the tensors": "missing tensor 'v.blk.2.ln1.weight'",
    "block_count smaller than the tensors": None,  # the second block is unused: a smaller tower, which runs
    "block_count zero": "'clip.vision.block_count' = 0 is out of range",
    "embedding_length not the tensors'": "tensor 'v.patch_embd.weight' has shape",
    "feed_forward_length not the tensors'": "tensor 'v.blk.0.ffn_gate.weight' has shape",
    "feed_forward_length missing": "missing the required key 'clip.vision.feed_forward_length'",
    "projection_dim not the model's": "does not fit the model: it makes embeddings of 32 values, the model's are 64",
    "projection_dim zero": "clip.vision.projection_dim is missing or not a positive integer",
    "pooling zero": "'clip.vision.projector.scale_factor' = 0 is out of range",
    "max_soft_tokens zero": "dgemma.vision.max_soft_tokens is missing or not a positive integer",
    "max_soft_tokens larger than the context": "an image takes up to 4098 positions",
    "max_soft_tokens as a string": "dgemma.vision.max_soft_tokens is missing or not a positive integer",
    "rope freq_base NaN": "'dgemma.vision.rope.freq_base' = nan is out of range",
    "rope freq_base zero": "'dgemma.vision.rope.freq_base' = 0 is out of range",
    "no vision encoder": "projector GGUF has no vision encoder",
    "vision encoder flag missing": "projector GGUF has no vision encoder",
    "projector type mlp": 'projector type "mlp" is not supported',
    "projector type missing": 'projector type "None" is not supported',
    "an extra unknown key": None,
}
GENERATE_OPTIONS = {"num_predict": 8, "seed": 1}  # the sampler's settings are the file's own defaults
PNG = base64.b64encode((TINY_V / "images" / "square.png").read_bytes()).decode()


def test_every_mutant_has_an_expectation():
    assert set(EXPECTED) == set(MUTANTS)
    assert set(PROJECTOR_EXPECTED) == set(PROJECTOR_MUTANTS)


@pytest.fixture(scope="module")
def fixture_gguf(gguf_path):
    return gguf_path("tiny-a", "f32")


@pytest.fixture(scope="module")
def vision_files(gguf_path, tmp_path_factory) -> tuple[Path, Path]:
    """tiny-v's text model (width 64, with an image token) and its projector, converted."""
    from dgemma_convert.mmproj import convert_mmproj

    projector = convert_mmproj(TINY_V, tmp_path_factory.mktemp("tiny-v-mmproj") / "mmproj.gguf", "f32").path
    return gguf_path("tiny-v", "f32"), Path(projector)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server with the real engine runner (one model resident at a time)."""
    store = Store(tmp_path_factory.mktemp("mutants") / "store")
    config = ServerConfig.from_env({"DGEMMA_MODELS": str(store.root), "DGEMMA_NOPRUNE": "1"})
    with InProcessServer(config, store, None) as running:
        with httpx.Client(base_url=running.url, timeout=300) as client:
            yield client


def upload(client: httpx.Client, data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    assert client.post(f"/api/blobs/{digest}", content=data).status_code in (200, 201)
    return digest


def refused_or_runs(client: httpx.Client, model: str, files: dict[str, bytes], expected: str | None,
                    generate: dict) -> None:
    """Create `model` from `files`; a refusal must be the expected one-line 400 storing nothing, an accepted model
    must answer a streamed generate without an error line."""
    digests = {name: upload(client, data) for name, data in files.items()}
    response = client.post("/api/create", json={"model": model, "files": digests, "stream": False})
    stored = {m["name"].removesuffix(":latest") for m in client.get("/api/tags").json()["models"]}
    if expected is not None:
        message = response.json().get("error", "")
        assert response.status_code == 400 and expected in message and "\n" not in message, response.text
        assert model not in stored
        return
    assert response.status_code == 200, response.text
    try:
        answer = client.post("/api/generate", json={"model": model, "stream": True, "options": GENERATE_OPTIONS,
                                                    **generate})
        lines = [json.loads(line) for line in answer.text.splitlines() if line.strip()]
        assert answer.status_code == 200 and lines and lines[-1].get("done"), answer.text[-300:]
        assert not [line for line in lines if "error" in line], answer.text[-300:]
    finally:
        client.request("DELETE", "/api/delete", json={"model": model})


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_model_mutant_is_refused_clearly_or_runs(server, fixture_gguf, tmp_path, name):
    data = mutate(fixture_gguf, tmp_path / "mutant.gguf", name).read_bytes()
    refused_or_runs(server, "mutant", {"model.gguf": data}, EXPECTED[name], {"prompt": "Hello"})


@pytest.mark.parametrize("name", sorted(PROJECTOR_MUTANTS))
def test_projector_mutant_is_refused_clearly_or_encodes_an_image(server, vision_files, tmp_path, name):
    model, projector = vision_files
    data = mutate(projector, tmp_path / "mmproj.gguf", name, PROJECTOR_MUTANTS).read_bytes()
    refused_or_runs(server, "vision-mutant", {"model.gguf": model.read_bytes(), "mmproj.gguf": data},
                    PROJECTOR_EXPECTED[name], {"prompt": "what is this?", "images": [PNG]})


def test_create_names_the_problem_in_one_line(tmp_path, fixture_gguf):
    """In-process create (the CLI's) says what is wrong, the file by its name and never the store's path."""
    store = Store(tmp_path / "models")
    for name, words in (("eb_max_steps zero", CANNOT_RUN + "diffusion.eb_max_steps is out of range"),
                        ("unknown task", CANNOT_RUN + "the model's task 'chess'"),
                        ("a million one-byte keys", f"{NOT_GGUF} (invalid GGUF: 1000050 metadata keys (at most 4096))")):
        mutate(fixture_gguf, tmp_path / "mutant.gguf", name)
        with pytest.raises(DgemmaError) as info:
            list(create_model("mutant", parse_modelfile("FROM ./mutant.gguf"), store, tmp_path))
        message = str(info.value)
        assert message.startswith(words) and "\n" not in message and str(tmp_path) not in message, message
        assert not store.exists("mutant")


def test_a_million_keys_cost_bounded_time_and_memory_at_create(tmp_path, fixture_gguf):
    """Issue 36: tiny-a plus 1M one-byte keys (20 MB) took 75 s and 3.2 GB at create, in gguf-py's reader."""
    mutate(fixture_gguf, tmp_path / "mutant.gguf", "a million one-byte keys")
    store = Store(tmp_path / "models")
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(DgemmaError, match="metadata keys"):
            list(create_model("mutant", parse_modelfile("FROM ./mutant.gguf"), store, tmp_path))
        with pytest.raises(EngineError, match="metadata keys"):
            Tokenizer.from_gguf(tmp_path / "mutant.gguf")  # the tokenizer reads headers the same bounded way
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert time.monotonic() - started < 5.0
    assert peak < 16 << 20


@pytest.mark.parametrize("model_mutant,projector_mutant,words", [
    ("eb_max_steps zero", None, "diffusion.eb_max_steps is out of range"),
    ("unknown task", None, "the model's task 'chess'"),
    ("unchanged", "patch_size zero", "'clip.vision.patch_size' = 0 is out of range"),
])
def test_pull_refuses_what_create_refuses(registry, tmp_path, vision_files, model_mutant, projector_mutant, words):
    from dgemma_cli.registry import PullOptions, pull
    from dgemma_cli.store import MEDIA_MODEL, MEDIA_PROJECTOR

    model, projector = vision_files
    layers = [(MEDIA_MODEL, mutate(model, tmp_path / "model.gguf", model_mutant).read_bytes())]
    if projector_mutant is not None:
        layers.append((MEDIA_PROJECTOR, mutate(projector, tmp_path / "p.gguf", projector_mutant,
                                               PROJECTOR_MUTANTS).read_bytes()))
    registry.add_model("library/bad:latest", layers)
    store = Store(tmp_path / "store")
    options = PullOptions(part_size=1 << 20, streams=2, retries=1, backoff=0.01, free_disk_margin=0)
    with pytest.raises(DgemmaError) as info:
        list(pull(f"{registry.host}/library/bad:latest", store, insecure=True, options=options))
    assert words in str(info.value) and "\n" not in str(info.value) and info.value.status == 400
    assert not store.exists(f"{registry.host}/library/bad:latest")
    assert not any(p.name.startswith("sha256-") and p.stat().st_size > 4096 for p in store.blobs_dir.iterdir())


# ---- the reader's limits (docs/compat.md, security D8) ----------------------------------------------------------

def _header(kvs: list[bytes]) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs)


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


def _strings(key: str, items: list[bytes]) -> bytes:
    return _key(key) + struct.pack("<IIQ", 9, 8, len(items)) + b"".join(struct.pack("<Q", len(i)) + i for i in items)


def test_the_reader_bounds_keys_bytes_and_elements(monkeypatch):
    one_byte = [_key(f"k{i}") + struct.pack("<IB", 0, 1) for i in range(gguf_reader.MAX_METADATA_KEYS + 1)]
    with pytest.raises(gguf_reader.GGUFError, match="4097 metadata keys"):
        gguf_reader.parse_gguf(_header(one_byte))
    gguf_reader.parse_gguf(_header(one_byte[:-1]))  # at the limit: read
    with pytest.raises(gguf_reader.GGUFError, match="holds arrays"):  # as the engine's parser
        gguf_reader.parse_gguf(_header([_key("a") + struct.pack("<IIQ", 9, 9, 0)]))
    # the byte and element budgets, made small here so the files stay small
    monkeypatch.setattr(gguf_reader, "MAX_METADATA_BYTES", 1 << 16)
    with pytest.raises(gguf_reader.GGUFError, match="metadata is larger than"):
        gguf_reader.parse_gguf(_header([_strings("big", [b"x" * 100] * 1000)]))
    monkeypatch.setattr(gguf_reader, "MAX_ARRAY_ITEMS", 3000)
    with pytest.raises(gguf_reader.GGUFError, match="more than 3000 elements"):
        gguf_reader.parse_gguf(_header([_strings("a", [b""] * 2000), _strings("b", [b""] * 2000)]))
    # short arrays beyond the show budget are summarised like long ones, not read one by one
    monkeypatch.setattr(gguf_reader, "MAX_SHOWN_ITEMS", 10)
    info = gguf_reader.parse_gguf(_header([_strings("a", [b"p", b"q"] * 4), _strings("b", [b"r", b"s"] * 4)]))
    assert info.metadata["a"] == ["p", "q"] * 4 and info.metadata["b"] == gguf_reader.ArraySummary(8, 8, False)


@pytest.mark.parametrize("name,words", [
    ("duplicate key", "duplicate metadata key 'diffusion.canvas_length'"),
    ("empty key", "empty metadata key"),
    ("canvas_length 65536", "diffusion.canvas_length"),
    ("context_length missing", "diffusion-gemma.context_length"),
])
def test_the_engine_loader_refuses_them_too(tmp_path, fixture_gguf, name, words, capfd):
    path = mutate(fixture_gguf, tmp_path / "sha256-0123.gguf", name)
    with pytest.raises(EngineError) as info:
        Model.load(path, threads=1, name="model 'mutant'")
    message = str(info.value)
    assert message.startswith("cannot load model 'mutant': ") and words in message and "sha256" not in message
    assert "gguf_init" not in capfd.readouterr().err  # ggml's parser never saw the file


def test_malformed_tokenizer_metadata_already_in_a_store_is_a_clear_engine_error():
    """Files stored before create checked them: the tokenizer reports one line instead of a TypeError (a 500)."""
    import numpy as np

    for metadata in ({"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": np.arange(5, dtype=np.int32)},
                     {"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": ["a", "b"],
                      "tokenizer.ggml.eos_token_id": np.array([1, 2])},
                     {"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": ["a", "b"],
                      "tokenizer.ggml.merges": np.array([1, 2])}):
        with pytest.raises(EngineError) as info:
            Tokenizer.from_metadata(metadata)
        assert "\n" not in str(info.value)
