"""The short-document attention kernel: outputs and gradients against SDPA, and when it applies."""

import pytest
import torch
import torch.nn.functional as F

from slipstream.packing.attention import _window_allowed
from slipstream.packing.short_attention import (
    SHORT_MAX_LEN,
    short_causal_attention,
    short_kernel_policy,
    takes_short_kernel,
)


def _inputs(n, heads, kv_heads, length, dim, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, length, dim, generator=generator).to(dtype).requires_grad_()
    k = torch.randn(n, kv_heads, length, dim, generator=generator).to(dtype).requires_grad_()
    v = torch.randn(n, kv_heads, length, dim, generator=generator).to(dtype).requires_grad_()
    grad = torch.randn(n, heads, length, dim, generator=generator).to(dtype)
    return q, k, v, grad


def _reference(q, k, v, scale, window):
    """SDPA's math in fp64, with the key heads repeated for GQA."""
    r = q.shape[1] // k.shape[1]
    q64, k64, v64 = (t.double() for t in (q, k, v))
    k64, v64 = k64.repeat_interleave(r, 1), v64.repeat_interleave(r, 1)
    mask = _window_allowed(q.shape[-2], q.shape[-2], window, q.device)
    return F.scaled_dot_product_attention(q64, k64, v64, attn_mask=mask, scale=scale)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("window", [None, 5])
def test_matches_sdpa_forward_and_backward(dtype, tol, heads, kv_heads, window):
    q, k, v, grad = _inputs(3, heads, kv_heads, 17, 8, dtype)
    out = short_causal_attention(q, k, v, 0.3, window)
    out.backward(grad)
    got = [out, q.grad, k.grad, v.grad]
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _reference(qr, kr, vr, 0.3, window)
    ref.backward(grad.double())
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, [ref, qr.grad, kr.grad, vr.grad], strict=True):
        assert a.dtype == dtype, name
        error = (a.double() - b).abs().max().item() / max(b.abs().max().item(), 1e-12)
        assert error < tol, f"{name}: relative error {error:.2e}"


def test_bf16_is_as_close_to_fp64_as_sdpa_flash():
    """Not just within a tolerance: about as close to the exact answer as the kernel it replaces."""
    q, k, v, grad = _inputs(8, 9, 3, 47, 64, torch.bfloat16, seed=1)
    out = short_causal_attention(q, k, v, 0.125, None)
    out.backward(grad)
    mine = [out.detach(), q.grad, k.grad, v.grad]
    for t in (q, k, v):
        t.grad = None
    flash = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True)
    flash.backward(grad)
    theirs = [flash.detach(), q.grad, k.grad, v.grad]
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _reference(qr, kr, vr, 0.125, None)
    ref.backward(grad.double())
    for name, a, b, r in zip(
        ("out", "dq", "dk", "dv"), mine, theirs, [ref, qr.grad, kr.grad, vr.grad], strict=True
    ):
        mine_error = (a.double() - r).abs().max().item()
        flash_error = (b.double() - r).abs().max().item()
        assert mine_error <= 1.25 * flash_error + 1e-6, (
            f"{name}: {mine_error:.2e} against flash {flash_error:.2e}"
        )


def test_padding_queries_add_nothing_to_real_gradients():
    """A right-padded document (as a length group pads it): zero output gradient on the padding
    queries leaves the real keys' and values' gradients as the unpadded document's."""
    q, k, v, grad = _inputs(1, 4, 2, 12, 8, torch.float32)
    short_causal_attention(q[:, :, :9], k[:, :, :9], v[:, :, :9], 0.5, None).backward(grad[:, :, :9])
    want = [t.grad[:, :, :9].clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    padded_grad = grad.clone()
    padded_grad[:, :, 9:] = 0
    short_causal_attention(q, k, v, 0.5, None).backward(padded_grad)
    for name, w, t in zip("qkv", want, (q, k, v), strict=True):
        torch.testing.assert_close(t.grad[:, :, :9], w, msg=f"d{name}")
        assert not t.grad[:, :, 9:].any(), f"d{name} on padding"


def test_where_it_applies():
    q = torch.zeros(2, 4, 10, 8, dtype=torch.bfloat16)
    kv = torch.zeros(2, 2, 10, 8, dtype=torch.bfloat16)
    assert takes_short_kernel(q, kv, 0.0)
    assert not takes_short_kernel(q, kv, 0.1), "dropout keeps SDPA"
    assert not takes_short_kernel(q[:, :, :1], kv, 0.0), "a decoding step keeps SDPA"
    long_q = torch.zeros(1, 4, SHORT_MAX_LEN + 1, 8, dtype=torch.bfloat16)
    long_kv = torch.zeros(1, 2, SHORT_MAX_LEN + 1, 8, dtype=torch.bfloat16)
    assert not takes_short_kernel(long_q, long_kv, 0.0), "long documents keep SDPA's flash kernel"
    assert takes_short_kernel(q.half(), kv.half(), 0.0)
    assert not takes_short_kernel(q.float(), kv.float(), 0.0), "fp32 keeps SDPA (as fast there)"
    assert takes_short_kernel(q.float(), kv.float(), 0.0, "on"), "unless asked"
    assert not takes_short_kernel(q, kv, 0.0, "off")
    assert not takes_short_kernel(long_q, long_kv, 0.0, "on")
    prefixed_kv = torch.zeros(2, 2, SHORT_MAX_LEN, 8, dtype=torch.bfloat16)
    assert takes_short_kernel(q, prefixed_kv, 0.0), "a shared prefix: decided on prefix + own tokens"
    assert not takes_short_kernel(q, long_kv, 0.0), "a prefix + own tokens past the reach keeps SDPA"
    with torch._subclasses.fake_tensor.FakeTensorMode():
        assert not takes_short_kernel(
            torch.empty(2, 4, 10, 8, device="cuda"), torch.empty(2, 2, 10, 8, device="cuda"), 0.0
        )


def test_policy_lines():
    assert short_kernel_policy("off", "sdpa").startswith("off")
    assert "unused" in short_kernel_policy("auto", "varlen")
    assert str(SHORT_MAX_LEN) in short_kernel_policy("auto", "sdpa")
    assert short_kernel_policy("on", "sdpa").startswith("on (")
