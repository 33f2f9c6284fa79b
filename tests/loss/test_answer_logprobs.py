"""answer_logprobs (summed answer log-probs a chunk at a time) against a direct log_softmax:
values, and gradients through a frozen head (kept from the forward) and a trainable one
(recomputed in backward), at chunk sizes that cut the rows unevenly, and under no_grad."""

import pytest
import torch
import torch.nn.functional as F

from slipstream.loss import LinearHead, LogitTransform, answer_logprobs, answer_logprobs_from_logits

N, H, V, ANSWERS = 23, 16, 50, 5


def inputs(seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=generator)
    targets = torch.randint(0, V, (N,), generator=generator)
    # rows of an answer need not be contiguous (a rejected answer's first row is the prompt's last)
    index = torch.randint(0, ANSWERS, (N,), generator=generator)
    index[:ANSWERS] = torch.arange(ANSWERS)  # every answer has a row
    head = torch.nn.Linear(H, V, bias=True)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=generator) * 0.5)
        head.bias.copy_(torch.randn(V, generator=generator))
    return hidden, targets, index, head


def direct(hidden, targets, index, weight, bias, transform=None):
    transform = transform or LogitTransform()
    logp = transform(F.linear(hidden, weight, bias)).float().log_softmax(-1)
    per_token = logp.gather(1, targets.unsqueeze(1)).squeeze(1)
    return torch.zeros(ANSWERS).index_add(0, index, per_token)


def preference_like(sums):
    """A nonlinear function of the sums, as a preference loss is: every answer gets its own dL/ds."""
    return -F.logsigmoid(0.3 * (sums[0::2][:2] - sums[1::2][:2])).sum() + 0.1 * sums[-1] ** 2


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


TRANSFORMS = [LogitTransform(), LogitTransform(scale=2.0, softcap=5.0)]


@pytest.mark.parametrize("chunk", [1, 4, 7, N, 1024])
@pytest.mark.parametrize("transform", TRANSFORMS, ids=["plain", "scaled-softcapped"])
def test_frozen_head_values_and_hidden_gradients(chunk, transform):
    hidden, targets, index, head = inputs()
    head.requires_grad_(False)
    x = hidden.clone().requires_grad_(True)
    sums = answer_logprobs(
        x,
        targets,
        index,
        ANSWERS,
        LinearHead(head.weight, head.bias),
        transform=transform,
        chunk_tokens=chunk,
    )
    assert sums.shape == (ANSWERS,) and sums.dtype == torch.float32
    x_ref = hidden.clone().requires_grad_(True)
    expected = direct(x_ref, targets, index, head.weight, head.bias, transform)
    torch.testing.assert_close(sums, expected, rtol=1e-5, atol=1e-5)
    (grad,) = torch.autograd.grad(preference_like(sums), [x])
    (grad_ref,) = torch.autograd.grad(preference_like(expected), [x_ref])
    assert rel(grad, grad_ref) <= 1e-5


@pytest.mark.parametrize("chunk", [1, 6, 1024])
def test_frozen_head_given_as_its_module(chunk):
    """A head that is not a plain linear (a PEFT layer, say) goes through its module: the same numbers."""
    hidden, targets, index, head = inputs(seed=1)
    head.requires_grad_(False)
    x = hidden.clone().requires_grad_(True)
    sums = answer_logprobs(x, targets, index, ANSWERS, head, chunk_tokens=chunk)
    x_ref = hidden.clone().requires_grad_(True)
    expected = direct(x_ref, targets, index, head.weight, head.bias)
    torch.testing.assert_close(sums, expected, rtol=1e-5, atol=1e-5)
    (grad,) = torch.autograd.grad(preference_like(sums), [x])
    (grad_ref,) = torch.autograd.grad(preference_like(expected), [x_ref])
    assert rel(grad, grad_ref) <= 1e-5


