#!/usr/bin/env bash
# Build llama.cpp's own `llama-bench` from the sources of the llama-cpp-python version the app runs,
# so scripts/bench_latency.py can compare our llama.cpp engine with llama.cpp's benchmark on the same
# GGUF, machine and library version (issue 7: decode >= 85 % of llama-bench).
#
#     scripts/build_llama_bench.sh            # -> .cache/llama-bench/llama-bench
#     JOBS=1 scripts/build_llama_bench.sh     # leave a core free (about 15 min on 2 cores otherwise)
#
# Same default flags as pip's build of the wheel (Release, GGML_NATIVE); no network at run time.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
OUT="$ROOT/.cache/llama-bench"
JOBS="${JOBS:-$(nproc)}"

VERSION="$("$PYTHON" -c 'import llama_cpp; print(llama_cpp.__version__)')" || {
    echo "llama-cpp-python is not installed in $PYTHON; run scripts/install.sh first." >&2; exit 1; }
if [[ -x "$OUT/llama-bench" && "$(cat "$OUT/VERSION" 2>/dev/null)" == "$VERSION" ]]; then
    echo "llama-bench for llama-cpp-python $VERSION already built: $OUT/llama-bench"; exit 0
fi

WORK="$OUT/src"
rm -rf "$WORK" && mkdir -p "$WORK"
echo "== fetching the llama-cpp-python $VERSION source distribution"
"$PYTHON" -m pip download "llama-cpp-python==$VERSION" --no-binary :all: --no-deps -q -d "$WORK"
tar xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"

echo "== configuring llama.cpp (llama-bench only)"
cmake -S "$SRC" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >/dev/null
echo "== compiling with $JOBS job(s)"
cmake --build "$WORK/build" --target llama-bench -j "$JOBS"
cp "$WORK/build/bin/llama-bench" "$OUT/llama-bench"
echo "$VERSION" > "$OUT/VERSION"
rm -rf "$WORK"
echo "built $OUT/llama-bench (llama-cpp-python $VERSION)"
