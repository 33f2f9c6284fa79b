"""The chunked loss inside a transformers causal LM, through its public hooks: no forked forward.

A transformers ``*ForCausalLM.forward`` runs the decoder, calls its output-embeddings module
(the LM head) on the hidden states, may transform the logits (scale, soft-cap), then calls
``self.loss_function(logits=..., labels=..., **kwargs)``. ``ChunkedLoss`` plugs into the
three seams, only for a training forward (model in training mode, autograd on, ``labels``
given, no ``logits_to_keep``):

1. a forward pre-hook on the head keeps the hidden states and hands the head an empty slice
   of them, so the head computes no logits (and every transform runs on an empty tensor);
2. ``model.loss_function`` is replaced by this object, which computes the loss from the kept
   hidden states a chunk at a time (:mod:`.linear_ce`), over the labelled positions only;
3. a forward hook on the model clears the state and sets ``logits`` to a :class:`LogitsNotComputed`
   placeholder: a training forward returns ``loss`` only. Evaluation, ``no_grad`` forwards and
   generation take the stock path and get their logits,

unless they run inside :func:`chunked_evaluation` (``with chunked_evaluation(model): ...``):
there a forward given ``labels`` in eval mode or under ``torch.no_grad()`` is armed too, its
loss is computed by the same chunks without computing or keeping any gradient
(:mod:`.linear_ce`'s loss-only path), and its ``out.logits`` is the same placeholder - the
point of evaluating this way is that the ``[tokens, vocab]`` logits never exist. It is opt-in
because code that evaluates with labels usually wants the logits too (metrics, transformers'
``Trainer.evaluate``); ``slipstream train``'s evaluation wants only the loss.

The placeholder stands where the logits would be (``out.logits``, ``out["logits"]``, the same
position of ``out.to_tuple()``), so the output keeps the stock layout, and code that only
passes it along (``ModelOutput`` iteration, ``to_tuple``, accelerate's and DDP's walks over an
output, ``hasattr(x, "dtype")`` tests, ``repr``) works. Using it as a tensor (an attribute such
as ``.shape``, indexing, ``len``, iteration, arithmetic, a ``torch`` function) raises
:class:`LogitsNotComputedError`, which names the fix: ``slipstream.optimize(model,
chunked_loss=False)`` (``speedups.chunked_loss: false`` in a training config), or an eval /
``no_grad`` forward. The error is an ``AttributeError`` and a ``TypeError``, the errors ``None``
would have raised, so code that caught those still does. ``out.logits is None`` is False.

What the model does between its head and its loss is not read from its source: on the
first training forward, the head's output is replaced by a probe row of known logits
(-64 ... 64), the model transforms it as it always does, and the result is matched against
the transforms its config names (scale, soft-cap). If none matches, the model is refused
with an error naming it - never a silently different loss. The probe costs one host read,
once per model.

Which positions are labelled is known on the host from a :class:`PackedBatch`
(``loss_positions``, built by the collator), so selecting them adds no host sync on CUDA.
Without a PackedBatch the positions are found with ``nonzero`` on a CPU and not selected
on CUDA (all positions are projected; the ignored ones weigh zero), so no sync either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..data.labels import IGNORE_INDEX
from ..packing.batch import PACKED_BATCH_KWARG
from ..refusal import Refusal, optimize_call
from .answer_logprobs import answer_logprobs
from .linear_ce import LinearHead, LogitTransform, choose_chunk_tokens, linear_cross_entropy

logger = logging.getLogger("slipstream")

# Config attributes that name a logit transform, and how each reads as LogitTransform fields.
_SOFTCAP_KEYS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")
_SCALE_KEYS = ("logit_scale", "lm_head_multiplier", "output_multiplier")
_PROBE_RANGE = 64.0


class UnsupportedLoss(Refusal, NotImplementedError):
    """The chunked loss cannot compute this model's loss exactly; the message says why and what to do."""

    avoid = {"chunked_loss": False}


# The way out the messages name, generated from the class's ``avoid`` (text and data cannot drift).
STOCK_LOSS = optimize_call(UnsupportedLoss.avoid)  # slipstream.optimize(model, chunked_loss=False)


