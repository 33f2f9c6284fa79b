"""``slipstream.optimize``: switch a transformers model onto slipstream's fast paths, in place.

Every speedup is a toggle whose other arm is the stock path, so the A/B harness can compare
them and the tests can prove they compute the same thing. Calling ``optimize`` again with a
toggle off restores the stock behaviour.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from . import lora as lora_compute
from .compile import compile_layers, should_compile, uncompile_layers
from .fused import decide_fused_kernels
from .loss import ChunkedLoss, UnsupportedLoss
from .moe.experts import (
    COMPUTE_CHOICE,
    EXPERTS_IMPLEMENTATION,
    UnsupportedExperts,
    check_experts_module,
    experts_modules,
    is_moe_model,
    register_experts_implementation,
)
from .offload import enable_checkpointing
from .packing import calibration
from .packing.attention import BACKEND_NAMES, choose_backend, register_attention_functions
from .packing.batch import PACKED_BATCH_KWARG
from .packing.costs import ATTENTION_COSTS, BUILTIN, AttentionCosts
from .packing.grouping import GROUPING_CHOICE, GROUPING_COUNTS, GroupingCounts, grouping_policy
from .packing.guards import UnsupportedArchitecture, enter_forward, leave_forward
from .packing.short_attention import SHORT_KERNEL_CHOICE, short_kernel_policy
from .packing.verdict import TRAIN_UNPACKED, apply_adaptations, architecture_verdict
from .speedups import Speedups

logger = logging.getLogger("slipstream")

_STATE_ATTR = "slipstream"  # the one attribute slipstream puts on a model: its OptimizeState


@dataclass
class OptimizeState:
    """Everything slipstream attached to a model (``model.slipstream``): each decision, the
    hooks and managers it installed, the policy log; :meth:`undo` puts the model back."""

    stock_attn_implementation: str | None
    stock_use_cache: bool | None
    stock_experts_implementation: str | None = None
    packed_attention: str | None = None  # the backend name, None when stock
    attention_grouping: str | None = None  # Speedups.attention_grouping, None when stock
    short_document_kernel: str | None = None  # Speedups.short_document_kernel, None when stock
    # what the packed SDPA path's "auto" choices weigh (packing.costs: measured on a CPU, else built in)
    attention_costs: AttentionCosts = BUILTIN
    moe_routing: str | None = None  # "sorted" when on, None when stock
    checkpointing: str | None = None  # the mode running, None when untouched
    offload_manager: object | None = field(default=None, repr=False)
    chunked_loss: object | None = field(default=None, repr=False)  # a loss.ChunkedLoss when on
    policies: list[str] = field(default_factory=list)
    model: object | None = field(default=None, repr=False)  # the transformers model it belongs to
    hook: object | None = field(default=None, repr=False)
    guard_hooks: list = field(default_factory=list, repr=False)
    undo_adaptations: object | None = field(default=None, repr=False)  # removes the verdict's adaptations
    lora_hook: object | None = field(default=None, repr=False)  # installs lora.compute on the next forward
    compiled: bool = False  # the decoder layers run compiled (slipstream.compile)
    # batches and attention calls the packed SDPA path ran grouped / per document (packing.grouping)
    grouping_counts: GroupingCounts = field(default_factory=GroupingCounts)
    fused_kernels: str | None = None  # "liger" / "compiled" when fused kernels are on, None when stock
    undo_fused_kernels: object | None = field(default=None, repr=False)  # puts the model's modules back

    def undo(self) -> None:
        """Every speedup back to its stock arm, the hooks removed, and this state detached."""
        model = self.model
        stock = Speedups.stock()
        optimize(model, stock.replace(checkpointing="off") if self.checkpointing is not None else stock)
        if getattr(model, _STATE_ATTR, None) is self:
            delattr(model, _STATE_ATTR)


def state_of(model: torch.nn.Module) -> OptimizeState | None:
    """The slipstream state of ``model`` (through a PEFT wrapper), or None if never optimized."""
    return getattr(base_model(model), _STATE_ATTR, None)


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a PEFT wrapper (or the model itself). (A DDP / FSDP wrapper is
    ``train.distributed.unwrap``'s: that one keeps the adapters' wrapper.)"""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def has_attention_sinks(model: torch.nn.Module) -> bool:
    return any(hasattr(module, "sinks") for module in model.modules())


