"""KTO rows binned and packed: each bin's KL completions are TRL's rotation of the same rows, and the
packed row (prompt once, completion and KL completion after it) gives every sequence's log-probs and
the KTO loss's LoRA gradients exactly as each sequence run alone (fp32)."""

from __future__ import annotations

import copy

import pytest
import torch

import slipstream
from slipstream.loss import answer_logprobs_of
from slipstream.loss.kto import clamp_kl, kl_baseline, kto_terms
from slipstream.models import build_model
from slipstream.packing.kto import (
    collate_kto,
    kto_tokens,
    no_single_rows,
    pack_kto,
    with_kl_completions,
    without_kl_completions,
)

VOCAB = 512


def random_rows(shapes, seed=3):
    generator = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(1, VOCAB, (n,), generator=generator).tolist()

    return [
        {"prompt_ids": ids(p), "completion_ids": ids(c), "label": number % 2 == 0}
        for number, (p, c) in enumerate(shapes)
    ]


SHAPES = [(9, 5), (6, 7), (12, 3), (4, 6)]


def test_the_kl_completions_are_trls_rotation_of_the_same_rows():
    datasets = pytest.importorskip("datasets")
    trl_kto = pytest.importorskip("trl.trainer.kto_trainer")
    from types import MethodType, SimpleNamespace

    from trl import KTOConfig

    from slipstream.data import demo_tokenizer

    tokenizer = demo_tokenizer()
    text = [
        {"prompt": f"question {i} about the river", "completion": " north" * (i + 1), "label": i % 2 == 0}
        for i in range(7)
    ]
    args = KTOConfig(
        output_dir="unused",
        per_device_train_batch_size=3,
        max_length=None,
        report_to=[],
        use_cpu=True,
        bf16=False,
    )
    trainer = SimpleNamespace(
        calculate_KL=True, _tokenizer=tokenizer, desirable_weight=1.0, undesirable_weight=1.0
    )
    if hasattr(trl_kto.KTOTrainer, "_get_kl_dataset"):  # TRL 1.8 (the floor): the rotation is its own method
        trainer._get_kl_dataset = MethodType(trl_kto.KTOTrainer._get_kl_dataset, trainer)
    prepared = trl_kto.KTOTrainer._prepare_dataset(
        trainer, datasets.Dataset.from_list(text), tokenizer, args, "train"
    )
    rows = [
        {"prompt_ids": r["prompt_ids"], "completion_ids": r["completion_ids"], "label": r["label"]}
        for r in prepared
    ]
    for start in range(0, len(rows), 3):  # TRL's batches of per_device_train_batch_size sequential rows
        ours = with_kl_completions(rows[start : start + 3])
        assert [row["rejected_ids"] for row in ours] == prepared[start : start + 3]["KL_completion_ids"]
        assert [row["chosen_ids"] for row in ours] == prepared[start : start + 3]["completion_ids"]
    # TRL's last batch here holds one row: its "mismatched" completion is its own (ours refuses such a bin)
    assert prepared[6]["KL_completion_ids"] == prepared[6]["completion_ids"]


def test_bins_take_the_rotation_within_themselves_and_their_size_is_rotation_free():
    rows = random_rows([(5, 4)] * 6 + [(3, 9)] * 3 + [(2, 2)])
    bins = pack_kto(rows, max_seq_len=40, seed=0)
    assert sorted(r["prompt_ids"] for b in bins for r in b) == sorted(r["prompt_ids"] for r in rows)
    for rows_in_bin in bins:
        assert len(rows_in_bin) >= 2
        completions = [r["completion_ids"] for r in rows_in_bin]
        assert [r["rejected_ids"] for r in rows_in_bin] == [completions[-1], *completions[:-1]]
        # the bin's tokens as packed (prompt, completion, KL completion) are what it was filled by
        packed = sum(
            len(r["prompt_ids"]) + len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in rows_in_bin
        )
        assert packed == sum(kto_tokens(r) for r in rows_in_bin) <= 40


def test_a_bin_of_one_row_takes_a_row_from_a_bin_of_three():
    rows = random_rows([(10, 5), (2, 1), (2, 1), (2, 1)])
    size = kto_tokens
    moved = no_single_rows([[rows[0]], rows[1:]], max_seq_len=30, size=size)
    assert [len(b) for b in moved] == [2, 2]
    assert no_single_rows([[rows[0]], rows[1:3]], max_seq_len=30, size=size)[0] == [rows[0]]  # no donor of 3+


def test_apo_rows_pack_prompt_and_completion_only():
    rows = without_kl_completions(random_rows(SHAPES))
    batch = collate_kto(rows)
    assert batch.num_tokens == sum(p + c for p, c in SHAPES)
    assert batch.answers.lengths == tuple(c for _, c in SHAPES)


# ----------------------------------------------------------------------------- exactness


def alone_sums(model, rows) -> torch.Tensor:
    """[completion 0, KL 0, completion 1, KL 1, ...]: each sequence's summed log-prob, run alone after its prompt."""
    sums = []
    for row in rows:
        prompt = row["prompt_ids"]
        for answer in (row["chosen_ids"], row["rejected_ids"]):
            logits = model(input_ids=torch.tensor([prompt + answer]), use_cache=False).logits[0]
            per_token = logits[len(prompt) - 1 : len(prompt) + len(answer) - 1].float().log_softmax(-1)
            sums.append(per_token.gather(1, torch.tensor(answer).unsqueeze(1)).sum())
    return torch.stack(sums)


def kto_loss(sums, reference, labels):
    """The KTO loss as the objective takes it: the KL sequences' sums detached, the baseline clamped."""
    kl = clamp_kl(kl_baseline(sums[1::2].detach(), reference[1::2]))
    return kto_terms(sums[0::2], reference[0::2], labels, kl, beta=0.5, undesirable_weight=1.3).losses.mean()


def lora(model):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(1)
    return peft.get_peft_model(model, config)  # B != 0: the gradients reach both LoRA matrices


@pytest.mark.parametrize("prefix_sharing", [True, False])
def test_packed_kto_rows_give_each_sequence_alone_log_probs_and_lora_gradients(prefix_sharing):
    rows = with_kl_completions(random_rows(SHAPES, seed=5))
    labels = torch.tensor([row["label"] for row in rows])
    stock = lora(build_model("llama", vocab_size=VOCAB)).train()
    packed = slipstream.optimize(copy.deepcopy(stock)).train()  # the chunked loss: sums, no logits
    with torch.no_grad():
        reference = alone_sums(stock, rows) - 0.25  # any reference: a non-zero KL and rewards

    batch = collate_kto(rows, prefix_sharing)
    packed(**batch.model_inputs())
    ours = answer_logprobs_of(batch)
    kto_loss(ours, reference, labels).backward()
    theirs = alone_sums(stock, rows)
    kto_loss(theirs, reference, labels).backward()

    assert (ours.detach() - theirs.detach()).abs().max().item() <= 1e-5
    checked = 0
    for (name, mine), (_, expected) in zip(packed.named_parameters(), stock.named_parameters(), strict=True):
        if expected.grad is None:
            assert mine.grad is None, name
            continue
        assert (mine.grad - expected.grad).abs().max().item() <= 1e-5, name
        checked += "lora_" in name
    assert checked == 8  # A and B of q_proj and v_proj in both layers
