"""The worker of the ``unsloth`` A/B arms (``unsloth.py``): LoRA training through Unsloth's CPU backend.

Runs inside Unsloth's own virtualenv (see make_unsloth_venv.sh) and never imports slipstream. One optimizer
step per entry of --batches, on exactly those documents, starting from the adapter in
--adapter-init; writes per-step wall time, tokens and loss plus peak RSS as JSON.

What Unsloth's CPU path (unsloth_zoo.cpu, selected by UNSLOTH_FORCE_CPU=1) does, and so this arm:

- model: ``FastLanguageModel.from_pretrained`` = stock transformers + PEFT on CPU; ``dtype=None``
  picks bfloat16 where the CPU has AMX / AVX512-BF16, else float32. 16-bit weights here
  (``load_in_4bit=False``: the comparison is LoRA, not QLoRA).
- gradient checkpointing: on by default (``use_gradient_checkpointing="unsloth"`` is plain
  non-reentrant recomputation on CPU); ``--checkpointing off`` turns it off.
- loss: its chunked linear cross entropy (no [tokens, vocab] logits, padded / ignored rows skipped),
  installed on the model but switched on only inside its patched ``SFTTrainer.compute_loss``;
  this loop flips the same switch around each forward.
- batches: padded. Its trainer defaults turn ``packing`` and ``padding_free`` off on CPU ("SDPA on
  CPU attends across examples"), so documents are right-padded rows with an attention mask, as
  TRL's collator builds them. Tokens/s counts real tokens only.
- mixed precision: its SFTTrainer runs bf16 autocast whenever the CPU has native bf16 (TRL's
  ``bf16=None`` resolves to True). For a bfloat16 model this loop does the same; for float32 it
  does not (a float32 run means float32 math).
- optimizer: its CPU default ``adamw_torch_fused``: ``torch.optim.AdamW(fused=True)``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import sys
import time

os.environ.setdefault("UNSLOTH_FORCE_CPU", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
IGNORE_INDEX = -100


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM). Not ru_maxrss: Linux carries that across fork + exec, so a
    child launched by a big parent reports the parent's RSS as its own peak."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def load_adapter(model, path: str) -> int:
    """Copy ``{module}.lora_A.weight`` / ``.lora_B.weight`` from the file into the PEFT adapter."""
    from safetensors.torch import load_file

    tensors = load_file(path)
    used = set()
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            base = name.removeprefix("base_model.model.")
            for part in ("lora_A", "lora_B"):
                key = f"{base}.{part}.weight"
                target = getattr(module, part)["default"].weight
                target.data.copy_(tensors[key].to(target.dtype))
                used.add(key)
    if used != set(tensors):
        raise KeyError(f"adapter keys not matched: {sorted(set(tensors) ^ used)[:4]}")
    return len(used)


def pad(docs: list[dict], pad_id: int):
    """Right-padded rows, as TRL's collator builds them without packing; labels -100 on padding."""
    import torch

    longest = max(len(d["input_ids"]) for d in docs)
    ids, labels, mask = [], [], []
    for d in docs:
        n = longest - len(d["input_ids"])
        ids.append(d["input_ids"] + [pad_id] * n)
        labels.append(d["labels"] + [IGNORE_INDEX] * n)
        mask.append([1] * len(d["input_ids"]) + [0] * n)
    return {
        "input_ids": torch.tensor(ids),
        "labels": torch.tensor(labels),
        "attention_mask": torch.tensor(mask),
        "use_cache": False,
    }


def chunked_ce_owner(model):
    """The module Unsloth installed its chunked CE on (its compute_loss looks it up the same way)."""
    base = getattr(model, "base_model", None)
    for candidate in (model, base, getattr(base, "model", None)):
        if candidate is not None and vars(candidate).get("_unsloth_cpu_chunked_ce", False):
            return candidate
    return None


