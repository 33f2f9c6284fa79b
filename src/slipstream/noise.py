"""Known third-party lines that tell a slipstream user nothing, hidden at the command line.

``slipstream train`` and ``slipstream ab`` import bitsandbytes, PEFT and TRL, and those print
warnings meant for their own users before slipstream prints anything. Each such line is one
entry of ``KNOWN_NOISE``: where it comes from (the logger that logs it, or the module whose
``warnings.warn`` issues it, with the category), the start of its message, and why it says
nothing to a slipstream user. Only these are hidden, matched by origin and message: slipstream's
own warnings and every other warning, ours or a third party's, still show.

The CLI runs each command inside ``known_noise_hidden()`` (``slipstream --debug ...`` does not, and
shows them all); a process it starts for an A/B arm calls ``hide_known_noise`` first, when its
parent hides them (``runner.run_in_fresh_process``).
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Noise:
    """One known line: ``origin`` is a logger's name, or with ``category`` the warning's module."""

    origin: str
    message: str  # a regular expression matched at the start of the message
    example: str  # the line as it reads (the tests issue it)
    why: str
    category: type[Warning] | None = None  # None: a logging record of the logger ``origin``


KNOWN_NOISE: tuple[Noise, ...] = (
    Noise(
        origin="bitsandbytes.backends.cpu.ops",
        message=r"Failed to load CPU gemm_4bit_forward from kernels-community",
        example="Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'. "
        "Please make sure you already `pip install kernels` and the kernels >= 0.11.1",
        why="logged when bitsandbytes is imported (PEFT imports it in every LoRA run), on a CPU with "
        "AVX512-BF16 and without the optional `kernels` package (which fetches a kernel from the Hugging "
        "Face Hub); bitsandbytes falls back to its own CPU kernel, and most runs have no 4-bit layer",
    ),
    Noise(
        origin="transformers.modeling_utils",
        message=r"`is_gradient_checkpointing` is deprecated",
        example="`is_gradient_checkpointing` is deprecated and will be removed in v6. Use "
        "`is_activation_checkpointing` instead.",
        category=FutureWarning,
        why="PEFT's get_peft_model reads model.is_gradient_checkpointing, deprecated in recent "
        "transformers; slipstream's own code reads neither that nor its new name",
    ),
    Noise(
        origin="trl.trainer.sft_trainer",
        message=r"(\[RANK \d+\] )?You are using a per_device_train_batch_size of 1 with padding-free training",
        example="[RANK 0] You are using a per_device_train_batch_size of 1 with padding-free training. Using a "
        "batch size of 1 annihilate the benefits of padding-free training. Please consider increasing the "
        "batch size to at least 2.",
        why="the trl arm of `slipstream ab` hands TRL's SFTTrainer each micro-batch itself, already one "
        "packed row of many documents, so TRL's advice to raise the batch size does not apply",
    ),
)

_hidden_for_good = False  # hide_known_noise() ran in this process
_hidden_depth = 0  # known_noise_hidden() blocks open


class _DropKnown(logging.Filter):
    """A logger's filter dropping the records whose message starts like one of ``patterns``."""

    def __init__(self, patterns: list[str]):
        super().__init__()
        self.patterns = [re.compile(pattern) for pattern in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is not ours to judge: let logging report it
            return True
        return not any(pattern.match(message) for pattern in self.patterns)


def _install() -> list[tuple[logging.Logger, logging.Filter]]:
    """Add the warnings filters (to ``warnings.filters``) and the logger filters; the latter returned."""
    patterns: dict[str, list[str]] = {}
    for noise in KNOWN_NOISE:
        if noise.category is None:
            patterns.setdefault(noise.origin, []).append(noise.message)
        else:
            warnings.filterwarnings(
                "ignore",
                message=noise.message,
                category=noise.category,
                module=re.escape(noise.origin) + r"\Z",
            )
    added = []
    for name, messages in patterns.items():
        logger, drop = logging.getLogger(name), _DropKnown(messages)
        logger.addFilter(drop)  # on the logger itself: only records logged there, none of its children
        added.append((logger, drop))
    return added


def hide_known_noise() -> None:
    """Hide the lines of ``KNOWN_NOISE`` in this process for good (a worker process's first call)."""
    global _hidden_for_good
    if not _hidden_for_good:
        _install()
        _hidden_for_good = True


def known_noise_hidden_here() -> bool:
    """Whether this process hides them now (what a process it starts should do too)."""
    return _hidden_for_good or _hidden_depth > 0


@contextlib.contextmanager
def known_noise_hidden(hide: bool = True) -> Iterator[None]:
    """Within the block, the lines of ``KNOWN_NOISE`` are hidden; after it, everything is as before.

    ``hide=False`` (``--debug``) changes nothing.
    """
    global _hidden_depth
    if not hide:
        yield
        return
    with warnings.catch_warnings():
        added = _install()
        _hidden_depth += 1
        try:
            yield
        finally:
            _hidden_depth -= 1
            for logger, drop in added:
                logger.removeFilter(drop)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Within the block, transformers logs errors only: its warnings about a shrunk config (its rope
    scaling, ...) or a GGUF file it loads are not the user's concern there. After it, as before."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)
