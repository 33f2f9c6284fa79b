"""Doctor's fast-path checks: what each path would run on this device and why, then a run of each
against its stock arm on a tiny random model of the requested family.

Every decision comes from the library's own decider (``choose_backend``, ``GroupedLinear``,
``choose_policy``, ``choose_chunk_tokens``, ``resolve_dtype``, ``should_compile``); nothing is
re-derived here. Compile has a decision row only (what "auto" does here, and whether inductor is
installed for the device): a cold compile takes tens of seconds on a CPU, too long for a check.

Each path is checked on its own: its fast arm is the model as ``slipstream.optimize`` sets it up
by default (every path on where the model allows it), its stock arm differs in that one path
only, so a difference is that path's:

- packed attention: the documents packed in one row, one SDPA call each (the other paths run on
  top of it), vs each document alone (stock attention);
- sorted MoE routing (``grouped_mm`` or the loop, whichever the device gets) vs transformers'
  own experts, on the requested family if it has experts, else on a tiny Qwen3-MoE;
- offload-double: the offload schedule vs no checkpointing, on the real ``CudaEngine`` on a GPU
  and on the ``RecordingEngine`` (same schedule, copies at once) elsewhere;
- the chunked loss vs transformers' loss;
- grouped attention: the packed row's documents grouped by length into batched SDPA calls
  (``attention_grouping="grouped"`` on the SDPA backend, whatever "auto" would pick for these
  few documents) vs each document alone (stock attention).

Both arms train one step from the same weights in the dtype training would use; the loss and
every parameter gradient are compared. In fp32 the fast arm must match the stock arm within
the compatibility sweep's tolerances. In bf16 both arms are also compared with an fp32 run of
the stock model (same bf16-rounded weights): the fast arm may be off by no more than
``BF16_FACTOR`` times the stock arm's own rounding error (or the fp32 tolerance where that is
larger). A second step of the fast arm counts host syncs (and, on CUDA, the syncs
``torch.cuda.set_sync_debug_mode("warn")`` reports); a path promises none, except the MoE loop
path's one read of the expert counts per layer per forward.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import re
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..bench.ablation import remembered as remembered_ablations
from ..bench.compat import LENGTHS, TOLERANCE, documents, gradient_errors
from ..bench.counters import HostSyncCounter
from ..compile import BREAK_EVEN_STEPS, inductor_available, should_compile
from ..fused import compiled_plan, compiled_policy, liger_plan
from ..fused.compiled import BREAK_EVEN_STEPS as FUSED_BREAK_EVEN_STEPS
from ..loss import UnsupportedLoss, choose_chunk_tokens
from ..models import TINY, build_config, build_model, model_names
from ..models.tiny_any import causal_lm_class, random_model, shrink_config, tiny_config
from ..moe.experts import UnsupportedExperts, check_experts_module, experts_modules, is_moe_model
from ..moe.grouped import GroupedLinear
from ..offload import CudaEngine, RecordingEngine, UnsupportedCheckpointing, enable_checkpointing
from ..offload.policy import DeviceDescription, choose_policy
from ..optimize import has_attention_sinks, optimize, state_of
from ..packing import collate_packed
from ..packing.attention import BACKEND_NAMES, UnsupportedAttentionFeature, choose_backend
from ..packing.costs import BUILTIN, AttentionCosts
from ..packing.grouping import grouping_policy
from ..packing.guards import UnsupportedArchitecture
from ..packing.short_attention import short_kernel_policy
from ..speedups import Speedups

DEFAULT_MODEL = "demo"  # the demo's model (`slipstream ab` with no arguments): a Qwen3 shape
PER_DOCUMENT = Speedups(attention_grouping="per_document")
MOE_STAND_IN = "qwen3-moe"  # the MoE check's model when the requested family has no experts
REFUSALS = (
    UnsupportedArchitecture,
    UnsupportedAttentionFeature,
    UnsupportedExperts,
    UnsupportedLoss,
    UnsupportedCheckpointing,
)
BF16_FACTOR = 4.0
OFFLOAD_TOKENS = 8192  # the reload buffer offload sizes its second copy by (see enable_checkpointing)
VERDICTS = ("ok", "WRONG", "refused", "skipped")


class DoctorError(ValueError):
    """A doctor request that cannot be run (an unknown model, an unreadable config): exit status 2."""


# --------------------------------------------------------------------------- the model checked


@dataclass
class CheckedModel:
    """The requested model: its full-size config (what decisions read) and the tiny one checked."""

    asked: str
    source: str  # "default preset", "preset", "local config"
    family: str  # transformers model_type
    config: Any  # full-size config
    tiny: Any  # the tiny config the checks build
    build: Callable[[int], torch.nn.Module] = field(repr=False)  # seed -> fp32 random model
    note: str = ""

    def describe(self) -> str:
        return f"{self.asked} ({self.source}, {self.family} family)" + (f"; {self.note}" if self.note else "")


def shape_of(config: Any) -> str:
    """One line for a (tiny) config's shape."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config

    def get(*keys: str) -> Any:
        return next((getattr(text, k) for k in keys if isinstance(getattr(text, k, None), int)), None)

    parts = [
        f"hidden {get('hidden_size', 'd_model', 'n_embd')}",
        f"{get('num_hidden_layers', 'n_layer')} layers",
    ]
    heads, kv = get("num_attention_heads", "n_head"), get("num_key_value_heads")
    if heads:
        parts.append(f"{heads} heads" + (f" / {kv} kv" if kv and kv != heads else ""))
    experts = get("num_experts", "num_local_experts", "n_routed_experts")
    if experts and experts > 1:
        parts.append(f"{experts} experts top-{get('num_experts_per_tok', 'moe_topk') or '?'}")
    window = get("sliding_window")
    if window:
        parts.append(f"window {window}")
    parts.append(f"vocab {get('vocab_size')}")
    return ", ".join(parts)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' warnings about a shrunk config (its rope scaling, ...) are not the user's concern here."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)


