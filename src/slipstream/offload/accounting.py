"""Bytes of activations a forward keeps on the device for backward: a figure no clock can blur.

Counted with ``saved_tensors_hooks`` over one forward: every tensor autograd saves for
backward, once per storage, if it lives on the model's device, plus the offload manager's
device-resident layer inputs and the reload buffers its backward will need. The offload
manager's host pool is not saved through autograd, so it is never counted, as on a GPU,
where it is host memory.
"""

from __future__ import annotations

import weakref

import torch


class _Saved:
    """What the probe's pack hook hands autograd: a tensor autograd saved, weakly referable (alive
    while the graph that saved it is)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def device_activation_bytes(model: torch.nn.Module, inputs: dict, manager=None) -> int:
    """Run ``model(**inputs)`` and return the activation bytes kept for its backward (no backward run).

    A backward that runs inside the forward (the chunked loss of a trained head differentiates each
    chunk through ``torch.autograd.grad`` while its logits are alive) unpacks what it saved there; such
    tensors are freed before the forward returns, so only what is still saved when it returns counts."""
    device = next(model.parameters()).device
    not_activations = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: list[tuple[weakref.ref, int, int]] = []  # (the saved handle, its storage, its bytes)

    def pack(tensor: torch.Tensor) -> _Saved:
        # A detached view is handed back, never the tensor: a tensor its own grad_fn saves (an
        # activation's output) would hold its node through a Python object that node holds, a cycle
        # through C++ no garbage collector sees (on SmolLM2-135M: 1.3-1.7 GB alive to the process's end).
        handle = _Saved(tensor.detach())
        storage = tensor.untyped_storage()
        if tensor.device == device and storage.data_ptr() not in not_activations:
            saved.append((weakref.ref(handle), storage.data_ptr(), storage.nbytes()))
        return handle

    def unpack(handle: _Saved) -> torch.Tensor:
        return handle.tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        output = model(**inputs)
    # still saved when the forward returned: what its backward would read (once per storage)
    storages = {ptr: nbytes for handle, ptr, nbytes in saved if handle() is not None}
    total = sum(storages.values())
    if manager is not None:
        resident = {
            s.device_tensor.untyped_storage().data_ptr(): s.device_tensor.untyped_storage().nbytes()
            for s in manager.saved.values()
            if s.device_tensor is not None
        }
        total += sum(nbytes for ptr, nbytes in resident.items() if ptr not in storages)
        offloaded = [s.shape.numel() * s.dtype.itemsize for s in manager.saved.values() if s.stored]
        total += len(manager.slots) * max(offloaded, default=0)  # the reload buffers backward will need
        manager.saved.clear()  # this forward's backward will not run
    del output
    return total
