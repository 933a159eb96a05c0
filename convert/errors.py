"""The converter's one user-facing error type: the CLI prints it as a single `Error: ...` line and exits 1."""
from dgemma_engine.errors import DgemmaError


class ConvertError(DgemmaError):
    """Bad or unsupported input (config, checkpoint, tokenizer) or an output that cannot be written."""
