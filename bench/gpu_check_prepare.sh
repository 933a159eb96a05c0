#!/usr/bin/env bash
# Make the inputs bench/gpu_check.sh carries to a lent GPU machine, which reaches no network: .gpu/ (git-ignored
# through .git/info/exclude), named in the device tool's `carry`. Run here, from the repo root, with PyPI reachable.
#   .gpu/ggml.tar.xz  ggml as llama-cpp-python 0.3.36 vendors it (2.2 MB; the whole sdist is 73 MB, over the 64 MiB a
#                     call carries): the GPU build of the ggml dgemma compiles against
#   .gpu/peer.tar.xz  llama.cpp PR #24423 at c3fb9724 (its own, older ggml) without models, docs and tests
#   .gpu/whl/         the Python packages the machine's image lacks (Python 3.12 there)
# Usage: bash bench/gpu_check_prepare.sh PEER_MIRROR_GIT_DIR     (the `fetch` of unslothai/llama.cpp)
set -euo pipefail
mirror=$1
commit=${PEER_COMMIT:-c3fb97241295c196e09b783e705e84b96cd1bd74}
cd "$(dirname "$0")/.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu/whl
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

python3 -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$tmp"
tar xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp"
tar cJf .gpu/ggml.tar.xz -C "$tmp"/llama_cpp_python-0.3.36/vendor/llama.cpp ggml

# the peer's tree, blob by blob (the mirror lacks some large model files: skipped, as build_peer.sh does)
git -C "$mirror" ls-tree -r "$commit" | python3 -c '
import os, subprocess, sys
mirror, out = sys.argv[1], sys.argv[2]
skip = ("models/", "docs/", "media/", "gguf-py/", "app/", ".github/", "benches/", "tests/")
cat = subprocess.Popen(["git", "-C", mirror, "cat-file", "--batch"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
for line in sys.stdin:
    meta, path = line.rstrip("\n").split("\t", 1)
    mode, kind, sha = meta.split()
    if kind != "blob" or path.startswith(skip):
        continue
    cat.stdin.write((sha + "\n").encode()); cat.stdin.flush()
    head = cat.stdout.readline().split()
    if head[1] == b"missing":
        continue
    data = cat.stdout.read(int(head[2])); cat.stdout.read(1)
    dst = os.path.join(out, path); os.makedirs(os.path.dirname(dst), exist_ok=True)
    if mode == "120000":
        os.symlink(data.decode(), dst)
    else:
        open(dst, "wb").write(data)
        os.chmod(dst, 0o755 if mode == "100755" else 0o644)
' "$mirror" "$tmp/peer"
mkdir -p "$tmp/peer/tests" && echo "" > "$tmp/peer/tests/CMakeLists.txt"  # LLAMA_BUILD_TESTS is off; the folder must exist
tar cJf .gpu/peer.tar.xz -C "$tmp" peer

# the CLI (`debug generate`) imports pydantic, the converter gguf; the image has numpy, typer, rich, tokenizers, ...
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 -d .gpu/whl gguf==0.19.0 pydantic==2.14.4 pydantic-core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5
du -sh .gpu .gpu/*
