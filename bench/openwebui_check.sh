#!/usr/bin/env bash
# Open WebUI against `dgemma serve`, end to end, with default settings (not in CI: Open WebUI is a multi-GB install).
#
#   bash bench/openwebui_check.sh            # screenshots and results.json in ~/.cache/dgemma-openwebui/screenshots
#
# 1. installs Open WebUI (and Playwright) in its own venv outside the repo, and Debian's chromium when missing
#    (Playwright's own browser download is not used);
# 2. starts `dgemma serve` (access log on) on a fresh store with the bundled `sudoku` model, `tiny-tools`, the
#    random-weight test fixture tiny-a, whose Gemma-4-style template declares tools, and `tiny-vision`, the fixture
#    tiny-v with its vision projector;
# 3. starts Open WebUI pointed at it (OLLAMA_BASE_URL, WEBUI_AUTH=False, offline: no model downloads, no update
#    check, no telemetry);
# 4. bench/openwebui_driver.py sends one chat to each model through the browser (to tiny-vision with an uploaded
#    image) and reads the stored chat back (answer, title, tags, follow-ups, images);
# 5. checks dgemma's access log: every request Open WebUI made (chat, title, tags, follow-ups) answered 200.
#
# Environment: OPENWEBUI_WORK (work folder), OPENWEBUI_VERSION (0.12.4), DGEMMA_PYTHON (the repo's .venv python),
# CHROMIUM (browser path), DGEMMA_PORT (11535), WEBUI_PORT (8080), OUT (screenshot folder).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${DGEMMA_PYTHON:-$REPO/.venv/bin/python}
WORK=${OPENWEBUI_WORK:-$HOME/.cache/dgemma-openwebui}
VENV=$WORK/venv
VERSION=${OPENWEBUI_VERSION:-0.12.4}
DGEMMA_PORT=${DGEMMA_PORT:-11535}
WEBUI_PORT=${WEBUI_PORT:-8080}
OUT=${OUT:-$WORK/screenshots}
SUDOKU_PUZZLE=530070000600195000098000060800060003400803001700020006060000280000419005000080079
DGEMMA="$PY -m dgemma_cli.main"
mkdir -p "$WORK"

say() { printf '\n== %s\n' "$*"; }

wait_for() {  # URL SECONDS LOG
    local deadline=$((SECONDS + $2))
    until curl -fs -o /dev/null "$1"; do
        if ((SECONDS > deadline)); then
            echo "timed out waiting for $1; last lines of $3:" >&2
            tail -n 40 "$3" >&2
            return 1
        fi
        sleep 1
    done
}

# ---- 1. installs ------------------------------------------------------------------------------------------------------
installed() { "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('open-webui') == '$VERSION'"; }
if [ ! -x "$VENV/bin/open-webui" ] || ! installed 2>/dev/null; then
    say "installing open-webui==$VERSION and playwright into $VENV (several GB, several minutes)"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q "open-webui==$VERSION" playwright
fi
CHROMIUM=${CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}
if [ -z "$CHROMIUM" ]; then
    say "installing Debian's chromium"
    apt-get update -q && apt-get install -y -q chromium
    CHROMIUM=$(command -v chromium)
fi

# ---- 2. dgemma serve with two models ------------------------------------------------------------------------------------
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
}
trap cleanup EXIT INT TERM

rm -rf "$WORK/models" "$WORK/webui-data" "$OUT"
mkdir -p "$OUT"
export DGEMMA_HOST=127.0.0.1:$DGEMMA_PORT
say "dgemma serve on $DGEMMA_HOST (log: $WORK/dgemma.log)"
DGEMMA_MODELS="$WORK/models" DGEMMA_DEBUG=1 DGEMMA_NOPRUNE=1 $DGEMMA serve >"$WORK/dgemma.log" 2>&1 &
PIDS+=($!)
wait_for "http://$DGEMMA_HOST/" 60 "$WORK/dgemma.log"

if [ ! -s "$WORK/tiny-a.gguf" ]; then
    $DGEMMA convert "$REPO/tests/fixtures/tiny-a" -o "$WORK/tiny-a.gguf" --outtype f32 >/dev/null
fi
printf 'FROM %s\nPARAMETER diffusion_steps 4\n' "$WORK/tiny-a.gguf" >"$WORK/tiny-tools.Modelfile"
$DGEMMA create tiny-tools -f "$WORK/tiny-tools.Modelfile" 2>/dev/null
# a vision model: the tiny-v checkpoint, text model and projector converted by `create`
printf 'FROM %s\nPARAMETER diffusion_steps 4\n' "$REPO/tests/fixtures/tiny-v" >"$WORK/tiny-vision.Modelfile"
$DGEMMA create tiny-vision -f "$WORK/tiny-vision.Modelfile" 2>/dev/null
$DGEMMA show sudoku >/dev/null  # the bundled model registers itself on first use
$DGEMMA list

# ---- 3. Open WebUI ----------------------------------------------------------------------------------------------------
say "Open WebUI $VERSION on 127.0.0.1:$WEBUI_PORT (log: $WORK/webui.log)"
(
    cd "$WORK"
    exec env DATA_DIR="$WORK/webui-data" WEBUI_AUTH=False WEBUI_SECRET_KEY=dgemma-check \
        OLLAMA_BASE_URL="http://$DGEMMA_HOST" ENABLE_OPENAI_API=False \
        OFFLINE_MODE=True HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAG_EMBEDDING_MODEL_AUTO_UPDATE=False \
        ANONYMIZED_TELEMETRY=False DO_NOT_TRACK=True SCARF_NO_ANALYTICS=True \
        "$VENV/bin/open-webui" serve --host 127.0.0.1 --port "$WEBUI_PORT"
) >"$WORK/webui.log" 2>&1 &
PIDS+=($!)
wait_for "http://127.0.0.1:$WEBUI_PORT/health" 600 "$WORK/webui.log"

# ---- 4. the browser -----------------------------------------------------------------------------------------------------
say "chatting through headless Chromium ($CHROMIUM); screenshots in $OUT"
status=0
"$VENV/bin/python" "$REPO/bench/openwebui_driver.py" --webui "http://127.0.0.1:$WEBUI_PORT" --out "$OUT" \
    --chromium "$CHROMIUM" --chat "sudoku:latest=$SUDOKU_PUZZLE" \
    --chat "tiny-tools:latest=What is the weather in Paris?" \
    --chat "tiny-vision:latest=What is in this picture?" \
    --image "tiny-vision:latest=$REPO/tests/fixtures/tiny-v/images/square.png" || status=1

# ---- 5. what the server saw -------------------------------------------------------------------------------------------
say "dgemma access log: inference requests by status"
grep -oE '"POST /(api/(chat|generate)|v1/[a-z/]+) HTTP/1.1" [0-9]{3}' "$WORK/dgemma.log" | sort | uniq -c || true
if grep -E '"POST /(api/(chat|generate)|v1/[a-z/]+) HTTP/1.1" [45][0-9]{2}' "$WORK/dgemma.log"; then
    echo "FAIL: dgemma refused or failed some of Open WebUI's requests (above)" >&2
    status=1
fi
grep -E "truncating the prompt|ignoring the [0-9]+ tool" "$WORK/dgemma.log" | cut -c1-200 || true
say "Open WebUI errors about tasks (title, tags, follow-ups), if any"
grep -E "\| (ERROR|WARNING) " "$WORK/webui.log" | grep -iE "task|title|tags|follow" | head -n 20 || true
[ "$status" -eq 0 ] && say "OK" || say "FAILED (see above and $OUT)"
exit "$status"