def resolve_model(asked: str | None) -> CheckedModel:
    """``--model``: a preset name (``slipstream.models.model_names()``) or a local directory with a
    config.json; None: the demo model. Raises DoctorError naming what is wrong."""
    if asked is None or asked in model_names():
        name = asked or DEFAULT_MODEL
        config = build_config(name)
        source = "preset" if asked else "default preset: the demo model"
        if name in TINY:  # already tiny: checked as it is
            return CheckedModel(
                name,
                source,
                config.model_type,
                config,
                config,
                lambda seed: build_model(name, seed=seed, attn_implementation="eager"),
            )
        return _shrunk(name, source, config)
    path = Path(asked).expanduser()
    if not path.is_dir():
        raise DoctorError(f"--model {asked}: not a preset ({', '.join(model_names())}) and no such directory")
    if not (path / "config.json").is_file():
        raise DoctorError(f"--model {asked}: no config.json in this directory")
    from transformers import AutoConfig

    try:
        with _quiet_transformers():
            config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as error:  # noqa: BLE001 - any unreadable config is the same answer
        raise DoctorError(f"--model {asked}: config.json could not be read ({_one_line(error)})") from error
    try:
        causal_lm_class(config.model_type)
    except (KeyError, AttributeError) as error:
        raise DoctorError(
            f"--model {asked}: model_type {config.model_type!r} has no causal-LM class in transformers' registry"
        ) from error
    return _shrunk(str(asked), "local config", config)


def _shrunk(asked: str, source: str, config: Any) -> CheckedModel:
    """A full-size config checked as a tiny model of its family (its own values kept where they fit)."""
    family = config.model_type
    note = ""
    try:
        with _quiet_transformers():
            tiny = shrink_config(config)
            random_model(tiny, seed=0)  # built once here, so a config that cannot shrink says so now
    except Exception as error:  # noqa: BLE001 - any failure: the family's defaults instead
        note = f"its own values did not shrink ({_one_line(error)[:80]}); the family's defaults were used"
        try:
            with _quiet_transformers():
                tiny = tiny_config(family)
                random_model(tiny, seed=0)
        except Exception as again:  # noqa: BLE001
            raise DoctorError(
                f"--model {asked}: no tiny {family} model builds here ({_one_line(again)})"
            ) from again

    def build(seed: int) -> torch.nn.Module:
        with _quiet_transformers():
            return random_model(tiny, seed=seed)

    return CheckedModel(asked, source, family, config, tiny, build, note)


# --------------------------------------------------------------------------- decisions


