"""The CUDA engine and the CUDA device policy, without CUDA.

tests/offload/test_schedule.py proves the offload schedule on a ``RecordingEngine``. Here the
real ``CudaEngine`` runs a whole offloaded step on a fake CUDA device, over a recording stand-in
for ``torch.cuda``'s streams and events, and must issue exactly that schedule as stream calls:
copies on the copy stream and non-blocking, streams (never the host) waiting on events, the
allocator told about every device tensor the copy stream reads, host buffers pinned.
"""

import contextlib
import itertools
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import slipstream
from slipstream.models import build_model
from slipstream.offload import (
    CudaEngine,
    DeviceDescription,
    RecordingEngine,
    choose_policy,
    enable_checkpointing,
)
from slipstream.offload import policy as policy_module
from tests.conftest import random_docs
from tests.fake_cuda import (
    GiB,
    backward_by_hand,
    fake_cuda,
    requires_fake_cuda,
    skip_logit_probe,
    tiny_cuda_model,
)

pytestmark = pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor:UserWarning")

LAYERS = 4
DOCS = random_docs([30, 50, 20])


class FakeStream:
    def __init__(self, streams, name):
        self.streams, self.name = streams, name

    def wait_event(self, event):
        self.streams.log.append(("wait", self.name, event.name))

    def synchronize(self):
        self.streams.blocking.append(f"{self.name}.synchronize")


class FakeEvent:
    def __init__(self, streams, **kwargs):
        self.streams, self.name = streams, f"event{next(streams.events)}"

    def record(self, stream=None):
        self.streams.log.append(("record", self.name, (stream or self.streams.current).name))

    def synchronize(self):
        self.streams.blocking.append(f"{self.name}.synchronize")


class FakeCudaStreams(TorchDispatchMode):
    """``torch.cuda``'s stream API as a log; copies (seen at dispatch) logged with their stream."""

    def __init__(self):
        super().__init__()
        self.log, self.blocking, self.recorded, self.host_buffers = [], [], [], []
        self.events = itertools.count(1)
        self.compute = self.current = FakeStream(self, "compute")
        self.side = 0

    def Stream(self, device=None, priority=0):
        self.side += 1
        return FakeStream(self, "copy" if self.side == 1 else f"side{self.side}")

    def Event(self, **kwargs):
        return FakeEvent(self, **kwargs)

    def current_stream(self, device=None):
        return self.current

    @contextlib.contextmanager
    def stream(self, stream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def record_stream(self, tensor, stream):
        # aten::record_stream has a CUDA kernel only ("dispatch: CUDA: record_stream_cuda"); a host
        # tensor fails at dispatch exactly like this, on any build.
        if tensor.device.type != "cuda":
            raise NotImplementedError(
                f"Could not run 'aten::record_stream' with arguments from the '{tensor.device.type.upper()}' backend"
            )
        self.recorded.append((tensor, stream.name))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            self.log.append(
                ("copy", self.current.name, f"{src.device.type}->{dst.device.type}", non_blocking, src)
            )
        host = kwargs.get("device", torch.device("cpu")).type == "cpu"
        if func is torch.ops.aten.empty.memory_format and host and list(args[0]):  # not a 0-d dtype probe
            self.host_buffers.append(kwargs.get("pin_memory"))
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def installed(self):
        with pytest.MonkeyPatch.context() as patch, self:
            for name in ("Stream", "Event", "current_stream", "stream"):
                patch.setattr(torch.cuda, name, getattr(self, name))
            patch.setattr(torch.cuda, "synchronize", lambda device=None: self.blocking.append("synchronize"))
            patch.setattr(torch.Tensor, "record_stream", lambda t, stream: self.record_stream(t, stream))
            patch.setattr(
                torch.cuda, "get_rng_state", lambda device="cuda": torch.zeros(16, dtype=torch.uint8)
            )
            patch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": None)
            yield self


def test_record_stream_has_no_host_kernel():
    """What FakeCudaStreams.record_stream emulates: no CPU kernel in the dispatcher (nor in CUDA builds)."""
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::record_stream", "CPU")
    with pytest.raises(NotImplementedError, match="from the 'CPU' backend"):
        torch.empty(4).record_stream(torch.Stream("cpu"))


def backward_into_grad(tensors, grad_tensors=None, **kwargs):
    """``torch.autograd.backward`` by hand: the offloaded layer's backward calls it for its recompute."""
    for leaf, grad in backward_by_hand(tensors, grad_tensors).items():
        leaf.grad = grad if leaf.grad is None else leaf.grad + grad


def recording_schedule(mode: str) -> list[tuple]:
    """The schedule RecordingEngine logs for one step (test_schedule.py proves it right)."""
    model = build_model("llama", layers=LAYERS).train()
    slipstream.optimize(model)
    engine = RecordingEngine()
    enable_checkpointing(model, mode, engine=engine, min_offload_bytes=0)
    model(**slipstream.collate_packed(DOCS).model_inputs()).loss.backward()
    return engine.log


def cuda_step(mode: str, monkeypatch, pinned_ok: bool = True):
    """One offloaded bf16 step on fake CUDA with the real CudaEngine: (streams log, policy, manager, grads)."""
    streams = FakeCudaStreams()
    monkeypatch.setattr(torch.autograd, "backward", backward_into_grad)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda index: SimpleNamespace(name="H100", is_integrated=False)
    )
    monkeypatch.setattr(policy_module, "_pinned_allocation_works", lambda: pinned_ok)
    with fake_cuda(cuda_available=True), streams.installed():
        model = tiny_cuda_model("llama", layers=LAYERS)
        slipstream.optimize(model)
        skip_logit_probe(model)
        policy, manager = enable_checkpointing(model, mode, min_offload_bytes=0)  # the device detected
        loss = model(**slipstream.collate_packed(DOCS, device="cuda").model_inputs()).loss
        grads = backward_by_hand([loss])
    for param in model.parameters():
        if param.grad is not None:
            grads[param] = grads.get(param, 0) + param.grad
    return streams, policy, manager, model, grads