@pytest.mark.parametrize("chunk", [1, 5, 1024])
@pytest.mark.parametrize("as_tensors", [False, True], ids=["module", "linear-head"])
@pytest.mark.parametrize("transform", TRANSFORMS, ids=["plain", "scaled-softcapped"])
def test_trainable_head_recomputes_in_backward(chunk, as_tensors, transform):
    hidden, targets, index, head = inputs(seed=2)
    x = hidden.clone().requires_grad_(True)
    given = LinearHead(head.weight, head.bias) if as_tensors else head
    sums = answer_logprobs(
        x, targets, index, ANSWERS, given, list(head.parameters()), transform=transform, chunk_tokens=chunk
    )
    reference_head = torch.nn.Linear(H, V)
    reference_head.load_state_dict(head.state_dict())
    x_ref = hidden.clone().requires_grad_(True)
    expected = direct(x_ref, targets, index, reference_head.weight, reference_head.bias, transform)
    torch.testing.assert_close(sums, expected, rtol=1e-5, atol=1e-5)
    ours = torch.autograd.grad(preference_like(sums), [x, head.weight, head.bias])
    theirs = torch.autograd.grad(
        preference_like(expected), [x_ref, reference_head.weight, reference_head.bias]
    )
    for name, a, b in zip(("hidden", "weight", "bias"), ours, theirs, strict=True):
        assert rel(a, b) <= 1e-5, name


def test_trainable_head_without_a_hidden_gradient():
    """Only the head trains (the rows come from a frozen trunk): its gradient alone is right."""
    hidden, targets, index, head = inputs(seed=3)
    sums = answer_logprobs(hidden, targets, index, ANSWERS, head, list(head.parameters()), chunk_tokens=4)
    reference_head = torch.nn.Linear(H, V)
    reference_head.load_state_dict(head.state_dict())
    expected = direct(hidden, targets, index, reference_head.weight, reference_head.bias)
    ours = torch.autograd.grad(preference_like(sums), [head.weight, head.bias])
    theirs = torch.autograd.grad(preference_like(expected), [reference_head.weight, reference_head.bias])
    for a, b in zip(ours, theirs, strict=True):
        assert rel(a, b) <= 1e-5


def test_gradients_accumulate_into_grad_like_autograd():
    """backward() (not autograd.grad) leaves the same .grad on the hidden rows and the head."""
    hidden, targets, index, head = inputs(seed=4)
    x = hidden.clone().requires_grad_(True)
    preference_like(
        answer_logprobs(x, targets, index, ANSWERS, head, list(head.parameters()), chunk_tokens=3)
    ).backward()
    reference_head = torch.nn.Linear(H, V)
    reference_head.load_state_dict(head.state_dict())
    x_ref = hidden.clone().requires_grad_(True)
    preference_like(direct(x_ref, targets, index, reference_head.weight, reference_head.bias)).backward()
    assert rel(x.grad, x_ref.grad) <= 1e-5
    assert rel(head.weight.grad, reference_head.weight.grad) <= 1e-5
    assert rel(head.bias.grad, reference_head.bias.grad) <= 1e-5


@pytest.mark.parametrize("chunk", [1, 6, 1024])
@pytest.mark.parametrize("trainable", [False, True])
def test_under_no_grad_the_values_and_no_graph(chunk, trainable):
    hidden, targets, index, head = inputs(seed=5)
    head.requires_grad_(trainable)
    x = hidden.clone().requires_grad_(True)
    with torch.no_grad():
        sums = answer_logprobs(
            x,
            targets,
            index,
            ANSWERS,
            head,
            [p for p in head.parameters() if p.requires_grad],
            chunk_tokens=chunk,
        )
        expected = direct(hidden, targets, index, head.weight, head.bias)
    assert not sums.requires_grad and sums.grad_fn is None
    torch.testing.assert_close(sums, expected, rtol=1e-5, atol=1e-5)


def test_from_logits_is_the_same_sum():
    hidden, targets, index, head = inputs(seed=6)
    with torch.no_grad():
        logits = head(hidden)  # [N, V]: rows already at the answer positions
        positions = torch.arange(N)
        sums = answer_logprobs_from_logits(logits.unsqueeze(0), positions, targets, index, ANSWERS)
        torch.testing.assert_close(sums, direct(hidden, targets, index, head.weight, head.bias))
        # positions pick rows out of a longer row
        padded = torch.cat([torch.randn(3, V), logits, torch.randn(2, V)])
        picked = answer_logprobs_from_logits(padded.unsqueeze(0), positions + 3, targets, index, ANSWERS)
        torch.testing.assert_close(picked, sums)


def test_hidden_rows_must_be_two_dimensional():
    hidden, targets, index, head = inputs()
    with pytest.raises(ValueError, match=r"must be \[N, H\]"):
        answer_logprobs(hidden.unsqueeze(0), targets, index, ANSWERS, head)