def decisions(
    checked: CheckedModel,
    model: torch.nn.Module,
    moe_model: torch.nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    dtype_why: str,
    costs: AttentionCosts = BUILTIN,
) -> list[dict[str, str]]:
    """What each fast path would run on ``device`` for ``checked`` and why, from the library's deciders.

    ``model``: the tiny model of the family (its structure: sinks, experts); ``moe_model``: the
    model the MoE check runs (the family's own or the stand-in); ``costs``: the packed attention's
    figures training would weigh here (``packing.calibration``)."""
    text = checked.config.get_text_config()

    def attention() -> tuple[str, str]:
        backend, why = choose_backend("auto", device, has_attention_sinks(model), dtype)
        return f"{backend} ({BACKEND_NAMES[backend]})", why

    def offload() -> tuple[str, str]:
        hidden = int(getattr(text, "hidden_size", 0) or 0)
        buffer_bytes = hidden * OFFLOAD_TOKENS * torch.empty((), dtype=dtype).element_size()
        policy = choose_policy("auto", DeviceDescription.detect(device), buffer_bytes)
        engine = "CudaEngine" if device.type == "cuda" else "RecordingEngine (CPU stand-in)"
        buffers = "pinned" if policy.pinned else "pageable"
        return f"{policy.mode}; {buffers} host buffers; engine {engine}", "; ".join(policy.reasons) or "-"

    def grouping() -> tuple[str, str]:
        backend, _ = choose_backend("auto", device, has_attention_sinks(model), dtype)
        return "auto", grouping_policy("auto", backend, has_attention_sinks(model), costs).removeprefix(
            "auto "
        )

    def short_kernel() -> tuple[str, str]:
        backend, _ = choose_backend("auto", device, has_attention_sinks(model), dtype)
        limit = costs.short_limit(dtype) if backend == "sdpa" and device.type == "cpu" else 0
        measured = costs.figures.get("short_kernel_speedup_by_length")
        figures = (
            "; its speedup over SDPA by document length: "
            + ", ".join(f"{length} {ratio:.2f}x" for length, ratio in measured.items())
            if measured
            else ""
        )
        if limit:
            return f"on up to {limit} tokens", short_kernel_policy(
                "auto", backend, costs, dtype
            ).removeprefix("auto (").removesuffix(")") + figures
        if backend != "sdpa":
            return "off", f"SDPA for every document: the {backend} backend attends the whole row in one call"
        if device.type != "cpu":
            return "off", f"SDPA for every document: a CPU kernel (here {device.type})"
        return "off", f"SDPA for every document: no length where it was faster ({costs.source}){figures}"

    def loss() -> tuple[str, str]:
        tokens, why = choose_chunk_tokens(int(text.vocab_size), dtype, device)
        return f"{tokens} tokens per chunk", why

    def fused_kernels() -> tuple[str, str]:
        plan, why = liger_plan(model, device, "auto")  # the tiny model: its config's model type
        if plan:
            return "liger", why
        return fused_compiled_decision(model, device, why.removeprefix("off (auto: ").removesuffix(")"))

    deciders = {
        "dtype": lambda: (_dtype_name(dtype), dtype_why),
        "compile (auto)": lambda: compile_decision(device),
        "packed attention": attention,
        "attention grouping": grouping,
        "short-document kernel (auto)": short_kernel,
        "MoE routing": lambda: _moe_decision(checked, model, moe_model, device, dtype),
        "offload (checkpointing: auto)": offload,
        "chunked loss": loss,
        "fused kernels (auto)": fused_kernels,
    }
    rows = []
    for path, decide in deciders.items():
        try:
            choice, why = decide()
        except Exception as error:  # noqa: BLE001 - a decider that fails here is itself a finding
            choice, why = "undecided", f"the decider failed: {_one_line(error)}"
        rows.append({"path": path, "choice": choice, "why": why})
    return rows


def compile_decision(device: torch.device) -> tuple[str, str]:
    """What ``compile="auto"`` does on ``device`` (it depends on the run's length, which doctor does
    not know) and whether inductor can compile here (what is installed; nothing is compiled)."""
    break_even = BREAK_EVEN_STEPS.get(device.type)
    choice = _by_run_length(break_even, "on")
    if break_even is None:
        _, why = should_compile("auto", 2**31, device)
        why = why.removeprefix("off (auto: ").removesuffix(")")
    else:
        why = (
            f"{break_even} steps pay back a compile's cold start on {device.type} (measured; "
            "slipstream.compile.should_compile); without a step count (plain optimize) it stays off"
        )
    works, how = inductor_available(device)
    choice += "" if works else "; compile='on' cannot run here"
    return choice, f"{why}; torch.compile: {how} (not compiled here: a cold compile takes tens of seconds)"


