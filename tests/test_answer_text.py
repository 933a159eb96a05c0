"""Control tokens in answers (dgemma_engine.chat.answer_text): an answer's text holds none but the thinking channel's
markers and the tool-call syntax, which the server parses away; the token ids (`context`) keep every token."""
import httpx
import pytest

from dgemma_engine.chat.answer_text import KEPT_CONTROL_TOKENS, hidden_control_ids
from dgemma_engine.tokenizer import Tokenizer
from server_harness import ServeProcess


@pytest.fixture(scope="module")
def tokenizer(gguf_path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path("tiny-a", "f32"))


def test_hidden_ids_are_the_control_tokens_no_reader_parses(tokenizer):
    hidden = {tokenizer.tokens[i] for i in hidden_control_ids(tokenizer)}
    assert {"<mask>", "<|image>", "<image|>", "<tool_response|>", "<|turn>", "<pad>"} <= hidden
    assert not hidden & KEPT_CONTROL_TOKENS
    kept = {tokenizer.tokens[i] for i in tokenizer.control_ids} - hidden
    assert kept == {"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>'}


def test_decoding_leaves_hidden_tokens_out_and_streams_the_same(tokenizer):
    hidden = hidden_control_ids(tokenizer)
    ids = ([tokenizer.token_to_id("<mask>")] + tokenizer.encode("Hello there") + [tokenizer.token_to_id("<|image>")]
           + tokenizer.encode("<|channel>thought\nhm<channel|>done"))
    text = tokenizer.decode(ids, hide=hidden)
    assert text == "Hello there<|channel>thought\nhm<channel|>done"
    assert "<mask>" in tokenizer.decode(ids)  # without `hide`, as the debug commands and the prompt side see it
    stream = tokenizer.stream_decoder(hide=hidden)
    assert "".join(stream.feed([i]) for i in ids) + stream.flush() == text


def test_answers_through_the_server_hold_no_hidden_control_token(tmp_path, gguf_path, tokenizer):
    """A random-weight model writes control tokens at random: none reaches a client as text."""
    hidden = hidden_control_ids(tokenizer)
    hidden_text = [tokenizer.tokens[i] for i in hidden]
    gguf = gguf_path("tiny-a", "f32")
    written = 0  # hidden tokens the model wrote, seen in the answers' ids: the check below is not vacuous
    with ServeProcess(tmp_path / "models", {"DGEMMA_NOPRUNE": "1"}) as server, \
            httpx.Client(base_url=server.url, timeout=300) as http:
        import hashlib

        data = gguf.read_bytes()
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        http.post(f"/api/blobs/{digest}", content=data).raise_for_status()
        http.post("/api/create", json={"model": "tiny", "files": {"a.gguf": digest}, "stream": False}
                  ).raise_for_status()
        for seed in range(12):
            body = {"model": "tiny", "prompt": "Hi", "stream": False,
                    "options": {"seed": seed, "num_predict": 48, "diffusion_steps": 2}}
            answer = http.post("/api/generate", json=body).json()
            prompt_length = answer["prompt_eval_count"]
            written += sum(1 for t in answer["context"][prompt_length:] if t in hidden)
            assert not [t for t in hidden_text if t in answer["response"]], answer["response"]
    assert written > 0


def test_a_hidden_token_still_separates_the_bytes_around_it(tokenizer):
    """Left out, a control token between byte tokens must not join them into other characters: the text is what it
    was with the token written, less the token."""
    hidden = hidden_control_ids(tokenizer)
    byte = {t: i for i, t in enumerate(tokenizer.tokens) if t.startswith("<0x") and t.endswith(">")}
    image = tokenizer.token_to_id("<|image>")
    ids = [byte["<0xE2>"], image, byte["<0x08>"]]
    assert tokenizer.decode(ids, hide=hidden) == tokenizer.decode(ids).replace("<|image>", "")
