"""How far each layout's bf16 step sits from an fp32 step, for rows that share a long start (issue 43).

One micro-batch of chats that all begin with one long system prompt, LoRA r16 on the 7 projections,
step 0 (loss, gradient norm, gradient) in four arms:

- ``fp32``: stock transformers in fp32, each row alone (the truth);
- ``stock``: stock transformers in bf16, the rows packed (restarting position_ids);
- ``unshared``: ``slipstream.optimize`` in bf16, the rows packed whole (``collate_groups(...,
  prefix_sharing=False)``);
- ``shared``: ``slipstream.optimize`` in bf16, the shared start once (``collate_groups``).

Each bf16 arm's distance to fp32: the loss (absolute), the gradient norm (relative), the gradient
(relative error ||g - g32|| / ||g32|| and cosine). ``--model smollm2`` is the real
SmolLM2-135M-Instruct (fetched once, ``benchmarks/real_model.py``); a tiny preset name runs a random
model on random ids.

    PYTHONPATH=src python benchmarks/shared_prefix_precision.py --model smollm2 --labels all
    PYTHONPATH=src python benchmarks/shared_prefix_precision.py --model llama --labels response
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

TEXT = (
    "the agent reads a ticket checks the order then calls a tool and answers with care when a customer "
    "asks about refunds shipping delays or account access it must verify identity first never reveal "
    "internal notes and always summarise the resolution in plain words"
)
WORDS = TEXT.split()  # the rows' vocabulary


def chat_rows(rows: int, system_words: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    system = " ".join(rng.choice(WORDS) for _ in range(system_words))
    out = []
    for _ in range(rows):
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 24)))
        answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40)))
        out.append(
            {
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": answer},
                ]
            }
        )
    return out


def real_groups(tokenizer, rows: int, system_words: int, labels: str, seed: int) -> list[dict]:
    from slipstream.data.prefix_groups import as_group, find_groups
    from slipstream.data.samples import load_samples

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "chats.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(rows, system_words, seed)))
        samples, _ = load_samples(path, tokenizer, response_only=labels == "response")
    groups = [(shared, members) for shared, members in find_groups(samples) if shared]
    assert len(groups) == 1, f"expected one group, got {[(s, len(m)) for s, m in groups]}"
    shared, members = groups[0]
    return [as_group(shared, [samples[i] for i in members])]


def random_groups(vocab: int, rows: int, prefix: int, labels: str, seed: int, own=(12, 60)) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(3, vocab - 3, (n,), generator=g).tolist()  # noqa: E731
    continuations = []
    for _ in range(rows):
        n = int(torch.randint(*own, (1,), generator=g))
        tokens = ids(n)
        lab = tokens if labels == "all" else [-100] * (n // 3) + tokens[n // 3 :]
        continuations.append({"input_ids": tokens, "labels": lab})
    p = ids(prefix)
    return [
        {
            "prefix_ids": p,
            "prefix_labels": p if labels == "all" else [-100] * prefix,
            "continuations": continuations,
        }
    ]


LAYERS = {"n": None}  # set by main: the first n decoder layers only (a faster, shallower model)


def load(model_name: str, dtype: torch.dtype, vocab: int | None):
    if model_name == "smollm2":
        from transformers import AutoModelForCausalLM

        from slipstream.models import smollm2_dir

        model = AutoModelForCausalLM.from_pretrained(
            smollm2_dir(), dtype=dtype, attn_implementation="sdpa", local_files_only=True
        )
        if LAYERS["n"]:
            model.model.layers = model.model.layers[: LAYERS["n"]]
            model.config.num_hidden_layers = LAYERS["n"]
        return model
    from slipstream.models import build_model

    return build_model(model_name, vocab_size=vocab, dtype=dtype, layers=LAYERS["n"])


TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA = {"init": "peft", "targets": TARGETS}  # set by main


def with_lora(model, seed: int):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=list(LORA["targets"])))
    if LORA["init"] == "peft":  # B = 0: only B's gradient at step 0, as the A/B's step 0
        return model
    # B != 0: A's gradient (and every activation gradient behind it) takes part too
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)
    return model


def lora_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.float().flatten() for n, p in model.named_parameters() if p.grad is not None])


def step_fp32(base32, groups, seed):
    from slipstream.packing.groups import unshared_documents

    model = with_lora(base32, seed)
    model.train()
    docs = unshared_documents(groups)
    total = sum(sum(1 for t in d["labels"][1:] if t != -100) for d in docs)
    loss = 0.0
    for d in docs:
        ids = torch.tensor([d["input_ids"]])
        labels = torch.tensor([d["labels"]])
        out = model(input_ids=ids, labels=labels, num_items_in_batch=total)
        out.loss.backward()
        loss += out.loss.item()
    return loss, lora_grad(model)


def step_stock(base, groups, seed):
    from slipstream.packing.groups import collate_groups

    model = with_lora(base, seed)
    model.train()
    batch = collate_groups(groups, prefix_sharing=False)
    out = model(
        input_ids=batch.input_ids, labels=batch.labels, position_ids=batch.position_ids, use_cache=False
    )
    out.loss.backward()
    return out.loss.item(), lora_grad(model)


def step_slipstream(base, groups, seed, sharing: bool, **options):
    from slipstream import optimize
    from slipstream.packing.groups import collate_groups

    optimize(base, **{"compile": "off", "fused_kernels": "off", **options})
    model = with_lora(base, seed)
    model.train()
    batch = collate_groups(groups, prefix_sharing=sharing)
    out = model(**batch.model_inputs())
    out.loss.backward()
    return out.loss.item(), lora_grad(model)


# ---- forward only: each layer's hidden states at the positions that predict a label, and the per-token NLL


def _nll(model, hidden_NH, targets) -> torch.Tensor:
    """Per-prediction NLL from the final hidden states, the head in fp32 (the trunk's error alone)."""
    head = model.get_output_embeddings().weight.float()
    logits = hidden_NH.float() @ head.t()
    return torch.nn.functional.cross_entropy(logits, targets, reduction="none")


def forward_fp32(base32, groups):
    """Per layer [N_pred, hidden] at every prediction (the unshared rows' order), and the NLL."""
    from slipstream.packing.groups import unshared_documents

    layers, targets = None, []
    with torch.no_grad():
        for d in unshared_documents(groups):
            positions = [t for t in range(len(d["labels"]) - 1) if d["labels"][t + 1] != -100]
            targets += [d["labels"][t + 1] for t in positions]
            out = base32.model(input_ids=torch.tensor([d["input_ids"]]), output_hidden_states=True)
            hs = [h[0, positions].float() for h in out.hidden_states]
            layers = hs if layers is None else [torch.cat([a, b]) for a, b in zip(layers, hs, strict=True)]
    targets = torch.tensor(targets)
    return layers, _nll(base32, layers[-1], targets), targets


def forward_packed(base, batch, stock: bool):
    with torch.no_grad():
        if stock:
            out = base.model(
                input_ids=batch.input_ids,
                position_ids=batch.position_ids,
                use_cache=False,
                output_hidden_states=True,
            )
        else:
            inputs = {k: v for k, v in batch.model_inputs().items() if k != "labels"}
            out = base.model(**inputs, output_hidden_states=True)
    if batch.loss_targets is not None:
        positions, targets = batch.loss_positions, batch.loss_targets
    else:
        labels = batch.labels[0]
        positions = torch.nonzero(labels[1:] != -100).squeeze(1)
        targets = labels[positions + 1]
    layers = [h[0, positions].float() for h in out.hidden_states]
    return layers, _nll(base, layers[-1], targets), targets


def forward_report(args, vocab, groups, options) -> dict[str, dict[str, float]]:
    """Per arm: the batch's mean NLL distance to fp32, each row's (rms over rows) and each
    prediction's (rms), and the last layer's hidden-state error. A shared start is one draw of the
    bf16 roundings that every row reads; packed whole, each row computes its own copy of the start
    (``prefix copies' spread``: the copies differ), so the batch mean averages N draws of them."""
    from slipstream import optimize, state_of
    from slipstream.packing.groups import collate_groups

    ref_layers, ref_nll, ref_targets = forward_fp32(load(args.model, torch.float32, vocab), groups)
    print(f"fp32 forward: {ref_nll.numel()} predictions, mean NLL {ref_nll.mean().item():.6f}")
    # which predictions are made inside the shared prefix (the same N times), in the unshared rows' order
    g = groups[0]
    P = len(g["prefix_ids"])
    in_prefix = []
    for c in g["continuations"]:
        labels = g["prefix_labels"] + c["labels"]
        in_prefix += [t < P - 1 for t in range(len(labels) - 1) if labels[t + 1] != -100]
    in_prefix = torch.tensor(in_prefix)
    n_rows = len(g["continuations"])
    row_of = torch.tensor(
        [
            r
            for r, c in enumerate(g["continuations"])
            for t in range(len(g["prefix_labels"]) + len(c["labels"]) - 1)
            if (g["prefix_labels"] + c["labels"])[t + 1] != -100
        ]
    )
    kept, summary = {}, {}
    for name in args.arms.split(","):
        base = load(args.model, torch.bfloat16, vocab)
        base.train()
        sharing = name == "shared"
        if name != "stock":
            optimize(base, **{"compile": "off", "fused_kernels": "off", "chunked_loss": False, **options})
        batch = collate_groups(groups, prefix_sharing=sharing)
        layers, nll, targets = forward_packed(base, batch, stock=name == "stock")
        assert torch.equal(targets, ref_targets), name
        errs = [((a - b).norm() / b.norm()).item() for a, b in zip(layers, ref_layers, strict=True)]
        d = nll - ref_nll
        kept[name] = (layers, nll)
        pre, own = d[in_prefix], d[~in_prefix]
        rows_d = torch.zeros(n_rows).index_add_(0, row_of, d) / torch.bincount(row_of, minlength=n_rows)
        summary[name] = {
            "batch": d.mean().item(),
            "row_rms": rows_d.pow(2).mean().sqrt().item(),
            "prediction_rms": d.pow(2).mean().sqrt().item(),
            "hidden_last": errs[-1],
        }
        if pre.numel():
            copy_means = pre.view(n_rows, -1).mean(1)
            print(
                f"{name:9s} each row's copy of the start, mean NLL d: min {copy_means.min().item():+.2e} "
                f"median {copy_means.median().item():+.2e} max {copy_means.max().item():+.2e}; "
                f"each row's loss d: rms {summary[name]['row_rms']:.2e}"
            )
        copies = layers[-1][in_prefix].view(n_rows, -1, layers[-1].shape[-1])
        spread = ((copies - copies[:1]).norm() / copies.norm()).item()
        print(
            f"{name:9s} NLL d: prefix predictions mean {pre.mean().item():+.2e} rms {pre.pow(2).mean().sqrt().item():.2e} "
            f"({pre.numel()}), own mean {own.mean().item():+.2e} rms {own.pow(2).mean().sqrt().item():.2e} ({own.numel()}); "
            f"prefix copies' spread {spread:.1e}"
        )
        print(
            f"{name:9s} mean NLL {nll.mean().item():.6f} (d {d.mean().item():+.2e}, rms {d.pow(2).mean().sqrt().item():.2e})"
            f"  hidden rel err by layer: "
            + " ".join(f"{e:.1e}" for e in errs[1 :: max(1, len(errs) // 8)])
            + f"  last {errs[-1]:.2e}"
        )
        for other, (o_layers, _) in kept.items():
            if other != name:
                e = [((a - b).norm() / b.norm()).item() for a, b in zip(layers, o_layers, strict=True)]
                pe = (
                    (layers[-1][in_prefix] - o_layers[-1][in_prefix]).norm() / o_layers[-1][in_prefix].norm()
                ).item()
                oe = (
                    (layers[-1][~in_prefix] - o_layers[-1][~in_prefix]).norm()
                    / o_layers[-1][~in_prefix].norm()
                ).item()
                print(
                    f"    vs {other}: by layer "
                    + " ".join(f"{x:.1e}" for x in e[1 :: max(1, len(e) // 8)])
                    + f"; last layer prefix {pe:.1e} own {oe:.1e}"
                )
        if name != "stock" and args.policies:
            for line in state_of(base).policies:
                if "short" in line or "grouping" in line or "attention" in line:
                    print("    " + line[:160])
    return summary


def distance(arm, ref) -> dict[str, float]:
    (loss, g), (loss32, g32) = arm, ref
    return {
        "loss": abs(loss - loss32),
        "gnorm": abs(g.norm().item() - g32.norm().item()) / g32.norm().item(),
        "grad": ((g - g32).norm() / g32.norm()).item(),
        "cos": torch.nn.functional.cosine_similarity(g.double(), g32.double(), dim=0).item(),
    }


def measure_distances(args, vocab, groups, options) -> None:
    ref = step_fp32(load(args.model, torch.float32, vocab), groups, args.seed)
    print(f"fp32       loss {ref[0]:.6f}  gnorm {ref[1].norm().item():.6f}")
    runs = {
        "stock": lambda: step_stock(load(args.model, torch.bfloat16, vocab), groups, args.seed),
        "unshared": lambda: step_slipstream(
            load(args.model, torch.bfloat16, vocab), groups, args.seed, False, **options
        ),
        "shared": lambda: step_slipstream(
            load(args.model, torch.bfloat16, vocab), groups, args.seed, True, **options
        ),
        "shared32": lambda: step_slipstream(
            load(args.model, torch.float32, vocab), groups, args.seed, True, **options
        ),
    }
    for name in args.arms.split(","):
        arm = runs[name]()
        d = distance(arm, ref)
        print(
            f"{name:9s}  loss {arm[0]:.6f} (|d| {d['loss']:.2e})  gnorm rel {d['gnorm']:.2e}  "
            f"grad rel err {d['grad']:.2e}  cos {d['cos']:.6f}"
        )


def time_steps(args, vocab, groups, options) -> None:
    """Each slipstream layout's bf16 step (forward + backward), the best of ``--time`` after a warm-up."""
    from slipstream import optimize
    from slipstream.packing.groups import collate_groups

    for layout in args.time_layouts.split(","):
        base = load(args.model, torch.bfloat16, vocab)
        optimize(base, compile="off", fused_kernels="off", **options)
        model = with_lora(base, args.seed)
        batch = collate_groups(groups, prefix_sharing=layout == "shared")
        times = []
        for _ in range(args.time + 1):
            start = time.perf_counter()
            model(**batch.model_inputs()).loss.backward()
            times.append(time.perf_counter() - start)
        print(f"{layout:9s} step {min(times[1:]):.3f} s (best of {args.time} after a warm-up)")


def make_groups(args, tokenizer, vocab, seed: int) -> list[dict]:
    if tokenizer is not None:
        return real_groups(tokenizer, args.rows, args.prefix, args.labels, seed)
    own = tuple(int(n) for n in args.own.split(","))
    return random_groups(vocab, args.rows, args.prefix, args.labels, seed, own)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llama", help="smollm2, or a tiny preset (llama, qwen3, ...)")
    parser.add_argument("--labels", choices=("all", "response"), default="all")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument(
        "--prefix", type=int, default=300, help="system prompt: words (smollm2) or tokens (tiny)"
    )
    parser.add_argument("--own", default="12,60", help="tiny: a continuation's own tokens, [low, high)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--arms", default="stock,unshared,shared", help="'' for none (--time alone)")
    parser.add_argument(
        "--short-kernel", default="auto", help="short_document_kernel for the slipstream arms"
    )
    parser.add_argument("--grouping", default="auto", help="attention_grouping for the slipstream arms")
    parser.add_argument(
        "--time", type=int, default=0, help="also time this many steps of each slipstream arm"
    )
    parser.add_argument("--time-layouts", default="unshared,shared", help="the layouts --time times")
    parser.add_argument("--policies", action="store_true", help="print the attention policy lines")
    parser.add_argument("--forward", action="store_true", help="forward only: hidden states and NLL per arm")
    parser.add_argument("--seeds", type=int, default=1, help="--forward: repeat on this many seeds")
    parser.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers")
    parser.add_argument(
        "--lora-init", choices=("peft", "random"), default="peft", help="B = 0 (PEFT) or random B"
    )
    parser.add_argument("--targets", default=",".join(TARGETS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    LAYERS["n"], LORA["init"] = args.layers, args.lora_init
    LORA["targets"] = tuple(args.targets.split(","))

    tokenizer, vocab = None, None
    if args.model == "smollm2":
        from transformers import AutoTokenizer

        from slipstream.models import smollm2_dir

        tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    else:
        vocab = 512
    groups = make_groups(args, tokenizer, vocab, args.seed)
    g = groups[0]
    lens = [len(c["input_ids"]) for c in g["continuations"]]
    print(
        f"model {args.model}, labels {args.labels}: prefix {len(g['prefix_ids'])} tokens, {len(lens)} rows "
        f"of {min(lens)}-{max(lens)} own tokens"
    )

    options = {"short_document_kernel": args.short_kernel, "attention_grouping": args.grouping}
    if args.forward:
        runs = [forward_report(args, vocab, groups, options)]
        for seed in range(args.seed + 1, args.seed + args.seeds):
            print(f"-- seed {seed}")
            runs.append(forward_report(args, vocab, make_groups(args, tokenizer, vocab, seed), options))
        if len(runs) > 1:
            print(f"over {len(runs)} seeds (rows and start drawn anew), the mean NLL's distance to fp32:")
            for name in runs[0]:
                batch = torch.tensor([abs(r[name]["batch"]) for r in runs])
                row = torch.tensor([r[name]["row_rms"] for r in runs])
                pred = torch.tensor([r[name]["prediction_rms"] for r in runs])
                print(
                    f"  {name:9s} batch |d| mean {batch.mean().item():.2e} (max {batch.max().item():.2e})  "
                    f"each row's |d| rms {row.mean().item():.2e}  each prediction's rms {pred.mean().item():.2e}"
                )
        return 0
    if args.arms:
        measure_distances(args, vocab, groups, options)
    if args.time:
        time_steps(args, vocab, groups, options)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
