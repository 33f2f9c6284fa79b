"""``slipstream export RUN_DIR --merged OUT``: the run's adapter merged into its base weights, as a
plain transformers directory that loads with ``AutoModelForCausalLM.from_pretrained(OUT)`` alone (a reward
model's run, ``training.objective: reward``: with ``AutoModelForSequenceClassification``, one label, the
pad token id set, as ``grpo.rewards`` and TRL's ``GRPOTrainer`` load a reward model).

The base is rebuilt as training built it (``train.loop``: the ``model.path`` directory, or the
preset with the run's seed, in the run's dtype); the adapter is the final ``adapter/`` or
checkpoint N's trainable weights. PEFT's ``merge_and_unload`` merges what PEFT made (LoRA on any
module, ``modules_to_save``: the trained copy replaces the original); slipstream merges its own
per-expert LoRA (``moe.lora.merge_expert_lora``); a 4-bit base is dequantized first
(``models.qlora.dequantize_model``), to the very values its 4-bit forward computed with.

Nothing is reported written until it is checked: the written directory is loaded back with plain
transformers and its logits on a probe batch (rows of the run's tokenizer) are compared with the
base + adapter the run trained. The difference, ``max |merged - reference| / max |reference|``,
must be within ``TOLERANCE`` of the coarser of the run's and the export's dtype:

- float32 ``1e-4``: merging changes only the rounding order (``W x + s B A x`` against
  ``(W + s B A) x``), a few fp32 ulps (~1e-7 relative) per layer; 1e-4 leaves room for deep
  models and is still three orders of magnitude below any real change of the weights.
- float16 ``1e-2`` and bfloat16 ``5e-2``: the merged weight is rounded once to the dtype (unit
  roundoff 2^-11 and 2^-8), where base + adapter keeps ``W`` and ``B A`` apart; that rounding
  compounds through the layers, so the bound is ~20x and ~13x the unit roundoff. A wrong merge
  (a missing or mis-scaled adapter, the wrong module replaced) moves the logits by the adapter's
  whole effect, far above either.
- For a float16 / bfloat16 run the reference is base + adapter computed in fp32 (the function the
  run's weights define), and the bound is the dtype's or twice the run's own forward's distance from
  it (``reference_rounding`` in the marker), whichever is larger: the run's forward rounds too, and
  on some CPUs (SmolLM2-135M, bf16, AMX, one thread's adapter) it is 4.5% from the fp32 function, the
  merged model 5.3%, and the two 8.5% apart.

When the export's dtype differs from the run's, the merge is made in fp32 and checked there
first, against the run's dtype's bound (so a bf16 export of an fp32 run still proves the merge
itself to 1e-4), then cast once; the written model is then held to the dtype's bound or twice the
cast's own distance from the fp32 merge, whichever is larger. A difference above a bound names the row, position and token of the worst logit and nothing is
written. OUT is written atomically, holds a ``.slipstream-export`` marker, and only a directory
holding that marker is ever replaced (``overwrite``).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .._version import __version__
from ..atomic import atomic_directory
from ..train.checkpoints import DamagedCheckpoint, _step_dirs, read_checkpoint
from ..train.config import ConfigError, TrainConfig, run_config
from ..train.errors import TrainError
from ..train.output_dir import ADAPTER, CHECKPOINTS, CONFIG, FINISHED, MARKER

EXPORT_MARKER = ".slipstream-export"
DTYPES = ("bfloat16", "float16", "float32")
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}
MAX_SHARD_SIZE = "5GB"
EXPERTS = "experts"  # adapter/experts: per-expert LoRA (moe.lora.save_expert_lora)
PROBE_TEXTS = (
    "The quick brown fox jumps over the lazy dog while the band plays on.",
    "Explain, step by step, how a merged adapter keeps the model's answers unchanged.",
)
PROBE_LENGTH = 24


class ExportError(RuntimeError):
    """The export cannot be made or would not match the run: one line naming the path or the difference."""


@dataclass
class ProbeCheck:
    max_abs: float
    relative: float  # max_abs / the largest |reference logit|
    tolerance: float
    row: int
    position: int
    token: int
    tokens: int  # probe rows x positions (a reward model: rows, one score each)
    kind: str = "logit"  # "score": a sequence classifier's one score per row

    @property
    def ok(self) -> bool:
        return self.relative <= self.tolerance

    @property
    def probed(self) -> str:
        """What the probe compared, counted: "48 tokens' logits", or "3 sequences' scores"."""
        return f"{self.tokens} sequences' scores" if self.kind == "score" else f"{self.tokens} tokens' logits"

    def describe(self) -> str:
        where = (
            f"probe row {self.row}"
            if self.kind == "score"
            else f"probe row {self.row}, position {self.position}, vocabulary entry {self.token}"
        )
        return (
            f"max |{self.kind} difference| {self.max_abs:.3g} (relative {self.relative:.3g}, tolerance "
            f"{self.tolerance:g}) at {where}"
        )


@dataclass
class ExportReport:
    out: str
    run_dir: str
    source: str  # the adapter directory or the checkpoint exported
    dtype: str
    check: ProbeCheck


# ----------------------------------------------------------------------------- inputs
def _run_config(run_dir: Path) -> TrainConfig:
    if not run_dir.exists():
        raise ExportError(f"{run_dir}: no such run directory")
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: is a file, not a run directory")
    if not (run_dir / MARKER).is_file():
        raise ExportError(f"{run_dir}: not a slipstream run directory (no {MARKER})")
    if not (run_dir / CONFIG).is_file():
        raise ExportError(f"{run_dir}: the run holds no {CONFIG} (it never got past its set-up)")
    try:
        config = run_config(run_dir / CONFIG)
    except ConfigError as error:
        raise ExportError(f"{run_dir / CONFIG}: not a usable run config ({error})") from None
    if not config.lora.enabled:
        raise ExportError(
            f"{run_dir}: lora.enabled is false: the run trained the whole model, and {run_dir / ADAPTER} "
            "already is it in transformers format; there is no adapter to merge"
        )
    return config


def _checkpoint_steps(run_dir: Path) -> str:
    steps = sorted(step for step, _ in _step_dirs(run_dir))
    return ", ".join(map(str, steps)) if steps else "none"


def _source(run_dir: Path, checkpoint: int | None):
    """The final adapter directory, or checkpoint ``checkpoint`` read whole."""
    if checkpoint is None:
        adapter = run_dir / ADAPTER
        if not (run_dir / FINISHED).is_file() or not adapter.is_dir():
            raise ExportError(
                f"{run_dir}: the run is unfinished (no {FINISHED} and {ADAPTER}/): pass --checkpoint N "
                f"to export a checkpoint (checkpoints: {_checkpoint_steps(run_dir)})"
            )
        return adapter
    path = run_dir / CHECKPOINTS / f"step-{checkpoint:06d}"
    if not path.is_dir():
        raise ExportError(f"{path}: no such checkpoint (checkpoints: {_checkpoint_steps(run_dir)})")
    try:
        return read_checkpoint(path)
    except DamagedCheckpoint as error:
        raise ExportError(f"{path}: damaged checkpoint ({error})") from None


def _run_dtype(run_dir: Path, source, config: TrainConfig) -> torch.dtype:
    """The dtype the run trained in: as it recorded it, else as ``model.dtype`` resolves here."""
    if isinstance(source, Path):
        try:
            name = json.loads((run_dir / FINISHED).read_text()).get("dtype")
        except (OSError, ValueError, AttributeError):
            name = None
    else:
        name = ((source.state.get("fingerprint") or {}).get("config") or {}).get("model.dtype")
    if name in DTYPES:
        return getattr(torch, name)
    from ..train.precision import resolve_dtype

    return resolve_dtype(config.model.dtype, torch.device("cpu"))[0]


def _check_out(out: Path, run_dir: Path, overwrite: bool) -> None:
    resolved, run = out.resolve(), run_dir.resolve()
    if resolved == run or run in resolved.parents:
        raise ExportError(f"{out}: inside the run directory {run_dir}: export to a path outside it")
    if resolved in run.parents:
        raise ExportError(f"{out}: holds the run directory {run_dir}: export to a path outside it")
    if not (out.exists() or out.is_symlink()):
        return
    if not out.is_dir():
        raise ExportError(f"{out}: exists and is not a directory; not touched")
    if not any(out.iterdir()):
        return  # an empty directory: nothing to lose
    if not (out / EXPORT_MARKER).is_file():
        raise ExportError(
            f"{out}: exists and is not a slipstream export (no {EXPORT_MARKER}); not touched, "
            "even with --overwrite: choose a new path"
        )
    if not overwrite:
        raise ExportError(f"{out}: holds a previous export: pass --overwrite to replace it")


# ----------------------------------------------------------------------------- the models
def _untie(model) -> bool:
    """Give a tied LM head its own copy of the embeddings (the adapter may change one side only)."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return False
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embeddings is None:
        return False
    head.weight = torch.nn.Parameter(embeddings.weight.detach().clone(), requires_grad=False)
    model.config.tie_word_embeddings = False
    return True


