"""Regional compile (slipstream.compile): every decoder layer compiled once for all packed
batches, the same losses and gradients as the eager layers, no host reads in a graph, the
packed-attention guards still raising, and the "auto" decision."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from peft import LoraConfig, get_peft_model
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch._functorch.aot_autograd import make_boxed_func

import slipstream
from slipstream.bench.counters import HOST_SYNC_OPS
from slipstream.compile import regional, should_compile
from slipstream.compile.regional import compiled_layers
from slipstream.models import build_model
from slipstream.packing import PACKED_BATCH_KWARG, collate_packed
from slipstream.packing.guards import UnsupportedArchitecture
from tests.conftest import random_docs

VOCAB = 256
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Total lengths 31, 42, 31, 40, 33 and 1 to 6 documents: each batch a new length or document count.
BATCHES = [[5, 17, 9], [30, 12], [7, 7, 7, 7, 3], [40], [3, 4, 5, 6, 7, 8]]


class RecordingBackend:
    """A torch.compile backend (AOT autograd, eager kernels) that keeps every graph it is given:
    ``compiles`` counts dynamo's graphs, ``ops`` every ATen op of their forwards and backwards."""

    def __init__(self):
        self.compiles = 0
        self.ops: set[str] = set()

        def keep(graph, example_inputs):
            self.ops.update(str(node.target) for node in graph.graph.nodes if node.op == "call_function")
            return make_boxed_func(graph.forward)

        self._aot = aot_autograd(fw_compiler=keep, bw_compiler=keep)

    def __call__(self, graph, example_inputs):
        self.compiles += 1
        return self._aot(graph, example_inputs)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def lora_model(family: str, compile: str, layers: int = 2, dtype=torch.float32):
    model = build_model(family, vocab_size=VOCAB, seed=0, layers=layers, dtype=dtype)
    slipstream.optimize(model, compile=compile)
    return with_lora(model)


def with_lora(model):
    """Rank-8 LoRA on every projection, seeded, with B given a size."""
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    torch.manual_seed(2)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:  # B starts at zero in PEFT: give the update a size, so it is tested
            parameter.data.normal_(0, 0.05)
    return model


def step(model, lengths, seed=0):
    model.zero_grad(set_to_none=True)
    batch = collate_packed(random_docs(lengths, vocab_size=VOCAB, seed=seed))
    loss = model(**batch.model_inputs()).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


@pytest.mark.slow  # two inductor builds (about 2 min on 2 cores): run by .ci/run (make compile-check)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_compiled_layers_match_eager_and_compile_once_for_every_packed_batch(family):
    """Inductor, fp32: each of five packed batches (new total length or document count every time)
    gives the eager model's loss and LoRA gradients within 1e-5 relative; dynamo compiles its
    frames on the first batch only (``counters["frames"]["ok"]`` and ``unique_graphs`` unchanged
    after it, ``counters["recompiles"]`` empty): dynamic shapes from the first compile, so there
    is no later dynamic recompile either."""
    eager, compiled = lora_model(family, "off"), lora_model(family, "on")
    assert len(compiled_layers(compiled.get_base_model())) == 2
    first = None
    for index, lengths in enumerate(BATCHES):
        eager_loss, eager_grads = step(eager, lengths, seed=index)
        loss, grads = step(compiled, lengths, seed=index)
        assert torch.allclose(loss, eager_loss, rtol=1e-5, atol=0), (lengths, loss, eager_loss)
        assert set(grads) == set(eager_grads) and len(grads) == 2 * len(TARGETS) * 2
        for name, grad in eager_grads.items():
            scale = grad.abs().max()
            assert (grads[name] - grad).abs().max() <= 1e-5 * scale, (lengths, name)
        seen = (counters["frames"]["ok"], counters["stats"]["unique_graphs"])
        if first is None:
            first = seen
            assert first[1] > 0  # something was compiled
        assert seen == first, f"recompiled for {lengths}: {seen} after {first}"
    assert not counters["recompiles"]
    policies = slipstream.state_of(compiled).policies
    assert any(p.startswith("compile: decoder layers (2 ") and "(requested)" in p for p in policies)