def _padding_guard(module, args, kwargs):
    """Forward pre-hook: a padded (2D-masked) batch cannot run on the packed attention.

    The packed backends take document boundaries from the PackedBatch; a padding mask would be
    silently dropped by transformers' mask builders, so refuse it instead. Only the unpacked
    path pays for this check (one sync), never a PackedBatch.
    """
    batch = kwargs.get(PACKED_BATCH_KWARG)
    if batch is not None:
        if (
            batch.loss_targets is not None
            and kwargs.get("labels") is not None
            and not isinstance(vars(module).get("_loss_function"), ChunkedLoss)
        ):
            raise ValueError(
                "this PackedBatch shares prefixes (slipstream.packing.collate_groups): its loss is read at "
                "batch.loss_positions / batch.loss_targets, which the stock loss (shifted labels) cannot "
                "express, so it would differ from the unshared rows' loss. Turn the chunked loss on "
                "(slipstream.optimize(model, chunked_loss=True), speedups.chunked_loss: true), or run the "
                "forward without labels and take slipstream.loss.packed_loss_from_logits(out.logits, batch), "
                "or collate_groups(..., prefix_sharing=False)"
            )
        return None
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all()):
        raise ValueError(
            "this model runs slipstream's packed attention, which takes document boundaries from a "
            "PackedBatch (slipstream.collate_packed), not from a padding mask. Pack the batch, or call "
            "slipstream.optimize(model, packed_attention=False) to go back to the stock attention."
        )
    return None