def _by_run_length(break_even: int | None, on: str) -> str:
    """What an "auto" gated by a measured break-even does, for a run of unknown length."""
    return (
        "off, whatever the run's length" if break_even is None else f"{on} from {break_even} steps, off below"
    )


def fused_compiled_decision(model: torch.nn.Module, device: torch.device, liger_why: str) -> tuple[str, str]:
    """Where Liger cannot run: what ``fused_kernels="auto"`` does with the compiled kernels (it
    depends on the run's length, which doctor does not know), which of the model's module classes
    the probe would switch, and whether inductor can build here (nothing is compiled)."""
    break_even = FUSED_BREAK_EVEN_STEPS.get(device.type)
    choice = _by_run_length(break_even, "compiled")
    if break_even is None:
        why = compiled_policy(device, "auto", 2**31)[1]
    else:
        why = f"{break_even} steps pay back the kernels' cold start on {device.type} (measured; slipstream.fused.compiled)"
    works, how = inductor_available(device)
    choice += "" if works else "; fused_kernels='compiled' cannot run here"
    return choice, f"Liger: {liger_why}; {why}; {compiled_plan(model).describe()}; {how}"


def _moe_decision(checked, model, moe_model, device, dtype) -> tuple[str, str]:
    modules = experts_modules(moe_model)
    where = "" if moe_model is model else f" (a tiny {MOE_STAND_IN}: {checked.family} has no experts)"
    if not is_moe_model(moe_model):
        return "-", f"{checked.family} has no experts"
    try:
        if not modules:
            raise UnsupportedExperts(
                f"{type(moe_model).__name__}'s experts do not use transformers' experts interface"
            )
        for module in modules:
            check_experts_module(module)
    except UnsupportedExperts as error:
        return "stock" + where, _one_line(error)
    module = modules[0]
    first = getattr(module, "gate_up_proj" if module.has_gate else "up_proj", None)
    if getattr(module, "slipstream_nf4", None) is not None or not isinstance(first, torch.Tensor):
        path, why = "loop", "4-bit experts: chunked dequantization"
    else:
        hidden = moe_model.config.get_text_config().hidden_size
        x = torch.zeros(16, hidden, dtype=dtype, device=device)
        linear = GroupedLinear(x, first.detach().to(device=device, dtype=dtype), None, None, "auto")
        path, why = linear.path, linear.reason
        if path == "grouped_mm":
            why = f"grouped_mm runs {_dtype_name(dtype)} experts on {device.type} (0 host syncs)"
        else:
            why += " (the loop path: one host read of the expert counts per layer)"
    return f"sorted, {path}{where}", why


# --------------------------------------------------------------------------- running an arm


@dataclass
class ArmRun:
    loss: float
    grads: dict[str, torch.Tensor]
    syncs: int | None = None
    syncs_by_op: dict[str, int] = field(default_factory=dict)
    cuda_sync_warnings: int | None = None
    policies: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    copies: dict[str, int] = field(default_factory=dict)


class _CountingEngine:
    """The offload engine it wraps (CudaEngine or RecordingEngine), counting the copies it issues."""

    def __init__(self, engine):
        self._engine = engine
        self.copies: Counter[str] = Counter()

    def copy(self, dst, src, stream, what: str) -> None:
        self.copies["offloads" if what.startswith("offload") else "reloads"] += 1
        self._engine.copy(dst, src, stream, what)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


class _ListHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def _captured_log() -> Iterator[list[str]]:
    """slipstream's policy log lines while active (shown as well only if the user asked for -v)."""
    logger = logging.getLogger("slipstream")
    handler = _ListHandler()
    level, propagate = logger.level, logger.propagate
    if not logger.isEnabledFor(logging.INFO):
        logger.setLevel(logging.INFO)
        logger.propagate = False
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


@contextlib.contextmanager
def _cuda_sync_warnings(device: torch.device) -> Iterator[list]:
    """On CUDA: torch.cuda.set_sync_debug_mode("warn") while active; the warnings it raised."""
    if device.type != "cuda":
        yield []
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode(previous)


