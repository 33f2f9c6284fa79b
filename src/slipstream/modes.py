"""Module modes switched for a while and put back: evaluation and reference passes run in eval mode."""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def eval_mode(model: torch.nn.Module):
    """Inside, ``model`` is in eval mode; after, each module is back in the mode it was in."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        model.train(modes[0][1])  # through each module's own train(), as model.eval() went
        for module, training in modes:
            if module.training != training:  # a module that was not in the model's mode stays as it was
                module.train(training)