def _retie(model) -> None:
    """Tie the head back to the embeddings where the merge left them equal (no copy stored twice)."""
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if torch.equal(head.weight, embeddings.weight):
        head.weight = embeddings.weight
        model.config.tie_word_embeddings = True


_MISMATCH = re.compile(r"size mismatch for [^\n]*?(?:\.|$)", re.M)


def _does_not_fit(where: Path, config: TrainConfig, error: Exception) -> ExportError:
    text = str(error)
    match = _MISMATCH.search(text)
    gist = match.group(0).rstrip(".") if match else " ".join(text.split())[:300]
    base = config.model.path or f"model.preset {config.model.preset}"
    return ExportError(f"{where}: does not fit the base model {base} (another base model?): {gist}")


def _attached(config: TrainConfig, tokenizer, dtype: torch.dtype, source, *, dequantize: bool = False):
    """Base + adapter, as the run trained them (eval mode); the base dequantized if asked."""
    from peft import PeftModel

    from ..models.heads import say_which_id_pads
    from ..models.qlora import dequantize_model
    from ..moe.experts import use_sorted_experts
    from ..moe.lora import load_expert_lora

    # the run's own builders: the same base, the same adapter
    from ..train.driver import apply_lora, load_model

    try:
        base = load_model(config, len(tokenizer), dtype)
    except (TrainError, ConfigError) as error:
        raise ExportError(f"the run's base model: {error}") from None
    if dequantize:
        dequantize_model(base, dtype)
    say_which_id_pads(base, tokenizer)  # a reward model's: the probe's rows, and the written config
    tied = _untie(base)
    if isinstance(source, Path):
        try:
            model = PeftModel.from_pretrained(base, source)
        except (RuntimeError, ValueError, KeyError) as error:
            raise _does_not_fit(source, config, error) from None
        if (source / EXPERTS).is_dir():
            use_sorted_experts(model)  # expert LoRA runs inside the sorted routing
            try:
                load_expert_lora(model, source / EXPERTS)
            except (RuntimeError, ValueError, KeyError) as error:
                raise _does_not_fit(source / EXPERTS, config, error) from None
    else:
        model = apply_lora(base, config)
        if config.lora.experts:
            use_sorted_experts(model)
        _load_checkpoint_weights(model, source, config)
    model.eval()
    return model, tied