class LogitsNotComputedError(AttributeError, TypeError):
    """The logits of a training forward under the chunked loss were used; the message names the fix.

    Both an ``AttributeError`` (so ``hasattr`` / ``getattr(x, name, default)`` answer "no") and a
    ``TypeError``: what ``None`` raised in the same place before, so existing handlers still catch it.
    """


class LogitsNotComputed:
    """What ``out.logits`` holds after a training forward under slipstream's chunked loss.

    The loss was computed from the hidden states a chunk at a time, so no ``[tokens, vocab]``
    logits exist. Passing the placeholder along is fine; using it as a tensor raises
    :class:`LogitsNotComputedError` naming the fix (see the module docstring).
    """

    __slots__ = ("_model_name",)

    def __init__(self, model_name: str):
        object.__setattr__(self, "_model_name", model_name)

    def message(self) -> str:
        return (
            f"{self._model_name}'s logits were not computed: slipstream's chunked loss computes a training "
            "forward's loss (training mode, autograd on, labels given) from the hidden states a chunk at a "
            "time and returns out.loss only (so does an evaluation forward inside "
            "slipstream.loss.chunked_evaluation). Evaluation (model.eval()), torch.no_grad() forwards and "
            "generate() keep their logits. To get logits from training forwards too, turn the chunked loss "
            f"off: {STOCK_LOSS}, or speedups.chunked_loss: false in a "
            "slipstream training config."
        )

    def _refuse(self, *args, **kwargs):
        raise LogitsNotComputedError(self.message())

    def __getattr__(self, name: str):
        raise LogitsNotComputedError(f"{self.message()} (reading .{name})")

    def __setattr__(self, name: str, value) -> None:
        self._refuse()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        found = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, cls)]
        placeholder = found[0] if found else cls("the model")  # nested in a list: the name is not at hand
        raise LogitsNotComputedError(f"{placeholder.message()} (calling {getattr(func, '__name__', func)})")

    def __repr__(self) -> str:
        return f"<logits not computed: {self._model_name} ran slipstream's chunked loss; see its .message()>"

    def __reduce__(self):
        return (type(self), (self._model_name,))

    # Every tensor-like use raises the message (not "'NoneType' object is not subscriptable").
    __getitem__ = __setitem__ = __len__ = __iter__ = __bool__ = __array__ = __float__ = __int__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _refuse
    __matmul__ = __rmatmul__ = __pow__ = __neg__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse


class _GatherRows(torch.autograd.Function):
    """``x[positions]`` whose backward sums a repeated position's gradients in fp32 and rounds once.

    A prefix group's row repeats positions (a labelled prefix token once per continuation, the
    prefix's last token before every continuation's first): ``index_select``'s backward would sum
    their N gradients with a bf16 ``index_add`` (atomics on CUDA, rounding after every addition),
    where the unshared rows sum them in fp32 inside the projections' GEMMs."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(positions)
        ctx.rows = x.shape[0]
        return x.index_select(0, positions)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (positions,) = ctx.saved_tensors
        wide = torch.promote_types(grad.dtype, torch.float32)
        total = grad.new_zeros((ctx.rows, *grad.shape[1:]), dtype=wide)
        return total.index_add_(0, positions, grad.to(wide)).to(grad.dtype), None


def gather_rows(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``x.index_select(0, positions)``; a repeated position's gradient summed in fp32 (:class:`_GatherRows`)."""
    if not torch.is_grad_enabled() or not x.requires_grad:
        return x.index_select(0, positions)
    return _GatherRows.apply(x, positions)


@dataclass
class _Call:
    """One training forward in flight: where it stands and what the hooks handed over."""

    labels: torch.Tensor
    packed_batch: Any
    phase: str = "armed"  # -> "head-skipped" (hidden kept) -> "done" (loss computed)
    hidden: torch.Tensor | None = None
    probe: torch.Tensor | None = None


