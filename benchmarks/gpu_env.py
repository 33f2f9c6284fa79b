"""The GPU check's first step: the versions it runs on, and one line naming what is missing.

Exit 0 when everything slipstream imports is there (the optional extras are listed, and the checks
that need them are skipped with the reason later); exit 1 with one line otherwise.
    python benchmarks/gpu_env.py
"""

from __future__ import annotations

import importlib
import sys

# what slipstream itself imports (pyproject's dependencies that a bare machine may lack)
REQUIRED = {
    "torch": "torch",
    "transformers": "transformers",
    "peft": "peft",
    "accelerate": "accelerate",
    "tokenizers": "tokenizers",
    "safetensors": "safetensors",
    "yaml": "pyyaml",
    "rich": "rich",
    "tqdm": "tqdm",
    "numpy": "numpy",
    "jinja2": "jinja2",
    "matplotlib": "matplotlib",
}
# extras: a check that needs one is skipped, named, where it is missing
OPTIONAL = {
    "trl": "trl",
    "datasets": "datasets",
    "bitsandbytes": "bitsandbytes",
    "liger_kernel": "liger-kernel",
}


def version(module: str) -> str | None:
    try:
        imported = importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 - an extra that fails to import is as good as missing
        return None if isinstance(error, ModuleNotFoundError) else f"does not import ({type(error).__name__})"
    return str(getattr(imported, "__version__", "unknown version"))


def main() -> int:
    print(f"python {sys.version.split()[0]}")
    missing = []
    for module, package in {**REQUIRED, **OPTIONAL}.items():
        found = version(module)
        print(f"{package}: {found or 'not installed'}")
        if module in REQUIRED and (found is None or found.startswith("does not import")):
            missing.append(package)
    import torch

    print(
        f"cuda: {torch.cuda.is_available()} ({torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-'})"
    )
    if missing:
        print(
            f"gpu_check: missing {', '.join(missing)}: bring the wheels (bash benchmarks/gpu_wheels.sh, carry .whl)"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