def _load_checkpoint_weights(model, checkpoint, config: TrainConfig) -> None:
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    where = checkpoint.path
    extra = sorted(checkpoint.weights.keys() - params.keys())
    missing = sorted(params.keys() - checkpoint.weights.keys())
    if extra or missing:
        what = f"has {extra[0]!r}, which" if extra else f"lacks {missing[0]!r}, which"
        raise _does_not_fit(where, config, ValueError(f"the checkpoint {what} the rebuilt adapter does not"))
    for name, tensor in checkpoint.weights.items():
        theirs, ours = tuple(tensor.shape), tuple(params[name].shape)
        if theirs != ours:
            shapes = f"shape {theirs} in the checkpoint, {ours} in the model"
            raise _does_not_fit(where, config, ValueError(f"size mismatch for {name}: {shapes}"))
    with torch.no_grad():
        for name, tensor in checkpoint.weights.items():
            params[name].copy_(tensor)


def _merged(model, tied: bool, dtype: torch.dtype):
    """The plain transformers model: expert LoRA and PEFT's adapters folded into the weights."""
    from ..moe.experts import experts_modules
    from ..moe.lora import merge_expert_lora

    merge_expert_lora(model)
    merged = model.merge_and_unload()
    if experts_modules(merged):  # the saved config names no slipstream experts implementation
        merged.set_experts_implementation(None)
    if tied:
        _retie(merged)
    merged.to(dtype)
    for param in merged.parameters():
        param.requires_grad_(False)
    return merged


