"""Optional extras: a feature that needs one says, in one line, which to install.

bitsandbytes -> pip install 'slipstream[qlora]'   (quantization.four_bit, 4-bit experts)
trl          -> pip install 'slipstream[trl]'     (the trl A/B arm, TRL's trainers)
liger_kernel -> pip install 'slipstream[liger]'   (fused_kernels: liger, the liger arm)
gguf         -> pip install gguf                  (reading a GGUF checkpoint)
datasets     -> pip install 'slipstream[datasets]' (a directory saved with datasets)
"""

from __future__ import annotations

import importlib
import importlib.util

EXTRAS = {
    "bitsandbytes": "pip install 'slipstream[qlora]'",
    "trl": "pip install 'slipstream[trl]'",
    "liger_kernel": "pip install 'slipstream[liger]'",
    "gguf": "pip install gguf",
    "datasets": "pip install 'slipstream[datasets]'",
}


class MissingExtra(ModuleNotFoundError):
    """An optional package a requested feature needs is not installed; the message says what to run."""


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def require(module: str, feature: str):
    """Import and return ``module`` (e.g. ``"bitsandbytes.functional"``), or raise :class:`MissingExtra`
    naming ``feature`` and the install command where its top-level package is missing."""
    top = module.split(".")[0]
    if not installed(top):
        raise MissingExtra(
            f"{feature} needs {top}, which is not installed: {EXTRAS.get(top, f'pip install {top}')}",
            name=top,
        )
    return importlib.import_module(module)
