"""One A/B workload, ``ABConfig``: every arm sees exactly this; its fields generate ``slipstream ab``'s options.

Kept apart from the runner so that the runner and the memory-ceiling search (``ceiling.py``),
which both read it, import it from below instead of from each other.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from .. import speedups as speedups_module  # read at call time, so a new field is known here
from ..fields import Dtype, check_fields
from ..offload.policy import Checkpointing
from ..train.config import Schedule
from .adapter import LORA_TARGETS
from .arms import ARM_PRESETS, ARM_SPECS, ARMS
from .inputs import check_model, is_model_dir, read_chat_template_option

# How the arms' processes share the machine (bench/lockstep.py)
Interleave = Literal["auto", "steps", "arms"]
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_bytes(text: str) -> int:
    """'8GB' -> 8e9, '8GiB' -> 8 * 2**30, '512MB', '1.5GB'; ValueError naming the text otherwise."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMG]I?B|B)?\s*", text.upper())
    if not match:
        raise ValueError(f"max_tokens_within: {text!r} is not a memory size (e.g. 8GB, 512MiB)")
    value = float(match.group(1)) * _UNITS[match.group(2) or ""]
    if value <= 0:
        raise ValueError(f"max_tokens_within: {text!r} must be positive")
    return int(value)


def _option(
    default: Any, help: str | None, flag: str | None = None, cli: bool = True, metavar: str | None = None
):
    """An ABConfig field and its ``slipstream ab`` option (generated in bench/command.py)."""
    return field(default=default, metadata={"help": help, "flag": flag, "cli": cli, "metavar": metavar})


