"""``slipstream generate``: text from a trained run (or a bare PEFT adapter) and its base model.

A run directory (what ``slipstream train`` wrote) names its base model in ``config.json``:
``model.path`` is loaded from disk, ``model.preset`` is rebuilt as training built it (same
seed, layers and vocabulary), ``quantization.four_bit`` loads it in NF4 again, and the
adapter (with expert LoRA, where the run trained one) goes on top; a run trained without LoRA
saved the whole model in ``adapter/``. A plain model directory is used as it is (the base
model alone, to compare with). A bare adapter directory names its base in
``adapter_config.json`` (``base_model_name_or_path``), which must be a local directory:
nothing is downloaded.

The model is fresh: no ``slipstream.optimize`` (packed attention is for training batches;
generation runs transformers' stock attention with its KV cache); only expert LoRA switches the
experts to slipstream's sorted routing, the one place those adapters run. The prompts are answered
as a training run's ``training.sample_prompts`` are (``models.answer.Generator``: the chat
template, greedy unless sampling is asked for).

``engine="vllm"`` (``--engine vllm``): the loaded model, adapter merged, is handed to vLLM in its own
process (:mod:`slipstream.engines.vllm_engine`, as ``grpo.engine: vllm`` does) and every prompt is
answered in one batched call. It pays the engine's start (about a minute and a half on 2 CPU cores,
once per command), so it is for many prompts, not one. Greedy answers are the same tokens as the hf
engine's up to float rounding; sampled answers are drawn by vLLM (seeded per call: the same seed and
prompts give the same answers, but not the hf engine's draws). What vLLM cannot run exactly (a 4-bit
base, expert LoRA, a LoRA on tied embeddings) is refused by name.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .models.answer import Answer, Generator
from .train.config import ConfigError, run_config
from .train.errors import TrainError
from .train.output_dir import ADAPTER, CHECKPOINTS, CONFIG, MARKER
from .train.precision import resolve_dtype


class GenerateError(RuntimeError):
    """A run, adapter or prompt that cannot be used; the message is one line naming the path."""


def generate(
    path: str | Path,
    prompts: str | Sequence[str],
    *,
    max_new_tokens: int = 256,
    sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    device: str | torch.device | None = None,
    dtype: str | None = None,
    engine: str = "hf",
    vllm_gpu_memory_utilization: float = 0.3,
) -> list[str]:
    """The answers of a run directory's (or an adapter directory's) model to ``prompts``, one per prompt.

    Greedy by default; ``sample=True`` draws with ``temperature`` and ``top_p``, seeded by
    ``seed`` per prompt. ``dtype`` ("auto", "float32", "bfloat16", ...): default the run's
    ``model.dtype`` (``auto`` for an adapter or model directory). ``engine="vllm"``: all prompts in
    one call to vLLM (``vllm_gpu_memory_utilization``: its memory share). Raises ``GenerateError``
    (one line, naming the path) on bad input.
    """
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    options = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    check_options(**options)
    check_engine(engine, vllm_gpu_memory_utilization)
    generator = load_generator(path, device=device, dtype=dtype)
    if engine == "hf":
        return [generator.generate(prompt, sample=sample, seed=seed, **options) for prompt in prompts]
    answers = EngineAnswers.start(generator, prompts, max_new_tokens, vllm_gpu_memory_utilization)
    try:
        return [a.text for a in answers.answers(prompts, sample=sample, seed=seed, **options)]
    finally:
        answers.close()


ENGINES = ("hf", "vllm")


def check_engine(engine: str, memory_share: float) -> None:
    if engine not in ENGINES:
        raise GenerateError(f"unknown engine {engine!r} ({', '.join(ENGINES)})")
    if not 0 < memory_share < 1:
        raise GenerateError(f"the vLLM memory share must be in (0, 1), got {memory_share}")


def check_options(*, max_new_tokens: int, temperature: float, top_p: float) -> None:
    if max_new_tokens < 1:
        raise GenerateError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not temperature > 0:
        raise GenerateError(f"temperature must be > 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise GenerateError(f"top_p must be in (0, 1], got {top_p}")


def read_prompt_file(path: str | Path) -> list[str]:
    """One prompt per non-blank line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise GenerateError(f"{path}: no such prompt file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise GenerateError(f"{path}: cannot read the prompt file ({error})") from None
    prompts = prompt_lines(text.splitlines())
    if not prompts:
        raise GenerateError(f"{path}: no prompts in the file (one prompt per line)")
    return prompts


def prompt_lines(lines: Iterable[str]) -> list[str]:
    return [line.rstrip("\r\n") for line in lines if line.strip()]


# ------------------------------------------------------------------------------- loading


def load_generator(
    path: str | Path, *, device: str | torch.device | None = None, dtype: str | None = None
) -> Generator:
    """Load a run directory's (or a bare adapter directory's) base model, adapter and tokenizer,
    or a plain model directory's model and tokenizer."""
    path = Path(path)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if not path.exists():
        raise GenerateError(f"{path}: no such run or adapter directory")
    if not path.is_dir():
        raise GenerateError(f"{path}: not a directory (give a run directory or its adapter/)")
    if path.name == ADAPTER and _is_run(path.parent):
        path = path.parent  # the run's adapter: the run's config knows the base
    if _is_run(path):
        generator = _from_run(path, device, dtype)
    elif (path / "adapter_config.json").is_file():
        generator = _from_adapter(path, device, dtype)
    elif (path / "config.json").is_file():  # a plain model directory: the base model alone
        tokenizer = _tokenizer(path, f"{path}: no usable tokenizer saved beside the model")
        model = _full_model(path, _dtype(dtype or "auto", device), device)
        generator = Generator(model, tokenizer, f"the model in {path}")
    else:
        raise GenerateError(
            f"{path}: neither a slipstream run directory, an adapter directory (adapter_config.json) "
            "nor a model directory (config.json)"
        )
    generator.model.eval()
    return generator


def _is_run(path: Path) -> bool:
    if (path / MARKER).exists():
        return True
    try:
        data = json.loads((path / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and {"model", "lora", "training"} <= set(data)


def _dtype(name: str, device: torch.device) -> torch.dtype:
    try:
        return resolve_dtype(name, device)[0]
    except AttributeError:
        raise GenerateError(f"unknown dtype {name!r} (auto, float32, bfloat16, float16)") from None


def _from_run(run: Path, device: torch.device, dtype_name: str | None) -> Generator:
    from .train.driver import load_model as train_model

    adapter = run / ADAPTER
    if not adapter.is_dir():
        checkpoints = sorted((run / CHECKPOINTS).glob("step-*")) if (run / CHECKPOINTS).is_dir() else []
        hint = (
            f"; its newest checkpoint is {checkpoints[-1].name}: finish the run with "
            "slipstream train CONFIG.yaml --resume"
            if checkpoints
            else ""
        )
        raise GenerateError(f"{run}: no {ADAPTER}/ (the run has not finished{hint})")
    try:
        config = run_config(run / CONFIG)
    except ConfigError as error:
        raise GenerateError(str(error)) from None
    from .train.driver import model_head

    if model_head(config) != "causal-lm":
        raise GenerateError(
            f"{run}: a reward model's run (training.objective {config.training.objective}): it scores sequences, "
            "it does not generate; score with it through grpo.rewards after export --merged"
        )
    dtype = _dtype(dtype_name or config.model.dtype, device)
    if not (adapter / "adapter_config.json").is_file():  # trained without LoRA: the whole model
        tokenizer = _tokenizer(adapter, f"{adapter}: no tokenizer saved with the model")
        return Generator(_full_model(adapter, dtype, device), tokenizer, f"the fine-tuned model in {adapter}")
    if config.model.path is not None and not Path(config.model.path).is_dir():
        raise GenerateError(
            f"{run}: the run's base model {config.model.path} is not a local directory any more"
        )
    tokenizer = _tokenizer(adapter, f"{adapter}: no tokenizer saved with the adapter")
    try:
        base = train_model(config, len(tokenizer), dtype)
    except (TrainError, ConfigError) as error:
        raise GenerateError(f"{run}: cannot load the base model ({error})") from None
    where = config.model.path or f"model.preset {config.model.preset} (seed {config.seed})"
    model = _with_adapter(base.to(device) if not config.quantization.four_bit else base, adapter)
    return Generator(model, tokenizer, f"{where} + the adapter in {adapter}")


def _from_adapter(adapter: Path, device: torch.device, dtype_name: str | None) -> Generator:
    try:
        spec = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise GenerateError(f"{adapter / 'adapter_config.json'}: cannot read it ({error})") from None
    base = spec.get("base_model_name_or_path") if isinstance(spec, dict) else None
    if not base or not Path(base).is_dir():
        raise GenerateError(
            f"{adapter}: the adapter's base model {base!r} is not a local directory (slipstream generate "
            "downloads nothing; give the run directory, or a base saved on this machine)"
        )
    has_tokenizer = any((adapter / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
    tokenizer = _tokenizer(Path(base) if not has_tokenizer else adapter, f"{base}: no usable tokenizer")
    model = _with_adapter(_full_model(Path(base), _dtype(dtype_name or "auto", device), device), adapter)
    return Generator(model, tokenizer, f"{base} + the adapter in {adapter}")


def _tokenizer(path: Path, failure: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise GenerateError(f"{failure} ({' '.join(str(error).split())})") from None


def _full_model(path: Path, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    if not (path / "config.json").is_file():
        raise GenerateError(f"{path}: not a model directory (no config.json)")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    except Exception as error:  # safetensors, torch and transformers each raise their own kinds
        raise GenerateError(f"{path}: cannot load the model ({' '.join(str(error).split())})") from None
    return model.to(device)


def _with_adapter(base, adapter: Path):
    from peft import PeftModel

    try:
        model = PeftModel.from_pretrained(base, adapter)
    except Exception as error:  # PEFT raises ValueError, KeyError, RuntimeError (shape mismatch)...
        raise GenerateError(f"{adapter}: cannot load the adapter ({' '.join(str(error).split())})") from None
    experts = adapter / "experts"
    if experts.is_dir():
        from .moe.experts import use_sorted_experts
        from .moe.lora import load_expert_lora

        use_sorted_experts(model)  # expert LoRA runs inside slipstream's sorted routing, as in training
        try:
            load_expert_lora(model, experts)
        except (KeyError, OSError, RuntimeError, ValueError) as error:
            raise GenerateError(f"{experts}: cannot load the expert LoRA ({error})") from None
    return model


# ------------------------------------------------------------------------------- the vLLM engine
INTERACTIVE_CONTEXT = 8192  # the engine's context when the prompts are not known at its start


@dataclass
class EngineAnswers:
    """A loaded model's answers drawn by vLLM in its own process (``--engine vllm``)."""

    generator: Generator
    engine: Any  # slipstream.engines.vllm_engine.VLLMEngine

    @classmethod
    def start(
        cls, generator: Generator, prompts: Sequence[str], max_new_tokens: int, memory_share: float
    ) -> EngineAnswers:
        """Start the engine on ``generator``'s model; its context fits the longest of ``prompts`` and
        ``max_new_tokens`` (an interactive session, no prompts: the model's context up to 8192)."""
        from .engines.vllm_engine import EngineError, VLLMEngine, refuse_inexact
        from .rollouts import context_length

        model = generator.model
        limit = context_length(model, INTERACTIVE_CONTEXT)
        if prompts:
            longest = max(len(generator.inputs(p)["input_ids"][0]) for p in prompts)
            if longest + max_new_tokens > limit:
                raise GenerateError(
                    f"a prompt of {longest} tokens and --max-new-tokens {max_new_tokens} exceed the model's "
                    f"context of {limit} tokens"
                )
            max_model_len = longest + max_new_tokens
        else:
            max_model_len = min(limit, INTERACTIVE_CONTEXT)
        try:
            refuse_inexact(model, where="generate --engine vllm", instead="use --engine hf")
        except EngineError as error:
            raise GenerateError(str(error)) from None
        engine = VLLMEngine(
            stop_ids=tuple(generator.stop_ids()),
            max_model_len=max_model_len,
            memory_share=memory_share,
        )
        try:
            line = engine.start(model)
        except EngineError as error:
            engine.close()
            raise GenerateError(str(error)) from None
        except BaseException:
            engine.close()
            raise
        generator.source = f"{generator.source}, answered by {line}"
        return cls(generator, engine)

    def answers(
        self,
        prompts: Sequence[str],
        *,
        max_new_tokens: int,
        sample: bool,
        temperature: float,
        top_p: float,
        seed: int,
    ) -> list[Answer]:
        """One answer per prompt, all prompts in one call (greedy: temperature 0, vLLM's argmax)."""
        from .engines.vllm_engine import EngineError
        from .rollouts import Sampling

        ids = [self.generator.inputs(p)["input_ids"][0].tolist() for p in prompts]
        room = self.engine.max_model_len
        for index, prompt in enumerate(ids):
            if len(prompt) + max_new_tokens > room:
                raise GenerateError(
                    f"prompt {index + 1}: {len(prompt)} tokens and --max-new-tokens {max_new_tokens} exceed "
                    f"the engine's context of {room} tokens"
                )
        sampling = Sampling(
            temperature=temperature if sample else 0.0,
            top_p=top_p if sample else 1.0,
            top_k=0,
            max_new_tokens=max_new_tokens,
        )
        try:
            rollouts = self.engine.generate(self.generator.model, ids, 1, sampling, seed)
        except EngineError as error:
            raise GenerateError(str(error)) from None
        decode = self.generator.tokenizer.decode
        return [
            Answer(decode(group[0].ids, skip_special_tokens=True), len(group[0].ids))
            for group in rollouts.completions
        ]

    def close(self) -> None:
        self.engine.close()
