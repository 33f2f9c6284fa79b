"""Fake CUDA on a CPU-only torch: run slipstream's CUDA branches under ``FakeTensorMode``.

What ``FakeTensorMode`` with ``device="cuda"`` does on a CPU-only build (probed on 2.13.0+cpu):

- Tensors are created on ``cuda:0`` and most ops trace: matmul, index_select, argsort, cumsum,
  scatter_add, split/cat, SDPA, ``torch._grouped_mm`` (whose meta kernel checks the CUDA rules:
  bf16 only, leading stride a 16-byte multiple), ``torch.nn.attention.varlen.varlen_attn``.
- Any op that takes a CUDA DeviceGuard fails with "PyTorch is not linked with support for cuda
  devices": Python indexing (``t[2:5]``), ``nonzero``, and autograd recording a CUDA result
  that requires grad, which *aborts the process* (a C++ ``terminate``). ``FakeTensorMode``
  calls ``torch._C._ensureCUDADeviceGuardSet()`` to install c10's ``FakeGuardImpl<CUDA>``, but
  c10 only swaps it in where a CUDA guard is already registered (a CUDA build without GPUs);
  on a CPU-only build it returns at once. :func:`install_cuda_device_guard` registers that same
  object through the exported ``c10::impl::registerDeviceGuard``; with it every op above works.
- The autograd *engine* still cannot run a backward over CUDA tensors here (``InputBuffer::add``
  asks ``at::accelerator`` for the current stream: "Cannot access accelerator device when none
  is available"; faking an accelerator via PrivateUse1 then trips the engine's stream asserts).
  :func:`backward_by_hand` walks the ``grad_fn`` graph and calls every node itself, so every
  backward kernel still runs on fake CUDA tensors; ``test_backward_by_hand_matches_the_engine``
  (tests/packing/test_fake_cuda.py) holds it to the engine's gradients on real CPU tensors.
- Host reads raise: ``.item()`` / ``.tolist()`` / ``bool()`` / ``torch.equal`` ->
  ``DataDependentOutputException``; ``nonzero`` / ``bincount`` / ``repeat_interleave`` without
  ``output_size`` -> ``DynamicOutputShapeException``. That is the no-sync check.
- Not available, so patched by :func:`fake_cuda` or the tests: ``torch.cuda.get_device_capability``,
  ``mem_get_info``, ``memory_reserved/allocated``, ``is_available``, streams, events, RNG state;
  ``pin_memory`` (NYI in fake mode). ``flex_attention`` cannot be traced (dynamo reaches the
  accelerator check).
- ``_grouped_mm`` outputs: a CUDA build's meta pads an output's row pitch to 16 bytes (a rank-4
  bf16 LoRA output then passes, and its contiguous gradient fails in backward); this build's are
  contiguous, so :class:`GroupedMMChecker` flags such an output already in forward.
- The process-abort reported for ``varlen_attn`` under fake CUDA is the autograd abort above
  (any op on inputs that require grad); with the guard installed varlen traces, backward too.
"""

from __future__ import annotations

import contextlib
import ctypes
import struct
import sys
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from torch.utils._python_dispatch import TorchDispatchMode

# What a data-dependent host read raises on a fake tensor.
HOST_READ_ERRORS = (DataDependentOutputException, DynamicOutputShapeException)

_CUDA = 1  # c10::DeviceType::CUDA
_REGISTRY = "_ZN3c104impl26device_guard_impl_registryE"
_REGISTER = "_ZN3c104impl19registerDeviceGuardENS_10DeviceTypeEPKNS0_24DeviceGuardImplInterfaceE"
_FAKE_GUARD = "_ZZN3c104impl24ensureCUDADeviceGuardSetEvE15fake_cuda_guard"  # FakeGuardImpl<CUDA>
_FAKE_GUARD_VTABLE = "_ZTVN3c104impl13FakeGuardImplILNS_10DeviceTypeE1EEE"