@dataclass
class ABConfig:
    """One A/B workload. Every arm sees exactly this."""

    model: str = _option(
        "demo",
        "a built-in shape (tiny config or real-model preset, seeded random weights) or a local model "
        "directory (real weights, with its tokenizer and chat template)",
        metavar="SHAPE_OR_DIR",
    )
    layers: int | None = _option(None, "shorten a built-in shape to N layers")
    # The documents: the user's file read as `slipstream train` reads it, or the demo rows.
    data: str | None = _option(
        None,
        "a data file in any shape slipstream train reads (JSONL, JSON, Parquet, a datasets directory); "
        "default: the built-in demo rows",
        metavar="FILE",
    )
    response_only: bool = _option(
        False, "labels on the assistant's turns only (as train's data.response_only)"
    )
    chat_template: str | None = _option(
        None,
        "render chats with this template instead of the tokenizer's: a .jinja file or a tokenizer directory "
        "(as train's data.chat_template)",
        metavar="FILE_OR_DIR",
    )
    # What every arm trains for (slipstream.objectives): next-token SFT on the documents, a
    # preference objective on pairs ({"prompt", "chosen", "rejected"} rows in --data, read as
    # slipstream train reads them) whose arms exist: dpo (--preset dpo), orpo (--preset orpo); or
    # online RL on prompt rows: grpo (--preset grpo; its rewards and settings from --config RUN.yaml).
    objective: str = _option(
        "sft",
        "sft (documents), dpo / orpo (--data holds preference pairs; arms: --preset dpo / --preset orpo), "
        "or grpo (--data holds prompt rows, --config RUN.yaml its rewards; arms: --preset grpo)",
    )
    beta: float = _option(0.1, "the preference objective's beta (dpo; orpo: its lambda)")
    # Rows that start with the same tokens (a system prompt, a prompt with several answers) run as
    # groups, the shared start once (data.prefix_groups): each step's rows, the same for every arm,
    # regrouped by the arms that share; the others (stock, peers, slipstream-no-prefix-sharing) run
    # them whole.
    share_prefixes: Literal["auto", "on", "off"] = _option(
        "auto",
        "run each step's rows that start with the same tokens with that start once (as train's "
        "data.share_prefixes); auto: where the device's cost model says it saves time",
    )
    max_seq_len: int = _option(1024, "tokens per packed micro-batch")
    overflow: Literal["truncate", "split"] = _option(
        "truncate",
        "a sample longer than --max-seq-len: cut it, or split it in pieces (as train's data.overflow)",
    )
    steps: int = _option(40, "optimizer steps per arm (warm-up included)")
    warmup: int = _option(2, "untimed warm-up steps")
    grad_accum: int = _option(1, "micro-batches per step")
    # None: the workload's default (``workload_defaults``): slipstream train's for a model directory
    # (what a user would train), the A/B's own for a built-in shape (seeded random weights)
    lr: float | None = _option(
        None,
        "peak learning rate (default: 2e-4 for a model directory, as slipstream train; 2e-3 for a shape)",
    )
    schedule: Schedule | None = _option(
        None,
        "learning-rate schedule over --steps (default: cosine for a model directory, as slipstream train; "
        "constant for a shape)",
    )
    lr_warmup_steps: int = _option(0, "steps the schedule warms the learning rate up over")
    seed: int = _option(0, "seeds the preset's weights, the demo rows, the bin order and the adapter")
    num_rows: int = _option(1500, "built-in demo rows to draw from", flag="--rows")
    # "bfd" = slipstream's best-fit-decreasing bins, which gather similar lengths and so also
    # spare the padded arm most of its padding; "sequential" = documents in shuffled order up
    # to the token budget, the batches padded training usually sees. Every arm gets the same.
    batching: Literal["bfd", "sequential"] = _option(
        "bfd",
        "documents per micro-batch: best-fit-decreasing bins, or shuffled order up to the budget "
        "(sequential: the batches padded training usually sees)",
    )
    dtype: Dtype | None = _option(
        None,
        "the parameters' dtype in every arm; auto: bf16 where the device runs it natively, else fp32 "
        "(default: auto for a model directory, as slipstream train; float32 for a shape)",
    )
    device: str = _option("auto", "auto, cpu or cuda")
    arms: tuple[str, ...] = _option(ARM_PRESETS["default"], f"comma-separated, from {','.join(ARMS)}")
    # Speedups for the slipstream arms: every Speedups field is an `ab` option (generated in
    # bench/command.py). checkpointing also makes the stock arms recompute when not "off"; the
    # others are collected here, and an arm's own ablation wins over them.
    checkpointing: Checkpointing = _option("off", None, cli=False)
    speedups: dict[str, Any] = field(default_factory=dict, metadata={"cli": False})
    lora_rank: int | None = _option(
        None,
        "train a PEFT LoRA of this rank in every arm, 0: full fine-tune (default: 8 for a model directory, "
        "as slipstream train; 0 for a shape)",
    )
    lora_alpha: float | None = _option(None, "the LoRA's alpha (default: 2 x rank)")
    lora_targets: tuple[str, ...] = _option(LORA_TARGETS, "comma-separated modules the LoRA wraps")
    lora_modules_to_save: tuple[str, ...] = _option((), None, cli=False)  # from --config's lora section
    repeats: int = _option(1, "run every arm this many times, interleaved")
    interleave: Interleave = _option(
        "auto",
        "steps: every arm's process alive at once, each arm's step k timed next to the others' (a slow "
        "phase of the machine then slows every arm alike); arms: one arm after another; auto: steps where "
        "the arms' memory fits side by side",
    )
    threads: int | None = _option(None, "torch CPU threads per arm")
    # Between two steps (CPU, untimed): hold the memory the arm's steps churn while it waits, so its
    # next step starts as one straight after another does (bench/host_pages.py: on a VM the host takes
    # a waiting process's freed pages back, and they fault in cold).
    keep_pages_warm: bool = _option(
        True,
        "CPU: between two steps, hold the memory the arm's steps churn (untimed) and free it just before the "
        "next, so an arm that waited (lockstep) pays no colder page faults than one stepping alone",
    )
    out_dir: str | None = _option(None, "output directory (default: runs/ab-<time>)", flag="--out")
    # The memory ceiling: for each arm, the most packed tokens one step trains within this
    # budget (e.g. "8GB"; peak RSS on a CPU, max_memory_allocated on CUDA). None: not searched.
    max_tokens_within: str | None = _option(
        None,
        "also find each arm's memory ceiling: the most packed tokens one step trains within SIZE "
        "(e.g. 8GB; peak RSS on a CPU, max_memory_allocated on CUDA)",
        metavar="SIZE",
    )
    # One more step per arm after the timed ones, under torch.profiler: where its time goes.
    profile_step: bool = _option(
        False,
        "after the timed steps, profile one more step per arm: its time in matmuls, attention, dtype "
        "copies, compiled kernels, the optimizer and the rest, and the linear layers' GEMM rate",
    )
    # The `slipstream train` config the workload was read from (--config RUN.yaml), for the record.
    train_config: str | None = _option(
        None,
        "A/B the run a slipstream train config describes: its model, data (path, response_only, "
        "max_seq_len, overflow), LoRA, dtype, lr, seed, grad_accum, speedups and objective (a preference "
        "objective: its beta and its arms); options given here win",
        flag="--config",
        metavar="RUN.yaml",
    )

    # An online-RL objective's settings (--objective grpo): ``slipstream train``'s ``grpo:`` section of
    # --config RUN.yaml (rewards, G, sampling, loss), as a dict; empty: GRPOConfig's defaults.
    grpo: dict[str, Any] = field(default_factory=dict, metadata={"cli": False})

    # What the workload took from its defaults (``workload_defaults``): {"source": ..., "fields": {...}};
    # set by __post_init__, kept in the record.
    defaults: dict[str, Any] = field(default_factory=dict, metadata={"cli": False})

    def __post_init__(self):
        check_model(self.model)  # raises ValueError naming a model that is neither shape nor directory
        self._apply_defaults()
        unknown = [arm for arm in self.arms if arm not in ARMS]
        if unknown:
            raise ValueError(f"unknown arm(s) {unknown}; choose from {ARMS}")
        if self.steps <= self.warmup:
            raise ValueError(f"steps ({self.steps}) must exceed warmup ({self.warmup})")
        check_fields(self)  # the typed fields' rules (choices, ranges), as everywhere
        if self.layers is not None and is_model_dir(self.model):
            raise ValueError(
                f"layers: a model directory ({self.model}) runs as saved; --layers shortens a built-in shape"
            )
        if self.data is not None and not Path(self.data).exists():
            raise ValueError(f"data {self.data}: no such file or directory")
        if self.chat_template is not None:
            read_chat_template_option(self.chat_template)  # raises ValueError naming chat_template
        self._check_objective()
        if self.lora_rank and not self.lora_targets:
            raise ValueError("lora_targets is empty: name the modules the LoRA wraps")
        speedups_module.Speedups(**self.speedups)  # the overrides' names and values, checked by Speedups
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' asked for, but this torch sees no CUDA device")
        if self.max_tokens_within is not None:
            parse_bytes(self.max_tokens_within)  # raises ValueError naming the value

    def _check_objective(self) -> None:
        """A registered objective; its arms train what it reads (pairs of this objective, or documents)."""
        from ..objectives import objective_for, objective_names

        try:
            reads = objective_for(self.objective).reads
        except KeyError:
            raise ValueError(
                f"objective {self.objective!r}: not a registered objective ({', '.join(objective_names())})"
            ) from None
        pairs = reads == "pairs"
        if reads == "prompts":
            self._check_prompts_objective()
            return
        if pairs:
            if self.data is None:
                raise ValueError(f"objective {self.objective}: --data must name a file of preference pairs")
            own = [arm for arm in ARMS if ARM_SPECS[arm].objective == self.objective]
            if not own:
                raise ValueError(f"objective {self.objective}: no A/B arm trains it yet")
            documents = [arm for arm in self.arms if not ARM_SPECS[arm].pairs]
            if documents:
                raise ValueError(
                    f"objective {self.objective}: arm(s) {documents} train documents, not pairs "
                    f"(use --preset {self.objective})"
                )
            other = [arm for arm in self.arms if ARM_SPECS[arm].objective != self.objective]
            if other:
                raise ValueError(
                    f"objective {self.objective}: arm(s) {other} train another objective "
                    f"(use --preset {self.objective}: {', '.join(own)})"
                )
        elif any(ARM_SPECS[arm].pairs for arm in self.arms):
            wanted = sorted({ARM_SPECS[arm].objective for arm in self.arms if ARM_SPECS[arm].pairs})
            raise ValueError(
                f"the {'/'.join(wanted)} arms train preference pairs: add --objective {wanted[0]}"
            )

    def _check_prompts_objective(self) -> None:
        """Online RL (grpo): prompt rows, its rewards from --config, and only its own arms."""
        if self.data is None:
            raise ValueError(f"objective {self.objective}: --data must name a file of prompt rows")
        own = [arm for arm in ARMS if ARM_SPECS[arm].objective == self.objective]
        other = [arm for arm in self.arms if ARM_SPECS[arm].objective != self.objective]
        if other:
            raise ValueError(
                f"objective {self.objective}: arm(s) {other} train another objective "
                f"(use --preset {self.objective}: {', '.join(own)})"
            )
        if not self.grpo.get("rewards"):
            raise ValueError(
                f"objective {self.objective}: no reward functions: give --config RUN.yaml whose "
                f"{self.objective}.rewards names them"
            )

    def _apply_defaults(self) -> None:
        """Fill the fields left None from ``workload_defaults`` and note which (``self.defaults``);
        ``dtype: auto`` becomes the dtype it resolves to on the run's device, said there too."""
        source, values = workload_defaults(self.model)
        applied = {name: value for name, value in values.items() if getattr(self, name) is None}
        if not applied.get("lora_rank", self.lora_rank):
            applied.pop("lora_alpha", None)  # a full fine-tune has no alpha to default
        for name, value in applied.items():
            setattr(self, name, value)
        if self.dtype == "auto":
            from ..train.precision import resolve_dtype  # the rule slipstream train applies

            chosen, why = resolve_dtype("auto", torch.device(resolve_device(self.device)))
            self.dtype = str(chosen).removeprefix("torch.")
            applied["dtype"] = f"auto: {self.dtype} ({why.split('(auto: ', 1)[-1].rstrip(')')})"
        if applied:
            self.defaults = {"source": source, "fields": {**self.defaults.get("fields", {}), **applied}}

    @classmethod
    def from_dict(cls, config_dict: dict) -> ABConfig:
        """Back from ``dataclasses.asdict`` (how a config reaches an arm's process)."""
        tuples = {
            k: tuple(config_dict[k])
            for k in ("arms", "lora_targets", "lora_modules_to_save")
            if k in config_dict
        }
        return cls(**{**config_dict, **tuples})