# ----------------------------------------------------------------------------- the probe
def probe_batch(tokenizer, vocab: int, length: int = PROBE_LENGTH) -> torch.Tensor:
    """A few rows of the run's tokenizer: fixed texts, and one seeded row over the whole vocabulary."""
    rows = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in PROBE_TEXTS]
    rows = [[i for i in row if i < vocab] for row in rows]
    length = max(2, min(length, *map(len, rows)))
    generator = torch.Generator().manual_seed(0)
    spread = torch.randint(0, vocab, (length,), generator=generator).tolist()
    rows = [row[:length] for row in rows if len(row) >= length] + [spread]
    return torch.tensor(rows, dtype=torch.long)


@torch.no_grad()
def _logits(model, probe: torch.Tensor) -> torch.Tensor:
    from ..models.qlora import training_4bit_forward

    device = next(p.device for p in model.parameters())
    with training_4bit_forward(model):  # a 4-bit base computes as it did in training
        logits = model(input_ids=probe.to(device)).logits.float().cpu()
    # a reward model's (sequence classifier's) [rows, 1]: one score per row, compared as [rows, 1, 1]
    return logits if logits.dim() == 3 else logits[:, None, :]


def _tolerance(*dtypes: torch.dtype) -> float:
    """The bound for a comparison between models computing in ``dtypes``: the coarsest one's."""
    return max(TOLERANCE[str(d).removeprefix("torch.")] for d in dtypes)


def compare_logits(reference: torch.Tensor, merged: torch.Tensor, tolerance: float) -> ProbeCheck:
    diff = (merged - reference).abs()
    if not torch.isfinite(merged).all():
        diff = torch.where(torch.isfinite(merged), diff, torch.full_like(diff, float("inf")))
    flat = int(diff.argmax())
    row, rest = divmod(flat, diff.shape[1] * diff.shape[2])
    position, token = divmod(rest, diff.shape[2])
    max_abs = float(diff.max())
    scale = max(float(reference.abs().max()), 1e-12)
    tokens = reference.shape[0] * reference.shape[1]
    kind = "score" if reference.shape[1:] == (1, 1) else "logit"  # _logits' [rows, 1, 1] of a classifier
    return ProbeCheck(max_abs, max_abs / scale, tolerance, row, position, token, tokens, kind)


