"""linear_cross_entropy against the plain head + cross-entropy: loss and every gradient."""

import pytest
import torch
import torch.nn.functional as F

from slipstream.bench.counters import LargeTensorWatch
from slipstream.loss import LinearHead, LogitTransform, choose_chunk_tokens, linear_cross_entropy

N, H, V = 45, 16, 70


def reference(x, targets, head, transform, divisor):
    logits = transform(head(x)).float()
    return F.cross_entropy(logits, targets, reduction="sum", ignore_index=-100) / divisor


def grads(loss, tensors):
    return torch.autograd.grad(loss, tensors)


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def as_given(head, path):
    """The head as the module (autograd path) or as its tensors (the plain-linear fast path)."""
    return head if path == "module" else LinearHead(head.weight, head.bias)


@pytest.mark.parametrize("path", ["module", "linear"])
@pytest.mark.parametrize("chunk", [1, 8, 45, 1000])
@pytest.mark.parametrize(
    "transform", [LogitTransform(), LogitTransform(scale=0.25), LogitTransform(scale=2.0, softcap=5.0)]
)
def test_loss_and_gradients_match_the_full_logits(chunk, transform, path):
    torch.manual_seed(0)
    x = torch.randn(N, H, requires_grad=True)
    head = torch.nn.Linear(H, V, bias=True)
    targets = torch.randint(0, V, (N,))
    targets[::4] = -100
    params = [x, head.weight, head.bias]
    expected = reference(x, targets, head, transform, 30.0)
    expected_grads = grads(expected, params)
    given = as_given(head, path)
    loss = linear_cross_entropy(x, targets, given, [head.weight, head.bias], 30.0, transform, chunk)
    assert rel(loss, expected) <= 1e-6
    for got, want in zip(grads(loss, params), expected_grads, strict=True):
        assert rel(got, want) <= 1e-5


def test_incoming_gradient_scales_every_gradient():
    torch.manual_seed(1)
    x = torch.randn(N, H, requires_grad=True)
    head = torch.nn.Linear(H, V, bias=False)
    targets = torch.randint(0, V, (N,))
    one = grads(linear_cross_entropy(x, targets, head, [head.weight], chunk_tokens=7), [x, head.weight])
    three = grads(3 * linear_cross_entropy(x, targets, head, [head.weight], chunk_tokens=7), [x, head.weight])
    for a, b in zip(one, three, strict=True):
        assert torch.allclose(3 * a, b, rtol=1e-6, atol=0)


def test_default_divisor_is_the_label_count_and_all_masked_gives_zero():
    torch.manual_seed(2)
    x = torch.randn(N, H, requires_grad=True)
    head = torch.nn.Linear(H, V, bias=False)
    targets = torch.randint(0, V, (N,))
    targets[:20] = -100
    loss = linear_cross_entropy(x, targets, head, [head.weight], chunk_tokens=16)
    assert rel(loss, F.cross_entropy(head(x), targets)) <= 1e-6
    masked = torch.full((N,), -100)
    zero = linear_cross_entropy(x, masked, head, [head.weight], chunk_tokens=16)
    zero.backward()
    assert zero.item() == 0.0
    assert torch.isfinite(x.grad).all() and x.grad.abs().max().item() == 0.0
    assert head.weight.grad.abs().max().item() == 0.0


@pytest.mark.parametrize("path", ["module", "linear"])
def test_frozen_head_and_no_grad_forward(path):
    torch.manual_seed(3)
    x = torch.randn(N, H, requires_grad=True)
    head = torch.nn.Linear(H, V, bias=False).requires_grad_(False)
    targets = torch.randint(0, V, (N,))
    loss = linear_cross_entropy(x, targets, as_given(head, path), [], chunk_tokens=10)
    (gx,) = grads(loss, [x])
    assert rel(gx, grads(reference(x, targets, head, LogitTransform(), N), [x])[0]) <= 1e-5
    with torch.no_grad():
        value = linear_cross_entropy(x, targets, as_given(head, path), [], chunk_tokens=10)
    assert rel(value, loss.detach()) <= 1e-7


@pytest.mark.parametrize("path", ["module", "linear"])
def test_a_no_grad_loss_of_a_trainable_head_computes_no_gradient(path):
    """Under no_grad (evaluation) a trainable head's gradient is neither computed nor kept."""
    torch.manual_seed(5)
    x = torch.randn(N, H)
    head = torch.nn.Linear(H, V)
    targets = torch.randint(0, V, (N,))
    expected = reference(x, targets, head, LogitTransform(), N).detach()
    with torch.no_grad(), LargeTensorWatch(min_numel=H * V) as big:
        value = linear_cross_entropy(
            x, targets, as_given(head, path), [head.weight, head.bias], chunk_tokens=10
        )
    assert value.grad_fn is None and head.weight.grad is None
    made = [seen for seen in big.seen if seen[0] != "t"]  # the head's weight.t() is a view
    assert made == [], made  # no [V, H] gradient accumulator, no full logits
    assert rel(value, expected) <= 1e-6


@pytest.mark.parametrize("path", ["module", "linear"])
def test_bfloat16_stays_close_to_the_fp32_upcast_loss(path):
    torch.manual_seed(4)
    x = torch.randn(N, H, dtype=torch.bfloat16, requires_grad=True)
    head = torch.nn.Linear(H, V, bias=False, dtype=torch.bfloat16)
    targets = torch.randint(0, V, (N,))
    loss = linear_cross_entropy(x, targets, as_given(head, path), [head.weight], chunk_tokens=8)
    expected = reference(x, targets, head, LogitTransform(), N)  # transformers: bf16 logits, fp32 loss
    assert loss.dtype == torch.float32
    assert rel(loss, expected) <= 1e-6  # the same bf16 logits, the same fp32 reduction
    got, want = grads(loss, [x, head.weight]), grads(expected, [x, head.weight])
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.bfloat16
        assert rel(a.float(), b.float()) <= 2e-2


def test_chunk_size_policy():
    cpu = torch.device("cpu")
    tokens, reason = choose_chunk_tokens(151936, torch.float32, cpu)
    assert tokens == 128 and "vocab 151936" in reason  # a real vocabulary: the CPU's floor of rows
    assert choose_chunk_tokens(151936, torch.bfloat16, cpu)[0] == 128
    small, _ = choose_chunk_tokens(2048, torch.float32, cpu)
    assert small % 64 == 0 and small * 2048 * 4 <= 64 * 2**20 and small >= 4096  # a small one: big chunks
    bf16, _ = choose_chunk_tokens(2048, torch.bfloat16, cpu)
    assert bf16 < small  # a bf16 row also holds its fp32 working copy
    assert choose_chunk_tokens(1000, torch.float32, torch.device("cpu"), override=5)[0] == 5
    with pytest.raises(ValueError, match="at least 1"):
        choose_chunk_tokens(1000, torch.float32, torch.device("cpu"), override=0)