def _inputs(docs: list[list[int]], layout: str, device: torch.device):
    if layout == "packed":
        return collate_packed([{"input_ids": doc} for doc in docs], device=device)
    return [torch.tensor([doc], device=device) for doc in docs]


def _step(model: torch.nn.Module, inputs, layout: str) -> torch.Tensor:
    """Forward + backward of one batch; the loss, still on the device (read after any counting)."""
    if layout == "packed":
        out = model(**inputs.model_inputs())
        out.loss.backward()
        return out.loss.detach()
    # each document alone, its loss weighted by its label tokens: the loss of a padded batch
    total = sum(ids.shape[1] - 1 for ids in inputs)
    loss = torch.zeros((), device=inputs[0].device)
    for ids in inputs:
        part = model(input_ids=ids, labels=ids).loss * ((ids.shape[1] - 1) / total)
        part.backward()
        loss = loss + part.detach().float()
    return loss


def run_arm(
    base: torch.nn.Module,
    docs: list[list[int]],
    speedups: Speedups,
    layout: str,
    device: torch.device,
    dtype: torch.dtype,
    offload: bool = False,
    count: bool = True,
    lora: bool = False,
) -> ArmRun:
    """One training step of a copy of ``base`` under ``speedups`` (parity), then another that is
    counted (host syncs; on CUDA the sync-debug warnings too). ``lora``: a PEFT LoRA on every linear
    layer trains instead of the whole model (the same adapter in every arm)."""
    model = copy.deepcopy(base).to(device=device, dtype=dtype)
    engine = None
    with _captured_log() as log:
        optimize(model, speedups)
        if lora:
            model = _with_lora(model)
        if offload:
            if device.type == "cuda":  # the real engine, under the real device policy
                engine = _CountingEngine(CudaEngine(device))
                enable_checkpointing(
                    model, "offload-double", DeviceDescription.detect(device), engine, min_offload_bytes=0
                )
            else:  # the same schedule on the CPU stand-in (the policy itself would recompute here)
                engine = _CountingEngine(RecordingEngine())
                enable_checkpointing(model, "offload-double", engine=engine, min_offload_bytes=0)
        model.train()
        inputs = _inputs(docs, layout, device)
        torch.manual_seed(0)
        loss = _step(model, inputs, layout)
        run = ArmRun(
            float(loss),
            {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None},
        )
        if engine is not None:
            run.copies = dict(engine.copies)
        if count:
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            with HostSyncCounter() as syncs, _cuda_sync_warnings(device) as warned:
                _step(model, inputs, layout)
            run.syncs, run.syncs_by_op = syncs.total, dict(syncs.by_op)
            if device.type == "cuda":
                run.cuda_sync_warnings = sum("synchroniz" in str(w.message).lower() for w in warned)
    state = state_of(model)
    run.policies = list(getattr(state, "policies", []) or [])
    run.log = log
    return run


def _with_lora(model: torch.nn.Module) -> torch.nn.Module:
    """PEFT LoRA (rank 4) on every linear layer but the head, seeded, with B drawn (not PEFT's zeros)
    so the adapters' own gradients and outputs are compared too."""
    from peft import LoraConfig, get_peft_model  # only the LoRA check imports it

    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    generator = torch.Generator().manual_seed(1)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            parameter.data.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model


# --------------------------------------------------------------------------- comparing


@dataclass
class Errors:
    loss: float
    grad: float  # the largest of ``grads``
    worst_param: str | None
    grads: dict[str, float] = field(default_factory=dict, repr=False)  # parameter -> relative error


def compare(actual: ArmRun, expected: ArmRun) -> Errors:
    """Relative error of the loss and of every parameter gradient (a gradient far smaller than the
    model's largest is compared against that scale, as the compatibility sweep does)."""
    loss = abs(actual.loss - expected.loss) / max(abs(expected.loss), 1e-12)
    grads = gradient_errors(actual.grads, expected.grads)
    worst = max(grads, key=grads.__getitem__, default=None)
    if worst is None or grads[worst] == 0:
        return Errors(loss, 0.0, None, grads)
    return Errors(loss, grads[worst], worst, grads)


# --------------------------------------------------------------------------- the checks


