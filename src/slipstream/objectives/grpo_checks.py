"""The checks of a ``training.objective: grpo`` config (:meth:`GRPO.validate`): each failure names its key,
before anything is loaded."""

from __future__ import annotations

from ..agents.tools import ToolError
from ..rewards import RewardError, load_rewards
from .grpo_agents import load_toolset
from .grpo_sharing import validate_sharing


def validate_grpo(config, fail) -> None:
    grpo = config.grpo
    if config.data.step_order == "histories":
        fail(
            "data.step_order",
            "data.step_order histories groups SFT rows or preference pairs by their history; training.objective "
            "grpo reads prompts: set data.step_order shuffled",
        )
    if config.data.path is None:
        fail(
            "data.path",
            "training.objective 'grpo' needs prompt rows: set data.path (a file of {\"prompt\": ...} rows)",
        )
    if config.data.batching != "bfd":
        fail(
            "data.batching",
            f"training.objective 'grpo' batches prompts_per_batch prompts; data.batching "
            f"{config.data.batching} is for SFT rows (set bfd)",
        )
    try:
        toolset = load_toolset(grpo)
    except ToolError as error:
        fail("grpo.environment" if "'grpo.environment'" in str(error) else "grpo.tools", str(error))
        toolset = None
    if not grpo.rewards and not (toolset is not None and toolset.rewards_itself):
        fail(
            "grpo.rewards",
            "training.objective 'grpo' needs at least one reward function in grpo.rewards "
            "('module:function', or a built-in: answer_tag, format_regex, length_penalty), or an "
            "environment with get_reward()",
        )
    try:
        load_rewards(grpo.rewards)
    except RewardError as error:
        fail("grpo.rewards", str(error))
    if config.data.max_seq_len <= grpo.max_new_tokens:
        fail(
            "data.max_seq_len",
            f"data.max_seq_len {config.data.max_seq_len} leaves no room for a prompt beside "
            f"grpo.max_new_tokens {grpo.max_new_tokens}",
        )
    if config.speedups.packed_attention is False:
        fail(
            "speedups.packed_attention",
            "training.objective 'grpo' trains packed completion groups: "
            "speedups.packed_attention false is not supported",
        )
    if grpo.num_iterations > 1 and config.training.epochs is not None:
        fail(
            "training.epochs",
            "training.epochs with grpo.num_iterations > 1: give training.steps instead (each batch of "
            "rollouts is trained num_iterations steps)",
        )
    if grpo.num_iterations > 1 and config.training.checkpoint_every % grpo.num_iterations:
        fail(
            "training.checkpoint_every",
            f"training.checkpoint_every must be a multiple of grpo.num_iterations "
            f"{grpo.num_iterations}: a checkpoint inside a round could not resume it exactly",
        )
    if grpo.beta > 0 and not config.lora.enabled:
        fail("grpo.beta", "grpo.beta > 0 compares with the base (the adapter off): it needs lora.enabled")
    if grpo.beta > 0 and config.lora.experts:
        fail("grpo.beta", "grpo.beta > 0 cannot switch lora.experts adapters off yet")
    if grpo.engine == "vllm" and grpo.vllm_sync == "lora" and not config.lora.enabled:
        fail("grpo.vllm_sync", "grpo.vllm_sync lora hands vLLM the adapter: it needs lora.enabled")
    validate_sharing(config, fail)
    if config.training.distributed == "fsdp2":
        fail(
            "training.distributed",
            "training.objective 'grpo' under fsdp2 (sharded weights while sampling) "
            "is not supported yet: use ddp",
        )