@dataclass
class ChunkedLoss:
    """The chunked LM-head loss installed on one model; ``remove()`` restores the stock loss."""

    model: torch.nn.Module
    requested_chunk_tokens: int | None = None  # None: from the memory budget
    chunk_tokens: int | None = None  # decided (and logged) on the first training forward
    policies: list[str] = field(default_factory=list)
    transform: LogitTransform | None = None  # None until the probe has matched one
    _call: _Call | None = None
    _handles: list = field(default_factory=list)
    _head: torch.nn.Module | None = None
    _head_handles: list = field(default_factory=list)
    _stock_loss: Any = None
    _no_logits: LogitsNotComputed | None = None  # made once: the hook only hands it out
    _had_loss_function: bool = False
    _previous_loss_function: Any = None
    evaluating: int = 0  # > 0 inside chunked_evaluation(): eval / no_grad forwards with labels arm too
    _unarmed_batch: Any = None  # the PackedBatch of the running forward, armed or not

    # ------------------------------------------------------------------ install / remove
    @classmethod
    def install(cls, model: torch.nn.Module, chunk_tokens: int | None = None) -> ChunkedLoss:
        """Put the chunked loss on ``model`` (a transformers causal LM), or raise UnsupportedLoss."""
        check_supported(model)
        if chunk_tokens is not None and chunk_tokens < 1:
            raise ValueError(f"loss_chunk_tokens must be at least 1, got {chunk_tokens}")
        self = cls(model=model, requested_chunk_tokens=chunk_tokens)
        self._had_loss_function = "_loss_function" in vars(model)
        self._previous_loss_function = vars(model).get("_loss_function")
        self._stock_loss = model.loss_function
        self._no_logits = LogitsNotComputed(type(model).__name__)
        model.loss_function = self
        self._handles = [
            model.register_forward_pre_hook(self._arm, with_kwargs=True),
            model.register_forward_hook(self._finish, with_kwargs=True),
        ]
        return self

    def remove(self) -> None:
        for handle in self._handles + self._head_handles:
            handle.remove()
        self._handles, self._head_handles, self._head = [], [], None
        if self._had_loss_function:
            self.model.loss_function = self._previous_loss_function
        else:
            vars(self.model).pop("_loss_function", None)

    def _hook_head(self) -> None:
        """Hook the current output-embeddings module (PEFT and FSDP may have replaced it since)."""
        head = self.model.get_output_embeddings()
        if head is self._head:
            return
        for handle in self._head_handles:
            handle.remove()
        self._head = head
        self._head_handles = [
            head.register_forward_pre_hook(self._skip_head),
            head.register_forward_hook(self._head_output),
        ]

    # ------------------------------------------------------------------ the three seams
    def _arm(self, module, args, kwargs):
        self._call = None
        self._unarmed_batch = batch = kwargs.get(PACKED_BATCH_KWARG)
        labels = kwargs.get("labels")
        keep = kwargs.get("logits_to_keep")
        training = module.training and torch.is_grad_enabled()
        answers = getattr(batch, "answers", None) is not None  # a preference batch: always chunked
        if (
            labels is None
            or not (training or self.evaluating or answers)
            or not (keep is None or (isinstance(keep, int) and keep == 0))
        ):
            return None
        self._hook_head()
        self._call = _Call(labels=labels, packed_batch=batch)
        return None

    def _skip_head(self, module, args):
        call = self._call
        if call is None or call.phase != "armed" or len(args) != 1 or not isinstance(args[0], torch.Tensor):
            return None
        call.hidden = args[0]
        call.phase = "head-skipped"
        return (args[0][..., :0, :],)

    def _head_output(self, module, args, output):
        call = self._call
        if call is None or call.phase != "head-skipped" or self.transform is not None:
            return None
        # First training forward: let the model transform a probe row of known logits.
        vocab = output.shape[-1]
        call.probe = torch.linspace(
            -_PROBE_RANGE, _PROBE_RANGE, vocab, device=output.device, dtype=output.dtype
        ).view(1, 1, vocab)
        return call.probe

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = IGNORE_INDEX,
        shift_labels: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """The model's ``loss_function``: chunked for a training forward, stock otherwise."""
        call = self._call
        if call is None or call.phase != "head-skipped":
            batch = self._unarmed_batch
            if _explicit_targets(batch, labels):
                # an evaluation / no_grad forward of a prefix group's row: the logits exist, and shifted
                # labels cannot say what the row predicts, so the loss is read at the batch's targets
                return packed_loss_from_logits(logits, batch, num_items_in_batch)
            return self._stock_loss(
                logits,
                labels,
                vocab_size,
                num_items_in_batch=num_items_in_batch,
                ignore_index=ignore_index,
                shift_labels=shift_labels,
                **kwargs,
            )
        if self.transform is None:
            self.transform = self._match_transform(call.probe, logits)
        if getattr(call.packed_batch, "answers", None) is not None:
            loss = self._answer_logprobs(call, vocab_size)
        else:
            loss = self._loss(call, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels)
        call.phase, call.hidden = "done", None
        return loss

    def _finish(self, module, args, kwargs, output):
        call, self._call = self._call, None
        self._unarmed_batch = None
        if call is None or call.phase == "armed":
            return None  # not a training forward, or the model never called its head module
        if call.phase != "done":
            raise UnsupportedLoss(
                f"{type(module).__name__} called its LM head but computed its loss without "
                "model.loss_function, so slipstream's chunked loss cannot stand in for it. "
                f"Use {STOCK_LOSS}.",
                refused=f"{type(module).__name__}'s loss computed without model.loss_function",
            )
        if hasattr(output, "logits"):
            output.logits = self._no_logits  # a ModelOutput also stores it as its "logits" item
        return output

    # ------------------------------------------------------------------ the loss itself
    def _loss(
        self, call: _Call, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels
    ) -> torch.Tensor:
        hidden = call.hidden
        hidden_NH = hidden.reshape(-1, hidden.shape[-1])
        if shift_labels is None:
            shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        targets = shift_labels.reshape(-1).to(hidden.device)
        if targets.shape[0] != hidden_NH.shape[0]:
            raise UnsupportedLoss(
                f"{type(self.model).__name__}: {targets.shape[0]} label positions for {hidden_NH.shape[0]} "
                f"hidden states reaching the LM head; use {STOCK_LOSS}",
                refused="labels that do not line up with the hidden states reaching the LM head",
            )
        batch = call.packed_batch
        if _explicit_targets(batch, labels):
            # a prefix group's row (:mod:`..packing.groups`): the predictions its unshared rows count,
            # a position repeated where a shared label counts once per row, each with its target
            hidden_NH = gather_rows(hidden_NH, batch.loss_positions.to(hidden.device))
            targets = batch.loss_targets.to(hidden.device)
        else:
            positions = self._labelled_positions(call, labels, shift_labels, targets, ignore_index)
            if positions is not None:
                hidden_NH = hidden_NH.index_select(0, positions)
                targets = targets.index_select(0, positions)
        head, params = self._chunked_head(vocab_size, hidden)
        if num_items_in_batch is not None and not isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = float(num_items_in_batch)
        return linear_cross_entropy(
            hidden_NH,
            targets,
            head,
            params,
            divisor=num_items_in_batch,
            transform=self.transform,
            chunk_tokens=self.chunk_tokens,
            ignore_index=ignore_index,
        )

    def _chunked_head(self, vocab_size: int, hidden: torch.Tensor):
        """The head as the chunks run it (a plain linear one by its tensors) and its trainable
        tensors; the chunk size decided (and logged) on first use."""
        if self.chunk_tokens is None:
            self.chunk_tokens, reason = choose_chunk_tokens(
                vocab_size, hidden.dtype, hidden.device, override=self.requested_chunk_tokens
            )
            self._log(f"chunked loss: {reason}")
        head = self._head
        params = [p for p in head.parameters() if p.requires_grad]
        if self._is_plain_linear(head):
            head = LinearHead(head.weight, head.bias)
        return head, params

    def _answer_logprobs(self, call: _Call, vocab_size: int) -> torch.Tensor:
        """A preference batch: every answer's summed log-prob, left on the batch
        (:func:`answer_logprobs_of`); the forward's ``loss`` is the answers' mean NLL, detached
        (a preference loss is computed from the sums, never by calling backward on it)."""
        batch = call.packed_batch
        answers = batch.answers
        hidden = call.hidden
        hidden_NH = hidden.reshape(-1, hidden.shape[-1]).index_select(0, answers.positions)
        head, params = self._chunked_head(vocab_size, hidden)
        transform = self.transform
        if answers.temperature != 1.0:  # online RL: the log-probs of the distribution it sampled from
            transform = dataclasses.replace(transform or LogitTransform(), temperature=answers.temperature)
        sums = answer_logprobs(
            hidden_NH,
            answers.targets,
            answers.index,
            answers.num_answers,
            head,
            params,
            transform=transform,
            chunk_tokens=self.chunk_tokens,
        )
        batch.memo(ANSWER_LOGPROBS, dict).clear()
        batch.memo(ANSWER_LOGPROBS, dict)["sums"] = sums
        return (-sums.sum() / max(1, batch.num_label_tokens)).detach()

    def _is_plain_linear(self, head: torch.nn.Module) -> bool:
        """An exact nn.Linear with no hooks but ours: its tensors can be used directly (the fast path)."""
        from torch.nn.modules import module as torch_module

        ours = {handle.id for handle in self._head_handles}
        foreign = (set(head._forward_hooks) | set(head._forward_pre_hooks)) - ours
        global_hooks = (
            torch_module._global_forward_hooks
            or torch_module._global_forward_pre_hooks
            or torch_module._global_backward_hooks
        )
        return type(head) is torch.nn.Linear and not foreign and not head._backward_hooks and not global_hooks

    @staticmethod
    def _labelled_positions(call: _Call, labels, shift_labels, targets, ignore_index):
        """Flat positions whose target counts: from the PackedBatch (host-built), else found here."""
        batch = call.packed_batch
        if (
            batch is not None
            and labels is batch.labels
            and shift_labels.shape == labels.shape
            and ignore_index == IGNORE_INDEX
            and batch.loss_positions is not None
        ):
            return batch.loss_positions.to(targets.device)
        if targets.device.type == "cpu":
            return torch.nonzero(targets != ignore_index).squeeze(1)
        return None  # CUDA without host-known positions: project every row rather than sync

    # ------------------------------------------------------------------ the logit transform
    def _match_transform(self, probe: torch.Tensor, transformed: torch.Tensor) -> LogitTransform:
        """The transform that maps the probe to what the model made of it, or UnsupportedLoss."""
        name = type(self.model).__name__
        if probe is None or transformed.shape[-1] != probe.shape[-1] or transformed.numel() == 0:
            raise UnsupportedLoss(
                f"{name} changes the shape of its LM head's output before the loss (e.g. slices the "
                f"vocabulary); slipstream's chunked loss cannot follow. Use {STOCK_LOSS}.",
                refused=f"{name}'s LM head output reshaped before the loss",
            )
        expected = transformed.reshape(-1, probe.shape[-1])[0].double().cpu()  # one host read, once
        candidates = transform_candidates(self.model)
        tolerance = 1e-5 if probe.dtype in (torch.float32, torch.float64) else 2e-2
        for candidate in candidates:
            ours = candidate(probe.reshape(-1)).double().cpu()
            if torch.allclose(ours, expected, rtol=tolerance, atol=tolerance * _PROBE_RANGE):
                self._log(f"chunked loss: logit transform {candidate.describe()} (verified on a probe row)")
                return candidate
        raise UnsupportedLoss(
            f"{name} transforms its logits before the loss in a way slipstream's chunked loss does not "
            f"know (tried: {', '.join(c.describe() for c in candidates)}); the loss would differ, so it is "
            f"refused. Use {STOCK_LOSS}.",
            refused=f"{name}'s unknown logit transform before the loss",
        )

    def _log(self, policy: str) -> None:
        self.policies.append(policy)
        logger.info(policy)


