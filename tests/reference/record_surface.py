"""Record dgemma's user-visible surface (CLI help, CLI errors, REST responses) into tests/goldens/surface.json.

    python tests/reference/record_surface.py

Run it on code whose surface is the intended one (it was first run before the module-map refactor); tests/test_surface.py
compares the current code against the file. It converts tests/fixtures/tiny-a itself, so it needs no torch.
"""
import json
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))

from surface_capture import FIXTURES, GOLDEN, capture  # noqa: E402


def main() -> None:
    from dgemma_convert import convert

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        gguf = work / "tiny-a-f32.gguf"
        convert(FIXTURES / "tiny-a", gguf, "f32", threads=2)
        (work / "run").mkdir()
        surface = capture(work / "run", gguf)
    GOLDEN.write_text(json.dumps(surface, indent=1, ensure_ascii=False, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN} ({sum(len(v) for v in surface.values())} entries)")


if __name__ == "__main__":
    main()
