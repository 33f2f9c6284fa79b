"""The chunked loss inside real transformers models: the stock loss and every gradient, exactly.

Each case trains one step twice from the same weights, once with transformers' loss (full
logits) and once with the chunked loss, on packed batches with masked prompts, and compares
the loss and every gradient (<= 1e-5 relative, fp32).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    CohereConfig,
    Gemma2Config,
    GraniteConfig,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.modeling_outputs import CausalLMOutputWithPast

import slipstream
from slipstream.bench.counters import HostSyncCounter, LargeTensorWatch
from slipstream.loss import LogitsNotComputed, UnsupportedLoss, chunked_evaluation
from slipstream.models import build_model
from slipstream.packing import collate_padded
from tests.conftest import random_docs

VOCAB = 300
LENGTHS = [5, 17, 9, 30, 12]
TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=VOCAB,
    use_cache=False,
)


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def prompt_masked_docs(lengths=LENGTHS, seed=3, prompt=3):
    docs = random_docs(lengths, vocab_size=VOCAB, seed=seed)
    for doc in docs:
        doc["labels"] = [-100 if i < prompt else t for i, t in enumerate(doc["input_ids"])]
    return docs


def pair(model, lora=None, packed_attention=True, **optimize_kwargs):
    """(stock, chunked): the same weights; only the loss differs."""
    stock = copy.deepcopy(model)
    slipstream.optimize(stock, packed_attention=packed_attention, chunked_loss=False)
    slipstream.optimize(model, packed_attention=packed_attention, chunked_loss=True, **optimize_kwargs)
    models = []
    for m in (stock, model):
        if lora is not None:
            from peft import get_peft_model

            torch.manual_seed(0)
            m = get_peft_model(m, copy.deepcopy(lora))
        models.append(m.train())
    return models


def step(model, micro_batches):
    """Forward + backward over micro-batches, token-weighted over all of them; returns the loss and grads."""
    model.zero_grad(set_to_none=True)
    total = torch.tensor(float(sum(b.num_label_tokens for b in micro_batches)))
    loss = 0.0
    for batch in micro_batches:
        out = model(**batch.model_inputs(num_items_in_batch=total))
        out.loss.backward()
        loss += out.loss.detach()
    return loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_same_step(stock, chunked, micro_batches, tolerance=1e-5):
    stock_loss, stock_grads = step(stock, micro_batches)
    loss, grads = step(chunked, micro_batches)
    assert rel(loss, stock_loss) <= tolerance
    assert grads.keys() == stock_grads.keys()
    for name, grad in grads.items():
        assert rel(grad, stock_grads[name]) <= tolerance, name
    return grads


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3-moe", "gpt-oss"])
def test_full_fine_tune_with_accumulation_matches_stock(family):
    extra = {"output_router_logits": True, "router_aux_loss_coef": 0.05} if family == "qwen3-moe" else {}
    stock, chunked = pair(build_model(family, vocab_size=VOCAB, **extra), loss_chunk_tokens=16)
    micro = [slipstream.collate_packed(prompt_masked_docs(seed=s)) for s in (3, 4)]
    grads = assert_same_step(stock, chunked, micro)
    assert "lm_head.weight" in grads and "model.embed_tokens.weight" in grads


def test_tied_embeddings_match_stock():
    model = build_model("llama", vocab_size=VOCAB, tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    stock, chunked = pair(model, loss_chunk_tokens=8)
    assert_same_step(stock, chunked, [slipstream.collate_packed(prompt_masked_docs())])


def test_head_with_bias_matches_stock():
    model = build_model("qwen3", vocab_size=VOCAB)
    torch.manual_seed(5)
    model.lm_head = torch.nn.Linear(64, VOCAB, bias=True)
    stock, chunked = pair(model, loss_chunk_tokens=8)
    grads = assert_same_step(stock, chunked, [slipstream.collate_packed(prompt_masked_docs())])
    assert "lm_head.bias" in grads


@pytest.mark.parametrize(
    "targets, modules_to_save",
    [
        (["q_proj", "k_proj", "v_proj", "o_proj"], None),  # the head frozen
        (["q_proj", "v_proj", "lm_head"], None),  # LoRA on the head (TRL refuses this)
        (["q_proj", "v_proj"], ["lm_head"]),  # the head trained in full beside the adapter
    ],
)
def test_lora_variants_match_stock(targets, modules_to_save):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets, modules_to_save=modules_to_save)
    model = build_model("qwen3", vocab_size=VOCAB)
    stock, chunked = pair(model, lora=lora, loss_chunk_tokens=16)
    # LoRA B starts at zero; one SGD step gives the adapters values, so the second step tests them.
    for m in (stock, chunked):
        step(m, [slipstream.collate_packed(prompt_masked_docs(seed=9))])
        with torch.no_grad():
            for p in m.parameters():
                if p.grad is not None:
                    p -= 0.5 * p.grad
    grads = assert_same_step(stock, chunked, [slipstream.collate_packed(prompt_masked_docs())])
    if "lm_head" in targets:
        assert any("lm_head.lora_A" in n for n in grads) and any("lm_head.lora_B" in n for n in grads)
    if modules_to_save:
        assert any("lm_head.modules_to_save" in n for n in grads)


@pytest.mark.parametrize(
    "config",
    [
        Gemma2Config(**TINY, final_logit_softcapping=3.0, attn_logit_softcapping=None),
        GraniteConfig(**TINY, logits_scaling=4.0),
        CohereConfig(**TINY, logit_scale=0.25),
    ],
    ids=["gemma2-softcap", "granite-logits-scaling", "cohere-logit-scale"],
)
def test_scaled_and_softcapped_logits_match_stock(config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    stock, chunked = pair(model, loss_chunk_tokens=16)
    assert_same_step(stock, chunked, [slipstream.collate_packed(prompt_masked_docs())])
    policies = " ".join(chunked.slipstream.policies)
    expected = {"Gemma2Config": "softcap 3", "GraniteConfig": "scale 0.25", "CohereConfig": "scale 0.25"}
    assert expected[type(config).__name__] in policies


def test_padded_batches_without_packing_match_stock():
    model = build_model("llama", vocab_size=VOCAB)
    stock, chunked = pair(model, packed_attention=False, loss_chunk_tokens=8)
    padded = collate_padded(prompt_masked_docs())
    stock_out, out = stock(**padded), chunked(**padded)
    assert rel(out.loss, stock_out.loss) <= 1e-6


def test_an_all_masked_micro_batch_adds_nothing_and_no_nan():
    stock, chunked = pair(build_model("qwen3", vocab_size=VOCAB), loss_chunk_tokens=8)
    masked = random_docs([6, 9], vocab_size=VOCAB)
    for doc in masked:
        doc["labels"] = [-100] * len(doc["input_ids"])
    micro = [slipstream.collate_packed(prompt_masked_docs()), slipstream.collate_packed(masked)]
    assert micro[1].num_label_tokens == 0
    assert_same_step(stock, chunked, micro)
    chunked.zero_grad()
    out = chunked(**micro[1].model_inputs())  # alone, without num_items_in_batch: 0, not NaN
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert all(torch.isfinite(p.grad).all() for p in chunked.parameters() if p.grad is not None)


def test_no_host_sync_and_no_tokens_by_vocab_tensor():
    vocab = 5000  # large enough that half of T x V dwarfs every activation (and the head's gradient)
    model = build_model("qwen3", vocab_size=vocab)
    slipstream.optimize(model, loss_chunk_tokens=16)
    model.train()
    batch = slipstream.collate_packed(random_docs([40, 100, 25, 77], vocab_size=vocab))
    model(**batch.model_inputs()).loss.backward()  # the first forward verifies the logit transform once
    tokens = batch.num_tokens
    with HostSyncCounter() as syncs, LargeTensorWatch(min_numel=tokens * vocab // 2) as big:
        model(**batch.model_inputs()).loss.backward()
    assert syncs.total == 0, dict(syncs.by_op)
    assert big.seen == [], big.seen
    stock = build_model("qwen3", vocab_size=vocab)
    slipstream.optimize(stock, chunked_loss=False)
    stock.train()
    with LargeTensorWatch(min_numel=tokens * vocab // 2) as big:
        stock(**batch.model_inputs()).loss.backward()
    assert big.seen  # the watch does see the stock loss's [T, V] logits


def test_only_labelled_positions_reach_the_head():
    model = build_model("llama", vocab_size=VOCAB)
    slipstream.optimize(model, loss_chunk_tokens=1000)
    model.train()
    rows = []
    model.lm_head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
    batch = slipstream.collate_packed(prompt_masked_docs(prompt=6))
    model(**batch.model_inputs())
    model(**batch.model_inputs())
    # The first forward adds an empty call (the skipped head) per forward; the chunks hold labelled rows only.
    assert batch.num_label_tokens == sum(max(0, n - 6) for n in LENGTHS)
    assert max(rows) == batch.num_label_tokens


def test_training_returns_no_logits_but_eval_and_no_grad_do():
    model = build_model("qwen3", vocab_size=VOCAB)
    slipstream.optimize(model)
    batch = slipstream.collate_packed(prompt_masked_docs())
    model.train()
    out = model(**batch.model_inputs())
    assert isinstance(out.logits, LogitsNotComputed) and out.loss.requires_grad
    with torch.no_grad():
        assert model(**batch.model_inputs()).logits.shape == (1, batch.num_tokens, VOCAB)
    model.eval()
    evaluated = model(**batch.model_inputs())
    assert evaluated.logits.shape == (1, batch.num_tokens, VOCAB)
    assert rel(evaluated.loss, out.loss.detach()) <= 1e-6
    slipstream.optimize(model, chunked_loss=False)
    model.train()
    assert model(**batch.model_inputs()).logits is not None  # the toggle restores the stock loss
    assert "chunked loss: off (stock loss)" in model.slipstream.policies


@pytest.mark.parametrize("head", ["frozen", "lora", "modules_to_save"])
def test_a_chunked_evaluation_matches_the_stock_loss_and_keeps_no_gradient(head):
    """model.eval() + no_grad with labels inside chunked_evaluation: the stock full-logits loss, no graph."""
    from peft import LoraConfig

    targets = ["q_proj", "v_proj"] + (["lm_head"] if head == "lora" else [])
    saved = ["lm_head"] if head == "modules_to_save" else None
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets, modules_to_save=saved)
    stock, chunked = pair(build_model("qwen3", vocab_size=VOCAB), lora=lora, loss_chunk_tokens=16)
    for m in (stock, chunked):  # give the adapters values, then evaluate
        step(m, [slipstream.collate_packed(prompt_masked_docs(seed=9))])
        with torch.no_grad():
            for p in m.parameters():
                if p.grad is not None:
                    p -= 0.5 * p.grad
        m.zero_grad(set_to_none=True)
        m.eval()
    batch = slipstream.collate_packed(prompt_masked_docs())
    with torch.no_grad():
        expected = stock(**batch.model_inputs())
        with chunked_evaluation(chunked) as served:
            got = chunked(**batch.model_inputs())
        outside = chunked(**batch.model_inputs())
    assert served and isinstance(got.logits, LogitsNotComputed)
    assert abs(got.loss.item() - expected.loss.item()) <= 1e-5 * abs(expected.loss.item())
    assert not got.loss.requires_grad and got.loss.grad_fn is None
    assert all(p.grad is None for p in chunked.parameters())
    assert outside.logits.shape == expected.logits.shape  # outside the block: the stock path, logits


def test_a_chunked_evaluation_builds_no_tokens_by_vocab_tensor():
    vocab = 5000
    model = build_model("qwen3", vocab_size=vocab)
    slipstream.optimize(model, loss_chunk_tokens=16)
    batch = slipstream.collate_packed(random_docs([40, 100, 25, 77], vocab_size=vocab))
    model.eval()
    with torch.no_grad(), chunked_evaluation(model):
        model(**batch.model_inputs())  # the first forward verifies the logit transform once
        with HostSyncCounter() as syncs, LargeTensorWatch(min_numel=batch.num_tokens * vocab // 2) as big:
            loss = model(**batch.model_inputs()).loss
        inputs = {k: v for k, v in batch.model_inputs().items() if k != "labels"}
        assert model(**inputs).logits.shape == (1, batch.num_tokens, vocab)  # no labels: logits
    assert syncs.total == 0, dict(syncs.by_op)
    assert big.seen == [], big.seen
    stock = build_model("qwen3", vocab_size=vocab)
    slipstream.optimize(stock, chunked_loss=False)
    stock.eval()
    with (
        torch.no_grad(),
        chunked_evaluation(stock) as served,
        LargeTensorWatch(batch.num_tokens * vocab // 2) as big,
    ):
        expected = stock(**batch.model_inputs()).loss
    assert not served and big.seen  # no chunked loss: the stock loss, whose [T, V] logits the watch sees
    assert rel(loss, expected) <= 1e-5


def test_using_the_training_logits_says_why_and_names_the_fix():
    """Not "'NoneType' object has no attribute 'shape'": the message names chunked_loss=False."""
    model = build_model("qwen3", vocab_size=VOCAB)
    slipstream.optimize(model)
    batch = slipstream.collate_packed(prompt_masked_docs())
    model.train()
    for _ in range(2):  # the first forward (the probe row) and a later one alike
        out = model(**batch.model_inputs())
        fix = r"chunked_loss=False.*speedups\.chunked_loss: false"
        with pytest.raises(AttributeError, match=fix):
            out.logits.shape  # noqa: B018
        with pytest.raises(TypeError, match=fix):
            out.logits[:, -1]
        with pytest.raises(TypeError, match=fix):
            torch.softmax(out.logits, dim=-1)
        with pytest.raises(TypeError, match=fix):
            out.logits.float() * 2
        # Passed along, it is harmless: the stock layout, no stale tensor behind it, no tensor-like look.
        assert list(out.keys()) == ["loss", "logits"]
        assert out["logits"] is out.logits and out.to_tuple()[1] is out.logits
        assert not hasattr(out.logits, "dtype") and getattr(out.logits, "shape", None) is None
        assert "chunked loss" in repr(out)
        assert torch.equal(out.to_tuple()[0], out.loss)
        out.loss.backward()


class _ExtraTransformLlama(LlamaForCausalLM):
    """A model that does something to its logits that no config field names."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
        logits = self.lm_head(hidden) * 0.5 + 1.0
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=VOCAB, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class _InlineLossLlama(LlamaForCausalLM):
    """A model that computes its cross-entropy itself instead of through loss_function."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
        logits = self.lm_head(hidden)
        loss = F.cross_entropy(logits[0, :-1].float(), labels[0, 1:], ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class _SometimesInlineLossLlama(LlamaForCausalLM):
    """Names loss_function in its forward but, in training, computes a loss of its own."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
        logits = self.lm_head(hidden)
        if not self.training:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=VOCAB, **kwargs)
        else:
            loss = logits.float().logsumexp(-1).mean()  # shape-agnostic: runs on any logits
        return CausalLMOutputWithPast(loss=loss, logits=logits)


