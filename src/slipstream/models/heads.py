"""Which transformers class carries an objective's head, and whether a reward head sits where slipstream
reads it.

``causal-lm`` is ``AutoModelForCausalLM``. ``reward`` is ``AutoModelForSequenceClassification`` with
``num_labels=1``, as TRL's ``RewardTrainer`` loads a reward model and as ``grpo.rewards`` and TRL's
``GRPOTrainer`` load one back: a ``score`` linear layer on every position's final hidden state, read at
the sequence's last token. slipstream reads that same ``score`` output at each packed answer's last
token (``AnswerSpans.ends``), so a model is trained as a reward model only where both hold:

- transformers has a sequence-classification class for the architecture (else refused by name);
- its forward returns ``score`` of the last token that is not the pad id for an unpadded sequence (:func:`check_reward_head`,
  one small forward at start): a head under another name, another pooling (first token, EOS tokens,
  a mean) or a transform after ``score`` is refused by name, never trained as something else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..refusal import Refusal

if TYPE_CHECKING:
    from ..packing.batch import PackedBatch

# the PEFT task of each head: SEQ_CLS trains the reward model's score head in full (modules_to_save), as TRL's
# RewardTrainer does with a PEFT config
PEFT_TASKS = {"causal-lm": "CAUSAL_LM", "reward": "SEQ_CLS"}


class HeadError(Refusal, ValueError):
    """The architecture cannot carry the objective's head exactly; the message names it (no speedup avoids
    it: the model must change)."""


def sequence_classifier_class(config: Any, where: str):
    """transformers' sequence-classification class of ``config``'s architecture, or HeadError."""
    from transformers import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING

    try:
        return MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING[type(config)]
    except KeyError:
        raise HeadError(
            f"{where}: transformers has no sequence-classification class for {type(config).__name__} "
            f"(model_type {getattr(config, 'model_type', '?')!r}); training.objective reward trains a scalar "
            "head as AutoModelForSequenceClassification places it, so this architecture cannot be a reward "
            "model here"
        ) from None


def auto_class(path, head: str, trust_remote_code: bool = False) -> tuple[Any, dict]:
    """The auto class that loads ``path`` with ``head``, and the keywords ``from_pretrained`` needs."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    if head == "causal-lm":
        return AutoModelForCausalLM, {}
    config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    if not trust_remote_code:
        sequence_classifier_class(config, str(path))
    return AutoModelForSequenceClassification, {"num_labels": 1}


def build_with_head(config: Any, head: str, **kwargs) -> torch.nn.Module:
    """A randomly initialised model of ``config`` with ``head`` (``from_config``)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if head == "causal-lm":
        return AutoModelForCausalLM.from_config(config, **kwargs)
    sequence_classifier_class(config, f"model type {config.model_type!r}")
    config.num_labels = 1
    return AutoModelForSequenceClassification.from_config(config, **kwargs)


def classifier_of(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under any wrapper (DDP's ``module``, PEFT's base model)."""
    inner = getattr(model, "module", model)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def score_module(model: torch.nn.Module) -> torch.nn.Module:
    """The reward model's ``score`` head under any wrapper (DDP, PEFT: its trained copy's wrapper)."""
    base = classifier_of(model)
    head = getattr(base, "score", None)
    if head is None:
        raise HeadError(
            f"{type(base).__name__} has no 'score' head: its classification head is placed differently from "
            "the last-token score training.objective reward reads"
        )
    return head


def check_reward_head(model: torch.nn.Module, input_ids: list[int]) -> None:
    """One unpadded sequence through the model as transformers runs it: its returned reward must be the
    ``score`` output at the last token, else the head is placed differently (HeadError naming it)."""
    head = score_module(model)
    name = type(getattr(model, "module", model)).__name__
    base = classifier_of(model)
    if getattr(base.config, "num_labels", None) != 1:
        raise HeadError(
            f"{type(base).__name__}: a reward model has num_labels 1, not {base.config.num_labels}"
        )
    seen: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda module, args, output: seen.append(output))
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([input_ids], device=device), use_cache=False)
    finally:
        hook.remove()
    returned = out.logits.reshape(-1).float()
    if len(seen) != 1 or seen[0].shape[:2] != (1, len(input_ids)) or returned.numel() != 1:
        raise HeadError(
            f"{name} ({type(base).__name__}): its forward does not apply 'score' once to every position and "
            "return one reward; its classification head is placed differently from the last-token score "
            "training.objective reward reads"
        )
    pad = base.config.get_text_config().pad_token_id
    last = (
        next((i for i in range(len(input_ids) - 1, -1, -1) if input_ids[i] != pad), 0)
        if pad is not None
        else -1
    )
    read = seen[0][0, last].reshape(-1).float()
    if not torch.equal(read, returned):
        raise HeadError(
            f"{type(base).__name__}: its reward is not 'score' of the last token (read {read.item():.6g}, "
            f"returned {returned.item():.6g}): its head pools or transforms differently from what "
            "training.objective reward reads"
        )


def pad_id_of(tokenizer: Any) -> int | None:
    """The id a reward model pads with, as TRL's ``RewardTrainer`` and ``GRPOTrainer`` choose it: the
    tokenizer's pad token, else its EOS."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def say_which_id_pads(model: torch.nn.Module, tokenizer: Any) -> int | None:
    """A reward model scores each row's last token that is not padding: its config names the pad id
    (:func:`pad_id_of`; TRL sets it so too), so right-padded rows score as each row alone. Note that a
    sequence ending with that id (EOS, where EOS pads) is scored at the token before it, by transformers
    and TRL alike, and so by slipstream (``AnswerSpans.ends``). Returns the id (None: not a reward model)."""
    inner = classifier_of(model)
    if getattr(inner.config, "num_labels", None) != 1:
        return None
    text = inner.config.get_text_config()
    if text.pad_token_id is None:
        text.pad_token_id = pad_id_of(tokenizer)
    return text.pad_token_id


def reward_scores(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """[answers] fp32: each packed answer's reward, ``score`` read at its last token (differentiable)."""
    ends = batch.answers.ends
    if ends is None:
        raise ValueError(
            "a reward model reads each answer's last token: this batch's layout does not give it"
        )
    seen: list[torch.Tensor] = []
    hook = score_module(model).register_forward_hook(lambda module, args, output: seen.append(output))
    inputs = batch.model_inputs()
    inputs.pop("labels")  # no loss inside the model: the pairs' loss is read from the scores
    try:
        model(**inputs)
    finally:
        hook.remove()
    return seen[-1][0, ends, 0].float()
