"""What an A/B trains on: a built-in shape or the user's model directory, the demo rows or the
user's data file; and the fingerprints that name them in the record.

``ab --model DIR`` loads real weights (every arm the same file, so the same weights) with the
directory's tokenizer and chat template; ``ab --data FILE`` reads any file ``slipstream train``
reads, the same way (``--response-only``, ``--max-seq-len``, ``--overflow``). A preset keeps
its seeded random weights and the demo tokenizer; the demo rows stay the default data.
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

from ..data.chat import read_chat_template
from ..data.samples import hash_path
from ..models import model_names, preset_vocab_size

# Weights up to this size are hashed whole; above it, each weight file's size, its safetensors
# header and evenly spaced samples of its bytes (a 70B checkpoint would take minutes to hash).
FULL_HASH_BYTES = 4 * 2**30
SAMPLES_PER_FILE = 64
SAMPLE_BYTES = 1 << 20


class ABInputError(ValueError):
    """The model or data an A/B was pointed at cannot be used (a one-line error naming it)."""


def is_model_dir(model: str) -> bool:
    """``ab --model`` names a local directory (real weights) rather than a built-in shape."""
    return model not in model_names() and Path(model).is_dir()


def check_model(model: str) -> None:
    """A preset name, or a directory save_pretrained wrote; ValueError naming it otherwise."""
    if model in model_names():
        return
    path = Path(model)
    if not path.exists():
        raise ValueError(
            f"model {model!r}: neither a built-in shape ({', '.join(model_names())}) nor a directory "
            "(models are read from disk, never downloaded)"
        )
    if not path.is_dir():
        raise ValueError(f"model {model}: is a file; give the directory save_pretrained wrote")
    if not (path / "config.json").exists():
        raise ValueError(f"model {model}: not a model directory (no config.json)")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise ValueError(f"model {model}: no weights (*.safetensors or *.bin) in the directory")


def ab_tokenizer(config):
    """``slipstream train``'s tokenizer of the run (``train/inputs.load_tokenizer``): the model
    directory's own (and chat template), or the demo tokenizer for a preset; with
    ``data.chat_template``'s template in place of its own where one is given. ABInputError naming
    what cannot be used."""
    from ..errors import TrainError
    from ..train.inputs import load_tokenizer

    try:
        return load_tokenizer(config.train)
    except TrainError as error:
        raise ABInputError(str(error)) from None


def read_chat_template_option(source: str) -> str:
    """The template ``--chat-template`` names; ABInputError naming the option when it cannot be used."""
    try:
        return read_chat_template(source)
    except ValueError as error:
        raise ABInputError(f"chat_template {error}") from None


def vocab_size(config, tokenizer) -> int:
    """The embedding rows the arms' model has: the directory's config, a preset's real vocabulary,
    or a tiny model's tokenizer."""
    if is_model_dir(config.model):
        from transformers import AutoConfig

        model_config = AutoConfig.from_pretrained(config.model, local_files_only=True)
        return int(model_config.get_text_config().vocab_size)
    return preset_vocab_size(config.model) or len(tokenizer)


@contextlib.contextmanager
def quiet_progress_bars():
    """No transformers progress bar ("Loading weights", "Writing model shards") per arm inside ab's own."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def _sampled_digest(files: list[Path]) -> str:
    """SHA-256 over each file's name, size, safetensors header and evenly spaced 1 MiB samples."""
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        with open(file, "rb") as stream:
            if file.suffix == ".safetensors":  # the header: every tensor's name, dtype, shape, offsets
                header_length = int.from_bytes(stream.read(8), "little")
                digest.update(stream.read(min(header_length, 100 << 20)))
            for index in range(SAMPLES_PER_FILE):
                stream.seek(index * max(size - SAMPLE_BYTES, 0) // max(SAMPLES_PER_FILE - 1, 1))
                digest.update(stream.read(SAMPLE_BYTES))
    return digest.hexdigest()


def model_fingerprint(model: str) -> dict:
    """What names the model in a record: a preset's name, or a directory's path and a hash of its
    config and weights (whole up to FULL_HASH_BYTES, sampled above)."""
    if not is_model_dir(model):
        return {"kind": "preset", "name": model}
    path = Path(model)
    weights = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
    total = sum(p.stat().st_size for p in weights)
    digest = hashlib.sha256((path / "config.json").read_bytes())
    if total <= FULL_HASH_BYTES:
        for file in weights:
            digest.update(file.name.encode() + b"\0" + hash_path(file)[0].encode())
        method = "config.json and every weight byte"
    else:
        digest.update(_sampled_digest(weights).encode())
        method = (
            f"config.json, each weight file's size and header, {SAMPLES_PER_FILE} x 1 MiB samples per file"
        )
    return {
        "kind": "model directory",
        "path": str(path.resolve()),
        "sha256": digest.hexdigest(),
        "weight_bytes": total,
        "hashed": method,
    }


def data_fingerprint(config) -> dict:
    """What names the data in a record: the demo rows (count, seed), or the file's path and SHA-256;
    with the SHA-256 of the chat template it was rendered with where ``chat_template`` replaced the
    tokenizer's."""
    if config.train.data.path is None:
        fingerprint = {"kind": "demo", "rows": config.train.data.demo_rows, "seed": config.train.seed}
    else:
        sha, size = hash_path(config.train.data.path)
        fingerprint = {
            "kind": "data file",
            "path": str(Path(config.train.data.path).resolve()),
            "sha256": sha,
            "bytes": size,
        }
    if config.train.data.chat_template is not None:
        template = read_chat_template_option(config.train.data.chat_template)
        fingerprint["chat_template_sha256"] = hashlib.sha256(template.encode()).hexdigest()
    return fingerprint


def inputs_record(config) -> dict:
    """The record's ``inputs``: the model and the data, each with its fingerprint."""
    return {"model": model_fingerprint(config.model), "data": data_fingerprint(config)}


def short_name(fingerprint: dict) -> str:
    """'SmolLM2-135M@1a2b3c4d' for a directory or file, the preset's name, or 'demo rows'."""
    if fingerprint["kind"] == "preset":
        return fingerprint["name"]
    if fingerprint["kind"] == "demo":
        return "demo rows"
    return f"{Path(fingerprint['path']).name}@{fingerprint['sha256'][:8]}"
