"""``model.dtype: auto`` on CUDA: bf16 from compute capability 8.0, fp32 below (capability patched)."""

import pytest
import torch

from slipstream.train.precision import fast_bf16, resolve_dtype

CUDA = torch.device("cuda")


@pytest.mark.parametrize(
    "capability, dtype, reason",
    [
        ((9, 0), torch.bfloat16, "capability 9.0 has bf16 tensor cores"),
        ((8, 0), torch.bfloat16, "capability 8.0 has bf16 tensor cores"),
        ((8, 6), torch.bfloat16, "capability 8.6 has bf16 tensor cores"),
        ((7, 5), torch.float32, "capability 7.5 has no bf16 tensor cores"),
        ((6, 0), torch.float32, "capability 6.0 has no bf16 tensor cores"),
    ],
)
def test_auto_dtype_on_cuda_follows_compute_capability(monkeypatch, capability, dtype, reason):
    asked = []
    monkeypatch.setattr(
        torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or capability
    )
    chosen, why = resolve_dtype("auto", CUDA)
    assert chosen == dtype and reason in why and why.startswith(f"dtype {str(dtype)[6:]} (auto: CUDA")
    assert asked == [CUDA]  # the training device's own capability
    assert fast_bf16(CUDA)[0] is (dtype == torch.bfloat16)


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32"])
def test_a_set_dtype_does_not_ask_the_device(monkeypatch, name):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: pytest.fail("asked"))
    assert resolve_dtype(name, CUDA) == (getattr(torch, name), f"dtype {name} (set)")
