"""Model shapes: tiny test configs and random-initialised presets of real models."""

from .presets import PRESETS, TINY, build_config, build_model, model_names, preset_vocab_size

__all__ = ["PRESETS", "TINY", "build_config", "build_model", "model_names", "preset_vocab_size"]
