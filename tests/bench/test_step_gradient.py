"""An arm's step-0 gradient: held at its first optimizer step, written as fp32 by name, compared by cosine."""

import numpy as np
import pytest
import torch

from slipstream.bench.step_gradient import HeldGradient, gradient_cosine, parameter_name


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[0].bias.requires_grad_(False)  # frozen: left out
    return model


def _step(model: torch.nn.Module, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    """One optimizer step on a fixed batch (gradients clipped by ``scale`` first, as a trainer clips);
    returns the flattened trainable gradient it stepped with."""
    model.to(dtype)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    x = torch.arange(8, dtype=torch.float32).reshape(2, 4).to(dtype) / 8
    model(x).float().pow(2).sum().backward()
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(scale)
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grads


def test_the_first_optimizer_steps_gradient_is_written_as_fp32_by_name_and_the_hook_goes(
    tmp_path, monkeypatch
):
    import slipstream.bench.step_gradient as step_gradient

    monkeypatch.setattr(step_gradient, "CHUNK", 5)  # a parameter written a few values at a time
    model = _model()
    held = HeldGradient(model, str(tmp_path), "arm")
    grads = _step(model)
    _step(model)  # a later step is not held
    kept = held.save()
    assert kept["names"] == ["0.weight", "1.weight", "1.bias"]  # trainable only, in the model's order
    assert kept["sizes"] == [12, 6, 2]
    written = torch.from_numpy(np.fromfile(kept["file"], dtype=np.float32))
    assert torch.equal(written, grads)
    assert held.handle is None and held.held is None and held.save() is None


def test_without_a_directory_nothing_is_held():
    model = _model()
    held = HeldGradient(model, None, "arm")
    _step(model)
    assert held.handle is None and held.save() is None


def test_the_cosine_matches_by_name_ignores_a_trainers_clipping_and_says_why_when_it_cannot(tmp_path):
    reference = HeldGradient(_model(), str(tmp_path), "fp32")
    _step(reference.model)
    clipped = HeldGradient(_model(), str(tmp_path), "clipped")
    _step(clipped.model, scale=0.25)  # clipping scales every gradient alike: the direction is kept
    rounded = HeldGradient(_model(), str(tmp_path), "bf16")
    _step(rounded.model, dtype=torch.bfloat16)
    other = HeldGradient(_model(seed=1), str(tmp_path), "other")
    _step(other.model)
    fp32, clipped, rounded, other = (held.save() for held in (reference, clipped, rounded, other))
    assert gradient_cosine(fp32, clipped)[0] == pytest.approx(1.0, abs=1e-7)
    cosine, why = gradient_cosine(fp32, rounded)
    assert why is None and 1 - 1e-3 < cosine < 1.0  # bf16 rounding: close, not equal
    assert gradient_cosine(fp32, other)[0] < 0.999  # other weights: another gradient
    renamed = {**clipped, "names": ["a", "b", "c"]}
    assert gradient_cosine(fp32, renamed) == (
        None,
        "its trainable parameters are named otherwise (0 of 3 names match)",
    )
    assert gradient_cosine(fp32, None) == (None, "this arm kept no step-0 gradient")
    assert gradient_cosine(None, fp32)[1] == "the fp32 step kept no step-0 gradient"


def test_wrappers_names_are_matched_without_their_segments():
    assert parameter_name("module.layers.0._orig_mod.q_proj.weight") == "layers.0.q_proj.weight"
    assert parameter_name("layers.0._checkpoint_wrapped_module.mlp.weight") == "layers.0.mlp.weight"
