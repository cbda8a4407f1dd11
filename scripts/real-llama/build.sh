#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` (what llama-swap users run) and write the tiny test
# models for the end-to-end suite (e2e/, `make e2e`). Nothing is downloaded but packages from
# the package registries: the llama.cpp source is the one vendored in the llama-cpp-python
# source package (PyPI), the model generator needs `gguf` (PyPI), the build tools come from
# Debian (apt) when missing. Idempotent: a finished build and up-to-date models are reused
# (about 1 s); the first build takes about 10 minutes on 2 cores.
#
#   scripts/real-llama/build.sh            # from anywhere
#
# Prints on its last two lines (the e2e suite reads the same paths from the environment):
#   LLAMASWAP_E2E_LLAMA_SERVER=<path of the llama-server binary>
#   LLAMASWAP_E2E_MODELS=<directory holding tiny-a.gguf and tiny-b.gguf>
#
# Environment overrides:
#   LLAMASWAP_E2E_CACHE        default ~/.cache/llamaswap-e2e (outside the repository)
#   LLAMA_CPP_PYTHON_VERSION   default 0.3.36 (its vendored llama.cpp is what gets built)
#   GGUF_VERSION               default 0.19.0
#   LLAMA_BUILD_JOBS           default $(nproc)
#   PYTHON                     default python3 (creates the small venv holding gguf)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${LLAMASWAP_E2E_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llamaswap-e2e}"
VER="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
GGUF_VERSION="${GGUF_VERSION:-0.19.0}"
JOBS="${LLAMA_BUILD_JOBS:-$(nproc)}"
PYTHON="${PYTHON:-python3}"
SRC="$CACHE/src"
BUILD="$CACHE/build-$VER"              # one build per llama-cpp-python version
BIN="$BUILD/bin/llama-server"          # linked statically: can be copied anywhere
GVENV="$CACHE/gguf-venv"
MODELS="$CACHE/models"
LOG="$CACHE/llama-server-build-$VER.log"
log() { echo "[real-llama] $*" >&2; }
mkdir -p "$CACHE" "$MODELS"

# 0. build tools (present on the stock image; from Debian when missing)
missing=()
for tool in cmake g++ ninja; do command -v "$tool" >/dev/null 2>&1 || missing+=("$tool"); done
if [ "${#missing[@]}" -gt 0 ]; then
    log "missing build tools: ${missing[*]} -> apt-get install cmake g++ ninja-build"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake g++ ninja-build >/dev/null
fi

# 1. the tiny models, from a small venv with gguf (pure Python + numpy; seconds).
#    Two different models (different seeds) so that a swap really loads other weights.
#    --n-ctx 8192: the model's own context bounds a reply whatever -c says, and the
#    priority test needs a long job.
if [ ! -x "$GVENV/bin/python" ]; then "$PYTHON" -m venv "$GVENV"; fi
if ! "$GVENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('gguf') != '$GGUF_VERSION')" 2>/dev/null; then
    log "installing gguf==$GGUF_VERSION into $GVENV"
    "$GVENV/bin/pip" install -q "gguf==$GGUF_VERSION"
fi
make_model() {  # name seed
    local out="$MODELS/$1.gguf"
    if [ ! -s "$out" ] || [ "$HERE/make_tiny_gguf.py" -nt "$out" ]; then
        log "generating $out"
        "$GVENV/bin/python" "$HERE/make_tiny_gguf.py" --out "$out.tmp" --seed "$2" --n-ctx 8192 \
            && mv -f "$out.tmp" "$out"
    fi
}
make_model tiny-a 1234
make_model tiny-b 4321

# 2. llama-server, from the sdist's vendored llama.cpp (~10 min on 2 cores the first time)
if [ ! -x "$BIN" ]; then
    tree="$SRC/llama_cpp_python-$VER/vendor/llama.cpp"
    if [ ! -f "$tree/CMakeLists.txt" ]; then
        log "fetching the llama-cpp-python $VER source package (for its vendored llama.cpp)"
        mkdir -p "$SRC"
        "$GVENV/bin/pip" download -q --no-deps --no-binary :all: -d "$SRC" "llama-cpp-python==$VER"
        rm -rf "$SRC/unpack" "$SRC/llama_cpp_python-$VER"   # an interrupted unpack starts over
        mkdir -p "$SRC/unpack"
        tar xzf "$SRC/llama_cpp_python-$VER.tar.gz" -C "$SRC/unpack"
        mv "$SRC/unpack/llama_cpp_python-$VER" "$SRC/" && rmdir "$SRC/unpack"
    fi
    log "building llama-server with $JOBS jobs (log: $LOG)"
    start=$(date +%s)
    cmake -S "$tree" -B "$BUILD" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF \
        -DGGML_NATIVE=OFF -DLLAMA_BUILD_UI=OFF -DBUILD_SHARED_LIBS=OFF >"$LOG" 2>&1 \
        || { tail -n 30 "$LOG" >&2; exit 1; }
    cmake --build "$BUILD" --target llama-server -j "$JOBS" >>"$LOG" 2>&1 \
        || { tail -n 30 "$LOG" >&2; exit 1; }
    log "llama-server built in $(( $(date +%s) - start ))s"
fi

echo "LLAMASWAP_E2E_LLAMA_SERVER=$BIN"
echo "LLAMASWAP_E2E_MODELS=$MODELS"
