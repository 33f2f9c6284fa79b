"""One prompt in, one answer out: the chat-template prompt and the ``generate`` call that
``slipstream generate`` and a training run's ``training.sample_prompts`` share.

A prompt goes through the tokenizer's chat template (one user turn, ``add_generation_prompt``)
when it has one, as is otherwise. Greedy decoding draws no random number and seeds nothing, so
answering in the middle of a training run leaves every RNG as it was; sampling seeds torch's
RNG per prompt (each answer is reproducible on its own). The model is used as it is given
(its mode included): the caller puts it in eval mode and under the attention it wants.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Answer:
    text: str  # special tokens removed
    new_tokens: int  # tokens generated, a stop token included


@dataclass
class Generator:
    """A loaded model and tokenizer, ready for ``generate`` (load once, ask many times)."""

    model: Any
    tokenizer: Any
    source: str  # what was loaded, in words

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def inputs(self, prompt: str) -> dict[str, torch.Tensor]:
        """The prompt's token ids: one user turn of the chat template (when there is one), else the text."""
        if self.tokenizer.chat_template:
            encoded = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}],
                add_generation_prompt=True,
                return_dict=True,
                return_tensors="pt",
            )
        else:
            encoded = self.tokenizer(prompt, return_tensors="pt")
        return {
            key: encoded[key].to(self.device) for key in ("input_ids", "attention_mask") if key in encoded
        }

    def generate(self, prompt: str, **options: Any) -> str:
        """The answer to one prompt (special tokens removed); ``answer``'s options (``streamer``
        gets the tokens as they come)."""
        return self.answer(prompt, **options).text

    def answer(
        self,
        prompt: str,
        *,
        max_new_tokens: int = 256,
        sample: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int = 0,
        streamer=None,
    ) -> Answer:
        """``generate``'s answer with the number of tokens generated."""
        inputs = self.inputs(prompt)
        options: dict[str, Any] = {"do_sample": sample}
        if sample:
            options.update(temperature=temperature, top_p=top_p, top_k=0)
            torch.manual_seed(seed)
        else:  # a model's own sampling defaults would only draw warnings under greedy decoding
            options.update(temperature=None, top_p=None, top_k=None)
        with torch.no_grad():
            out = self.model.generate(
                **inputs,
                max_new_tokens=max_new_tokens,
                eos_token_id=self.stop_ids(),
                pad_token_id=self._pad_id(),
                streamer=streamer,
                **options,
            )
        new = out[0, inputs["input_ids"].shape[1] :]
        return Answer(self.tokenizer.decode(new, skip_special_tokens=True), int(new.shape[0]))

    def stop_ids(self) -> list[int]:
        """The tokens that end an answer: the generation config's EOS ids and the tokenizer's."""
        configured = self.model.generation_config.eos_token_id
        ids = configured if isinstance(configured, list) else [configured]
        ids = [i for i in [*ids, self.tokenizer.eos_token_id] if i is not None]
        return list(dict.fromkeys(ids))

    def _pad_id(self) -> int | None:
        if self.tokenizer.pad_token_id is not None:
            return self.tokenizer.pad_token_id
        stops = self.stop_ids()
        return stops[0] if stops else None
