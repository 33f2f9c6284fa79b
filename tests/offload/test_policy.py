"""Every branch of the checkpointing policy, through an injectable device description."""

import pytest
import torch

from slipstream.offload import DeviceDescription, OffloadManager, RecordingEngine, choose_policy

GPU = DeviceDescription(has_cuda=True, name="H100", free_bytes=80 << 30)


@pytest.mark.parametrize("requested", ["auto", "offload", "offload-double"])
def test_no_cuda_means_recompute(requested):
    policy = choose_policy(requested, DeviceDescription(has_cuda=False))
    assert policy.mode == "recompute"
    assert any("no CUDA" in r for r in policy.reasons)


def test_auto_on_a_discrete_gpu_is_double_buffered_offload():
    assert choose_policy("auto", GPU).mode == "offload-double"


def test_unified_memory_gets_no_double_buffer():
    device = DeviceDescription(has_cuda=True, name="GH200", is_integrated=True, free_bytes=80 << 30)
    policy = choose_policy("offload-double", device)
    assert policy.mode == "offload"
    assert any("unified-memory" in r for r in policy.reasons)


def test_too_little_free_memory_for_a_second_buffer_means_single():
    device = DeviceDescription(has_cuda=True, name="RTX 4090", free_bytes=300 << 20)
    policy = choose_policy("auto", device, buffer_bytes=200 << 20)
    assert policy.mode == "offload"
    assert any("not enough for a second" in r for r in policy.reasons)


def test_pinned_allocation_failure_means_pageable():
    device = DeviceDescription(has_cuda=True, name="WSL GPU", free_bytes=8 << 30, pinned_ok=False)
    policy = choose_policy("offload", device)
    assert policy.mode == "offload" and policy.pinned is False
    assert any("pageable" in r for r in policy.reasons)


def test_pinned_environment_override(monkeypatch):
    """(SLIPSTREAM_CHECKPOINTING is applied by Speedups, in one place: tests/speedups/test_speedups.py.)"""
    monkeypatch.setenv("SLIPSTREAM_CHECKPOINTING", "recompute")
    assert choose_policy("offload-double", GPU).mode == "offload-double"  # not read here
    monkeypatch.setenv("SLIPSTREAM_PINNED", "0")
    assert choose_policy("offload", GPU).pinned is False


def test_explicit_modes_pass_and_bad_ones_fail():
    assert choose_policy("off", GPU).mode == "off"
    assert choose_policy("recompute", GPU).mode == "recompute"
    with pytest.raises(ValueError, match="checkpointing must be"):
        choose_policy("swap", GPU)


def test_manager_falls_back_to_pageable_when_pinning_fails_at_allocation():
    class CappedPinning(RecordingEngine):
        def host_empty(self, numel, dtype, pinned):
            if pinned:
                raise RuntimeError("cudaHostAlloc failed: out of pinned memory")
            return super().host_empty(numel, dtype, pinned)

    manager = OffloadManager(3, double_buffer=True, engine=CappedPinning(), pinned=True, min_offload_bytes=0)
    manager.offload(0, torch.ones(4, 8))
    assert manager.pinned is False
    assert torch.equal(manager.host_pool[0][:32].view(4, 8), torch.ones(4, 8))


def test_tiny_inputs_and_the_last_layer_stay_on_the_device():
    manager = OffloadManager(3, double_buffer=True, engine=RecordingEngine(), min_offload_bytes=1 << 20)
    assert manager.offload(0, torch.ones(4, 8)).device_tensor is not None  # 128 bytes: not worth a copy
    manager = OffloadManager(3, double_buffer=True, engine=RecordingEngine(), min_offload_bytes=0)
    assert manager.offload(0, torch.ones(4, 8)).stored
    assert manager.offload(2, torch.ones(4, 8)).device_tensor is not None  # the last layer
