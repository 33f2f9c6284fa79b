"""The offload schedule, proven on an event log from a recording engine (no GPU needed)."""

import re

import pytest
import torch

import slipstream
from slipstream.models import build_model
from slipstream.offload import RecordingEngine, enable_checkpointing
from tests.conftest import random_docs

LAYERS = 8


def run_step(mode):
    model = build_model("llama", layers=LAYERS).train()
    slipstream.optimize(model)
    engine = RecordingEngine()
    _, manager = enable_checkpointing(model, mode, engine=engine, min_offload_bytes=0)
    seen: dict[int, list[torch.Tensor]] = {}
    for index, layer in enumerate(model.model.layers):  # the norm sees each layer's input, also on recompute
        layer.input_layernorm.register_forward_pre_hook(
            lambda module, args, index=index: seen.setdefault(index, []).append(args[0].detach().clone())
        )
    batch = slipstream.collate_packed(random_docs([30, 50, 20]))
    model(**batch.model_inputs()).loss.backward()
    return engine.log, seen, manager


def position(log, entry):
    return log.index(entry)


def reload_copies(log):
    """(log index, layer, slot) of every reload."""
    out = []
    for i, entry in enumerate(log):
        if entry[0] == "copy" and (m := re.fullmatch(r"reload(\d+)->slot(\d+)", entry[2])):
            out.append((i, int(m[1]), int(m[2])))
    return out


def test_double_buffer_issues_the_next_reload_before_the_current_layer_computes():
    log, _, _ = run_step("offload-double")
    copies = {layer: i for i, layer, _ in reload_copies(log)}
    # the last layer's input stays on the device; every other layer's input comes back
    assert sorted(copies) == list(range(LAYERS - 1))
    for layer in range(1, LAYERS):
        assert copies[layer - 1] < position(log, ("mark", f"backward{layer}-begin")), layer
    # and each reload overlaps a layer: it is issued before the previous layer's compute ends
    for layer in range(1, LAYERS):
        assert copies[layer - 1] < position(log, ("mark", f"backward{layer}-end"))


def test_single_buffer_reloads_only_after_the_buffer_is_free():
    log, _, _ = run_step("offload")
    for i, layer, slot in reload_copies(log):
        assert slot == 0
        if layer + 1 < LAYERS - 1:  # the previous reader of the one buffer has finished its backward
            assert position(log, ("mark", f"backward{layer + 1}-end")) < i


@pytest.mark.parametrize("mode", ["offload", "offload-double"])
def test_no_buffer_is_overwritten_before_its_reader_is_done(mode):
    log, _, _ = run_step(mode)
    last_reader: dict[int, int] = {}
    for i, layer, slot in reload_copies(log):
        if slot in last_reader:
            reader = last_reader[slot]
            end = position(log, ("mark", f"backward{reader}-end"))
            freed = [e for e in log[end:i] if e[0] == "record" and e[1].startswith(f"slot{slot}-free")]
            assert freed, f"slot {slot} rewritten for layer {layer} with no free event after layer {reader}"
            assert ("wait", "copy", freed[-1][1]) in log[end:i], "the copy stream must wait for that event"
        last_reader[slot] = layer
    # and no layer reads its buffer before its reload landed
    for _, layer, _ in reload_copies(log):
        done = [e for e in log if e[0] == "record" and e[1].startswith(f"reload{layer}-done")][-1][1]
        assert position(log, ("wait", "compute", done)) < position(log, ("mark", f"backward{layer}-begin"))


@pytest.mark.parametrize("mode", ["offload", "offload-double"])
def test_each_layer_recomputes_from_exactly_its_own_input(mode):
    _, seen, manager = run_step(mode)
    assert sorted(seen) == list(range(LAYERS))
    for layer, inputs in seen.items():
        assert len(inputs) == 2  # forward, then the recompute in backward
        assert torch.equal(inputs[0], inputs[1]), layer
    assert manager.saved == {}  # every layer released its input


def test_host_buffers_are_pooled_and_grown_not_reallocated():
    model = build_model("llama", layers=4).train()
    slipstream.optimize(model)
    _, manager = enable_checkpointing(model, "offload-double", engine=RecordingEngine(), min_offload_bytes=0)
    pool_ids = []
    for lengths in ([30, 10], [25, 15], [60, 40]):  # 40, 40, then 100 tokens
        model(**slipstream.collate_packed(random_docs(lengths)).model_inputs()).loss.backward()
        pool_ids.append({k: v.data_ptr() for k, v in manager.host_pool.items()})
    assert pool_ids[0] == pool_ids[1]  # same size: reused
    assert pool_ids[2] != pool_ids[1]  # longer batch: grown
