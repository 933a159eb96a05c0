#!/usr/bin/env bash
# The one prepared check for a lent NVIDIA GPU (an H200, sm_90), meant to fit one 10-minute call:
#   1. ggml as llama-cpp-python 0.3.36 vendors it, built with CUDA for sm_90 and RPC, and a `llama_cpp`-shaped folder
#      holding it, so dgemma's setup.py compiles against it; the peer (llama.cpp PR #24423, its own ggml) built with
#      CUDA at the same time;
#   2. the fixtures' parity per placement on the GPU (every unit, 2 units, every unit with the experts on the CPU):
#      max |Δlogits| against transformers' goldens and `--rng torch` token exactness (tests/device_check.py);
#   3. a step of the released geometry (GPU_CHECK_LAYERS layers, random GPU_CHECK_OUTTYPE weights written straight to
#      GGUF by bench/random_gguf.py) for dgemma and the peer in the same run (bench/vs_peer.py, every layer on the GPU).
# Inputs: .gpu/ from bench/gpu_check_prepare.sh (carried: the machine reaches no network).
#   device:     run(command="bash bench/gpu_check.sh", carry=[".gpu"], timeout_s=600)
#   rehearsal:  GPU_CHECK_CPU=1 GPU_CHECK_LAYERS=2 GPU_CHECK_PEER=0 GPU_CHECK_WHEELS=0 bash bench/gpu_check.sh
#               (in a clone, in the project's virtual environment: ggml built for the CPU, no peer)
# Output: $OUT/gpu_check.log, $OUT/parity.json, $OUT/step.json.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
OUT=${OUT:-/tmp/gpu-check-out}
work=${GPU_CHECK_WORK:-/tmp/gpu-check}
cpu=${GPU_CHECK_CPU:-0}
layers=${GPU_CHECK_LAYERS:-30}
outtype=${GPU_CHECK_OUTTYPE:-q4_k_m}
with_peer=${GPU_CHECK_PEER:-1}
mkdir -p "$OUT" "$work"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
stamp() { echo "[$(date +%T)] $*"; }
cuda=ON; [ "$cpu" = 1 ] && cuda=OFF
stamp "start: $(nproc) cores, CUDA $cuda, $layers layers $outtype, peer $with_peer"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

