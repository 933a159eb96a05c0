"""LoRA adapters outside the engine (docs/gguf.md#lora-adapters): `dgemma convert --lora`, `ADAPTER` in Modelfiles
and `adapters` in /api/create (GGUF LoRA files and PEFT folders), `show`, copy/rm, one clear error for every
malformed adapter with nothing registered, and a created model that generates with its adapter applied.

The PEFT adapters are the committed tiny-a fixtures of tests/reference/make_lora_fixtures.py (read with numpy and
safetensors here; no torch). Malformed GGUF LoRA files are written with gguf-py.
"""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import httpx
import numpy as np
import ollama
import pytest
from safetensors.numpy import load_file

from cli_helpers import cli_env, in_process
from dgemma_cli.server.config import ServerConfig
from dgemma_cli.store import MEDIA_ADAPTER, MEDIA_MODEL, Store
from dgemma_convert.lora import LoraError, convert_lora, read_lora_header
from server_harness import FakeBehaviour, InProcessServer, ServeProcess, fake_factory

FIXTURES = Path(__file__).parent / "fixtures"
PEFT = FIXTURES / "lora" / "r4-all"  # attention, dense MLP, router and experts; rank 4, alpha 8
PEFT_R8 = FIXTURES / "lora" / "r8-attn-mlp"  # attention and dense MLP; rank 8, alpha 4
REPO = Path(__file__).resolve().parent.parent
ARCH = "diffusion-gemma"
FAST = {"diffusion_steps": 4, "seed": 7, "num_predict": 16}


@pytest.fixture(scope="module")
def base(gguf_path) -> Path:
    return gguf_path("tiny-a", "f32")


@pytest.fixture(scope="module")
def other_base(gguf_path) -> Path:
    return gguf_path("tiny-b", "f32")


