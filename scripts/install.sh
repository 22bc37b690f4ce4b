#!/usr/bin/env bash
# Create .venv (if needed) and install MedVQA's requirements into it.
#   scripts/install.sh          the app
#   scripts/install.sh --dev    the app and what the tests need (pytest, Playwright, Debian's chromium, and
#                               Debian's orthanc with its DICOMweb plugin: the PACS the tests start)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "Creating virtual environment in .venv"
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
if [ "${1:-}" = "--dev" ]; then
  python -m pip install --quiet -r requirements-dev.txt
  if [ "$(id -u)" = 0 ]; then APT=apt-get; else APT="sudo apt-get"; fi
  if ! command -v chromium >/dev/null 2>&1; then
    echo "Installing Debian's chromium for the browser tests"
    $APT update -qq && DEBIAN_FRONTEND=noninteractive $APT install -y -qq chromium >/dev/null
  fi
  if [ ! -x /usr/sbin/Orthanc ] || [ ! -f /usr/share/orthanc/plugins/libOrthancDicomWeb.so ]; then
    echo "Installing Debian's orthanc and orthanc-dicomweb for the PACS tests (the tests start their own)"
    $APT update -qq && DEBIAN_FRONTEND=noninteractive $APT install -y -qq orthanc orthanc-dicomweb >/dev/null
  fi
else
  python -m pip install --quiet -r requirements.txt
fi
python -m pip install --quiet --no-deps -r requirements-nodeps.txt
# MedVQA itself, editable (the `medvqa` command; scripts and tests import the installed package).
# (Quiet: setuptools warns about editable installs on every run; shown in full only if it fails.)
python -m pip install -qq --no-deps -e . >/dev/null 2>&1 || python -m pip install --no-deps -e .
# The llama.cpp decoder engine (the offline profile's fastest). Set MEDVQA_NO_LLAMA=1 to skip it;
# the transformers engine then serves alone.
# On x86-64 it is built for AVX2 (not -march=native): a native build on a CPU with AMX compiles
# llama.cpp's AMX kernels, which crash (SIGSEGV in ggml_backend_amx_mul_mat on every prompt of more than
# one token) where the kernel or sandbox has not enabled AMX tiles, as on this project's machines; and a
# native wheel carried to an older CPU fails there. The wheel is kept in .cache/wheels (pip's own cache
# does not tell builds with other flags apart). Set CMAKE_ARGS for another build (CUDA, Metal, native).
LLAMA_WHEELS=.cache/wheels/llama-portable
LLAMA_VERSION=$(sed -n "s/^llama-cpp-python==//p" requirements-llama.txt)
if [ "${MEDVQA_NO_LLAMA:-0}" != 1 ] && ! python -c "import llama_cpp" 2>/dev/null; then
  if [ -z "${CMAKE_ARGS:-}" ] && [ "$(uname -m)" = x86_64 ]; then
    export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
    if ! ls "$LLAMA_WHEELS"/llama_cpp_python-"$LLAMA_VERSION"-*.whl >/dev/null 2>&1; then
      echo "Building llama-cpp-python for AVX2: it compiles llama.cpp, about 15 minutes on 2 cores the first time"
      python -m pip wheel --progress-bar off --no-cache-dir --no-deps -w "$LLAMA_WHEELS" -r requirements-llama.txt \
        >/dev/null || echo "llama-cpp-python did not build." >&2
    fi
    LLAMA_SOURCE=$(ls "$LLAMA_WHEELS"/llama_cpp_python-"$LLAMA_VERSION"-*.whl 2>/dev/null | head -n 1 || true)
  else
    echo "Installing llama-cpp-python: it compiles llama.cpp, about 15 minutes on 2 cores the first time"
    LLAMA_SOURCE="-r requirements-llama.txt"
  fi
  # shellcheck disable=SC2086 # LLAMA_SOURCE is a wheel path or "-r file"
  if [ -n "${LLAMA_SOURCE:-}" ]; then python -m pip install --quiet --progress-bar off $LLAMA_SOURCE || true; fi
  python -c "import llama_cpp" 2>/dev/null || \
    echo "llama-cpp-python did not install; the transformers engine will be used." >&2
fi
echo "Installed into .venv"
