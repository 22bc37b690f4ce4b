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
if [ "${MEDVQA_NO_LLAMA:-0}" != 1 ] && ! python -c "import llama_cpp" 2>/dev/null; then
  echo "Installing llama-cpp-python: it compiles llama.cpp, about 15 minutes on 2 cores the first time"
  python -m pip install --progress-bar off -r requirements-llama.txt | grep -v "^Requirement already satisfied" || {
    echo "llama-cpp-python did not install; the transformers engine will be used." >&2; }
fi
echo "Installed into .venv"