@pytest.fixture(scope="module")
def lora_gguf(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lora") / "r4-all.gguf"
    convert_lora(PEFT, out)
    return out


def dgemma(env: dict[str, str], *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The real CLI in its own interpreter."""
    import os

    return subprocess.run([sys.executable, "-m", "dgemma_cli.main", *args], capture_output=True, text=True,
                          env={**os.environ, **env, "PYTHONPATH": str(REPO)}, cwd=cwd, timeout=120)


def sha256_of(path: Path) -> str:
    from dgemma_cli.store import sha256_file

    return sha256_file(path)


def write_lora(path: Path, tensors: dict[str, np.ndarray], *, alpha=8.0, arch=ARCH, general_type="adapter",
               adapter_type="lora") -> Path:
    """A GGUF LoRA file from torch-order arrays (gguf-py writes ne reversed); any key can be made to lie."""
    w = gguf.GGUFWriter(str(path), arch)
    if general_type is not None:
        w.add_string("general.type", general_type)
    if adapter_type is not None:
        w.add_string("adapter.type", adapter_type)
    if isinstance(alpha, str):
        w.add_string("adapter.lora.alpha", alpha)
    elif alpha is not None:
        w.add_float32("adapter.lora.alpha", alpha)
    for name, value in tensors.items():
        w.add_tensor(name, value.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def q_pair(r_a: int = 4, r_b: int = 4, n_out: int = 64, name: str = "dec.blk.0.attn_q.weight") -> dict:
    """tiny-a's blk.0.attn_q is ne [64, 64] (H 64 -> nH 4 x hd 16)."""
    return {f"{name}.lora_a": np.ones((r_a, 64)), f"{name}.lora_b": np.ones((n_out, r_b))}


def peft_copy(tmp_path: Path, source: Path = PEFT_R8, **config_changes) -> Path:
    folder = tmp_path / f"peft-{source.name}"
    shutil.copytree(source, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(config_changes)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


# ---- the converter ------------------------------------------------------------------------------------------------

def test_peft_folder_becomes_gguf_pairs_with_the_documented_layout(lora_gguf):
    peft = load_file(str(PEFT / "adapter_model.safetensors"))
    reader = gguf.GGUFReader(lora_gguf)
    fields = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    assert fields["general.architecture"] == ARCH and fields["general.type"] == "adapter"
    assert fields["adapter.type"] == "lora" and fields["adapter.lora.alpha"] == 8.0
    tensors = {t.name: np.array(t.data) for t in reader.tensors}
    assert len(tensors) == len(peft)  # every PEFT factor, nothing else (the fixture has no vision targets)

    prefix = "base_model.model.model."
    # a dense projection of each pass: A and B unchanged (torch order = ggml ne reversed)
    for pass_name, module in (("dec", "decoder.layers.1"), ("enc", "encoder.language_model.layers.1")):
        a, b = tensors[f"{pass_name}.blk.1.attn_q.weight.lora_a"], tensors[f"{pass_name}.blk.1.attn_q.weight.lora_b"]
        np.testing.assert_array_equal(a, peft[f"{prefix}{module}.self_attn.q_proj.lora_A.weight"])
        np.testing.assert_array_equal(b, peft[f"{prefix}{module}.self_attn.q_proj.lora_B.weight"])
    assert not np.array_equal(tensors["enc.blk.1.attn_q.weight.lora_b"], tensors["dec.blk.1.attn_q.weight.lora_b"])
    # experts: A is expert-major as saved; B's rank-major columns permuted to one [n_out, r] matrix per expert
    E, r = 4, 4
    for param, depth in (("gate_up_proj", ".base_layer"), ("down_proj", "")):
        name = {"gate_up_proj": "ffn_gate_up_exps", "down_proj": "ffn_down_exps"}[param]
        a_peft = peft[f"{prefix}decoder.layers.2.experts{depth}.lora_A.weight"]
        b_peft = peft[f"{prefix}decoder.layers.2.experts{depth}.lora_B.weight"]
        a, b = tensors[f"dec.blk.2.{name}.weight.lora_a"], tensors[f"dec.blk.2.{name}.weight.lora_b"]
        assert a.shape == (E, r, a_peft.shape[1]) and b.shape == (E, b_peft.shape[0], r)
        np.testing.assert_array_equal(a, a_peft.reshape(E, r, -1))
        for e in range(E):  # PEFT's delta: einsum("o r e, e r i -> e o i", B.reshape(o, r, E), A.reshape(E, r, i))
            np.testing.assert_array_equal(b[e], b_peft.reshape(-1, r, E)[:, :, e])
    # the expert shapes are the base's: gate_up ne [H, 2 FFe, E], down ne [FFe, H, E]
    header = read_lora_header(lora_gguf)
    shapes = {p.target: p.base_ne for p in header.pairs}
    assert shapes["blk.2.ffn_gate_up_exps.weight"] == (64, 64, 4) and shapes["blk.2.ffn_down_exps.weight"] == (32, 64, 4)
    assert header.ranks == [4] and {p.pass_name for p in header.pairs} == {"enc", "dec"}


def test_convert_lora_command_checks_the_base(tmp_path, base, other_base, lora_gguf):
    env = cli_env(tmp_path)
    out = tmp_path / "out.gguf"
    done = dgemma(env, "convert", "--lora", str(PEFT), "--outfile", str(out), "--base", str(base))
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == lora_gguf.read_bytes()  # deterministic: the same bytes as the library call
    refused = dgemma(env, "convert", "--lora", str(PEFT), "--outfile", str(tmp_path / "x.gguf"), "--base",
                     str(other_base))
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.startswith("Error: the adapter does not fit this base: ") and refused.stderr.count("\n") == 1
    assert not (tmp_path / "x.gguf").exists()


def test_convert_arguments_go_together(tmp_path, base):
    env, out = cli_env(tmp_path), str(tmp_path / "x.gguf")
    code, _, err = in_process(env, "convert", "--outfile", out)
    words = " ".join(err.replace("│", " ").split())  # Rich boxes and wraps usage errors
    assert code == 2 and "missing: give a checkpoint folder, or --lora PEFT_DIR" in words  # a usage error, as before
    assert in_process(env, "convert", str(FIXTURES / "tiny-a"), "--lora", str(PEFT), "--outfile", out) == (
        1, "", "Error: give either a checkpoint folder or --lora, not both\n")
    assert in_process(env, "convert", str(FIXTURES / "tiny-a"), "--base", str(base), "--outfile", out) == (
        1, "", "Error: --base goes with --lora\n")


def test_rslora_and_alpha_pattern_keep_peft_scales(tmp_path):
    plain = tmp_path / "plain.gguf"
    convert_lora(PEFT_R8, plain)
    r, alpha = 8, 4.0
    rs = tmp_path / "rs.gguf"
    convert_lora(peft_copy(tmp_path / "a", use_rslora=True), rs)
    assert math.isclose(read_lora_header(rs).alpha / r, alpha / math.sqrt(r), rel_tol=1e-6)  # alpha / sqrt(r)

    patterned = tmp_path / "pattern.gguf"
    convert_lora(peft_copy(tmp_path / "b", alpha_pattern={"q_proj": 16.0}), patterned)
    before = {t.name: np.array(t.data) for t in gguf.GGUFReader(plain).tensors}
    after = {t.name: np.array(t.data) for t in gguf.GGUFReader(patterned).tensors}
    assert read_lora_header(patterned).alpha == alpha
    for name in before:
        expected = before[name] * np.float32(16.0 / alpha) if "attn_q.weight.lora_b" in name else before[name]
        np.testing.assert_allclose(after[name], expected, rtol=1e-7, err_msg=name)


@pytest.mark.parametrize("changes,message", [
    ({"use_dora": True}, "DoRA adapters (use_dora) are not supported"),
    ({"rank_pattern": {"q_proj": 4}}, "rank mismatch"),
    ({"r": 16}, "rank mismatch"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "trained biases"),
    ({"init_lora_weights": "pissa"}, "also changes the base weights"),
    ({"peft_type": "LOHA"}, "only LoRA adapters are supported"),
    ({"lora_alpha": 0}, "lora_alpha must be a positive number"),
    ({"use_rslora": True, "alpha_pattern": {"q_proj": 2}}, "use_rslora together with"),
    ({"rank_pattern": {"(a+)+$": 8}}, "is not a module name"),
])
def test_unsupported_peft_adapters_are_refused(tmp_path, changes, message):
    with pytest.raises(LoraError, match=message.replace("(", r"\(").replace(")", r"\)")):
        convert_lora(peft_copy(tmp_path, **changes), tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


def test_expert_pairs_fit_fused_and_split_bases():
    from dgemma_convert.lora import check_against_base, lora_header_from

    meta = {"general.architecture": ARCH, "general.type": "adapter", "adapter.type": "lora", "adapter.lora.alpha": 8.0}
    H, FFe, E, r = 64, 32, 4, 2
    fused = lora_header_from(meta, [("dec.blk.0.ffn_gate_up_exps.weight.lora_a", (H, r, E), "F32"),
                                    ("dec.blk.0.ffn_gate_up_exps.weight.lora_b", (r, 2 * FFe, E), "Q8_0")])
    split = lora_header_from(meta, [(f"blk.0.ffn_{g}_exps.weight.lora_{h}", (H, r, E) if h == "a" else (r, FFe, E), "F16")
                                    for g in ("gate", "up") for h in "ab"])
    fused_base = {"blk.0.ffn_gate_up_exps.weight": (H, 2 * FFe, E)}
    split_base = {"blk.0.ffn_gate_exps.weight": (H, FFe, E), "blk.0.ffn_up_exps.weight": (H, FFe, E)}
    for header in (fused, split):
        for base_tensors in (fused_base, split_base):
            check_against_base(header, ARCH, base_tensors)
    with pytest.raises(LoraError, match="does not fit this base"):
        check_against_base(fused, ARCH, {"blk.0.ffn_gate_exps.weight": (H, 16, E), "blk.0.ffn_up_exps.weight": (H, 16, E)})


# ---- create / show / cp / rm through the CLI ----------------------------------------------------------------------

def manifest_layers(store: Store, name: str) -> list:
    return list(store.read_manifest(name).layers)


def test_create_with_adapter_through_the_cli(tmp_path, base, lora_gguf):
    env = cli_env(tmp_path)
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    shutil.copy(base, work / "base.gguf")
    shutil.copytree(PEFT, work / "my-adapter")
    # paths relative to the Modelfile, as FROM's (the command runs elsewhere)
    (work / "sub" / "Modelfile").write_text("FROM ../base.gguf\nADAPTER ../my-adapter\nSYSTEM tuned\n")
    done = dgemma(env, "create", "tuned", "-f", str(work / "sub" / "Modelfile"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "converting adapter" in done.stderr and done.stderr.rstrip().endswith("success")

    store = Store(tmp_path / "store")
    layers = manifest_layers(store, "tuned")
    assert [layer.media_type for layer in layers][:2] == [MEDIA_MODEL, MEDIA_ADAPTER]
    adapter = layers[1]
    assert adapter.digest == sha256_of(lora_gguf)  # the PEFT folder was stored as its GGUF LoRA file, nothing else
    assert store.resolve("tuned").adapters == [store.blob_path(adapter.digest)]

    shown = dgemma(env, "show", "tuned")
    assert shown.returncode == 0, shown.stderr
    assert f"  Adapters\n    LoRA {adapter.digest[7:19]}    rank 4, alpha 8, 76 weights\n" in shown.stdout

    # a GGUF LoRA file gives the same layer; show --modelfile round-trips it
    (work / "Modelfile.gguf").write_text(f"FROM ./base.gguf\nADAPTER {lora_gguf}\nSYSTEM tuned\n")
    code, _, err = in_process(env, "create", "tuned-gguf", "-f", str(work / "Modelfile.gguf"))
    assert code == 0, err
    assert [x.digest for x in manifest_layers(store, "tuned-gguf")] == [x.digest for x in layers]
    text = dgemma(env, "show", "tuned", "--modelfile").stdout
    assert f"\nADAPTER {store.blob_path(adapter.digest)}\n" in text
    (work / "Modelfile.shown").write_text(text)
    code, _, err = in_process(env, "create", "again", "-f", str(work / "Modelfile.shown"))
    assert code == 0, err
    assert "copying file" not in err  # every blob is already on the server
    assert [x.digest for x in manifest_layers(store, "again")] == [x.digest for x in layers]


def test_stacked_adapters_apply_in_order_and_round_trip(tmp_path, base, lora_gguf):
    env = cli_env(tmp_path)
    (tmp_path / "Modelfile").write_text(f"FROM {base}\nADAPTER {PEFT_R8}\nADAPTER {lora_gguf}\n")
    code, _, err = in_process(env, "create", "two", "-f", str(tmp_path / "Modelfile"))
    assert code == 0, err
    store = Store(tmp_path / "store")
    adapters = [x.digest for x in manifest_layers(store, "two") if x.media_type == MEDIA_ADAPTER]
    assert len(adapters) == 2 and adapters[1] == sha256_of(lora_gguf)  # in Modelfile order
    code, text, _ = in_process(env, "show", "two", "--modelfile")
    assert [line for line in text.splitlines() if line.startswith("ADAPTER")] == [
        f"ADAPTER {store.blob_path(d)}" for d in adapters]
    (tmp_path / "Modelfile.shown").write_text(text)
    assert in_process(env, "create", "again", "-f", str(tmp_path / "Modelfile.shown"))[0] == 0
    assert manifest_layers(store, "again") == manifest_layers(store, "two")


def test_two_adapters_with_one_file_name_are_both_applied(tmp_path, base, lora_gguf):
    env = cli_env(tmp_path)
    for folder, source in (("one", lora_gguf), ("two", None)):
        (tmp_path / folder).mkdir()
        target = tmp_path / folder / "adapter.gguf"
        if source is None:
            convert_lora(PEFT_R8, target)
        else:
            shutil.copy(source, target)
    (tmp_path / "Modelfile").write_text(f"FROM {base}\nADAPTER ./one/adapter.gguf\nADAPTER ./two/adapter.gguf\n")
    code, _, err = in_process(env, "create", "m", "-f", str(tmp_path / "Modelfile"))
    assert code == 0, err
    adapters = Store(tmp_path / "store").resolve("m").adapters
    assert [p.read_bytes() for p in adapters] == [(tmp_path / d / "adapter.gguf").read_bytes() for d in ("one", "two")]


def test_show_on_a_public_bind_prints_no_adapter_paths(tmp_path, base, lora_gguf):
    from dgemma_cli.create import create_model
    from dgemma_cli.modelfile import parse_modelfile
    from dgemma_cli.server import model_info

    store = Store(tmp_path / "store")
    list(create_model("m", parse_modelfile(f"FROM {base}\nADAPTER {lora_gguf}\n"), store, tmp_path))
    config = ServerConfig.from_env({"DGEMMA_MODELS": str(store.root), "DGEMMA_HOST": "0.0.0.0:11434"})
    show = model_info.show(store.resolve("m"), False, config.host.is_loopback)
    assert "ADAPTER" not in show.modelfile and str(store.root) not in show.modelfile
    assert "FROM m:latest" in show.modelfile and len(show.adapters) == 1


def test_an_unprefixed_llama_cpp_style_adapter_is_accepted(tmp_path, base):
    env = cli_env(tmp_path)
    adapter = write_lora(tmp_path / "both-passes.gguf", {**q_pair(name="blk.0.attn_q.weight"),
                                                         **q_pair(name="blk.1.ffn_up.weight", n_out=96)})
    (tmp_path / "Modelfile").write_text(f"FROM {base}\nADAPTER ./both-passes.gguf\n")
    code, _, err = in_process(env, "create", "m", "-f", str(tmp_path / "Modelfile"))
    assert code == 0, err
    assert Store(tmp_path / "store").resolve("m").adapters[0].read_bytes() == adapter.read_bytes()


def test_copy_and_rm_keep_adapter_blobs_consistent(tmp_path, base, lora_gguf):
    env = cli_env(tmp_path)
    (tmp_path / "Modelfile").write_text(f"FROM {base}\nADAPTER {lora_gguf}\n")
    assert in_process(env, "create", "a", "-f", str(tmp_path / "Modelfile"))[0] == 0
    store = Store(tmp_path / "store")
    adapter_blob = store.blob_path(sha256_of(lora_gguf))
    assert in_process(env, "cp", "a", "b")[0] == 0
    assert manifest_layers(store, "b") == manifest_layers(store, "a")
    assert in_process(env, "rm", "a")[0] == 0
    assert adapter_blob.is_file() and store.resolve("b").adapters == [adapter_blob]  # still used by b
    assert in_process(env, "rm", "b")[0] == 0
    assert not adapter_blob.exists() and not store.list_models()


# ---- the API with a real client -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A server over its own store (scripted runner: these tests are about the store)."""
    root = tmp_path_factory.mktemp("lora-api")
    store = Store(root / "store")
    config = ServerConfig.from_env({"DGEMMA_MODELS": str(store.root), "DGEMMA_NOPRUNE": "1"})
    with InProcessServer(config, store, fake_factory(FakeBehaviour(answer="ok"))) as server:
        yield server, store, ollama.Client(host=server.url)


def test_api_create_with_gguf_and_peft_adapters(served, base, lora_gguf):
    server, store, client = served
    base_digest, lora_digest = client.create_blob(base), client.create_blob(lora_gguf)
    done = client.create(model="api-gguf", files={"base.gguf": base_digest}, adapters={"r4.gguf": lora_digest})
    assert done.status == "success"
    # Ollama's form for a PEFT folder: its files by name; converted by the server, stored as GGUF
    peft = {name: client.create_blob(PEFT / name) for name in ("adapter_config.json", "adapter_model.safetensors")}
    done = client.create(model="api-peft", files={"base.gguf": base_digest}, adapters=peft)
    assert done.status == "success"
    for name in ("api-gguf", "api-peft"):
        adapters = [x for x in manifest_layers(store, name) if x.media_type == MEDIA_ADAPTER]
        assert [x.digest for x in adapters] == [lora_digest], name
    # from an existing model: its adapter is inherited, a new one stacks after it
    r8 = {name: client.create_blob(PEFT_R8 / name) for name in ("adapter_config.json", "adapter_model.safetensors")}
    assert client.create(model="api-child", from_="api-gguf", adapters=r8).status == "success"
    stacked = [x for x in manifest_layers(store, "api-child") if x.media_type == MEDIA_ADAPTER]
    assert len(stacked) == 2 and stacked[0].digest == lora_digest

    show = httpx.post(f"{server.url}/api/show", json={"model": "api-child"}).json()
    assert [a["ranks"] for a in show["adapters"]] == [[4], [8]] and show["adapters"][0]["digest"] == lora_digest
    adapter_lines = [line for line in show["modelfile"].splitlines() if line.startswith("ADAPTER ")]
    assert adapter_lines == [f"ADAPTER {store.blob_path(x.digest)}" for x in stacked]
    plain = httpx.post(f"{server.url}/api/show", json={"model": "api-gguf"}).json()
    assert "ADAPTER " in plain["modelfile"] and len(plain["adapters"]) == 1


# ---- malformed adapters: one error, nothing registered ------------------------------------------------------------

def bad_gguf_adapter(kind: str, tmp_path: Path, base: Path, lora_gguf: Path) -> Path:
    path = tmp_path / f"{kind}.gguf"
    if kind == "model":
        return Path(shutil.copy(base, path))
    if kind == "rank-mismatch":
        return write_lora(path, q_pair(r_a=4, r_b=8))
    if kind == "shape-mismatch":
        return write_lora(path, q_pair(n_out=100))
    if kind == "other-architecture":
        return write_lora(path, q_pair(), arch="llama")
    if kind == "missing-tensor":
        return write_lora(path, {"dec.blk.0.attn_q.weight.lora_a": np.ones((4, 64))})
    if kind == "not-in-base":
        return write_lora(path, q_pair(name="blk.9.attn_q.weight"))
    if kind == "not-a-target":
        return write_lora(path, {"blk.0.attn_norm.weight.lora_a": np.ones((4, 64)),
                                 "blk.0.attn_norm.weight.lora_b": np.ones((64, 4))})
    if kind == "both-forms":
        return write_lora(path, {**q_pair(), **q_pair(name="blk.0.attn_q.weight")})
    if kind == "lying-alpha":
        return write_lora(path, q_pair(), alpha="eight")
    if kind == "lying-type":
        return write_lora(path, q_pair(), adapter_type="ia3")
    if kind == "truncated":
        data = lora_gguf.read_bytes()
        path.write_bytes(data[: len(data) // 2])
        return path
    if kind == "lying-count":  # the header announces more tensors than it holds
        data = bytearray(lora_gguf.read_bytes())
        data[8:16] = (10**6).to_bytes(8, "little")
        path.write_bytes(data)
        return path
    if kind == "text":
        path.write_text("not a gguf")
        return path
    raise AssertionError(kind)


GGUF_CASES = {
    "model": "not a LoRA adapter: the GGUF is a model",
    "rank-mismatch": "rank mismatch",
    "shape-mismatch": "the adapter does not fit this base: blk.0.attn_q.weight is [64, 64] in the base",
    "other-architecture": "the adapter was made for architecture 'llama'",
    "missing-tensor": "the adapter lacks tensor dec.blk.0.attn_q.weight.lora_b",
    "not-in-base": "the adapter adapts blk.9.attn_q.weight, which the base model does not have",
    "not-a-target": "not a weight LoRA can target",
    "both-forms": "the adapter has both blk.0.attn_q.weight.* and dec.blk.0.attn_q.weight.*",
    "lying-alpha": "adapter.lora.alpha must be a positive float32",
    "lying-type": "adapter.type is 'ia3'",
    "truncated": "not a GGUF LoRA file (invalid GGUF",
    "lying-count": "not a GGUF LoRA file (invalid GGUF: tensor count",
    "text": "not a GGUF LoRA file (invalid GGUF: bad magic",
}


def bad_peft_adapter(kind: str, tmp_path: Path) -> Path:
    if kind == "dora":
        return peft_copy(tmp_path, use_dora=True)
    if kind == "config-rank":
        return peft_copy(tmp_path, r=2)
    if kind == "made-for-tiny-b":
        return peft_copy(tmp_path, PEFT)  # checked against tiny-b below
    if kind == "no-weights":
        folder = peft_copy(tmp_path)
        (folder / "adapter_model.safetensors").unlink()
        return folder
    if kind == "not-peft":
        folder = tmp_path / "empty"
        folder.mkdir()
        return folder
    if kind == "truncated-weights":
        folder = peft_copy(tmp_path)
        weights = folder / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:5000])
        return folder
    raise AssertionError(kind)


PEFT_CASES = {
    "dora": "DoRA adapters (use_dora) are not supported",
    "config-rank": "rank mismatch",
    "made-for-tiny-b": "the adapter does not fit this base",
    "no-weights": "adapter_model.safetensors is missing",
    "not-peft": "the folder is not a PEFT adapter",
    "truncated-weights": "adapter_model.safetensors is truncated",
}


def registered(store: Store) -> tuple[list[str], set[str]]:
    return sorted(m.name for m in store.list_models()), store.referenced_digests()


@pytest.mark.parametrize("kind", sorted(GGUF_CASES) + sorted(f"peft-{k}" for k in PEFT_CASES))
def test_malformed_adapter_through_the_cli(tmp_path, base, other_base, lora_gguf, kind):
    env = cli_env(tmp_path)
    if kind.startswith("peft-"):
        adapter, message = bad_peft_adapter(kind[5:], tmp_path), PEFT_CASES[kind[5:]]
    else:
        adapter, message = bad_gguf_adapter(kind, tmp_path, base, lora_gguf), GGUF_CASES[kind]
    from_ = other_base if kind == "peft-made-for-tiny-b" else base
    (tmp_path / "Modelfile").write_text(f"FROM {from_}\nADAPTER ./{adapter.name}\n")
    code, out, err = in_process(env, "create", "bad", "-f", str(tmp_path / "Modelfile"))
    assert (code, out) == (1, ""), err
    last = err.splitlines()[-1]
    assert last.startswith(f"Error: invalid adapter {adapter.name}: ") and message in last, err
    assert str(tmp_path) not in last  # names, not paths
    assert registered(Store(tmp_path / "store")) == ([], set())


@pytest.mark.parametrize("kind", sorted(GGUF_CASES))
def test_malformed_gguf_adapter_through_the_api(served, tmp_path, base, lora_gguf, kind):
    server, store, client = served
    adapter = bad_gguf_adapter(kind, tmp_path, base, lora_gguf)
    before = registered(store)
    body = {"model": "bad", "files": {"base.gguf": client.create_blob(base)},
            "adapters": {adapter.name: client.create_blob(adapter)}}
    for stream in (False, True):
        answer = httpx.post(f"{server.url}/api/create", json={**body, "stream": stream})
        assert answer.status_code == 400 and set(answer.json()) == {"error"}, answer.text
        assert answer.json()["error"].startswith(f"invalid adapter {adapter.name}: ")
        assert GGUF_CASES[kind] in answer.json()["error"]
    assert registered(store) == before


@pytest.mark.parametrize("kind", ["dora", "config-rank", "truncated-weights"])
def test_malformed_peft_adapter_through_the_api(served, tmp_path, base, kind):
    server, store, client = served
    folder = bad_peft_adapter(kind, tmp_path)
    before = registered(store)
    adapters = {name: client.create_blob(folder / name) for name in ("adapter_config.json", "adapter_model.safetensors")}
    with pytest.raises(ollama.ResponseError) as refused:
        client.create(model="bad", files={"base.gguf": client.create_blob(base)}, adapters=adapters)
    assert refused.value.status_code == 400 and PEFT_CASES[kind] in refused.value.error
    assert registered(store) == before


@pytest.mark.parametrize("adapters,status,message", [
    ({"../lora.gguf": "sha256:" + "0" * 64}, 400, "file path must be relative"),
    ({"/etc/lora.gguf": "sha256:" + "0" * 64}, 400, "file path must be relative"),
    ({"lora.gguf": "sha256:../../etc/passwd"}, 400, "invalid digest format"),
    ({"lora.gguf": "sha256:" + "0" * 64}, 404, "not found"),
    ({"adapter_config.json": None}, 400, "a PEFT adapter is exactly adapter_config.json and adapter_model.safetensors"),
])
def test_adapters_field_is_validated(served, base, adapters, status, message):
    server, store, client = served
    before = registered(store)
    if None in adapters.values():  # a real blob, but only half of a PEFT folder
        adapters = {name: client.create_blob(PEFT / name) for name in adapters}
    answer = httpx.post(f"{server.url}/api/create", json={"model": "bad", "files": {"base.gguf": client.create_blob(base)},
                                                          "adapters": adapters, "stream": False})
    assert answer.status_code == status and message in answer.json()["error"], answer.text
    assert registered(store) == before


# ---- generation with the adapter (real engine) --------------------------------------------------------------------

def test_a_model_created_with_adapter_generates_with_it(tmp_path, base, lora_gguf):
    with ServeProcess(tmp_path / "models", {"DGEMMA_NOPRUNE": "1"}) as server:
        client = ollama.Client(host=server.url)
        files = {"base.gguf": client.create_blob(base)}
        assert client.create(model="plain", files=files).status == "success"
        peft = {name: client.create_blob(PEFT / name) for name in ("adapter_config.json", "adapter_model.safetensors")}
        assert client.create(model="tuned", files=files, adapters=peft).status == "success"
        plain = client.generate(model="plain", prompt="Hello", options=FAST).response
        tuned = client.generate(model="tuned", prompt="Hello", options=FAST).response
        assert tuned != plain  # the adapter moved the logits: another sample from the same seed
        assert client.generate(model="tuned", prompt="Hello", options=FAST).response == tuned
