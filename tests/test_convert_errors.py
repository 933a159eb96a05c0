"""Malformed inputs through the CLI: one `Error: ...` line, exit status 1, and no output or temporary file left."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dgemma_convert import ConvertError, ProgressSink, convert
from synthetic_checkpoint import text_config, write_synthetic_checkpoint

SMALL = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, head_dim=32, global_head_dim=64)


def run_convert(hf_dir, out_dir, outtype="q8_0"):
    return subprocess.run([sys.executable, "-m", "dgemma_cli.main", "convert", str(hf_dir), "--outfile",
                           str(out_dir / "out.gguf"), "--outtype", outtype], capture_output=True, text=True,
                          timeout=120)


def assert_clean_failure(result, out_dir, message_part):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1, result.stderr
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert message_part in lines[0]
    assert list(out_dir.iterdir()) == []  # neither the output nor a temporary file


def edit_json(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def rewrite_header(path, change):
    """Re-serialize a safetensors header after `change(header)`; the data section stays byte for byte."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    change(header)
    blob = json.dumps(header).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + raw[8 + n:])


@pytest.fixture
def ckpt(tmp_path):
    return write_synthetic_checkpoint(tmp_path / "ckpt", text_config(**SMALL))


@pytest.fixture
def out_dir(tmp_path):
    d = tmp_path / "out"
    d.mkdir()
    return d


def test_valid_checkpoint_converts(ckpt, out_dir):
    """The baseline the malformed cases start from converts cleanly through the CLI, quietly when piped."""
    result = run_convert(ckpt, out_dir)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and result.stderr == ""
    assert [p.name for p in out_dir.iterdir()] == ["out.gguf"]


def test_missing_shard(tmp_path, out_dir):
    ckpt = write_synthetic_checkpoint(tmp_path / "sharded", text_config(**SMALL), n_shards=3)
    (ckpt / "model-00002-of-00003.safetensors").unlink()
    assert_clean_failure(run_convert(ckpt, out_dir), out_dir, "missing shard model-00002-of-00003.safetensors")


def test_truncated_shard(ckpt, out_dir):
    path = ckpt / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    assert_clean_failure(run_convert(ckpt, out_dir), out_dir, "truncated")


def test_header_offsets_overlap(ckpt, out_dir):
    def overlap(header):  # point one norm at another norm's bytes (same size: the lie is only in the offsets)
        header["model.decoder.norm.weight"]["data_offsets"] = list(
            header["model.decoder.self_conditioning.pre_norm.weight"]["data_offsets"])

    rewrite_header(ckpt / "model.safetensors", overlap)
    assert_clean_failure(run_convert(ckpt, out_dir), out_dir, "overlap")


def test_header_offsets_disagree_with_shape(ckpt, out_dir):
    def shrink(header):
        b, e = header["model.decoder.norm.weight"]["data_offsets"]
        header["model.decoder.norm.weight"]["data_offsets"] = [b, e - 4]

    rewrite_header(ckpt / "model.safetensors", shrink)
    assert_clean_failure(run_convert(ckpt, out_dir), out_dir, "data_offsets")


def test_header_offsets_beyond_file(ckpt, out_dir):
    def beyond(header):
        b, e = header["model.decoder.norm.weight"]["data_offsets"]
        header["model.decoder.norm.weight"]["data_offsets"] = [b + 10**9, e + 10**9]

    rewrite_header(ckpt / "model.safetensors", beyond)
    assert_clean_failure(run_convert(ckpt, out_dir), out_dir, "offsets lie")


def test_unknown_model_type(ckpt, out_dir):
    edit_json(ckpt / "config.json", lambda c: c.update(model_type="llama"))
    assert_clean_failure(run_convert(ckpt, out_dir), out_dir, "unsupported model_type 'llama'")


def test_bidirectional_all_is_rejected(ckpt, out_dir):
    edit_json(ckpt / "config.json", lambda c: c["text_config"].update(use_bidirectional_attention="all"))
    assert_clean_failure(run_convert(ckpt, out_dir), out_dir, "use_bidirectional_attention")


def test_missing_tokenizer(ckpt, out_dir):
    (ckpt / "tokenizer.json").unlink()
    assert_clean_failure(run_convert(ckpt, out_dir), out_dir, "tokenizer.json not found")


def test_shape_contradicting_config(ckpt, out_dir):
    edit_json(ckpt / "config.json", lambda c: c["text_config"].update(intermediate_size=256))
    assert_clean_failure(run_convert(ckpt, out_dir), out_dir, "but config.json implies")


def test_unknown_outtype(ckpt, out_dir):
    assert_clean_failure(run_convert(ckpt, out_dir, outtype="q3_k_xl"), out_dir, "unknown --outtype")


def test_failure_while_writing_removes_the_temporary_file(ckpt, out_dir):
    class Explode(ProgressSink):
        def advance(self, nbytes):
            raise ConvertError("disk full (simulated)")

    with pytest.raises(ConvertError, match="simulated"):
        convert(ckpt, out_dir / "out.gguf", "f32", progress=Explode())
    assert list(out_dir.iterdir()) == []


def test_progress_bar_on_a_tty(ckpt, out_dir):
    """On a terminal the conversion shows tensors done, bytes, rate and ETA, then a summary line."""
    import pexpect

    from dgemma_convert import plan

    n_tensors = len(plan(ckpt, "q8_0").tensors)
    child = pexpect.spawn(sys.executable, ["-m", "dgemma_cli.main", "convert", str(ckpt), "--outfile",
                                           str(out_dir / "out.gguf"), "--outtype", "q8_0"],
                          dimensions=(24, 200), timeout=120, encoding="utf-8")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    screen = child.before
    assert f"{n_tensors}/{n_tensors} tensors" in screen
    assert "/s" in screen and "kB" in screen  # rate and bytes columns
    assert f"wrote {out_dir / 'out.gguf'} ({n_tensors} tensors" in screen


def test_terminated_conversion_leaves_nothing(tmp_path, out_dir):
    """SIGTERM while writing: the process exits and removes its temporary file."""
    import signal
    import time

    big = text_config(num_experts=8, moe_intermediate_size=512, intermediate_size=1024)  # ~10 M weights: K-quants
    ckpt = write_synthetic_checkpoint(tmp_path / "big", big)  # take seconds, so the signal lands mid-write
    child = subprocess.Popen([sys.executable, "-m", "dgemma_cli.main", "convert", str(ckpt), "--outfile",
                              str(out_dir / "out.gguf"), "--outtype", "q4_k_m", "--threads", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not list(out_dir.glob(".out.gguf.*.tmp")) and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert child.poll() is None, "conversion finished before it could be interrupted"
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) == 128 + signal.SIGTERM
    assert list(out_dir.iterdir()) == []
