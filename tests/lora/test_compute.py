"""LoRA in the activations' dtype (slipstream.lora): the same losses and gradients as PEFT's own
forward within the dtype's tolerance, no activation-sized dtype conversion, and PEFT's forward
kept where this path would not be exact."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode

import slipstream
from slipstream.models import build_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK = 8


def lora_model(dtype: torch.dtype, lora_in_compute_dtype: bool, **lora_options):
    model = build_model("llama", vocab_size=256, seed=0, dtype=dtype)
    slipstream.optimize(model, packed_attention=False, lora_in_compute_dtype=lora_in_compute_dtype)
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=16, target_modules=TARGETS, **lora_options))
    torch.manual_seed(2)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:  # B starts at zero in PEFT: give the update a size, so it is tested
            parameter.data.normal_(0, 0.05)
    return model


def loss_and_grads(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach().float(), grads


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_losses_and_adapter_gradients_match_peft(dtype, tolerance):
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(3))
    peft_loss, peft_grads = loss_and_grads(lora_model(dtype, False), ids)
    model = lora_model(dtype, True)
    ours_loss, ours_grads = loss_and_grads(model, ids)
    assert any("lora compute: activations' dtype" in p for p in slipstream.state_of(model).policies)
    assert torch.allclose(ours_loss, peft_loss, rtol=tolerance / 10, atol=0)
    assert set(ours_grads) == set(peft_grads) and len(ours_grads) == 2 * len(TARGETS) * 2  # 2 layers
    for name, grad in peft_grads.items():
        assert ours_grads[name].dtype == torch.float32  # the adapters stay fp32 master weights
        scale = grad.abs().max()
        assert (ours_grads[name] - grad).abs().max() <= tolerance * scale, name


class ConversionSizes(TorchDispatchMode):
    """The element counts of every dtype conversion (``_to_copy``) a forward + backward makes."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") not in (None, args[0].dtype):
            self.sizes.append(args[0].numel())
        return func(*args, **(kwargs or {}))


def conversions(model, ids) -> list[int]:
    model(input_ids=ids, labels=ids)  # the first forward adapts the layers (not counted)
    with ConversionSizes() as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    return counter.sizes


def test_no_activation_changes_dtype_only_the_adapter_weights_do():
    """The conversions a LoRA model makes beyond the base model's own (RMSNorm's fp32 upcasts, the
    loss's): PEFT's are activation-sized, in and out of every wrapped linear; ours are weights."""
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(4))
    base = build_model("llama", vocab_size=256, seed=0, dtype=torch.bfloat16)
    slipstream.optimize(base, packed_attention=False)
    for parameter in base.parameters():
        parameter.requires_grad_(parameter.dim() == 1)  # a backward through every layer, no LoRA
    own = conversions(base, ids)
    peft = conversions(lora_model(torch.bfloat16, False), ids)
    ours = conversions(lora_model(torch.bfloat16, True), ids)
    activation = 64 * 32  # tokens x the narrowest wrapped width: no adapter weight is this big
    assert activation > RANK * 128  # r x the widest width (the MLP's)
    big_own = sum(size >= activation for size in own)
    assert sum(size >= activation for size in peft) >= big_own + 2 * 2 * len(TARGETS)  # 2 layers
    assert sum(size >= activation for size in ours) == big_own, (sorted(ours), sorted(own))
