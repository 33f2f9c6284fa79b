"""The ``unsloth`` arms: Unsloth (where our three optimizations come from) on our bins and weights.

Unsloth 2026.10.9 pins transformers <= 5.17 and TRL <= 1.15, so it runs in a virtualenv of its
own (``make_unsloth_venv.sh``, created on demand at ``$SLIPSTREAM_UNSLOTH_VENV``, default
``./.venv-unsloth``) through ``unsloth_worker.py``, which never imports slipstream. This side
writes the workload the worker reads: the arm's model (the same seeded weights as every arm,
``save_pretrained``), the demo tokenizer, each step's documents and the same initial LoRA
adapter; then turns the worker's JSON into the harness's arm result.

- ``unsloth``: its defaults: the dtype it picks (bfloat16 where the CPU has native bf16), its
  gradient checkpointing (on), bf16 autocast for a bf16 model, its chunked cross entropy.
- ``unsloth-same-settings``: the run's dtype and checkpointing (off unless the run sets it).

Both are padded: Unsloth's CPU trainer turns packing and padding-free off (stock SDPA on a CPU
would attend across documents), so each step's documents are right-padded rows; a step's
micro-batches are one padded batch (the loss is token-weighted over the step either way).
This harness runs Unsloth's CPU backend only (``UNSLOTH_FORCE_CPU=1``): its GPU path needs
Triton and bitsandbytes in its venv, which ``make_unsloth_venv.sh`` leaves out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
WORKER = HERE / "unsloth_worker.py"
MAKE_VENV = HERE / "make_unsloth_venv.sh"
VENV_TIMEOUT_S = 1800


def unsloth_venv() -> Path:
    return Path(os.environ.get("SLIPSTREAM_UNSLOTH_VENV", ".venv-unsloth")).absolute()


def unsloth_unavailable(config, device: str) -> str | None:
    """Why the unsloth arms cannot run (None: they can); creates the venv on first use."""
    if device != "cpu":
        return (
            "this harness runs Unsloth's CPU backend only (its GPU path needs Triton and bitsandbytes, "
            "which make_unsloth_venv.sh leaves out)"
        )
    if not config.lora_rank:
        return "the unsloth arms train a LoRA: set --lora-rank"
    if config.train.lora.modules_to_save:
        return "this harness's Unsloth worker trains LoRA only, not lora.modules_to_save"
    python = unsloth_venv() / "bin" / "python"
    if python.exists():
        return None
    command = ["bash", str(MAKE_VENV), str(unsloth_venv())]
    print(f"unsloth arm: creating its virtualenv (once): {' '.join(command)}", file=sys.stderr)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=VENV_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"creating the Unsloth virtualenv {unsloth_venv()} took over {VENV_TIMEOUT_S} s"
    if done.returncode != 0 or not python.exists():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return f"could not create the Unsloth virtualenv {unsloth_venv()}: {' / '.join(tail)}"
    return None


def _write_workload(config, plan: list, vocab_size: int, work: Path) -> Path:
    """The model (the same weights as every arm), tokenizer, documents per step and initial adapter;
    returns the model directory the worker loads (the user's own, for ``ab --model DIR``)."""
    from safetensors.torch import save_file

    from ...train.driver import apply_lora, load_model
    from ..inputs import ab_tokenizer, is_model_dir, quiet_progress_bars

    train = config.train  # the run's model and adapter, as every arm's (dropout draws no initial weight)
    with quiet_progress_bars():
        model = load_model(train, vocab_size, getattr(torch, train.model.dtype))
    if is_model_dir(config.model):
        model_dir = Path(config.model)  # its weights, tokenizer and chat template, as every arm loads them
    else:
        model_dir = work / "model"
        tokenizer = ab_tokenizer(config)
        model.config.pad_token_id = tokenizer.pad_token_id
        with quiet_progress_bars():  # a temporary copy
            model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    peft_model = apply_lora(model, train)
    adapter = {}
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            base = name.removeprefix("base_model.model.")
            adapter[f"{base}.lora_A.weight"] = module.lora_A["default"].weight.detach().float().contiguous()
            adapter[f"{base}.lora_B.weight"] = module.lora_B["default"].weight.detach().float().contiguous()
    save_file(adapter, work / "adapter_init.safetensors")
    steps = [[doc for micro in step for doc in micro] for step in plan]  # one padded batch per step
    (work / "batches.json").write_text(json.dumps(steps))
    return model_dir


def run_unsloth_arm(config, arm: str, plan: list, vocab_size: int) -> dict:
    """The arm's result (the harness's ArmResult fields), or ``{"arm", "skipped"}`` if the worker failed."""
    same_settings = arm == "unsloth-same-settings"
    with tempfile.TemporaryDirectory(prefix="slipstream-ab-unsloth-") as tmp:
        work = Path(tmp)
        model_dir = _write_workload(config, plan, vocab_size, work)
        threads = config.ab.threads or torch.get_num_threads()
        checkpointing = "default"  # Unsloth's own, unless the arm takes the run's settings
        if same_settings:
            checkpointing = "off" if (config.train.speedups.checkpointing or "off") == "off" else "on"
        command = [
            str(unsloth_venv() / "bin" / "python"),
            str(WORKER),
            "--model-dir", str(model_dir),
            "--batches", str(work / "batches.json"),
            "--adapter-init", str(work / "adapter_init.safetensors"),
            "--dtype", config.train.model.dtype if same_settings else "default",
            "--checkpointing", checkpointing,
            "--lora-rank", str(config.lora_rank),
            "--lora-alpha", str(config.train.lora.alpha),
            "--lora-targets", ",".join(config.train.lora.target_modules),
            "--threads", str(threads),
            "--lr", str(config.train.optimizer.lr),
            "--schedule", config.train.optimizer.schedule,
            "--lr-warmup-steps", str(config.train.optimizer.warmup_steps),
            "--schedule-steps", str(config.train.training.steps or config.ab.steps),
            "--weight-decay", str(config.train.optimizer.weight_decay),
            "--betas", ",".join(str(b) for b in config.train.optimizer.betas),
            "--max-grad-norm", str(config.train.optimizer.max_grad_norm),
            "--max-seq-len", str(config.train.data.max_seq_len * config.train.training.grad_accum),
            "--out", str(work / "result.json"),
        ]  # fmt: skip
        env = dict(os.environ, UNSLOTH_FORCE_CPU="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        env.update(OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", PYTHONPATH="")
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            tail = " / ".join(done.stderr.strip().splitlines()[-3:])
            return {"arm": arm, "skipped": f"the Unsloth worker failed (exit {done.returncode}): {tail}"}
        result = json.loads((work / "result.json").read_text())
    settings, steps = result["settings"], result["steps"]
    versions = ", ".join(f"{k} {v}" for k, v in result["versions"].items())
    return {
        "arm": arm,
        "step_s": [s["seconds"] for s in steps],
        **{
            key: [s[key] for s in steps] for key in ("forward_s", "backward_s", "tokens", "loss", "grad_norm")
        },
        "host_syncs_per_step": None,  # not counted: the worker runs without slipstream's counter
        "host_syncs_by_op": {},
        "peak_memory_mb": result["rss_mb"]["peak"],
        "memory_kind": "cpu peak RSS",
        "attn_implementation": settings["attn_implementation"],
        "dtype": settings["dtype"],
        "policies": [
            f"Unsloth ({versions}), {'the run' if same_settings else 'its default'} settings: "
            f"dtype {settings['dtype']} (asked: {settings['dtype_requested']}), "
            f"gradient checkpointing {'on' if settings['gradient_checkpointing'] else 'off'}, "
            f"bf16 autocast {'on' if settings['bf16_autocast'] else 'off'}, "
            f"chunked cross entropy {'on' if settings['chunked_cross_entropy'] else 'off'}",
            f"layout: {settings['layout']}; padded token slots {sum(s['padded_tokens'] for s in steps):,} "
            f"for {sum(s['tokens'] for s in steps):,} real tokens",
            f"optimizer: {settings['optimizer']}",
        ],
        "activation_bytes": None,
    }
