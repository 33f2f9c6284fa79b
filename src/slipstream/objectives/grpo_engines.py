"""Who samples GRPO's rollouts (``grpo.engine``): slipstream's sampler or vLLM in a process of its own.

:func:`start_engine` gives the objective a :class:`slipstream.rollouts.RolloutEngine` (``sync`` before a
round, ``generate``; ``close`` where it holds a process) and the line the run's log says of it. ``hf``:
:class:`~slipstream.rollouts.CachedSampler` samples from the model itself, each prompt prefilled once and
its KV cache shared by its G samples; a model whose attention its masks cannot describe is refused by
name. ``vllm``: :mod:`slipstream.engines.vllm_engine`, the policy synced to it every round; its sampling
log-probs are not the trainer's, which the update corrects for (``vllm_importance_sampling_*``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import TrainError
from ..rollouts import CachedSampler, UnsupportedRollout, check_sampleable
from .base import ObjectiveContext


def stop_ids(tokenizer, model) -> tuple[int, ...]:
    """The tokens that end a completion: the tokenizer's EOS and the model's generation config's."""
    found: set[int] = set()
    if tokenizer.eos_token_id is not None:
        found.add(int(tokenizer.eos_token_id))
    generation = getattr(model, "generation_config", None)
    eos = getattr(generation, "eos_token_id", None)
    for token in eos if isinstance(eos, (list, tuple)) else [eos]:
        if token is not None:
            found.add(int(token))
    return tuple(sorted(found))


def described(engine: Any) -> str:
    """The log's line for an engine that samples from the model itself."""
    return f"{type(engine).__name__}: each prompt prefilled once, its KV cache shared by its samples"


def start_engine(config: Any, settings: Any, context: ObjectiveContext, tokenizer) -> tuple[Any, str]:
    """The run's engine, started (vLLM: minutes the first time), and its line; a refusal or a failed start
    is one line naming it."""
    model = context.base_model
    if settings.engine == "vllm":
        from ..engines.vllm_engine import VLLMEngine, refuse_unsyncable

        refuse_unsyncable(model, config)
        rank = context.ranks.rank
        engine = VLLMEngine(
            stop_ids=stop_ids(tokenizer, model),
            max_model_len=config.data.max_seq_len,
            sync_mode=settings.vllm_sync,
            memory_share=settings.vllm_gpu_memory_utilization,
            seed=config.seed + rank,
            log_path=Path(config.output_dir) / ("vllm.log" if rank == 0 else f"vllm-rank{rank}.log"),
            lora_rank=config.lora.rank if config.lora.enabled else 0,
        )
        try:
            started = engine.start(model)
        except BaseException:
            engine.close()
            raise
        return engine, f"vLLM: {started}; importance sampling {correction_line(settings)}"
    try:
        check_sampleable(model, config.data.max_seq_len)
    except UnsupportedRollout as error:
        raise TrainError(f"{config.model.path or config.model.preset}: {error}") from None
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id or 0
    engine = CachedSampler(stop_ids(tokenizer, model), int(pad))
    return engine, described(engine)


def correction_line(settings: Any) -> str:
    """TRL's importance-sampling correction of vLLM's rollouts, as the log says it."""
    if not settings.vllm_importance_sampling_correction:
        return "off"
    low, high = settings.vllm_importance_sampling_clip_min, settings.vllm_importance_sampling_clip_max
    return (
        f"{settings.vllm_importance_sampling_mode}, clip [{'none' if low is None else f'{low:g}'}, "
        f"{'none' if high is None else f'{high:g}'}]"
    )