def _elf_symbols(path: Path, wanted: set[str]) -> dict[str, int]:
    """Values of ``wanted`` symbols from a little-endian ELF64 file's symbol tables."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return {}
    (section_offset,) = struct.unpack_from("<Q", data, 0x28)
    entry_size, count = struct.unpack_from("<HH", data, 0x3A)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", data, section_offset + i * entry_size) for i in range(count)
    ]
    found: dict[str, int] = {}
    for _, kind, _, _, offset, size, link, _, _, _ in sections:
        if kind not in (2, 11):  # SHT_SYMTAB, SHT_DYNSYM
            continue
        names = sections[link][4]
        for i in range(size // 24):
            name_at, _, _, _, value, _ = struct.unpack_from("<IBBHQQ", data, offset + i * 24)
            start = names + name_at
            name = data[start : data.index(b"\0", start)].decode(errors="replace")
            if name in wanted and value:
                found[name] = value
    return found


@cache
def _guard_handles() -> tuple[ctypes.c_void_p, object, int] | str | None:
    """(registry CUDA slot, registerDeviceGuard, FakeGuardImpl<CUDA> address), None where a CUDA
    build registers a guard itself, or why neither."""
    if torch.version.cuda is not None:
        return None
    if not sys.platform.startswith("linux"):
        return f"the CUDA device-guard shim reads an ELF libc10 (platform {sys.platform})"
    path = Path(torch.__file__).parent / "lib" / "libc10.so"
    if not path.exists():
        return f"no {path}"
    symbols = _elf_symbols(path, {_REGISTRY, _FAKE_GUARD, _FAKE_GUARD_VTABLE})
    if len(symbols) != 3:
        return f"libc10 does not expose c10's fake CUDA guard here (found {sorted(symbols)})"
    lib = ctypes.CDLL(str(path))
    base = ctypes.addressof(ctypes.c_void_p.in_dll(lib, _REGISTRY)) - symbols[_REGISTRY]
    guard = base + symbols[_FAKE_GUARD]
    # A constant-initialised object: its first word is the vtable's address point (Itanium ABI).
    if ctypes.c_void_p.from_address(guard).value != base + symbols[_FAKE_GUARD_VTABLE] + 16:
        return "c10's fake CUDA guard is not laid out as expected"
    register = getattr(lib, _REGISTER)
    register.argtypes, register.restype = [ctypes.c_int8, ctypes.c_void_p], None
    slot = ctypes.c_void_p.from_address(base + symbols[_REGISTRY] + 8 * _CUDA)
    return slot, register, guard


def unavailable_reason() -> str | None:
    """Why fake CUDA cannot run on this torch (None: it can)."""
    handles = _guard_handles()
    return handles if isinstance(handles, str) else None


requires_fake_cuda = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


@contextlib.contextmanager
def install_cuda_device_guard() -> Iterator[None]:
    """c10's ``FakeGuardImpl<CUDA>`` registered as the CUDA device guard; the previous one after."""
    handles = _guard_handles()
    if isinstance(handles, str):
        pytest.skip(handles)
    if handles is None:  # a CUDA build: its own guard (or c10's fallback) is in place
        yield
        return
    slot, register, guard = handles
    previous = slot.value
    register(_CUDA, guard)
    try:
        yield
    finally:
        register(_CUDA, previous)


@dataclass
class FakeCuda:
    """What :func:`fake_cuda` hands the test: the mode and the host tensors pinned under it."""

    mode: FakeTensorMode
    pinned: list[torch.Tensor] = field(default_factory=list)

    def to_cuda(self, tensor: torch.Tensor) -> torch.Tensor:
        """A real host tensor as a fake one on the fake CUDA device."""
        return self.mode.from_tensor(tensor).to("cuda")


GiB = 1 << 30


