#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: unit, integration (vLLM's parser) and e2e (a real
# vLLM server on the demo model, real Redis). Extra arguments go to pytest.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/setup.sh"
cd "$root"
exec .venv/bin/python -m pytest "$@"
