"""The KTO losses against TRL 1.16's own: ``KTOTrainer._compute_loss`` (TRL has no separate ``kto_loss``;
the loss is written inline there) run on the same summed log-probs, for both loss types and weights."""

from __future__ import annotations

from collections import defaultdict
from types import MethodType, SimpleNamespace

import pytest
import torch

from slipstream.loss.kto import KTO_METRICS, clamp_kl, kl_baseline, kto_means, kto_metric_sums, kto_terms

trl_kto = pytest.importorskip("trl.trainer.kto_trainer")

# six rows: summed completion log-probs of the policy and the reference, their labels, and the summed
# log-probs of their KL completions (policy, reference)
POLICY = torch.tensor([-10.0, -14.0, -30.0, -21.0, -7.5, -18.0])
REFERENCE = torch.tensor([-11.0, -12.0, -29.0, -24.0, -7.0, -18.5])
LABELS = torch.tensor([True, False, True, True, False, False])
KL_POLICY = torch.tensor([-15.0, -12.0, -25.0, -20.0, -9.0, -17.0])
KL_REFERENCE = torch.tensor([-16.0, -12.5, -24.0, -22.0, -9.5, -17.25])


class _LogProbs:
    """A model whose per-token log-probs are given: each row's sum sits on its one completion token. As
    TRL 1.16's fused head returns them (``log_probs``), and as logits whose log-softmax at the target
    (token 1) gives them, for TRL 1.8 (the floor), which reads ``logits``: [a, 0] with
    ``-log(1 + e^a) = sum``, in float64."""

    training = True

    def __init__(self, completion, kl):
        self.completion, self.kl = completion, kl

    def __call__(self, input_ids, labels=None, **_):
        sums = (
            self.kl if input_ids.shape[1] == 3 else self.completion
        )  # the KL sequences are one token longer
        per_token = torch.zeros(input_ids.shape[0], input_ids.shape[1] - 1)
        per_token[:, -1] = sums
        logits = torch.zeros(input_ids.shape[0], input_ids.shape[1], 2, dtype=torch.float64)
        logits[:, -2, 0] = torch.log(torch.expm1(-sums.double()))
        return SimpleNamespace(
            log_probs=per_token, entropy=torch.zeros_like(per_token), mean_logits=per_token, logits=logits
        )


def trl_loss(loss_type: str, beta: float, desirable_weight: float, undesirable_weight: float) -> torch.Tensor:
    """TRL's ``_compute_loss`` on one micro-batch of the rows above, the reference precomputed."""
    rows = len(LABELS)
    model = _LogProbs(POLICY, KL_POLICY)
    trainer = SimpleNamespace(
        model=model,
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda value: value),
        calculate_KL=loss_type == "kto",
        loss_type=loss_type,
        beta=beta,
        desirable_weight=desirable_weight,
        undesirable_weight=undesirable_weight,
        precompute_ref_logps=True,
        aux_loss_enabled=False,
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
        ref_model=None,
    )
    trainer._compute_kl_logps = MethodType(trl_kto.KTOTrainer._compute_kl_logps, trainer)  # TRL's own
    inputs = {
        "input_ids": torch.ones(rows, 2, dtype=torch.long),
        "attention_mask": torch.ones(rows, 2, dtype=torch.long),
        "completion_mask": torch.tensor([[0, 1]] * rows),
        "label": LABELS.clone(),
        "ref_logps": REFERENCE,
    }
    if loss_type == "kto":
        inputs |= {
            "KL_input_ids": torch.ones(rows, 3, dtype=torch.long),
            "KL_attention_mask": torch.ones(rows, 3, dtype=torch.long),
            "KL_completion_mask": torch.tensor([[0, 0, 1]] * rows),
            "ref_KL_logps": KL_REFERENCE,
        }
    loss = trl_kto.KTOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
    return loss, {key: values[-1] for key, values in trainer._metrics["train"].items()}


CASES = [
    ("kto", 0.1, 1.0, 1.0),
    ("kto", 0.5, 1.33, 0.75),
    ("apo_zero_unpaired", 0.1, 1.0, 1.0),
    ("apo_zero_unpaired", 0.3, 0.8, 1.6),
]


@pytest.mark.parametrize("loss_type, beta, desirable_weight, undesirable_weight", CASES)
def test_the_kto_losses_equal_trls_on_the_same_log_probs(
    loss_type, beta, desirable_weight, undesirable_weight
):
    expected, logged = trl_loss(loss_type, beta, desirable_weight, undesirable_weight)
    kl = clamp_kl(kl_baseline(KL_POLICY, KL_REFERENCE)) if loss_type == "kto" else torch.zeros(())
    terms = kto_terms(
        POLICY,
        REFERENCE,
        LABELS,
        kl,
        beta=beta,
        desirable_weight=desirable_weight,
        undesirable_weight=undesirable_weight,
        loss_type=loss_type,
    )
    # TRL concatenates the desirable rows' losses, then the undesirable ones', and takes the mean
    assert terms.losses.mean().item() == pytest.approx(expected.item(), abs=1e-7)
    sums = kto_metric_sums(terms, LABELS, kl)
    metrics = kto_means(dict(zip(KTO_METRICS, (sums / len(LABELS)).tolist(), strict=True)))
    assert metrics["loss"] == pytest.approx(expected.item(), abs=1e-7)
    assert metrics["chosen_reward"] == pytest.approx(logged["rewards/chosen"], abs=1e-6)
    assert metrics["rejected_reward"] == pytest.approx(logged["rewards/rejected"], abs=1e-6)
    assert metrics["reward_margin"] == pytest.approx(logged["rewards/margins"], abs=1e-6)
    assert metrics["kl"] == pytest.approx(logged["kl"], abs=1e-6)


def test_the_gradient_flows_through_the_completions_only():
    policy = POLICY.clone().requires_grad_()
    kl_policy = KL_POLICY.clone().requires_grad_()
    kl = clamp_kl(kl_baseline(kl_policy, KL_REFERENCE))
    kto_terms(policy, REFERENCE, LABELS, kl, beta=0.1).losses.sum().backward()
    assert kl_policy.grad is None and policy.grad.abs().min() > 0


def test_a_negative_baseline_is_clamped_at_zero():
    assert clamp_kl(kl_baseline(KL_REFERENCE - 1.0, KL_REFERENCE)).item() == 0.0
    assert clamp_kl(kl_baseline(KL_REFERENCE + 0.5, KL_REFERENCE)).item() == pytest.approx(0.5)


def test_a_step_of_one_label_reports_nan_for_the_other_reward():
    terms = kto_terms(POLICY[:2], REFERENCE[:2], torch.tensor([True, True]), 0.0, beta=0.1)
    sums = kto_metric_sums(terms, torch.tensor([True, True]), 0.0)
    metrics = kto_means(dict(zip(KTO_METRICS, (sums / 2).tolist(), strict=True)))
    assert metrics["chosen_reward"] == pytest.approx(0.1 * (1.0 - 2.0) / 2)
    assert metrics["rejected_reward"] != metrics["rejected_reward"]  # NaN: TRL logs nothing then