@dataclass
class Check:
    """One fast path's verdict on this device."""

    path: str
    verdict: str  # ok | WRONG | refused | skipped
    reason: str = ""
    model: str = ""
    arms: str = ""
    layout: str = ""  # "packed" (one row) or "alone" (one row per document)
    loss_error: float | None = None  # fast vs stock, relative
    grad_error: float | None = None  # the largest over the parameters
    worst_param: str | None = None
    bound: str = ""  # how parity was judged
    syncs: int | None = None  # fast arm, one step
    syncs_allowed: int | None = None  # None: no promise (unpacked layout)
    syncs_by_op: dict[str, int] = field(default_factory=dict)
    stock_syncs: int | None = None
    cuda_sync_warnings: int | None = None
    details: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Subject:
    """A model the checks run on: its fp32 weights, documents, and the layout its fast arms use."""

    label: str
    base: torch.nn.Module
    docs: list[list[int]]
    rounded: torch.nn.Module | None = None  # bf16 runs: fp32 copy of the bf16-rounded weights
    packs: bool = True  # False once packed attention is refused or wrong here: the others run unpacked

    @property
    def speedups(self) -> Speedups:
        # one SDPA call per document: the grouped path has its own check, so each check is one path's
        return PER_DOCUMENT if self.packs else Speedups(packed_attention=False)

    @property
    def layout(self) -> str:
        return "packed" if self.packs else "alone"


def subject(label: str, base: torch.nn.Module, dtype: torch.dtype) -> Subject:
    base.train()
    rounded = copy.deepcopy(base).to(dtype).to(torch.float32) if dtype != torch.float32 else None
    return Subject(label, base, documents(base, lengths=LENGTHS), rounded)


def _reference_speedups(stock: Speedups) -> Speedups:
    """A stock arm's speedups for its fp32 reference run: packed attention (if on) per-document SDPA,
    the backend every device runs in fp32 (varlen flash kernels do not take fp32)."""
    return stock.replace(attention_backend="sdpa") if stock.packed_attention else stock


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}"[:400]


def _moe_loop_reads(log: list[str]) -> int:
    """Experts modules that ran the loop path (each reads its expert counts once per forward)."""
    return sum(1 for line in log if re.match(r"moe compute for .*: loop ", line))


def _judge_fp32(check: Check, errors: Errors) -> list[str]:
    check.bound = f"fp32 vs stock: loss <= {TOLERANCE['loss']:g}, gradients <= {TOLERANCE['grad']:g}"
    problems = []
    if not errors.loss <= TOLERANCE["loss"]:
        problems.append(f"loss off by {errors.loss:.2g}")
    if not errors.grad <= TOLERANCE["grad"]:
        problems.append(f"gradient of {errors.worst_param} off by {errors.grad:.2g}")
    return problems


def _judge_low_precision(check: Check, fast: ArmRun, stock: ArmRun, reference: ArmRun, dtype) -> list[str]:
    """bf16: the fast arm no further from fp32 than BF16_FACTOR x the stock arm, quantity by quantity."""
    fast_ref, stock_ref = compare(fast, reference), compare(stock, reference)
    loss_bound = max(BF16_FACTOR * stock_ref.loss, TOLERANCE["loss"])
    ratios = {
        name: error / max(BF16_FACTOR * stock_ref.grads.get(name, 0.0), TOLERANCE["grad"])
        for name, error in fast_ref.grads.items()
    }
    worst = max(ratios, key=ratios.__getitem__, default=None)
    check.bound = (
        f"{_dtype_name(dtype)}: <= {BF16_FACTOR:g}x the stock arm's distance to fp32 "
        f"(stock: loss {stock_ref.loss:.0e}, gradients <= {stock_ref.grad:.0e})"
    )
    check.details["vs_fp32"] = {
        "fast": {"loss": fast_ref.loss, "grad": fast_ref.grad, "worst_param": fast_ref.worst_param},
        "stock": {"loss": stock_ref.loss, "grad": stock_ref.grad, "worst_param": stock_ref.worst_param},
        "loss_bound": loss_bound,
        "worst_grad_ratio": ratios[worst] if worst else 0.0,
    }
    problems = []
    if not fast_ref.loss <= loss_bound:
        problems.append(f"loss off fp32 by {fast_ref.loss:.2g} (the stock arm's: {stock_ref.loss:.2g})")
    if worst and not ratios[worst] <= 1.0:
        problems.append(
            f"gradient of {worst} off fp32 by {fast_ref.grads[worst]:.2g} "
            f"(the stock arm's: {stock_ref.grads.get(worst, 0.0):.2g})"
        )
    return problems