# What a built-in shape (seeded random weights) trains when the command line leaves it open: a full
# fine-tune at a constant, high learning rate, in fp32 (every earlier A/B record ran so).
SHAPE_DEFAULTS = {"lora_rank": 0, "lr": 2e-3, "schedule": "constant", "dtype": "float32"}


def workload_defaults(model: str) -> tuple[str, dict[str, Any]]:
    """The defaults of the fields an A/B leaves open, and where they come from.

    A model directory holds real weights a user would fine-tune: it gets ``slipstream train``'s own
    defaults (its LoRA's rank, alpha and target modules, its learning rate and schedule, dtype auto),
    read from the train config's dataclasses, so the two never drift apart. A full fine-tune is
    still there, asked for (``--lora-rank 0``). A built-in shape keeps :data:`SHAPE_DEFAULTS`."""
    if not is_model_dir(model):
        return "the A/B's defaults for a built-in shape", dict(SHAPE_DEFAULTS)
    from ..train.config import LoraConfig, ModelConfig, OptimizerConfig

    lora, optimizer = LoraConfig(), OptimizerConfig()
    return "slipstream train's defaults (a model directory)", {
        "lora_rank": lora.rank if lora.enabled else 0,
        "lora_alpha": lora.alpha,
        "lr": optimizer.lr,
        "schedule": optimizer.schedule,
        "dtype": ModelConfig().dtype,
    }


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name
