#!/usr/bin/env bash
# Creates (or tops up) the virtualenv of the `unsloth` A/B arms: Unsloth 2026.10.9 and its CPU
# backend. Usage: make_unsloth_venv.sh [VENV] (default: $SLIPSTREAM_UNSLOTH_VENV, else
# ./.venv-unsloth). `slipstream ab` runs it on demand. Idempotent: a second run checks and changes nothing.
#
# Unsloth pins transformers <= 5.17 and trl <= 1.15, older than slipstream's, so it lives in a
# venv of its own. Every package is installed from unsloth-constraints.txt with --no-deps, so the
# resolver cannot pull torchvision (breaks `import unsloth` on a CPU torch) or a CUDA torch.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${1:-${SLIPSTREAM_UNSLOTH_VENV:-$PWD/.venv-unsloth}}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
# Quiet and quick when everything is already there.
"$venv/bin/pip" install --quiet --no-deps -r "$here/unsloth-constraints.txt" 2>&1 | grep -v "^WARNING: Location" || true

if "$venv/bin/pip" show --quiet torchvision >/dev/null 2>&1; then
    echo "make_unsloth_venv: torchvision is installed in $venv; remove it (pip uninstall torchvision)" >&2
    exit 1
fi
UNSLOTH_FORCE_CPU=1 HF_HUB_OFFLINE=1 "$venv/bin/python" - <<'EOF'
import unsloth  # first, as Unsloth asks
import peft, torch, transformers, trl, unsloth_zoo
assert unsloth.DEVICE_TYPE == "cpu", unsloth.DEVICE_TYPE
print(f"make_unsloth_venv: ok: unsloth {unsloth.__version__}, unsloth_zoo {unsloth_zoo.__version__}, "
      f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, peft {peft.__version__}")
EOF
