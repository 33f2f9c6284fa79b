"""slipstream inside TRL's SFTTrainer and the HF Trainer: the same losses as slipstream's own loop.

Both trainers get ``slipstream.optimize`` + ``PackedCollator`` and are lined up with
``train_step`` on the same batches: a sequential sampler (no shuffling), the same micro-batches
per step (gradient accumulation 2, so the token weighting across micro-batches is exercised),
AdamW with the same hyperparameters, a constant LR, no weight decay, the same clipping, fp32,
and the same initial weights (the same seed to ``build_model``).
"""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerCallback

import slipstream
from slipstream.bench.peers.trl_base import checkpointing_argument as _checkpointing_argument
from slipstream.data import demo_samples, demo_tokenizer, pack_samples
from slipstream.models import build_model
from slipstream.packing import PackedCollator, PackedInputs
from slipstream.train.step import train_step

STEPS, GRAD_ACCUM, LR, MAX_GRAD_NORM = 10, 2, 3e-3, 1.0


@pytest.fixture(scope="module")
def tokenizer():
    return demo_tokenizer()


@pytest.fixture(scope="module")
def samples(tokenizer):
    return demo_samples(tokenizer, num_rows=120, seed=0)


@pytest.fixture(scope="module")
def bins(samples):
    bins, _ = pack_samples(samples, max_seq_len=256, seed=0)
    return bins[: STEPS * GRAD_ACCUM]


def tiny_model(tokenizer):
    return slipstream.optimize(build_model("qwen3", vocab_size=len(tokenizer), seed=0))


def reference_losses(tokenizer, steps_of_micro_batches: list[list[list[dict]]]) -> list[float]:
    """slipstream's own loop: one train_step per step, one packed row per micro-batch."""
    model = tiny_model(tokenizer).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for micro_batches in steps_of_micro_batches:
        packed = [slipstream.collate_packed(docs) for docs in micro_batches]
        micro = [(batch.model_inputs(), batch.num_label_tokens) for batch in packed]
        losses.append(train_step(model, micro, optimizer, max_grad_norm=MAX_GRAD_NORM)["loss"])
    return losses


def aligned_args() -> dict:
    """TrainingArguments that make the Trainer take the same steps as ``reference_losses``."""
    return dict(
        max_steps=STEPS,
        gradient_accumulation_steps=GRAD_ACCUM,
        train_sampling_strategy="sequential",  # no shuffling: dataset order is batch order
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        optim="adamw_torch",  # torch.optim.AdamW, as the reference
        max_grad_norm=MAX_GRAD_NORM,
        bf16=False,  # SFTConfig defaults to bf16 (autocast), which would not be the same arithmetic
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
    )


class LossRecorder(TrainerCallback):
    """Collects the loss the Trainer logs at every step (logging_steps=1), unrounded."""

    def __init__(self):
        self.losses: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def differently_sized(steps_of_micro_batches) -> bool:
    """True when some step's micro-batches hold different label-token counts (else a mean of means would pass)."""
    counts = [
        [slipstream.collate_packed(d).num_label_tokens for d in step] for step in steps_of_micro_batches
    ]
    return any(len(set(step)) > 1 for step in counts)


def test_sft_trainer_matches_slipstream_loop(tmp_path, tokenizer, bins):
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    # One feature per pre-packed bin, so with batch size 1 TRL trains on exactly our bins.
    rows = [{"input_ids": [d["input_ids"] for d in b], "labels": [d["labels"] for d in b]} for b in bins]
    recorder = LossRecorder()
    args = SFTConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=1,
        dataset_kwargs={"skip_prepare_dataset": True},  # the rows are already tokenized and packed
        # TRL's default; recomputation must not change the loss (the argument's name before 5.24's rename)
        **{_checkpointing_argument(SFTConfig): True},
        **aligned_args(),
    )
    trainer = SFTTrainer(
        model=tiny_model(tokenizer),
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        data_collator=PackedCollator(),
        callbacks=[recorder],
    )
    trainer.train()

    steps = [bins[s * GRAD_ACCUM : (s + 1) * GRAD_ACCUM] for s in range(STEPS)]
    assert differently_sized(steps)
    ours = reference_losses(tokenizer, steps)
    assert len(recorder.losses) == STEPS
    assert max(abs(a - b) for a, b in zip(recorder.losses, ours, strict=True)) <= 1e-4, (
        recorder.losses,
        ours,
    )
    assert sum(ours[-3:]) < sum(ours[:3])  # it trains


def test_hf_trainer_matches_slipstream_loop(tmp_path, tokenizer, samples):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    # One feature per document: the Trainer's batch of 3 documents becomes one packed row.
    per_row = 3
    docs = [{"input_ids": d["input_ids"][:96], "labels": d["labels"][:96]} for d in samples]
    docs = docs[: STEPS * GRAD_ACCUM * per_row]
    recorder = LossRecorder()
    trainer = Trainer(
        model=tiny_model(tokenizer),
        args=TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=per_row, **aligned_args()
        ),
        train_dataset=Dataset.from_list(docs),
        data_collator=PackedCollator(),
        callbacks=[recorder],
    )
    trainer.train()

    rows = [docs[i : i + per_row] for i in range(0, len(docs), per_row)]
    steps = [rows[s * GRAD_ACCUM : (s + 1) * GRAD_ACCUM] for s in range(STEPS)]
    assert differently_sized(steps)
    ours = reference_losses(tokenizer, steps)
    assert max(abs(a - b) for a, b in zip(recorder.losses, ours, strict=True)) <= 1e-4, (
        recorder.losses,
        ours,
    )


def test_the_feature_shapes_pack_to_the_same_row():
    docs = [
        {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
        {"input_ids": [8, 9], "labels": [8, 9]},
        {"input_ids": [10, 11, 12, 13]},
    ]
    expected = slipstream.collate_packed(docs)
    collate = PackedCollator()
    as_documents = collate(docs).batch
    as_bins = collate(
        [
            {"input_ids": [d["input_ids"] for d in docs[:2]], "labels": [d["labels"] for d in docs[:2]]},
            {"input_ids": [docs[2]["input_ids"]]},
        ]
    ).batch
    trl_packed = collate(
        [
            {
                "input_ids": [t for d in docs for t in d["input_ids"]],
                "labels": [t for d in docs for t in d.get("labels", d["input_ids"])],
                "seq_lengths": [3, 2, 4],
            }
        ]
    ).batch
    for batch in (as_documents, as_bins, trl_packed):
        assert batch.seq_lens == expected.seq_lens
        assert torch.equal(batch.input_ids, expected.input_ids)
        assert torch.equal(batch.labels, expected.labels)
        assert torch.equal(batch.cu_seqlens, expected.cu_seqlens)
    # The Trainer's count (labels[..., 1:]) is the count slipstream's own loop divides by.
    assert int((expected.labels[..., 1:] != -100).sum()) == expected.num_label_tokens


def test_padding_is_refused():
    with pytest.raises(ValueError, match="padding"):
        PackedCollator()([{"input_ids": [1, 2, 0], "attention_mask": [1, 1, 0]}])


def test_moving_the_inputs_moves_the_batch_once():
    from accelerate.utils import send_to_device

    inputs = PackedCollator()([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    moved = send_to_device(inputs, "meta")  # what the Trainer's accelerate dataloader does
    assert isinstance(moved, PackedInputs)
    assert moved["input_ids"].device.type == "meta"
    assert moved["input_ids"] is moved.batch.input_ids  # the kwargs and the packed attention agree
    assert moved["cu_seq_lens_q"] is moved.batch.cu_seqlens
