"""Offloaded activation checkpointing with double-buffered, prefetched reloads.

Plugged in as the gradient-checkpointing function of transformers' decoder layers
(``GradientCheckpointingLayer._gradient_checkpointing_func``): each layer runs forward
without keeping its activations, and its input goes to host memory on a side stream (the
last layer's input, and inputs under ``min_offload_bytes``, stay on the device). In
backward the layers come back in reverse; each one's input is copied back into one of the
device reload buffers, the layer is recomputed and back-propagated.

- ``offload`` (one buffer): layer i's reload can only start once layer i+1 is done with the
  buffer, so the copy is exposed.
- ``offload-double`` (two buffers): as soon as layer i has its input, the reload of layer
  i-1's input is issued into the other buffer, so it runs while layer i recomputes and
  back-propagates. Events guard each buffer: a reload waits for the event recorded when the
  buffer's last reader finished, and a layer waits for the event recorded when its reload
  landed. Streams wait on events; the host never blocks.

Host buffers are pooled per layer and grown when a longer batch comes, never reallocated
per step. Dropout RNG state is saved in forward and restored for the recompute.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import MutableMapping, MutableSequence
from dataclasses import dataclass

import torch

from ..packing.guards import bind_running
from ..refusal import Refusal, optimize_call

logger = logging.getLogger("slipstream")


class UnsupportedCheckpointing(Refusal, NotImplementedError):
    """A model whose layers the offloaded checkpointing cannot run exactly; the message says what to use."""

    avoid = {"checkpointing": "recompute"}


# The way out the messages name, generated from the class's ``avoid`` (text and data cannot drift).
# slipstream.optimize(model, checkpointing='recompute')
RECOMPUTE = optimize_call(UnsupportedCheckpointing.avoid)


@dataclass
class _Saved:
    """Where a layer's input lives between forward and backward."""

    layer: int
    shape: torch.Size
    dtype: torch.dtype
    device_tensor: torch.Tensor | None = None  # kept on the device (last layer, tiny inputs)
    stored: bool = False  # copied to the host pool
    offload_done: object = None  # event: the copy to host finished
    slot: int | None = None  # reload buffer holding it in backward
    reload_done: object = None  # event: the copy back finished
    ticket: int = 0  # which forward call saved it (a layer run twice per forward is refused)


