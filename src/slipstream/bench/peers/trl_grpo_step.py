"""The ``trl-grpo`` arm: one GRPO step as TRL's ``GRPOTrainer`` takes it (no vLLM, as users run it on
one machine without a vLLM server).

**Sampling** (:meth:`TrlGrpoStep.sample`): ``GRPOTrainer._generate_and_score_completions`` on the
step's prompts, each row repeated G times as its ``RepeatSampler`` feeds them: TRL tokenizes the
prompts (its chat template for message lists), left-pads the G x prompts rows and runs transformers'
``generate`` on the unwrapped model (every prompt prefilled G times, every row decoded to the longest),
masks after the first EOS, decodes, calls the reward functions, computes the group advantages and
its metrics. Its ``_generate_single_turn`` (padding + ``generate`` + the EOS mask) is timed on its
own as the arm's generation.

**The update** (:meth:`TrlGrpoStep.update`), on the harness's shared rollouts: each micro-batch is
the dict ``_generate_and_score_completions`` returns (prompts left-padded, completions right-padded
with their masks, the advantages, ``num_items_in_batch``: the step's completion tokens) and goes
through ``GRPOTrainer.training_step`` (``Trainer.training_step``: ``compute_loss``: the policy
forward over prompt + completion with ``logits_to_keep``, per-token log-probs and entropies of
logits / temperature, the clipped loss of ``loss_type``; ``accelerator.backward``) with its
generation hook bypassed (the rollouts are given); then its clipping (1.0), ``adamw_torch``
optimizer and scheduler. With ``num_iterations`` 1 and ``steps_per_generation`` equal to the
accumulation, TRL keeps no old log-probs (the ratio is 1 in value), and with ``beta`` 0 it runs no
reference forward, as slipstream.

Left out, as from every arm: the Trainer's dataloader, callbacks and logging. Mixed precision off
(``bf16=False``): the model is already in the run's dtype; gradient checkpointing off (the run's).
The advantages of the shared rollouts are given with them (the same formula as TRL's, computed once).
"""

from __future__ import annotations

import inspect
import time

import torch

from . import PeerUnavailable
from .trl_base import TrlTrainerStep


def _trl_reward(reward):
    """A slipstream reward handed to TRL under its own name (TRL names a function by ``__name__``; a
    built-in's bound ``args`` make it a partial), async where it is: both call it the same way."""
    fn = reward.fn
    if inspect.iscoroutinefunction(fn):

        async def call(**keywords):
            return await fn(**keywords)

    else:

        def call(**keywords):
            return fn(**keywords)

    call.__name__ = reward.name
    return call


def tool_template_refusal(tokenizer) -> str | None:
    """Why TRL's GRPOTrainer would refuse ``tokenizer``'s chat template with tools (None: it takes it).
    TRL needs a prefix-preserving template and patches only the ones it knows (an older revision of a
    model's template is not one of them)."""
    from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

    if is_chat_template_prefix_preserving(tokenizer):
        return None
    try:
        get_training_chat_template(tokenizer)
    except ValueError as error:
        return f"TRL's GRPOTrainer refuses this chat template with tools: {error}"
    return None


def _with_response_template(tokenizer, format_name: str):
    """The tokenizer with TRL's response template for the tool-call format slipstream read off its chat
    template, where TRL would not recognise the template itself (``add_response_schema`` matches its own
    template texts only: a ChatML template with tools, such as examples/chatml_tools.jinja, is hermes)."""
    from trl import chat_template_utils as trl_templates

    try:
        return trl_templates.add_response_schema(tokenizer)
    except ValueError:  # "Unrecognized chat template": set as its error message says, by hand
        family = {"hermes": "qwen3", "llama3": "llama3"}[format_name]
    tokenizer.response_template = getattr(trl_templates, f"{family}_template")
    return tokenizer


