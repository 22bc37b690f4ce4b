#!/usr/bin/env bash
# Install what the tests need (first time) and run the whole test suite.
# Arguments go to pytest, e.g. ./test.sh -m browser
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/install.sh --dev
exec .venv/bin/python -m pytest -q "$@"