def _explicit_targets(batch, labels) -> bool:
    """``batch`` says which row position predicts which token itself (``loss_targets``), for these labels."""
    return batch is not None and getattr(batch, "loss_targets", None) is not None and labels is batch.labels


def packed_loss_from_logits(
    logits: torch.Tensor, batch, num_items_in_batch: torch.Tensor | int | None = None
) -> torch.Tensor:
    """The SFT loss of a batch with explicit targets (``loss_positions`` / ``loss_targets``: a prefix
    group's row, :func:`slipstream.packing.groups.collate_groups`) from its ``[1, T, V]`` logits:
    the summed cross-entropy at those positions, divided by ``num_items_in_batch`` (default: the
    batch's ``num_label_tokens``), in fp32 like transformers' ForCausalLMLoss."""
    logits_NV = logits.reshape(-1, logits.shape[-1]).index_select(0, batch.loss_positions.to(logits.device))
    total = torch.nn.functional.cross_entropy(
        logits_NV.float(), batch.loss_targets.to(logits.device), reduction="sum"
    )
    divisor = batch.num_label_tokens if num_items_in_batch is None else num_items_in_batch
    if isinstance(divisor, torch.Tensor):
        divisor = divisor.to(total.device)
    return total / divisor


ANSWER_LOGPROBS = "answer_logprobs"  # the memo key under which a preference batch gets its sums