@pytest.mark.slow  # tens of seconds on a 2-core fp32-only CPU: make test-slow (.ci/run)
def test_one_graph_serves_every_layer_and_no_graph_reads_the_host(monkeypatch):
    """With 2 or 5 layers dynamo compiles the same number of graphs (one per layer class and
    region between graph breaks, not per layer), and none of their forward or backward graphs holds
    a host-syncing op (``HOST_SYNC_OPS``). The step is also counted with HostSyncCounter: 0; dynamo
    runs frames eagerly while a TorchDispatchMode is active, so that count covers the eager path
    and the graphs' own ops are what prove the compiled one."""
    from slipstream.bench.counters import HostSyncCounter

    compiles = {}
    for layers in (2, 5):
        torch._dynamo.reset()
        backend = RecordingBackend()
        monkeypatch.setattr(regional, "BACKEND", backend)
        model = lora_model("qwen3", "on", layers=layers)
        for index, lengths in enumerate(BATCHES[:3]):
            step(model, lengths, seed=index)
        compiles[layers] = backend.compiles
        host_ops = {op for op in backend.ops if op.split(".")[1:2] and op.split(".")[1] in HOST_SYNC_OPS}
        assert not host_ops, host_ops
        assert any("mm" in op for op in backend.ops)  # the graphs hold the layers' work
        with HostSyncCounter() as syncs:
            step(model, BATCHES[3], seed=3)
        assert syncs.total == 0, syncs.by_op
    assert compiles[2] == compiles[5] > 0


@pytest.mark.slow  # tens of seconds on a 2-core fp32-only CPU: make test-slow (.ci/run)
def test_the_packed_attention_guards_still_raise_in_compiled_layers(monkeypatch):
    monkeypatch.setattr(regional, "BACKEND", RecordingBackend())
    model = build_model("llama", vocab_size=VOCAB)
    slipstream.optimize(model, compile="on")
    batch = collate_packed(random_docs([6, 9], vocab_size=VOCAB))
    model(**batch.model_inputs()).loss.backward()  # compiled
    attention = model.model.layers[1].self_attn
    original = attention.forward

    def forward_without_kwargs(hidden_states, position_embeddings, attention_mask, **kwargs):
        kwargs.pop(PACKED_BATCH_KWARG)  # what a decoder layer that does not pass **kwargs on does
        return original(hidden_states, position_embeddings, attention_mask, **kwargs)

    attention.forward = forward_without_kwargs
    with pytest.raises(UnsupportedArchitecture, match=r"LlamaAttention \(layer 1\) was called without"):
        model(**collate_packed(random_docs([5, 8], vocab_size=VOCAB)).model_inputs())
    del attention.forward
    padded = {"input_ids": torch.tensor([[3, 4, 5, 0]]), "attention_mask": torch.tensor([[1, 1, 1, 0]])}
    with pytest.raises(ValueError, match="PackedBatch"):
        model(**padded)


def test_compile_off_and_undo_put_the_eager_layers_back(monkeypatch):
    monkeypatch.setattr(regional, "BACKEND", RecordingBackend())
    model = build_model("qwen3", vocab_size=VOCAB)
    slipstream.optimize(model, compile="on")
    assert len(compiled_layers(model)) == 2 and slipstream.state_of(model).compiled
    slipstream.optimize(model, compile="off")
    assert not compiled_layers(model) and not slipstream.state_of(model).compiled
    assert slipstream.state_of(model).policies[-1] == "compile: off (requested)"
    slipstream.optimize(model, compile="on")
    slipstream.state_of(model).undo()
    assert not compiled_layers(model)