def test_a_model_with_an_unknown_logit_transform_is_refused_on_its_first_step():
    torch.manual_seed(0)
    model = _ExtraTransformLlama(LlamaConfig(**TINY)).train()
    slipstream.optimize(model, packed_attention=False)
    assert model.slipstream.chunked_loss is not None
    with pytest.raises(UnsupportedLoss, match="transforms its logits .* does not know"):
        model(**collate_padded(prompt_masked_docs()))


def test_a_model_computing_its_own_loss_is_refused():
    model = _InlineLossLlama(LlamaConfig(**TINY)).train()
    slipstream.optimize(model, packed_attention=False)  # default: off, and says why
    assert any("does not call model.loss_function" in p for p in model.slipstream.policies)
    with pytest.raises(UnsupportedLoss, match="does not call model.loss_function"):
        slipstream.optimize(model, packed_attention=False, chunked_loss=True)
    model = _SometimesInlineLossLlama(LlamaConfig(**TINY)).train()
    slipstream.optimize(model, packed_attention=False)
    with pytest.raises(UnsupportedLoss, match="without model.loss_function"):
        model(**collate_padded(prompt_masked_docs()))


def test_a_model_with_its_own_loss_type_keeps_the_stock_loss_or_refuses():
    model = build_model("llama", vocab_size=VOCAB)
    model.loss_function = lambda logits, labels, vocab_size, **kw: logits.sum() * 0
    slipstream.optimize(model)
    assert any("chunked loss: off" in p and "its own loss" in p for p in model.slipstream.policies)
    with pytest.raises(UnsupportedLoss, match="its own loss"):
        slipstream.optimize(model, chunked_loss=True)


