#!/usr/bin/env bash
# Install (first time) and start the MedVQA web app on the `offline` profile.
# Arguments go to app.py, e.g. ./start.sh --port 7861 or ./start.sh --profile llava-med
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/install.sh
exec .venv/bin/python app.py "$@"
