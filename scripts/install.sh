#!/usr/bin/env bash
# Create .venv (if needed) and install MedVQA's requirements into it.
#   scripts/install.sh          the app
#   scripts/install.sh --dev    the app and what the tests need (pytest, Playwright, Debian's chromium)
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
  if ! command -v chromium >/dev/null 2>&1; then
    echo "Installing Debian's chromium for the browser tests"
    if [ "$(id -u)" = 0 ]; then APT=apt-get; else APT="sudo apt-get"; fi
    $APT update -qq && DEBIAN_FRONTEND=noninteractive $APT install -y -qq chromium >/dev/null
  fi
else
  python -m pip install --quiet -r requirements.txt
fi
python -m pip install --quiet --no-deps -r requirements-nodeps.txt
echo "Installed into .venv"
