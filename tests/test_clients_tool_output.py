"""Clients whose typed output is a forced tool call, unchanged, against `dgemma serve` running the random-weight tiny
model: pydantic-ai's default tool output (an output tool it requires the model to call); instructor's TOOLS mode is
bench/clients/instructor_tools.py (its dependency pins clash with the openai client's). Without `tool_choice` the model's free text never is a call, so these clients
raised or retried until they gave up; the constrained decoder makes every answer a call that validates."""
import openai
import pytest
from pydantic import BaseModel, Field

from server_harness import ServeProcess


class Weather(BaseModel):  # no numeric bounds: structured output does not enforce them (docs/generation.md)
    city: str = Field(max_length=20)
    days: int


@pytest.fixture(scope="module")
def served(tmp_path_factory, gguf_path):
    import ollama

    root = tmp_path_factory.mktemp("tool-output")
    with ServeProcess(root / "models", {"DGEMMA_NOPRUNE": "1"}) as server:
        setup = ollama.Client(host=server.url)
        digest = setup.create_blob(gguf_path("tiny-a", "f32"))
        setup.create(model="tiny", files={"tiny-a.gguf": digest}, parameters={"diffusion_steps": 2})
        yield server


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_pydantic_ai_default_tool_output(served, api):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=served.url + "/v1", api_key="unused")
    model = (OpenAIChatModel if api == "chat" else OpenAIResponsesModel)("tiny", provider=provider)
    agent = Agent(model, output_type=Weather, retries=0)
    for seed in range(3):
        result = agent.run_sync("Weather in Paris for 3 days?", model_settings={"max_tokens": 64, "seed": seed})
        assert isinstance(result.output, Weather) and len(result.output.city) <= 20