def run_check(
    path: str,
    subject_: Subject,
    fast: Speedups,
    stock: Speedups,
    device: torch.device,
    dtype: torch.dtype,
    *,
    stock_layout: str | None = None,
    offload: bool = False,
    arms: str = "",
    model: str = "",
    lora: bool = False,
) -> Check:
    """Run ``fast`` and ``stock`` on ``subject_`` and judge the fast arm (see the module docstring)."""
    started = time.perf_counter()
    check = Check(path, "ok", model=model or subject_.label, arms=arms, layout=subject_.layout)
    stock_layout = stock_layout or subject_.layout
    try:
        stock_run = run_arm(subject_.base, subject_.docs, stock, stock_layout, device, dtype, lora=lora)
        reference = None
        if subject_.rounded is not None:
            reference = run_arm(
                subject_.rounded,
                subject_.docs,
                _reference_speedups(stock),
                stock_layout,
                device,
                torch.float32,
                count=False,
                lora=lora,
            )
    except Exception as error:  # noqa: BLE001 - the stock arm failing leaves nothing to compare with
        check.verdict, check.reason = "skipped", f"the stock arm cannot run here: {_one_line(error)}"
        check.seconds = time.perf_counter() - started
        return check
    try:
        fast_run = run_arm(
            subject_.base, subject_.docs, fast, subject_.layout, device, dtype, offload=offload, lora=lora
        )
    except REFUSALS as error:
        check.verdict, check.reason = "refused", _one_line(error)
        check.seconds = time.perf_counter() - started
        return check
    except Exception as error:  # noqa: BLE001 - a fast path that crashes on this device is broken here
        check.verdict, check.reason = "WRONG", f"crashed: {_one_line(error)}"
        check.seconds = time.perf_counter() - started
        return check

    errors = compare(fast_run, stock_run)
    check.loss_error, check.grad_error, check.worst_param = errors.loss, errors.grad, errors.worst_param
    if reference is None:
        problems = _judge_fp32(check, errors)
    else:
        problems = _judge_low_precision(check, fast_run, stock_run, reference, dtype)

    check.syncs, check.syncs_by_op, check.stock_syncs = fast_run.syncs, fast_run.syncs_by_op, stock_run.syncs
    check.cuda_sync_warnings = fast_run.cuda_sync_warnings
    if subject_.layout == "packed":  # the promise is for packed batches (unpacked, positions are searched)
        forwards = 2 if offload else 1  # a checkpointed layer runs forward again in backward
        check.syncs_allowed = _moe_loop_reads(fast_run.log) * forwards
        if fast_run.syncs is not None and fast_run.syncs > check.syncs_allowed:
            problems.append(
                f"{fast_run.syncs} host syncs {fast_run.syncs_by_op} where {check.syncs_allowed} are promised"
            )
        if fast_run.cuda_sync_warnings and fast_run.cuda_sync_warnings > check.syncs_allowed:
            problems.append(
                f"set_sync_debug_mode('warn') reported {fast_run.cuda_sync_warnings} synchronizing calls"
            )
    check.details["policies"] = fast_run.policies
    check.details["log"] = fast_run.log
    if fast_run.copies:
        check.details["offload_copies"] = fast_run.copies
        if not fast_run.copies.get("offloads"):
            problems.append("the offload schedule copied nothing to the host")
    if problems:
        check.verdict, check.reason = "WRONG", "; ".join(problems)
    check.seconds = time.perf_counter() - started
    return check


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_paths(
    checked: CheckedModel,
    device: torch.device,
    dtype: torch.dtype,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[Check], dict[str, Subject]]:
    """Every fast path against its stock arm on ``device``; also returns the models checked."""
    with _one_thread(), _quiet_transformers():
        return _check_paths(checked, device, dtype, progress or (lambda text: None))


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """The checks' models are tiny: one CPU thread runs them as fast, and never stalls on a core
    another process holds (two OpenMP threads then wait on each other, 100x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _check_paths(
    checked: CheckedModel, device: torch.device, dtype: torch.dtype, say: Callable[[str], None]
) -> tuple[list[Check], dict[str, Subject]]:
    main = subject(checked.asked, checked.build(0), dtype)
    family_moe = is_moe_model(main.base)
    checks = []

    say("packed attention")
    packed = run_check(
        "packed attention",
        main,
        PER_DOCUMENT,
        Speedups(packed_attention=False),
        device,
        dtype,
        stock_layout="alone",
        arms="documents packed in one row vs each document alone (stock attention)",
    )
    checks.append(packed)
    # The other paths run on top of packed attention only where it is right here; else unpacked.
    main.packs = packed.verdict == "ok"

    say("sorted MoE routing")
    if family_moe:
        moe = main
    else:
        moe = subject(MOE_STAND_IN, build_model(MOE_STAND_IN, seed=0, attn_implementation="eager"), dtype)
        moe.packs = main.packs
    stand_in = "" if family_moe else f"{MOE_STAND_IN} stand-in ({checked.family} has no experts)"
    checks.append(
        run_check(
            "sorted MoE routing",
            moe,
            moe.speedups.replace(moe_routing="sorted"),
            moe.speedups.replace(moe_routing="stock"),
            device,
            dtype,
            arms="sorted routing vs transformers' own experts",
            model=stand_in,
        )
    )

    say("offload-double")
    engine = "CudaEngine" if device.type == "cuda" else "RecordingEngine: the CPU stand-in, same schedule"
    checks.append(
        run_check(
            "offload-double",
            main,
            main.speedups,
            main.speedups,
            device,
            dtype,
            offload=True,
            arms=f"offloaded checkpointing ({engine}) vs none",
        )
    )

    say("chunked loss")
    checks.append(
        run_check(
            "chunked loss",
            main,
            main.speedups.replace(chunked_loss=True),
            main.speedups.replace(chunked_loss=False),
            device,
            dtype,
            arms="LM head + loss a chunk at a time vs transformers' loss",
        )
    )

    say("LoRA in compute dtype")
    checks.append(
        run_check(
            "LoRA in compute dtype",
            main,
            main.speedups.replace(lora_in_compute_dtype=True),
            main.speedups.replace(lora_in_compute_dtype=False),
            device,
            dtype,
            lora=True,
            arms="LoRA on every linear: in the activations' dtype, one addmm, vs PEFT's forward",
        )
    )

    say("grouped attention")
    # on the packed row even where per-document packed attention is WRONG: the grouped path is its own
    grouped = run_check(
        "grouped attention",
        dataclasses.replace(main, packs=True),
        Speedups(attention_grouping="grouped", attention_backend="sdpa"),
        Speedups(packed_attention=False),
        device,
        dtype,
        stock_layout="alone",
        arms="documents grouped by length, one batched SDPA per group, vs each document alone (stock)",
    )
    checks.append(grouped)
    checks.append(ablation_check(device))
    return checks, {"main": main, "moe": moe}


def ablation_check(device: torch.device) -> Check:
    """Does ``auto`` hold here? The verdicts ``slipstream ab --preset ablation`` left for this device
    (``bench.ablation``): WRONG when an arm with a speedup off beat ``auto`` beyond the run's A/A noise,
    ok when every remembered run found none, skipped when no such run has been made here."""
    found = remembered_ablations(device)
    path, arms = "ablation", "slipstream (auto) vs each speedup off, in the last --preset ablation run"
    if not found:
        return Check(
            path,
            "skipped",
            reason="no --preset ablation run on this device yet (slipstream ab --preset ablation; "
            "doctor then reads its verdicts)",
            arms=arms,
        )
    beaten = []
    for workload, entry in found.items():
        for arm in entry["beats_auto"]:
            won = entry["arms"][arm]
            beaten.append(
                f"{arm} {won['ratio']:.2f}x [{won['low']:.2f}, {won['high']:.2f}] on {workload} "
                f"({entry['created'][:16]}; A/A noise {entry['noise_margin']:.1%})"
            )
    if beaten:
        return Check(
            path,
            "WRONG",
            reason="auto is beaten here beyond the noise: " + "; ".join(beaten) + "; set that speedup off",
            arms=arms,
        )
    runs = "; ".join(
        f"{workload}: {len(entry['arms']) - entry['a_a_control']} arms, A/A noise {entry['noise_margin']:.1%}"
        for workload, entry in found.items()
    )
    return Check(path, "ok", reason=f"no arm beats auto beyond the noise ({runs})", arms=arms)
