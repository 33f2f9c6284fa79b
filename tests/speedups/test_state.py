"""Each speedup keeps its run-time state in an object of its own module, reached with ``state.of``;
the names callers read on ``state_of(model)`` stay."""

from __future__ import annotations

import slipstream
from slipstream.models import build_model
from slipstream.speedups.attention_grouping import AttentionGroupingState
from slipstream.speedups.chunked_loss import ChunkedLossState
from slipstream.speedups.packed_attention import PackedAttentionState
from slipstream.speedups.short_document_kernel import ShortKernelState


def test_each_speedup_state_is_its_own_object_read_through_the_old_names():
    model = build_model("llama")
    slipstream.optimize(model, attention_grouping="grouped", short_document_kernel="on")
    state = slipstream.state_of(model)
    packed = state.of(PackedAttentionState)
    assert packed is state.of(PackedAttentionState) and packed.hook is not None
    assert state.packed_attention == packed.backend == "slipstream_docwise"
    assert state.of(AttentionGroupingState).choice == "grouped"
    assert state.grouping_counts is state.of(AttentionGroupingState).counts
    assert state.of(ShortKernelState).choice == "on"
    assert state.chunked_loss is state.of(ChunkedLossState).loss is not None
    assert set(state.states) >= {PackedAttentionState, AttentionGroupingState, ChunkedLossState}


def test_the_packed_attention_off_and_on_again_chooses_grouping_and_kernel_afresh():
    """The grouping and the short kernel forget their choices while the packed attention is off, so
    switching it back on applies (and logs) them again."""
    model = build_model("llama")
    slipstream.optimize(model, attention_grouping="grouped")
    state = slipstream.state_of(model)
    slipstream.optimize(model, packed_attention=False, attention_grouping="grouped")
    assert state.packed_attention is None and state.of(AttentionGroupingState).choice is None
    assert state.of(ShortKernelState).choice is None and state.of(PackedAttentionState).hook is None
    said = len(state.policies)
    slipstream.optimize(model, attention_grouping="grouped")
    assert state.of(AttentionGroupingState).choice == "grouped"
    assert any(line.startswith("packed attention grouping: ") for line in state.policies[said:])
    assert any(line.startswith("short-document kernel: ") for line in state.policies[said:])
    state.undo()
    assert slipstream.state_of(model) is None
