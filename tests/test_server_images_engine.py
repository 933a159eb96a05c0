"""Images end to end through the real engine (after the merge of the vision engine, the image prefill and the API):
a model created `FROM` the tiny-v checkpoint (text model and projector converted), served with the real runner, answers
an image on `/api/generate`, `/api/chat` and `/v1/chat/completions`, and the image changes the answer."""
from __future__ import annotations

import base64
from pathlib import Path

import ollama
import openai

from dgemma_cli.create import create_model
from dgemma_cli.modelfile import parse_modelfile
from dgemma_cli.server.config import ServerConfig
from dgemma_cli.store import Store
from server_harness import InProcessServer

TINY_V = Path(__file__).parent / "fixtures" / "tiny-v"
OPTIONS = {"diffusion_steps": 4, "seed": 1, "num_predict": 16}


def test_an_image_reaches_the_model_on_every_api(tmp_path):
    store = Store(tmp_path / "store")
    list(create_model("tiny-v", parse_modelfile(f"FROM {TINY_V}\n"), store, tmp_path))
    png = (TINY_V / "images" / "square.png").read_bytes()
    config = ServerConfig.from_env({"DGEMMA_MODELS": str(store.root), "DGEMMA_NOPRUNE": "1"})
    with InProcessServer(config, store, None) as server:
        client = ollama.Client(host=server.url)
        assert "vision" in client.show("tiny-v").capabilities
        with_image = client.generate(model="tiny-v", prompt="what is this?", images=[png], options=OPTIONS)
        without = client.generate(model="tiny-v", prompt="what is this?", options=OPTIONS)
        assert with_image.done and without.done
        assert with_image.response != without.response  # the image changed what the model saw
        again = client.generate(model="tiny-v", prompt="what is this?", images=[png], options=OPTIONS)
        assert again.response == with_image.response  # seeded: the image path is deterministic
        chat = client.chat(model="tiny-v", options=OPTIONS,
                           messages=[{"role": "user", "content": "what is this?", "images": [png]}])
        assert chat.done and chat.message.content
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        answer = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x").chat.completions.create(
            model="tiny-v", max_tokens=16, seed=1, messages=[{"role": "user", "content": [
                {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}]}])
        assert answer.choices[0].message.content is not None