@contextlib.contextmanager
def fake_cuda(
    capability: tuple[int, int] = (9, 0),
    free_bytes: int = 60 * GiB,
    total_bytes: int = 80 * GiB,
    cuda_available: bool = False,
) -> Iterator[FakeCuda]:
    """A fake CUDA device: ``FakeTensorMode`` plus the ``torch.cuda`` queries slipstream makes.

    ``cuda_available``: also say ``torch.cuda.is_available()`` (slipstream then picks the varlen
    kernel and pins host tensors; ``Tensor.pin_memory`` is recorded, since fake mode cannot pin).
    """
    state = FakeCuda(mode=FakeTensorMode())

    def pin(tensor: torch.Tensor) -> torch.Tensor:
        state.pinned.append(tensor)
        return tensor

    with contextlib.ExitStack() as stack:
        stack.enter_context(install_cuda_device_guard())
        stack.enter_context(state.mode)  # before is_available is patched: no real device init
        patches = {
            "torch.cuda.get_device_capability": lambda device=None: capability,
            "torch.cuda.mem_get_info": lambda device=None: (free_bytes, total_bytes),
            "torch.cuda.memory_reserved": lambda device=None: 0,
            "torch.cuda.memory_allocated": lambda device=None: 0,
        }
        if cuda_available:
            patches["torch.cuda.is_available"] = lambda: True
            stack.enter_context(mock.patch.object(torch.Tensor, "pin_memory", pin))
            # The mode itself must still know there is no real device (it reads is_available to
            # decide whether constants may be copied to one for real).
            stack.enter_context(
                mock.patch.object(FakeTensorMode, "avoid_device_init", property(lambda self: True))
            )
        for target, replacement in patches.items():
            stack.enter_context(mock.patch(target, replacement))
        yield state


# --------------------------------------------------------------------------- backward without the engine


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    return a if b is None else a + b


def _as_input(grad: torch.Tensor, metadata) -> torch.Tensor:
    """What the engine's ``validate_outputs`` does to a gradient: sum a broadcast, cast the dtype."""
    if tuple(grad.shape) != tuple(metadata.shape):
        grad = grad.sum_to_size(metadata.shape)
    if grad.dtype != metadata.dtype:
        grad = grad.to(metadata.dtype)
    if grad.device != metadata.device:
        raise RuntimeError(f"a gradient on {grad.device} for an input on {metadata.device}")
    return grad


def backward_by_hand(
    roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None = None
) -> dict[torch.Tensor, torch.Tensor]:
    """Reverse mode over ``roots``' ``grad_fn`` graph, each node called directly: {leaf: gradient}.

    The engine's own bookkeeping, done here: nodes in reverse topological order, gradients summed
    per input, cast and reduced to the input's metadata, a Python Function's missing gradients
    materialised as zeros and its per-argument results matched to its tensor inputs.
    """
    grads = list(grads) if grads is not None else [torch.ones_like(r) for r in roots]
    order, seen = [], set()
    stack = [(r.grad_fn, False) for r in roots if r.grad_fn is not None]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
        elif node not in seen:
            seen.add(node)
            stack.append((node, True))
            stack += [(child, False) for child, _ in node.next_functions if child is not None]
    pending: dict[object, dict[int, torch.Tensor]] = defaultdict(dict)
    for root, grad in zip(roots, grads, strict=True):
        if root.grad_fn is not None:
            pending[root.grad_fn][root.output_nr] = _add(pending[root.grad_fn].get(root.output_nr), grad)
    leaves: dict[torch.Tensor, torch.Tensor] = {}
    with torch.no_grad():
        for node in reversed(order):
            inputs = pending.pop(node, {})
            if not inputs:
                continue
            if hasattr(node, "variable"):  # AccumulateGrad: a leaf
                leaves[node.variable] = _add(leaves.get(node.variable), inputs.get(0))
                continue
            metadata = node._input_metadata
            args = [inputs.get(i) for i in range(len(metadata))]
            if isinstance(node, torch.autograd.function.BackwardCFunction):
                args = [
                    torch.zeros(m.shape, dtype=m.dtype, device=m.device) if a is None else a
                    for a, m in zip(args, metadata, strict=True)
                ]
                outs = node.apply(*args)
                outs = (outs,) if isinstance(outs, torch.Tensor) or outs is None else outs
                # One result per forward argument; the edges are the arguments that need a gradient.
                needed = [i for i, need in enumerate(node.needs_input_grad) if need]
                edges = [edge for edge in node.next_functions if edge[0] is not None]
                assert len(needed) == len(edges), node.name()
                pairs = [
                    (edge, outs[i] if i < len(outs) else None) for edge, i in zip(edges, needed, strict=True)
                ]
            else:
                outs = node(*args)
                outs = (outs,) if isinstance(outs, torch.Tensor) or outs is None else outs
                pairs = list(zip(node.next_functions, outs, strict=True))  # as the engine checks
            for (child, index), grad in pairs:
                if child is not None and grad is not None:
                    grad = _as_input(grad, child._input_metadata[index])
                    pending[child][index] = _add(pending[child].get(index), grad)
    return leaves