def test_label_positions_come_from_the_host_or_are_not_selected_on_a_device():
    from slipstream.loss.chunked_loss import ChunkedLoss, _Call

    batch = slipstream.collate_packed(prompt_masked_docs())
    shifted = torch.nn.functional.pad(batch.labels, (0, 1), value=-100)[..., 1:]
    targets = shifted.reshape(-1)
    packed = _Call(labels=batch.labels, packed_batch=batch)
    positions = ChunkedLoss._labelled_positions(packed, batch.labels, shifted, targets, -100)
    assert positions is batch.loss_positions  # built by the collator from Python ints
    assert torch.equal(positions, torch.nonzero(targets != -100).squeeze(1))
    # Not the batch's labels (changed after collating): found again, never trusted stale.
    other = batch.labels.clone()
    again = ChunkedLoss._labelled_positions(
        _Call(labels=other, packed_batch=batch), other, shifted, targets, -100
    )
    assert again is not batch.loss_positions
    # Off the CPU without a PackedBatch, nothing is selected (a nonzero would read the device).
    on_device = targets.to("meta")
    unpacked = _Call(labels=batch.labels, packed_batch=None)
    assert ChunkedLoss._labelled_positions(unpacked, batch.labels, shifted, on_device, -100) is None


def test_a_repeated_position_sums_its_gradients_in_fp32():
    """A prefix group's row repeats positions (a labelled prefix token once per continuation): their
    gradients are summed in fp32 and rounded once, not added one by one in bf16 (CUDA's index_add)."""
    from slipstream.loss.chunked_loss import gather_rows

    hidden = torch.zeros(3, 64, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.tensor([1] * 300 + [0, 2])
    grad = (torch.randn(302, 64, generator=torch.Generator().manual_seed(0)) * 0.3 + 1.0).bfloat16()
    rows = gather_rows(hidden, positions)
    assert torch.equal(rows, hidden.index_select(0, positions))
    rows.backward(grad)
    exact = torch.zeros(3, 64, dtype=torch.float64).index_add_(0, positions, grad.double())
    torch.testing.assert_close(hidden.grad.double(), exact, rtol=2**-8, atol=0)  # one rounding
