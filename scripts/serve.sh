#!/usr/bin/env bash
# Set up (idempotent) and start the server: the demo model on CPU when no GPU/--model is given.
# Arguments go to `python -m qwen_vllm_ext.serve` (and from there to vLLM).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/setup.sh"
exec "$root/.venv/bin/python" -m qwen_vllm_ext.serve "$@"