def optimize(
    model: torch.nn.Module,
    speedups: Speedups | None = None,
    *,
    expected_steps: int | None = None,
    **options: Any,
) -> torch.nn.Module:
    """Turn slipstream's optimizations on (or off) for ``model``, in place; returns the same model.

    ``speedups``: a :class:`slipstream.Speedups` (every toggle, typed and validated once; see
    its fields for what each does). ``**options`` are its fields by name, a convenience:
    ``optimize(model, packed_attention=False)`` is ``optimize(model, Speedups(packed_attention=False))``,
    and with both given the options replace those fields.

    packed_attention: attend within each document of a :class:`PackedBatch`, reading the
        metadata the collator built on the host: no host syncs, no [T, T] mask. The model is
        inspected first (:mod:`slipstream.packing.verdict`): refused with an error naming the
        feature, or adapted (token mixers per document, position offsets), each logged.
        ``False`` restores the model's stock attention.
    moe_routing: "sorted" groups each MoE layer's tokens by expert once (argsort + counts);
        "stock" leaves transformers' choice; default: sorted where the experts allow it exactly.
    checkpointing: "off", "recompute", "offload", "offload-double" or "auto"; ``None`` leaves it.
    chunked_loss: the LM head + cross-entropy a chunk of labelled tokens at a time, so the
        [tokens, vocab] logits never exist (training forwards with labels only: their
        ``out.logits`` is a ``loss.LogitsNotComputed`` placeholder that raises, naming this
        option, if used as a tensor; eval / ``no_grad`` forwards keep their logits); ``None``:
        on where the model supports it, else logged and off.
    fused_kernels: "auto" swaps in Liger-Kernel's fused RMSNorm / SwiGLU / RoPE kernels where the
        model is on CUDA, liger-kernel imports and knows the model type (never its loss), else
        inductor-compiled RMSNorm / SwiGLU where their cold start pays back over
        ``expected_steps`` (``slipstream.fused.compiled``; each module class probed exact first);
        "liger" / "compiled" insist (an error names the reason they cannot); "off" restores the
        model's own.
    compile: "on" compiles each decoder layer (``torch.compile``, dynamic shapes, the packed
        attention eager between graphs); "auto" does so only when ``expected_steps`` (the run's
        optimizer steps, which the trainer and ``slipstream ab`` pass) pays back the cold start
        (``slipstream.compile.should_compile``); without ``expected_steps`` "auto" stays off.

    Training with packed batches needs ``use_cache`` off (a cache lets packed documents see
    each other in stock transformers); ``optimize`` turns it off and restores it when undone.
    Each choice is logged once and kept in the model's state (``slipstream.state_of(model)``).
    """
    unknown = sorted(set(options) - {f.name for f in dataclasses.fields(Speedups)})
    if unknown:
        raise TypeError(
            f"optimize() got unknown option(s) {unknown}; the speedups are the fields of Speedups"
        )
    speedups = (speedups or Speedups()).replace(**options) if options else (speedups or Speedups())
    speedups, environment_note = speedups.with_environment()
    packed_attention, attention_backend = speedups.packed_attention, speedups.attention_backend
    attention_grouping = speedups.attention_grouping
    moe_routing, moe_compute = speedups.moe_routing, speedups.moe_compute
    checkpointing = speedups.checkpointing
    chunked_loss, loss_chunk_tokens = speedups.chunked_loss, speedups.loss_chunk_tokens
    base = base_model(model)
    state: OptimizeState | None = getattr(base, _STATE_ATTR, None)
    if state is None:
        state = OptimizeState(
            stock_attn_implementation=base.config._attn_implementation,
            stock_use_cache=getattr(base.config, "use_cache", None),
            stock_experts_implementation=getattr(base.config, "_experts_implementation", None),
            model=base,
        )
        setattr(base, _STATE_ATTR, state)

    if packed_attention:
        verdict = architecture_verdict(base)  # refuses what packed training cannot do exactly
        register_attention_functions()
        device = next(base.parameters()).device
        # the hidden states' dtype (the embeddings'; a 4-bit model's packed weights are uint8)
        embeddings = base.get_input_embeddings()
        dtype = embeddings.weight.dtype if embeddings is not None else next(base.parameters()).dtype
        backend, reason = choose_backend(attention_backend, device, has_attention_sinks(base), dtype)
        name = BACKEND_NAMES[backend]
        if state.packed_attention != name:
            try:
                base.set_attn_implementation(name)
            except (ValueError, TypeError, NotImplementedError) as error:
                raise UnsupportedArchitecture(
                    f"transformers refused slipstream's attention for {type(base).__name__} ({error}). {TRAIN_UNPACKED}"
                ) from error
            if base.config._attn_implementation != name:
                raise UnsupportedArchitecture(
                    f"transformers refused attention implementation {name!r} for {type(base).__name__}. {TRAIN_UNPACKED}"
                )
            base.config.use_cache = False
            if state.hook is None:
                state.hook = base.register_forward_pre_hook(_padding_guard, with_kwargs=True)
                state.guard_hooks = [  # the running forward's batch, for the attention guards
                    base.register_forward_pre_hook(enter_forward, with_kwargs=True),
                    base.register_forward_hook(leave_forward, with_kwargs=True, always_call=True),
                ]
            state.packed_attention = name
            policy = f"packed attention: {name} ({reason}); use_cache off"
            state.policies.append(policy)
            logger.info(policy)
            if state.undo_adaptations is None:
                state.undo_adaptations = apply_adaptations(base, verdict)
                for note in verdict.adaptations():
                    state.policies.append(f"packed attention: {note}")
                    logger.info("packed attention: %s", note)
        short_kernel = speedups.short_document_kernel
        if state.attention_grouping != attention_grouping or state.short_document_kernel != short_kernel:
            # what "auto" weighs: the figures measured on this CPU, dtype and thread count (once, cached)
            costs = BUILTIN
            if backend == "sdpa" and device.type == "cpu" and "auto" in (attention_grouping, short_kernel):
                costs = calibration.attention_costs(device, dtype)
            for module in base.modules():  # whichever module the model passes to the attention
                ATTENTION_COSTS[module] = costs
            state.attention_costs = costs
        if state.attention_grouping != attention_grouping:
            for module in base.modules():
                GROUPING_CHOICE[module] = attention_grouping
                GROUPING_COUNTS[module] = state.grouping_counts
            state.attention_grouping = attention_grouping
            sinks = has_attention_sinks(base)
            line = grouping_policy(attention_grouping, backend, sinks, state.attention_costs)
            policy = f"packed attention grouping: {line}"
            state.policies.append(policy)
            logger.info(policy)
        if state.short_document_kernel != short_kernel:
            for module in base.modules():
                SHORT_KERNEL_CHOICE[module] = short_kernel
            state.short_document_kernel = short_kernel
            line = short_kernel_policy(short_kernel, backend, state.attention_costs, dtype)
            policy = f"short-document kernel: {line}"
            state.policies.append(policy)
            logger.info(policy)
    elif state.packed_attention is not None:
        base.set_attn_implementation(state.stock_attn_implementation)
        if state.stock_use_cache is not None:
            base.config.use_cache = state.stock_use_cache
        if state.hook is not None:
            state.hook.remove()
            state.hook = None
            for handle in state.guard_hooks:
                handle.remove()
            state.guard_hooks = []
        if state.undo_adaptations is not None:
            state.undo_adaptations()
            state.undo_adaptations = None
        state.packed_attention = None
        state.attention_grouping = None
        state.short_document_kernel = None
        state.policies.append("packed attention: off (stock)")
        logger.info("packed attention: off (stock %s)", state.stock_attn_implementation)
    _set_moe_routing(base, state, moe_routing, moe_compute)
    _set_chunked_loss(base, state, chunked_loss, loss_chunk_tokens)
    _set_lora_compute(base, state, speedups.lora_in_compute_dtype)
    _set_fused_kernels(
        base, state, speedups.fused_kernels, expected_steps
    )  # before compile: the graphs trace them
    _set_compile(base, state, speedups.compile, expected_steps)
    if checkpointing is not None:
        if environment_note:
            state.policies.append(f"checkpointing: {environment_note}")
            logger.info("checkpointing: %s", environment_note)
        policy, state.offload_manager = enable_checkpointing(base, checkpointing)
        state.checkpointing = policy.mode
        state.policies += [f"checkpointing: {reason}" for reason in policy.reasons]
        state.policies.append(f"checkpointing: {policy.mode}")
    return model