def checkpointing_on(model) -> bool:
    """Whether any layer of ``model`` recomputes: what transformers' ``is_activation_checkpointing``
    (``is_gradient_checkpointing`` in older releases such as 5.17, deprecated in later ones) reads,
    without either name."""
    return any(bool(getattr(module, "gradient_checkpointing", False)) for module in model.modules())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--batches", required=True, help="JSON: steps, each a list of {input_ids, labels}")
    p.add_argument("--adapter-init", required=True, help="safetensors with the initial LoRA A/B")
    p.add_argument("--dtype", choices=("bfloat16", "float32", "default"), default="default")
    p.add_argument("--checkpointing", choices=("default", "on", "off"), default="default")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-alpha", type=float, default=None, help="default: 2 x rank")
    p.add_argument("--lora-targets", default=",".join(TARGETS), help="comma-separated module names")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--schedule", default="constant", help="transformers' get_scheduler name, over the steps")
    p.add_argument("--lr-warmup-steps", type=int, default=0)
    p.add_argument(
        "--schedule-steps", type=int, default=None, help="the schedule's length (default: the steps)"
    )
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--betas", default="0.9,0.999", help="AdamW's beta1,beta2")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="0: no clipping")
    p.add_argument("--max-seq-len", type=int, default=4096, help="Unsloth's max_seq_length")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing summary")
    p.add_argument("--out", help="write the JSON here instead of stdout")
    args = p.parse_args()
    alpha = args.lora_alpha if args.lora_alpha is not None else 2.0 * args.lora_rank
    targets = [t for t in args.lora_targets.split(",") if t]

    # Unsloth prints its banners on stdout: keep stdout for the JSON alone.
    with contextlib.redirect_stdout(sys.stderr):
        import torch

        torch.set_num_threads(args.threads)
        # isort: off
        import unsloth  # first, as Unsloth asks: it patches transformers / TRL on import

        # isort: on
        import peft
        import transformers
        import trl
        import unsloth_zoo
        from unsloth import FastLanguageModel
        from unsloth_zoo.cpu import cpu_bf16_supported

        rss_import = rss_mb()
        dtype = None if args.dtype == "default" else getattr(torch, args.dtype)
        gc = {"on": {"use_gradient_checkpointing": True}, "off": {"use_gradient_checkpointing": False}}
        model, tokenizer = FastLanguageModel.from_pretrained(
            args.model_dir,
            max_seq_length=args.max_seq_len,
            dtype=dtype,
            load_in_4bit=False,
            local_files_only=True,
            **gc.get(args.checkpointing, {}),
        )
        model = FastLanguageModel.get_peft_model(
            model,
            r=args.lora_rank,
            lora_alpha=alpha,
            lora_dropout=0.0,
            bias="none",
            target_modules=targets,
            **gc.get(args.checkpointing, {}),
        )
        n_adapters = load_adapter(model, args.adapter_init)
        model.train()
        rss_load, peak_load = rss_mb(), peak_rss_mb()

    model_dtype = next(model.get_base_model().parameters()).dtype
    # What Unsloth's SFTTrainer would run: bf16 autocast for a bf16 model on a bf16-capable CPU.
    autocast = model_dtype == torch.bfloat16 and cpu_bf16_supported()
    owner = chunked_ce_owner(model)
    params = [q for q in model.parameters() if q.requires_grad]
    betas = tuple(float(b) for b in args.betas.split(","))
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=betas, weight_decay=args.weight_decay, fused=True)
    with open(args.batches) as f:
        batches = json.load(f)
    scheduler = transformers.get_scheduler(
        args.schedule,
        optimizer,
        num_warmup_steps=args.lr_warmup_steps,
        num_training_steps=args.schedule_steps or len(batches),
    )

    # Any id pads: padded slots are masked out of attention and labels. A tokenizer without a pad
    # token (many base models) pads with its end-of-text id, as TRL does.
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
    steps = []
    for docs in batches:
        start = time.perf_counter()
        inputs = pad(docs, pad_id)
        # Label tokens of the step after the causal shift, as transformers' Trainer counts them.
        count = int((inputs["labels"][:, 1:] != IGNORE_INDEX).sum())
        if owner is not None:
            owner._unsloth_cpu_chunked_ce_active = True
        forward_start = time.perf_counter()
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                output = model(**inputs, num_items_in_batch=count)
        finally:
            if owner is not None:
                owner._unsloth_cpu_chunked_ce_active = False
        loss = output.loss
        chunked_used = output.logits is None  # the chunked path returns no logits
        backward_start = time.perf_counter()
        loss.backward()
        backward_end = time.perf_counter()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm or float("inf"))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = float(loss)
        steps.append(
            {
                "seconds": time.perf_counter() - start,
                "tokens": sum(len(d["input_ids"]) for d in docs),
                "padded_tokens": int(inputs["input_ids"].numel()),
                "label_tokens": count,
                "loss": loss_value,
                "grad_norm": float(grad_norm),
                # The chunked CE forms the LM head's gradient inside the forward.
                "forward_s": backward_start - forward_start,
                "backward_s": backward_end - backward_start,
            }
        )
        print(
            f"unsloth step {len(steps)}: loss {loss_value:.5f}, {steps[-1]['seconds']:.2f}s", file=sys.stderr
        )

    base = model.get_base_model()
    result = {
        "arm": "unsloth",
        "versions": {
            "unsloth": unsloth.__version__,
            "unsloth_zoo": unsloth_zoo.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": trl.__version__,
            "peft": peft.__version__,
        },
        "settings": {
            "dtype": str(model_dtype).removeprefix("torch."),
            "dtype_requested": args.dtype,
            "bf16_autocast": autocast,
            "cpu_bf16_supported": cpu_bf16_supported(),
            "gradient_checkpointing": checkpointing_on(base),
            "checkpointing_requested": args.checkpointing,
            "chunked_cross_entropy": owner is not None and chunked_used,
            "layout": "padded (right), attention mask; Unsloth's CPU trainer turns packing / padding_free off",
            "attn_implementation": base.config._attn_implementation,
            "optimizer": f"torch.optim.AdamW(fused=True, betas={args.betas}, weight_decay={args.weight_decay:g}), "
            f"max_grad_norm {args.max_grad_norm:g}, {args.schedule} "
            f"schedule ({args.lr_warmup_steps} warm-up steps)",
            "lora": f"r={args.lora_rank} alpha={alpha:g} dropout=0 {','.join(targets)}",
            "lora_param_dtype": str(params[0].dtype).removeprefix("torch."),
            "adapter_tensors_loaded": n_adapters,
            "threads": torch.get_num_threads(),
        },
        "rss_mb": {
            "after_import": rss_import,
            "after_load": rss_load,
            "peak_at_load": peak_load,
            "peak": peak_rss_mb(),
            "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # see peak_rss_mb
        },
        "warmup": args.warmup,
        "steps": steps,
    }
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