def test_auto_compiles_only_a_run_long_enough_to_pay_back(monkeypatch):
    model = build_model("qwen3", vocab_size=VOCAB)
    slipstream.optimize(model)  # plain optimize: no step count, so "auto" stays off and says why
    assert not compiled_layers(model)
    assert any(
        "compile: off (auto: the run's step count is unknown" in p
        for p in slipstream.state_of(model).policies
    )

    # the measured thresholds (should_compile's docstring): 500 steps on CPU, CUDA not measured yet
    assert [should_compile("auto", n, "cpu")[0] for n in (499, 500)] == [False, True]
    assert should_compile("auto", 10**6, "cuda") == (
        False,
        "off (auto: no measured break-even on cuda yet; compile='on' to run it)",
    )
    monkeypatch.setitem(regional.BREAK_EVEN_STEPS, "cpu", 50)
    assert should_compile("auto", 49, "cpu") == (
        False,
        "off (auto: 49 steps, fewer than the 50 that pay back the cold start on cpu)",
    )
    assert should_compile("auto", 50, "cpu")[0]
    assert should_compile("on", 1, "cpu") == (True, "requested")
    assert should_compile("off", 10**6, "cpu")[0] is False
    monkeypatch.setitem(regional.BREAK_EVEN_STEPS, "cpu", None)
    on, why = should_compile("auto", 10**6, "cpu")
    assert not on and "no measured break-even on cpu" in why
    monkeypatch.setattr(regional, "BACKEND", RecordingBackend())
    monkeypatch.setitem(regional.BREAK_EVEN_STEPS, "cpu", 3)
    slipstream.optimize(model, expected_steps=3)
    assert len(compiled_layers(model)) == 2
    assert "auto: 3 steps, at least the 3" in slipstream.state_of(model).policies[-1]


@pytest.mark.slow  # tens of seconds on a 2-core fp32-only CPU: make test-slow (.ci/run)
def test_a_step_under_a_dispatch_mode_runs_eagerly_and_leaves_later_steps_compiled(monkeypatch):
    """slipstream counts a step's host syncs under a TorchDispatchMode (ab's first step): dynamo
    would skip the layers' frames there and remember it, leaving every later step eager. The
    counted step runs the eager forward instead, and the next one compiles."""
    from slipstream.bench.counters import HostSyncCounter

    backend = RecordingBackend()
    monkeypatch.setattr(regional, "BACKEND", backend)
    model = lora_model("llama", "on")
    with HostSyncCounter() as syncs:
        step(model, BATCHES[0])
    assert backend.compiles == 0 and syncs.total == 0
    step(model, BATCHES[1], seed=1)
    assert backend.compiles > 0


def test_inductor_availability_is_read_from_what_is_installed(monkeypatch):
    import torch._inductor.cpp_builder as cpp_builder

    works, how = regional.inductor_available("cpu")
    assert works and how.startswith("inductor with the C++ compiler")

    def no_compiler():
        raise RuntimeError("no compiler")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    assert regional.inductor_available("cpu") == (False, "inductor finds no C++ compiler (RuntimeError)")


def _packed_paths():
    """Every way the per-document SDPA backend can run a batch: (name, grouping, short kernel, lengths)."""
    return [
        ("grouped", "grouped", "off", [7, 7, 7, 7, 3]),
        ("per document", "per_document", "off", [7, 7, 7, 7, 3]),
        ("one document", "auto", "off", [40]),
        ("short kernel, per document", "per_document", "on", [5, 17, 9]),
        ("short kernel, grouped", "grouped", "on", [8, 8, 6]),
        ("short kernel, one document", "auto", "on", [12]),
    ]


