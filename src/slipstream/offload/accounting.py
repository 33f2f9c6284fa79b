"""Bytes of activations a forward keeps on the device for backward: a figure no clock can blur.

Counted with ``saved_tensors_hooks`` over one forward: every tensor autograd saves for
backward, once per storage, if it lives on the model's device, plus the offload manager's
device-resident layer inputs and the reload buffers its backward will need. The offload
manager's host pool is not saved through autograd, so it is never counted, as on a GPU,
where it is host memory.
"""

from __future__ import annotations

import torch


def device_activation_bytes(model: torch.nn.Module, inputs: dict, manager=None) -> int:
    """Run ``model(**inputs)`` and return the activation bytes kept for its backward (no backward run)."""
    device = next(model.parameters()).device
    not_activations = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    storages: dict[int, int] = {}
    held: list = []  # the saved storages, alive until the count is done (as backward would keep them)

    def pack(tensor: torch.Tensor) -> None:
        # The storage is held, the tensor is not: this forward is never backpropagated, and handing the
        # tensor back to autograd would leak the whole graph: a tensor its own grad_fn saves (an
        # activation's output) then holds its node through a Python object that node holds, a cycle
        # through C++ no garbage collector sees (on SmolLM2-135M: 1.3-1.7 GB alive to the process's end).
        storage = tensor.untyped_storage()
        if tensor.device == device and storage.data_ptr() not in not_activations:
            storages[storage.data_ptr()] = storage.nbytes()
            held.append(storage)

    def unpack(_: None) -> torch.Tensor:
        raise RuntimeError("device_activation_bytes: the probe's forward has no backward")

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        output = model(**inputs)
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
    held.clear()
    return total