def answer_logprobs_of(batch) -> torch.Tensor | None:
    """The ``[answers]`` summed log-probs the chunked loss left on ``batch`` in its last forward."""
    found = batch._memo.get(ANSWER_LOGPROBS)
    return None if not found else found.get("sums")


@contextlib.contextmanager
def chunked_evaluation(model: torch.nn.Module) -> Iterator[bool]:
    """Inside it, forwards of ``model`` given labels return a chunked loss and no logits, in eval too.

    For an evaluation loss that never builds the ``[tokens, vocab]`` logits: run the forwards
    under ``torch.no_grad()`` (and ``model.eval()``) inside this block; each returns ``out.loss``
    (the stock loss, computed a chunk of labelled rows at a time, no gradient kept) and a
    :class:`LogitsNotComputed` placeholder for ``out.logits``. Forwards without labels keep
    their logits. ``model`` may be wrapped (PEFT, DDP, FSDP2); a model without the chunked loss
    (``chunked_loss=False``, or refused) computes its stock loss, full logits and all. Yields
    whether the chunked loss serves the block.
    """
    losses = [
        loss
        for module in model.modules()
        if isinstance(loss := vars(module).get("_loss_function"), ChunkedLoss)
    ]
    for loss in losses:
        loss.evaluating += 1
    try:
        yield bool(losses)
    finally:
        for loss in losses:
            loss.evaluating -= 1