# ----------------------------------------------------------------------------- writing
def _write(merged, tokenizer, directory: Path) -> None:
    from transformers import GenerationConfig

    config = merged.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    merged.save_pretrained(directory, max_shard_size=MAX_SHARD_SIZE)
    if not (directory / "generation_config.json").exists():
        GenerationConfig.from_model_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def export_merged(
    run_dir: str | Path,
    out: str | Path,
    *,
    dtype: str | None = None,
    checkpoint: int | None = None,
    overwrite: bool = False,
) -> ExportReport:
    """Merge a run's adapter (or checkpoint ``checkpoint``'s) into its base and write ``out``.

    ``dtype``: one of ``DTYPES`` (default: the dtype the run trained in). ``overwrite`` replaces
    a previous export (a directory holding ``.slipstream-export``), never anything else.
    Raises ``ExportError`` (one line) and writes nothing if the inputs are wrong or the merged
    model's probe logits differ from base + adapter by more than ``TOLERANCE``.
    """
    from ..models.heads import auto_class
    from ..train.driver import model_head
    from ..train.inputs import load_tokenizer

    run_dir, out = Path(run_dir), Path(out)
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    config = _run_config(run_dir)
    source = _source(run_dir, checkpoint)
    _check_out(out, run_dir, overwrite)
    run_dtype = _run_dtype(run_dir, source, config)
    export_dtype = getattr(torch, dtype) if dtype else run_dtype
    dtype_name = str(export_dtype).removeprefix("torch.")
    tolerance = _tolerance(run_dtype, export_dtype)
    # merge in the run's dtype when the export keeps it, else in fp32 (one rounding, at the end)
    merge_dtype = run_dtype if export_dtype == run_dtype else torch.float32
    try:
        tokenizer = load_tokenizer(config)
    except TrainError as error:
        raise ExportError(f"the run's tokenizer: {error}") from None

    model, tied = _attached(config, tokenizer, run_dtype, source)
    probe = probe_batch(
        tokenizer, min(len(tokenizer), model.get_base_model().config.get_text_config().vocab_size)
    )
    reference = _logits(model, probe)
    # the run's own low-precision forward is itself some way from the function its weights define: the
    # merged model (rounded once more) is judged against that function, computed in fp32, within the
    # dtype's bound or twice the run's own distance from it, whichever is larger
    rounding = 0.0
    if run_dtype != torch.float32 and not config.quantization.four_bit:
        model.to(torch.float32)  # bf16 / fp16 -> fp32 -> back is exact
        exact = _logits(model, probe)
        model.to(run_dtype)
        rounding = compare_logits(exact, reference, 0.0).relative
        reference = exact
    tolerance = max(tolerance, 2 * rounding)
    if config.quantization.four_bit:  # PEFT would merge into 4-bit weights and quantize again: start dense
        del model
        model, tied = _attached(config, tokenizer, run_dtype, source, dequantize=True)
    model.to(merge_dtype)
    merged = _merged(model, tied, merge_dtype)
    del model
    where = source if isinstance(source, Path) else source.path
    merge_check = None
    if merge_dtype != export_dtype:  # the merge alone, before the cast rounds it: held to fp32's bound
        merged_logits = _logits(merged, probe)
        merge_check = compare_logits(
            reference, merged_logits, max(_tolerance(run_dtype, merge_dtype), 2 * rounding)
        )
        if not merge_check.ok:
            raise ExportError(
                f"{out}: not written: the merge in {str(merge_dtype).removeprefix('torch.')} differs from "
                f"{where} on its base: {merge_check.describe()}"
            )
        merged.to(export_dtype)
        # the export's own forward rounds as a low-precision run's does: the written model is judged within
        # the dtype's bound or twice the cast merge's own distance from the merge, whichever is larger (on
        # a CPU without native bf16, SmolLM2-135M's fp32 run exported to bf16 is 6.4% from it)
        tolerance = max(tolerance, 2 * compare_logits(merged_logits, _logits(merged, probe), 0.0).relative)
    with atomic_directory(out, existing="replace") as tmp:
        _write(merged, tokenizer, tmp)
        del merged
        auto, extra = auto_class(tmp, model_head(config))  # a reward run: its sequence classifier
        loaded = auto.from_pretrained(tmp, dtype=export_dtype, local_files_only=True, **extra).eval()
        check = compare_logits(reference, _logits(loaded, probe), tolerance)
        del loaded
        if not check.ok:
            raise ExportError(
                f"{out}: not written: the merged model differs from {where} on its base: {check.describe()}"
            )
        marker = {
            "format": 1,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "slipstream": __version__,
            "run_dir": str(run_dir.resolve()),
            "source": str(Path(where).resolve()),
            "dtype": dtype_name,
            "check": asdict(check),
            "merge_check": asdict(merge_check) if merge_check is not None else None,
            # the run's own forward (its dtype) against the same weights computed in fp32, relative
            "reference_rounding": rounding,
        }
        (tmp / EXPORT_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        _check_out(out, run_dir, overwrite)  # again, just before the rename: what is there now may go
    return ExportReport(out=str(out), run_dir=str(run_dir), source=str(where), dtype=dtype_name, check=check)