@pytest.mark.parametrize("name, grouping, short, lengths", _packed_paths())
def test_every_packed_path_hands_the_next_graph_a_fresh_contiguous_row(name, grouping, short, lengths):
    """Dynamo guards a view on its base's sizes, so an attention output that is a view in one batch
    and a fresh tensor in the next rebuilt the compiled graph after it (issue 33: a recompile for
    [7, 7, 7, 7, 3] whenever a calibration taken under load flipped the grouping). Through the
    wrapper compiled layers call it by, every path of the per-document backend returns the same kind:
    [1, T, H, D], contiguous, not a view, with the eager path's values."""
    from slipstream.packing import attention, short_attention
    from slipstream.packing import grouping as grouping_module

    model = build_model("qwen3", vocab_size=VOCAB)
    slipstream.optimize(model, attention_grouping=grouping, short_document_kernel=short)
    module = model.model.layers[0].self_attn
    assert grouping_module.GROUPING_CHOICE[module] == grouping
    assert short_attention.SHORT_KERNEL_CHOICE[module] == short
    batch = collate_packed(random_docs(lengths, vocab_size=VOCAB))
    T = batch.num_tokens
    heads, kv_heads, dim = 4, 2, 16
    q = torch.randn(1, heads, T, dim, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, T, dim, requires_grad=True) for _ in range(2))
    inputs = {PACKED_BATCH_KWARG: batch}
    out, _ = attention._disabled(attention.packed_sdpa_attention)(module, q, k, v, None, **inputs)
    assert out.shape == (1, T, heads, dim) and out.is_contiguous() and not out._is_view(), name
    eager, _ = attention.packed_sdpa_attention(module, q, k, v, None, **inputs)
    assert torch.equal(out, eager)


def test_the_boundary_into_a_compiled_graph_hands_over_a_fresh_tensor():
    """varlen's output is a view (``unsqueeze``): where the attention runs between compiled graphs,
    the wrapper hands it over as a fresh tensor with the same values (and gradient)."""
    from slipstream.packing.attention import _disabled

    def view_returning(x):
        return (x * 2).unsqueeze(0), None

    x = torch.randn(5, 3, requires_grad=True)
    out, _ = _disabled(view_returning)(x)
    assert not out._is_view() and torch.equal(out, (x * 2).unsqueeze(0))
    out.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


def _data_file_batches(tokenizer) -> list:
    """examples/data/chats.jsonl, tokenized (response-only) and packed into 128-token bins."""
    from pathlib import Path

    from slipstream.data import load_samples, pack_samples

    path = Path(__file__).resolve().parents[2] / "examples" / "data" / "chats.jsonl"
    samples, _ = load_samples(path, tokenizer, response_only=True)
    bins, _ = pack_samples(samples, max_seq_len=128)
    return bins


@pytest.mark.slow  # a traced compile per CPU class (about 20 s each on 2 cores): make test-slow
def test_a_compiled_run_over_a_data_files_batches_compiles_once_on_each_cpu_class(
    fake_cpu_class, monkeypatch
):
    """The real data file's packed batches through compiled layers, on each CPU class (its own dtype
    and its own calibration): every graph is built on the first batch and ``graph_counts`` does not
    move after it, while the batches themselves take every path the backend has: each class's
    calibrated "auto", then grouped, per document and the short kernel forced in turn (what a
    calibration under load could flip)."""
    from slipstream.compile import graph_counts
    from slipstream.data import demo_tokenizer
    from slipstream.packing import grouping, short_attention
    from slipstream.train.precision import resolve_dtype

    monkeypatch.setattr(regional, "BACKEND", RecordingBackend())
    dtype, _ = resolve_dtype("auto", torch.device("cpu"))
    tokenizer = demo_tokenizer()
    model = build_model("qwen3", vocab_size=len(tokenizer), seed=0, layers=2, dtype=dtype)
    slipstream.optimize(model, compile="on")
    model = with_lora(model)
    attention_modules = [m for m in model.modules() if m in grouping.GROUPING_CHOICE]
    assert attention_modules
    choices = [("auto", "auto"), ("grouped", "off"), ("per_document", "off"), ("per_document", "on")]
    first, seen_paths = None, set()
    for index, docs in enumerate(_data_file_batches(tokenizer)[:12]):
        group_mode, short = choices[index % len(choices)]
        for module in attention_modules:
            grouping.GROUPING_CHOICE[module] = group_mode
            short_attention.SHORT_KERNEL_CHOICE[module] = short
        model.zero_grad(set_to_none=True)
        batch = collate_packed(docs)
        model(**batch.model_inputs()).loss.backward()
        seen_paths.add((group_mode, short, batch.num_docs > 1))
        counts = graph_counts()
        if first is None:
            first = counts
            assert first["graphs"] > 0
        assert counts == first, f"batch {index} ({group_mode}, short kernel {short}): {counts} after {first}"
    assert len(seen_paths) >= len(choices)