def _set_compile(base: torch.nn.Module, state: OptimizeState, mode: str, expected_steps: int | None) -> None:
    device = next(base.parameters()).device
    wanted, why = should_compile(mode, expected_steps, device)
    if wanted:
        register_attention_functions(outside_graphs=True)  # the per-document loop stays eager
        classes = compile_layers(base)
        if not classes:
            policy = "compile: off (no decoder layers found to compile)"
        else:
            layers = ", ".join(f"{count} {name}" for name, count in classes.items())
            policy = (
                f"compile: decoder layers ({layers}), dynamic shapes, attention eager between graphs ({why})"
            )
            state.compiled = True
    else:
        if uncompile_layers(base):
            state.compiled = False
        policy = f"compile: {why}"
    state.policies.append(policy)
    logger.info(policy)


def _set_fused_kernels(
    base: torch.nn.Module, state: OptimizeState, mode: str, expected_steps: int | None
) -> None:
    """Fused RMSNorm / SwiGLU (/ RoPE with Liger): decided by ``fused.decide_fused_kernels``
    (which raises for "liger" / "compiled" where they cannot run), applied to the transformers
    model under any PEFT wrapper, undone by putting back what was changed. A decision that
    differs from what is on undoes the old kernels first."""
    device = next(base.parameters()).device
    decision = decide_fused_kernels(base, device, mode, expected_steps)
    why = decision.why
    if state.fused_kernels is not None and state.fused_kernels != decision.kind:
        state.undo_fused_kernels()
        state.undo_fused_kernels = None
        state.fused_kernels = None
        if decision.kind is None:
            why += "; the model's own modules restored"
    if decision.kind is not None and state.fused_kernels is None:
        state.undo_fused_kernels = decision.apply(base)
        state.fused_kernels = decision.kind
    policy = f"fused kernels: {why}"
    state.policies.append(policy)
    logger.info(policy)