@requires_fake_cuda
@pytest.mark.parametrize("mode", ["offload", "offload-double"])
def test_cuda_engine_issues_the_recorded_schedule_as_stream_calls(monkeypatch, mode):
    expected = recording_schedule(mode)
    streams, policy, manager, model, grads = cuda_step(mode, monkeypatch)
    assert policy.mode == mode and policy.pinned and isinstance(manager.engine, CudaEngine)
    # the same records, waits and copies in the same order, on the same streams
    events = {}

    def event(name):  # CUDA events are anonymous: name them by creation, as the recording engine does
        return events.setdefault(name, f"event{len(events) + 1}")

    def as_cuda(entry):
        kind = entry[0]
        if kind == "record":
            return ("record", event(entry[1]), entry[2])
        if kind == "wait":
            return ("wait", entry[1], event(entry[2]))
        return ("copy", entry[1], "cuda->cpu" if entry[2].startswith("offload") else "cpu->cuda")

    def transfer(entry):  # the model's own copies stay on their device
        return entry[0] == "copy" and entry[2] in ("cuda->cpu", "cpu->cuda")

    copies = [e for e in streams.log if transfer(e)]
    scheduled = [e[:3] for e in streams.log if e[0] != "copy" or transfer(e)]
    assert scheduled == [as_cuda(e) for e in expected if e[0] != "mark"]
    assert {e[1] for e in copies} == {"copy"} and all(e[3] for e in copies)  # side stream, non-blocking
    # the allocator is told about every device tensor the copy stream reads, and nothing else
    device_sources = [e[4] for e in copies if e[2] == "cuda->cpu"]
    assert [t for t, _ in streams.recorded] == device_sources and {s for _, s in streams.recorded} == {"copy"}
    assert streams.blocking == []  # no synchronize anywhere: the host never waits
    assert streams.host_buffers and all(streams.host_buffers)  # the host pool is pinned
    assert manager.saved == {}
    assert all(p in grads for p in model.parameters() if p.requires_grad)


@requires_fake_cuda
def test_pageable_host_buffers_where_pinning_fails(monkeypatch):
    streams, policy, manager, _, _ = cuda_step("offload", monkeypatch, pinned_ok=False)
    assert not policy.pinned and any("pageable" in r for r in policy.reasons)
    assert streams.host_buffers and not any(streams.host_buffers)


def describe(monkeypatch, name="H100", integrated=False, free=70 * GiB, pinned_ok=True):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda index: SimpleNamespace(name=name, is_integrated=integrated),
    )
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (free, 80 * GiB))
    monkeypatch.setattr(policy_module, "_pinned_allocation_works", lambda: pinned_ok)
    return DeviceDescription.detect(torch.device("cuda"))


def test_detect_reads_the_cuda_device(monkeypatch):
    device = describe(monkeypatch, name="NVIDIA GH200", integrated=True, free=90 * GiB)
    assert device == DeviceDescription(
        has_cuda=True, name="NVIDIA GH200", is_integrated=True, free_bytes=90 * GiB, pinned_ok=True
    )
    assert DeviceDescription.detect(torch.device("cpu")) == DeviceDescription(has_cuda=False)


@pytest.mark.parametrize(
    "device, mode, pinned, reason",
    [
        (dict(), "offload-double", True, "auto: offload with double-buffered"),
        (dict(integrated=True), "offload", True, "unified-memory device: single buffer"),
        (dict(free=100 << 20), "offload", True, "not enough for a second"),
        (dict(pinned_ok=False), "offload-double", False, "pinned allocation failed"),
    ],
)
def test_auto_policy_on_a_detected_cuda_device(monkeypatch, device, mode, pinned, reason):
    policy = choose_policy("auto", describe(monkeypatch, **device), buffer_bytes=64 << 20)
    assert policy.mode == mode and policy.pinned is pinned
    assert any(reason in r for r in policy.reasons), policy.reasons


def test_pinned_check_on_this_build_reports_failure_instead_of_raising():
    """The real probe: without CUDA, pinning raises; the check says False (pageable buffers)."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine pins")
    assert policy_module._pinned_allocation_works() is False


@requires_fake_cuda
def test_cuda_engine_allocates_pinned_host_and_device_buffers(monkeypatch):
    """CudaEngine's two allocators, outside inference mode (an eval must not poison them)."""
    streams = FakeCudaStreams()
    with fake_cuda(), streams.installed(), torch.inference_mode():
        engine = CudaEngine(torch.device("cuda"))
        host = engine.host_empty(32, torch.bfloat16, pinned=True)
        device = engine.device_empty(32, torch.bfloat16)
        assert engine.copy_stream.name == "copy" and engine.compute_stream() is streams.compute
    assert streams.host_buffers == [True]
    assert host.device.type == "cpu" and device.device.type == "cuda"
    assert not host.is_inference() and not device.is_inference()