class OffloadManager:
    """The schedule of one model's offloaded checkpoints; see the module docstring."""

    def __init__(
        self,
        num_layers: int,
        double_buffer: bool,
        engine,
        pinned: bool = True,
        min_offload_bytes: int = 1 << 20,
    ):
        self.num_layers = num_layers
        self.double_buffer = double_buffer
        self.engine = engine
        self.pinned = pinned
        self.min_offload_bytes = min_offload_bytes
        self.host_pool: dict[int, torch.Tensor] = {}  # layer -> flat host buffer (grown, reused)
        self.slots: list[torch.Tensor | None] = [None, None] if double_buffer else [None]
        self.slot_free: list[object | None] = [None] * len(self.slots)  # event: last reader done
        self.saved: dict[int, _Saved] = {}
        self.tickets = itertools.count(1)

    # ------------------------------------------------------------------ forward
    def offload(self, layer: int, hidden: torch.Tensor) -> _Saved:
        saved = _Saved(layer=layer, shape=hidden.shape, dtype=hidden.dtype)
        nbytes = hidden.numel() * hidden.element_size()
        if layer == self.num_layers - 1 or nbytes < self.min_offload_bytes:
            saved.device_tensor = hidden
        else:
            host = self._host_buffer(layer, hidden.numel(), hidden.dtype)
            ready = self.engine.new_event(f"input{layer}-ready")
            self.engine.record(ready, self.engine.compute_stream())
            self.engine.wait(self.engine.copy_stream, ready)
            self.engine.copy(
                host[: hidden.numel()], hidden.reshape(-1), self.engine.copy_stream, f"offload{layer}"
            )
            saved.offload_done = self.engine.new_event(f"offload{layer}-done")
            self.engine.record(saved.offload_done, self.engine.copy_stream)
            saved.stored = True
        saved.ticket = next(self.tickets)
        self.saved[layer] = saved
        return saved

    def _host_buffer(self, layer: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buffer = self.host_pool.get(layer)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype:
            try:
                buffer = self.engine.host_empty(numel, dtype, self.pinned)
            except RuntimeError as error:  # pinned memory capped: fall back to pageable, once
                if not self.pinned:
                    raise
                logger.info(
                    "offload: pinned host allocation failed (%s): pageable buffers from now on", error
                )
                self.pinned = False
                buffer = self.engine.host_empty(numel, dtype, False)
            self.host_pool[layer] = buffer
        return buffer

    # ------------------------------------------------------------------ backward
    def fetch(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s input on the device, ready for the compute stream; prefetch the next."""
        saved = self.saved[layer]
        if saved.device_tensor is not None:
            hidden = saved.device_tensor
        else:
            if saved.reload_done is None:  # not prefetched (single buffer, or the first reload)
                self._reload(saved)
            self.engine.wait(self.engine.compute_stream(), saved.reload_done)
            hidden = self.slots[saved.slot][: saved.shape.numel()].view(saved.shape)
        if self.double_buffer and layer - 1 in self.saved and self.saved[layer - 1].stored:
            self._reload(self.saved[layer - 1])  # overlaps this layer's recompute + backward
        return hidden

    def _reload(self, saved: _Saved) -> None:
        slot = saved.layer % len(self.slots)
        numel = saved.shape.numel()
        buffer = self.slots[slot]
        if buffer is None or buffer.numel() < numel or buffer.dtype != saved.dtype:
            self.slots[slot] = self.engine.device_empty(numel, saved.dtype)
        self.engine.wait(self.engine.copy_stream, saved.offload_done)
        if self.slot_free[slot] is not None:  # never overwrite a buffer its last reader still uses
            self.engine.wait(self.engine.copy_stream, self.slot_free[slot])
        self.engine.copy(
            self.slots[slot][:numel],
            self.host_pool[saved.layer][:numel],
            self.engine.copy_stream,
            f"reload{saved.layer}->slot{slot}",
        )
        saved.slot = slot
        saved.reload_done = self.engine.new_event(f"reload{saved.layer}-done")
        self.engine.record(saved.reload_done, self.engine.copy_stream)

    def release(self, layer: int) -> None:
        """Layer ``layer``'s backward is done: its reload buffer may be overwritten after this point."""
        saved = self.saved.pop(layer)
        if saved.slot is not None:
            event = self.engine.new_event(f"slot{saved.slot}-free")
            self.engine.record(event, self.engine.compute_stream())
            self.slot_free[saved.slot] = event

    # ------------------------------------------------------------------ the checkpoint function
    def checkpoint_function(self, layer: int):
        """The ``_gradient_checkpointing_func`` for decoder layer ``layer``."""

        def run(function, hidden_states, *args):
            # Only the hidden states are offloaded; any other positional input (a mask, a
            # layer's extra stream such as the original embeddings) stays where it is and is
            # handed to the recompute as it was.
            if not torch.is_grad_enabled():  # nothing to save for a backward that will not come
                return function(hidden_states, *args)
            keywords = getattr(function, "keywords", None) or {}
            problem = _side_input_problem(keywords, args)
            if problem:
                raise UnsupportedCheckpointing(
                    f"decoder layer {layer} {problem}; the offloaded layer runs without autograd in forward, so "
                    f"that gradient would be lost. Use {RECOMPUTE}",
                    refused=f"offloading decoder layer {layer}, whose side inputs need a gradient",
                )
            function = bind_running(function)  # the recompute sees the packed batch of this forward
            return _OffloadedCheckpoint.apply(
                function, self, layer, args, keywords, _GRAD_ANCHOR, hidden_states
            )

        return run


def _needs_grad(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, tuple | list):
        return any(_needs_grad(v) for v in value)
    if isinstance(value, dict):
        return any(_needs_grad(v) for v in value.values())
    return False


def _side_input_problem(keywords: dict, args: tuple) -> str | None:
    """Why a layer's inputs other than its hidden states make offloading it inexact, if they do.

    transformers hands the layer's keyword arguments in ``functools.partial(layer.__call__, **kw)``.
    An input that needs a gradient (a shared block's original embeddings) would get none from a
    forward run without autograd. (A layer that writes into a dict or list argument, a channel
    for KV shared across layers, is caught after its forward: see ``_containers``.)
    """
    for index, value in enumerate(args):
        if _needs_grad(value):
            return f"takes positional input {index + 1} that needs a gradient"
    for name, value in keywords.items():
        if _needs_grad(value):
            return f"takes {name!r}, an input that needs a gradient"
    return None


def _containers(keywords: dict) -> dict[str, tuple]:
    """A fingerprint of the mutable containers among a layer's keyword arguments."""
    prints = {}
    for name, value in keywords.items():
        if isinstance(value, MutableMapping):
            prints[name] = tuple((k, id(v)) for k, v in value.items())
        elif isinstance(value, MutableSequence):
            prints[name] = tuple(id(v) for v in value)
    return prints


# Makes autograd call our backward even when no input needs a gradient (frozen embeddings
# under LoRA): the same reason transformers offers enable_input_require_grads.
_GRAD_ANCHOR = torch.empty(0, requires_grad=True)


class _OffloadedCheckpoint(torch.autograd.Function):
    """A layer run without its activations; its input offloaded; recomputed in backward.

    A layer that returns a tuple (hidden states plus attention weights, router logits, ...)
    is handled too: every tensor output gets its gradient from the recompute.
    """

    @staticmethod
    def forward(
        ctx, function, manager: OffloadManager, layer: int, args: tuple, keywords: dict, anchor, hidden_states
    ):
        ctx.function, ctx.manager, ctx.layer, ctx.args = function, manager, layer, args
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(hidden_states.device) if hidden_states.is_cuda else None
        manager.engine.mark(f"forward{layer}")
        before = _containers(keywords)
        with torch.no_grad():
            output = function(hidden_states, *args)
        changed = [name for name, print_ in _containers(keywords).items() if before.get(name) != print_]
        if changed:
            raise UnsupportedCheckpointing(
                f"decoder layer {layer} wrote into {', '.join(map(repr, changed))}, state a later layer reads (shared "
                "KV); computed without autograd under offload, its gradient would be lost. "
                f"Use {RECOMPUTE}",
                refused=f"offloading decoder layer {layer}, which writes state a later layer reads",
            )
        ctx.ticket = manager.offload(layer, hidden_states.detach()).ticket
        ctx.tuple_output = isinstance(output, tuple)
        return output

    @staticmethod
    def backward(ctx, *grad_outputs):
        manager, layer = ctx.manager, ctx.layer
        saved = manager.saved.get(layer)
        if saved is None or saved.ticket != ctx.ticket:
            raise UnsupportedCheckpointing(
                f"decoder layer {layer} ran more than once in one forward (a looped or shared layer); offloaded "
                f"checkpointing keeps one saved input per layer. Use {RECOMPUTE}",
                refused=f"offloading decoder layer {layer}, which runs more than once per forward",
            )
        hidden = manager.fetch(layer).detach().requires_grad_(True)
        manager.engine.mark(f"backward{layer}-begin")
        with torch.random.fork_rng(devices=[hidden.device] if hidden.is_cuda else [], enabled=True):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, hidden.device)
            with torch.enable_grad():
                output = ctx.function(hidden, *ctx.args)
        outputs = output if ctx.tuple_output else (output,)
        pairs = [
            (out, grad)
            for out, grad in zip(outputs, grad_outputs, strict=False)
            if isinstance(out, torch.Tensor) and out.requires_grad and grad is not None
        ]
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
        manager.engine.mark(f"backward{layer}-end")
        manager.release(layer)
        return None, None, None, None, None, None, hidden.grad