def _set_lora_compute(base: torch.nn.Module, state: OptimizeState, wanted: bool) -> None:
    """LoRA in the activations' dtype (``slipstream.lora``). Adapters are attached after
    ``optimize`` (PEFT wraps the optimized model), so the layers are adapted on the next forward,
    by a pre-hook that then removes itself; the decision joins the policy log there."""
    if not wanted:
        if state.lora_hook is not None:
            state.lora_hook.remove()
            state.lora_hook = None
        if lora_compute.uninstall(base):
            state.policies.append("lora compute: PEFT's forward (stock)")
            logger.info("lora compute: PEFT's forward (stock)")
        return
    if state.lora_hook is not None:
        return

    def adapt_on_first_forward(module, args, kwargs):
        state.lora_hook.remove()
        state.lora_hook = None
        installed, kept = lora_compute.install(base)
        if not installed and not kept:
            return  # no LoRA on this model: nothing to say
        policy = f"lora compute: activations' dtype, one fused addmm per layer ({installed} layers)"
        policy += "".join(f"; {count} keep PEFT's forward: {why}" for why, count in kept.items())
        state.policies.append(policy)
        logger.info(policy)

    state.lora_hook = base.register_forward_pre_hook(adapt_on_first_forward, with_kwargs=True)


def _set_chunked_loss(
    base: torch.nn.Module, state: OptimizeState, wanted: bool | None, chunk_tokens: int | None
) -> None:
    current = state.chunked_loss
    if wanted is False:
        if current is not None:
            current.remove()
            state.chunked_loss = None
            state.policies.append("chunked loss: off (stock loss)")
            logger.info("chunked loss: off (stock loss)")
        return
    if current is not None:
        if current.requested_chunk_tokens != chunk_tokens:
            current.requested_chunk_tokens, current.chunk_tokens = chunk_tokens, None
        return
    try:
        state.chunked_loss = ChunkedLoss.install(base, chunk_tokens=chunk_tokens)
    except UnsupportedLoss as error:
        if wanted:
            raise
        policy = f"chunked loss: off ({error})"
    else:
        state.chunked_loss.policies = state.policies  # its first-call decisions join the model's log
        policy = "chunked loss: on (LM head + cross-entropy over labelled tokens, a chunk at a time)"
    state.policies.append(policy)
    logger.info(policy)


def _check_sorted_routing(base: torch.nn.Module, modules: list[torch.nn.Module]) -> None:
    """Raise UnsupportedExperts unless sorted routing can run every experts module of ``base``."""
    if not is_moe_model(base):
        raise ValueError(f"moe_routing='sorted': {type(base).__name__} has no MoE layers")
    if not modules:
        raise UnsupportedExperts(
            f"{type(base).__name__} is an MoE model but its experts do not use transformers' experts "
            "interface (@use_experts_implementation); sorted routing cannot plug in. "
            "Use slipstream.optimize(model, moe_routing='stock')."
        )
    for module in modules:
        check_experts_module(module)


def _set_moe_routing(
    base: torch.nn.Module, state: OptimizeState, moe_routing: str | None, compute: str
) -> None:
    moe = is_moe_model(base)
    modules = experts_modules(base)
    if moe_routing is None:  # the default: sorted where it plugs in exactly, else stock (logged)
        moe_routing = "stock"
        if moe:
            try:
                _check_sorted_routing(base, modules)
                moe_routing = "sorted"
            except UnsupportedExperts as error:
                policy = f"moe routing: stock ({error})"
                state.policies.append(policy)
                logger.info(policy)
    if moe_routing == "sorted":
        _check_sorted_routing(base, modules)
        for module in modules:
            COMPUTE_CHOICE[module] = compute
        register_experts_implementation()
        if state.moe_routing != "sorted":
            base.set_experts_implementation(EXPERTS_IMPLEMENTATION)
            state.moe_routing = "sorted"
        policy = f"moe routing: sorted ({len(modules)} experts modules, compute {compute})"
        state.policies.append(policy)
        logger.info(policy)
    elif state.moe_routing is not None:
        if any(getattr(m, "slipstream_nf4", None) is not None for m in modules):
            raise ValueError("4-bit experts run only with moe_routing='sorted'")
        base.set_experts_implementation(state.stock_experts_implementation or "eager")
        state.moe_routing = None
        state.policies.append("moe routing: stock")
        logger.info("moe routing: stock (%s)", state.stock_experts_implementation)