# --------------------------------------------------------------------------- grouped_mm operands


class MisalignedGroupedMM(AssertionError):
    """A tensor reached ``grouped_mm`` that CUDA's kernel would refuse (dtype or 16-byte rule)."""


@dataclass
class GroupedMMCall:
    shapes: tuple[tuple[int, ...], ...]  # mat_a, mat_b, output
    strides: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]


def grouped_mm_problems(tensor: torch.Tensor, name: str) -> list[str]:
    """Why ``tensor`` breaks CUDA grouped_mm's operand rules: bf16, a 16-byte aligned start (the
    storage offset: fake storages start at 0, CUDA's allocator aligns real ones), every
    non-unit stride (row pitch) a whole number of 16-byte units."""
    size = tensor.element_size()
    problems = []
    if tensor.dtype != torch.bfloat16:
        problems.append(f"{name} is {tensor.dtype}, CUDA grouped_mm runs bfloat16")
    if tensor.storage_offset() * size % 16:
        problems.append(f"{name} starts {tensor.storage_offset() * size} bytes into its storage")
    bad = [s for s in tensor.stride() if s != 1 and s * size % 16]
    if bad:
        problems.append(f"{name} {tuple(tensor.shape)} has strides {tensor.stride()}: {bad} x {size} bytes")
    return problems


class GroupedMMChecker(TorchDispatchMode):
    """Sees every ``aten._grouped_mm`` (forward and backward) and raises on a bad operand or output
    (an output is the next call's operand, and its gradient backward's); records the good ones."""

    def __init__(self):
        super().__init__()
        self.calls: list[GroupedMMCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.ops.aten._grouped_mm.default:
            return func(*args, **kwargs)
        mat_a, mat_b = args[0], args[1]
        offs = args[2] if len(args) > 2 else kwargs.get("offs")
        problems = grouped_mm_problems(mat_a, "mat_a") + grouped_mm_problems(mat_b, "mat_b")
        if offs is None or offs.dtype != torch.int32 or offs.device != mat_a.device:
            problems.append(f"offs must be int32 on {mat_a.device}, got {offs!r}")
        if problems:
            raise MisalignedGroupedMM("; ".join(problems))
        out = func(*args, **kwargs)
        problems = grouped_mm_problems(out, "output")  # the next op's operand (and backward's grad)
        if problems:
            raise MisalignedGroupedMM("; ".join(problems))
        self.calls.append(
            GroupedMMCall(
                shapes=(tuple(mat_a.shape), tuple(mat_b.shape), tuple(out.shape)),
                strides=(mat_a.stride(), mat_b.stride(), out.stride()),
                dtypes=(mat_a.dtype, mat_b.dtype, out.dtype),
            )
        )
        return out


# --------------------------------------------------------------------------- a training step


def tiny_cuda_model(family: str, **overrides) -> torch.nn.Module:
    """A tiny bf16 model of ``family`` built on the (fake) CUDA device, in training mode."""
    from slipstream.models import build_model

    with torch.device("cuda"):
        return build_model(family, dtype=torch.bfloat16, **overrides).train()


def skip_logit_probe(model: torch.nn.Module) -> None:
    """Put the chunked loss in its steady state. Its first training forward reads one probe row
    to the host (documented, once per model) to match the logit transform; these families have
    none to match, so the identity is what that probe finds."""
    import slipstream
    from slipstream.loss.chunked_loss import LogitTransform, transform_candidates

    chunked = slipstream.state_of(model).chunked_loss
    if chunked is not None:
        assert transform_candidates(model) == [LogitTransform()], "this family transforms its logits"
        chunked.transform = LogitTransform()


def train_step(model: torch.nn.Module, batch) -> tuple[torch.Tensor, dict[torch.Tensor, torch.Tensor]]:
    """One packed forward and its backward (by hand): (loss, {parameter: gradient})."""
    loss = model(**batch.model_inputs()).loss
    return loss, backward_by_hand([loss])
