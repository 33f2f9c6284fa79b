"""LoRA without dtype round trips: PEFT's LoRA linears computed in the activations' dtype."""

from .compute import eligible, install, uninstall

__all__ = ["eligible", "install", "uninstall"]