def transform_candidates(model: torch.nn.Module) -> list[LogitTransform]:
    """Transforms the model's config (or the model) names; the most specific first, none last."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    holders = [config, model, getattr(model, "model", None)]

    def found(key: str) -> list[float]:
        values = []
        for holder in holders:
            value = getattr(holder, key, None) if holder is not None else None
            if isinstance(value, int | float) and not isinstance(value, bool) and value not in values:
                values.append(float(value))
        return values

    caps = [c for key in _SOFTCAP_KEYS for c in found(key) if c > 0]
    scales = [s for key in _SCALE_KEYS for s in found(key)]
    # Granite and MiniCPM divide by logits_scaling; HyperCLOVA X multiplies by it.
    scales += [v for s in found("logits_scaling") if s != 0 for v in (1.0 / s, s)]
    out = [LogitTransform(scale=s, softcap=c) for s in scales for c in caps]
    out += [LogitTransform(softcap=c) for c in caps] + [LogitTransform(scale=s) for s in scales]
    return [*out, LogitTransform()]


def check_supported(model: torch.nn.Module) -> None:
    """Refuse, before training, a model the chunked loss cannot stand in for."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    name = type(model).__name__
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Module):
        raise UnsupportedLoss(
            f"{name} has no output-embeddings (LM head) module; use {STOCK_LOSS}",
            refused=f"the chunked loss for {name}, which has no LM head module",
        )
    stock = model.loss_function
    if isinstance(stock, ChunkedLoss):
        raise UnsupportedLoss(  # a second install, not the model: turning the loss off is not the way out
            f"{name} already runs slipstream's chunked loss", refused="a second chunked loss", avoid=None
        )
    if stock is not ForCausalLMLoss:
        raise UnsupportedLoss(
            f"{name} uses its own loss ({getattr(stock, '__name__', stock)!r}, not transformers' "
            "ForCausalLMLoss); the chunked loss only stands in for the causal-LM cross-entropy. "
            f"Use {STOCK_LOSS}.",
            refused=f"{name}'s own loss function",
        )
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        source = ""
    if "loss_function" not in source:
        raise UnsupportedLoss(
            f"{name}.forward does not call model.loss_function (or its source cannot be read), so the "
            f"chunked loss cannot stand in for its loss. Use {STOCK_LOSS}.",
            refused=f"{name}.forward without model.loss_function",
        )