# ---- 1. builds ------------------------------------------------------------------------------------------------------
site=$work/site
mkdir -p "$site/llama_cpp/lib" "$site/include"
if [ "${GPU_CHECK_WHEELS:-1}" = 1 ] && compgen -G ".gpu/whl/*.whl" >/dev/null; then  # built for the image's Python 3.12
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .gpu/whl/*.whl
fi
tar xJf .gpu/ggml.tar.xz -C "$work"
touch "$work/ggml/ggml.pc.in"  # the vendored copy lacks the pkg-config template a standalone build configures
cmake -S "$work/ggml" -B "$work/ggml-build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF \
    -DGGML_CUDA=$cuda -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_RPC=ON -DGGML_NATIVE=ON >/dev/null
peer_bin=${PEER_BIN:-}
if [ "$with_peer" = 1 ] && [ -z "$peer_bin" ]; then
    tar xJf .gpu/peer.tar.xz -C "$work"
    cmake -S "$work/peer" -B "$work/peer-build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=$cuda \
        -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_BUILD_EXAMPLES=ON -DGGML_NATIVE=ON >/dev/null
    # both builds at once: they are mostly CUDA kernels, which compile file by file on all cores
    cmake --build "$work/peer-build" -j"$(nproc)" --target llama-diffusion-cli >"$work/peer-build.log" 2>&1 &
    peer_build=$!
    peer_bin=$work/peer-build/bin/llama-diffusion-cli
fi
cmake --build "$work/ggml-build" -j"$(nproc)" >"$work/ggml-build.log" 2>&1 || { tail -30 "$work/ggml-build.log"; exit 1; }
stamp "ggml built"
cp "$work"/ggml/include/*.h "$site/include/"
find "$work/ggml-build" -name 'libggml*.so*' -exec cp -P {} "$site/llama_cpp/lib/" \;
cat > "$site/llama_cpp/__init__.py" <<'PY'
"""Stands in for llama_cpp on the GPU machine: dgemma needs only its ggml, made resident once per process."""
import ctypes
import os

_LIB = os.path.join(os.path.dirname(__file__), "lib")
for _name in ("libggml-base.so", "libggml-cpu.so", "libggml-cuda.so", "libggml-rpc.so", "libggml.so"):
    if os.path.exists(os.path.join(_LIB, _name)):
        ctypes.CDLL(os.path.join(_LIB, _name), mode=ctypes.RTLD_GLOBAL)
PY
shim=$work/shim
mkdir -p "$shim"
ln -sfn "$repo/ggml_ext" "$shim/dgemma_engine"
ln -sfn "$repo/convert" "$shim/dgemma_convert"
ln -sfn "$repo/dgemma_cli" "$shim/dgemma_cli"
ln -sfn "$repo/modelfiles" "$shim/dgemma_modelfiles"
export PYTHONPATH="$site:$shim:$repo${PYTHONPATH:+:$PYTHONPATH}"
python3 setup.py -q build_ext --inplace >"$work/dgemma-build.log" 2>&1 || { tail -30 "$work/dgemma-build.log"; exit 1; }
python3 -c "from dgemma_engine.devices import list_devices; print('devices:', [(d.name, d.description) for d in list_devices()])"
stamp "dgemma built"

# ---- 2. parity per placement ----------------------------------------------------------------------------------------
python3 - "$work/fixtures" <<'PY'
import sys
from pathlib import Path
from dgemma_convert import convert
out = Path(sys.argv[1]); out.mkdir(exist_ok=True)
for name in ("tiny-a", "tiny-b"):
    if not (out / f"{name}.gguf").exists():
        convert(Path("tests/fixtures") / name, out / f"{name}.gguf", "f32")
PY
python3 - "$work/fixtures" >"$work/parity-request.json" <<'PY'
import json, sys
sys.path.insert(0, "tests")
from test_engine_devices import FREE_RUNNING
fx = sys.argv[1]
print(json.dumps({"ggufs": {n: f"{fx}/{n}.gguf" for n in ("tiny-a", "tiny-b")}, "free_running": FREE_RUNNING,
                  "placements": [{"num_gpu": None}, {"num_gpu": 2}, {"num_gpu": None, "num_cpu_moe": -1}]}))
PY
python3 tests/device_check.py <"$work/parity-request.json" >"$OUT/parity.json"
python3 - "$OUT/parity.json" <<'PY'
import json, sys
sys.path.insert(0, "tests")
from test_generate_free_running import golden
for placement in json.load(open(sys.argv[1])):
    for name, f in placement["fixtures"].items():
        exact = [run for run, out in f["runs"].items() if out["sequence"] == golden(name, run)[2]["seq"].tolist()]
        print(f"{json.dumps(placement['placement'])} {name}: {f['describe']}; max |Δlogits| vs transformers "
              f"{f['max_vs_transformers']:.2e}, vs the CPU fast path {f.get('max_vs_fast_path', float('nan')):.2e}; "
              f"--rng torch token-exact {len(exact)}/{len(f['runs'])}")
PY
stamp "parity done"

# ---- 3. the released geometry's step, dgemma and the peer ------------------------------------------------------------
python3 bench/random_gguf.py "$work/released-$layers-$outtype.gguf" --layers "$layers" --outtype "$outtype"
stamp "random GGUF written"
if [ -n "$peer_bin" ]; then
    [ -n "${peer_build:-}" ] && { wait "$peer_build" || { tail -30 "$work/peer-build.log"; exit 1; }; }
    stamp "peer built"
    python3 bench/vs_peer.py "$peer_bin" "$work/released-$layers-$outtype.gguf" --reps 2 --threads "$(nproc)" \
        --peer-args "-ngl 99" --json "$OUT/step.json"
else
    python3 bench/vs_peer.py --no-peer "$work/released-$layers-$outtype.gguf" --reps 2 --threads "$(nproc)" \
        --json "$OUT/step.json"
fi
stamp "done"
