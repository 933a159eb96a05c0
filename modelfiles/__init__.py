"""Ready Modelfile presets (and the bundled default model), shipped as package data."""
from pathlib import Path

PRESETS_DIR = Path(__file__).parent