class TrlGrpoStep(TrlTrainerStep):
    """Drives a real ``GRPOTrainer``: its sampling on the step's prompts, its update on given rollouts."""

    def __init__(self, model, tokenizer, settings, rewards, *, agents=None, device: str = "cpu", **run):
        """``run``: the run's steps, lr, schedule, warmup_steps, seed and grad_accum (``trl_base.trainer_run``);
        ``agents``: the run's tools (``objectives.grpo_agents.AgentPlan``), handed to TRL as its own
        ``tools`` / ``environment_factory``."""
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer

        self.settings, self.seed, self.agents = settings, run["seed"], agents
        G = settings.num_generations
        placeholder = Dataset.from_list([{"prompt": tokenizer.eos_token}] * G)  # never iterated
        tooling, extra = {}, {}
        if agents is not None:
            # TRL adds an environment's get_reward itself (weight 1, named after the class), as slipstream did
            rewards = [fn for fn in rewards if fn.source != "grpo.environment"]
            tooling = {
                "tools": list(agents.toolset.functions) or None,
                "environment_factory": agents.toolset.environment,
            }
            extra = {"max_tool_calling_iterations": agents.max_iterations}
            tokenizer = _with_response_template(tokenizer, agents.format.name)
        try:  # TRL's own missing optional dependency (TRL 1.8's tools want jmespath): skipped in its words
            super().__init__(
                lambda args: GRPOTrainer(
                    model=model,
                    reward_funcs=[_trl_reward(fn) for fn in rewards],
                    args=args,
                    train_dataset=placeholder,
                    processing_class=tokenizer,
                    **tooling,
                ),
                GRPOConfig,
                prefix="slipstream-ab-trl-grpo-",
                device=device,
                **run,
                per_device_train_batch_size=settings.prompts_per_batch * G,
                num_generations=G,
                max_completion_length=settings.max_new_tokens,
                temperature=settings.temperature,
                top_p=settings.top_p,
                top_k=settings.top_k,
                loss_type=settings.loss,
                scale_rewards=settings.scale_rewards,
                epsilon=settings.epsilon,
                epsilon_high=settings.epsilon_high,
                beta=settings.beta,
                num_iterations=1,
                mask_truncated_completions=settings.mask_truncated_completions,
                reward_weights=[fn.weight for fn in rewards],
                **extra,
            )
        except ImportError as error:
            raise PeerUnavailable(f"trl: {' '.join(str(error).split())}") from None
        self.pad_id = self.trainer._tokenizer.pad_token_id
        self.generation_s = 0.0
        # the arm's generation: padding, generate, the EOS mask; with tools, every turn of its tool loop
        # (the calls, each turn's whole trajectory generated again), as slipstream's includes its own
        timed = "_generate" if agents is not None else "_generate_single_turn"
        generate = getattr(self.trainer, timed)

        def timed_generate(*args, **kwargs):
            started = time.perf_counter()
            try:
                return generate(*args, **kwargs)
            finally:
                self.clock.sync()
                self.generation_s += time.perf_counter() - started

        setattr(self.trainer, timed, timed_generate)
        self.policies = [
            "TRL GRPOTrainer (no vLLM): each prompt repeated G times, left-padded and run through "
            "transformers' generate (every prompt prefilled G times), its rewards and advantages; the "
            "update through training_step on right-padded prompt + completion rows (logits_to_keep, "
            "per-token log-probs and entropies), its adamw_torch optimizer and clipping",
        ]
        if agents is not None:
            self.policies.append(
                "TRL's tool loop (_tool_call_loop): each turn's calls parsed by parse_response and run, then "
                "generate again on prompt + trajectory so far + results (the whole trajectory prefilled every "
                "turn); tool results masked out of the loss (tool_mask)"
            )

    def sample(self, rows: list[dict], step: int) -> dict:
        """TRL's sampling and scoring of ``rows`` (G completions each); its times and counts."""
        trainer, G = self.trainer, self.settings.num_generations
        inputs = [{"prompt": row["prompt"], **row["columns"]} for row in rows for _ in range(G)]
        torch.manual_seed(self.seed * 1_000_003 + step)  # TRL samples from the global generator
        trainer.model.train()  # as the Trainer's loop leaves it
        self.generation_s = 0.0
        started = time.perf_counter()
        output = trainer._generate_and_score_completions(inputs)
        self.clock.sync()
        total = time.perf_counter() - started
        mask = output["completion_mask"]
        if "tool_mask" in output:  # the tokens the model sampled, not the tool results
            mask = mask * output["tool_mask"]
        calls = trainer._metrics["train"].get("tools/call_frequency")
        trainer._metrics["train"].clear()
        return {
            "generation_s": self.generation_s,
            "scoring_s": total - self.generation_s,
            "completions": int(mask.size(0)),
            "generated_tokens": int(mask.sum()),
            "tool_calls": calls[-1] if self.agents is not None and calls else None,
        }

    def _inputs(self, groups: list[dict], advantages: list[float], items: int) -> dict:
        """TRL's micro-batch dict for ``groups`` (as ``_generate_and_score_completions`` builds it)."""
        from trl.trainer.utils import pad

        prompts = [torch.tensor(g["prompt_ids"]) for g in groups for _ in g["completions"]]
        completions = [torch.tensor(c) for g in groups for c in g["completions"]]
        prompt_ids = pad(prompts, padding_value=self.pad_id, padding_side="left")
        prompt_mask = pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left")
        completion_ids = pad(completions, padding_value=self.pad_id, padding_side="right")
        completion_mask = pad(
            [torch.ones_like(c) for c in completions], padding_value=0, padding_side="right"
        )
        if self.settings.mask_truncated_completions:
            finished = torch.tensor([f for g in groups for f in g["finished"]])
            completion_mask = completion_mask * finished.unsqueeze(1).int()
        found = {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "advantages": torch.tensor(advantages, dtype=torch.float32),
            "num_items_in_batch": torch.tensor(items),
        }
        if any("model_masks" in g for g in groups):  # trajectories: TRL's tool_mask (1 sampled, 0 results)
            masks = [torch.tensor(m) for g in groups for m in g["model_masks"]]
            found["tool_mask"] = pad(masks, padding_value=1, padding_side="right")
        return {k: v.to(self.device) for k, v in found.items()}

    def update(self, micro_groups: list[list[dict]], micro_advantages: list[list[float]], items: int) -> dict:
        """One optimizer step on the given rollouts; its loss, grad norm and times."""
        trainer = self.trainer
        lr = self.begin()
        micro = [self._inputs(g, a, items) for g, a in zip(micro_groups, micro_advantages, strict=True)]
        trainer.current_gradient_accumulation_steps = len(micro)
        prepare = trainer._prepare_inputs
        trainer._prepare_inputs = lambda inputs: inputs  # the rollouts are given: no generation here
        try:
            losses = [trainer.training_step(self.model, inputs, None) for inputs in micro]
        finally:
            trainer._prepare_inputs = prepare
        timed = self.end(lr)
        loss = float(sum(losses))
        trainer._metrics["train"].clear()
        return {"loss": loss, **timed}
