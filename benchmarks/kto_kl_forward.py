"""KTO's KL sequences, measured (issue 63): (a) packed into the row's forward, ``prompt | completion |
kl_completion`` with the prompt once and the KL log-probs detached (what ``training.objective: kto`` runs),
against (b) ``prompt | completion`` with a separate ``no_grad`` forward of ``prompt + kl_completion`` (what
TRL's ``KTOTrainer`` runs). The test preset with LoRA r8, fp32, 8 rows per micro-batch, forward + backward,
best of 21; prints each (prompt, completion) shape's times and (b)/(a).

    python benchmarks/kto_kl_forward.py [preset]
"""

from __future__ import annotations

import sys
import time

import torch
from peft import LoraConfig, get_peft_model

import slipstream
from slipstream.loss import answer_logprobs_of
from slipstream.models import build_model
from slipstream.packing.kto import collate_kto, with_kl_completions, without_kl_completions

torch.set_num_threads(2)
torch.manual_seed(0)
model = build_model(sys.argv[1] if len(sys.argv) > 1 else "qwen3")
vocab = model.config.vocab_size
model = get_peft_model(
    model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj"])
)
model = slipstream.optimize(model).train()
print(type(model.base_model.model).__name__, sum(p.numel() for p in model.parameters()))


def rows(P, C, n=8):
    g = torch.Generator().manual_seed(1)

    def ids(k):
        return torch.randint(1, vocab, (k,), generator=g).tolist()

    return [{"prompt_ids": ids(P), "completion_ids": ids(C), "label": bool(i % 2)} for i in range(n)]


def packed(r):
    b = collate_kto(with_kl_completions(r))
    model(**b.model_inputs())
    s = answer_logprobs_of(b)
    (s[0::2].sum() + 0 * s[1::2].detach().sum()).backward()


def separate(r):
    b = collate_kto(without_kl_completions(r))
    kl = collate_kto(
        [{**x, "completion_ids": x["rejected_ids"], "rejected_ids": []} for x in with_kl_completions(r)]
    )
    with torch.no_grad():
        model(**kl.model_inputs())
        answer_logprobs_of(kl)
    model(**b.model_inputs())
    s = answer_logprobs_of(b)
    s.sum().backward()


def clock(fn, r, reps=21):
    for _ in range(3):
        fn(r)
        model.zero_grad()
    t = []
    for _ in range(reps):
        s = time.perf_counter()
        fn(r)
        t.append(time.perf_counter() - s)
        model.zero_grad()
    return min(t) * 1e3


for P, C in [(48, 16), (32, 32), (16, 48), (128, 32)]:
    r = rows(P, C)
    a, b = clock(packed, r), clock(separate, r)
    a2, b2 = clock(packed, r), clock(separate, r)
    print(
        f"P={P} C={C} rows=8: packed {a:.1f}/{a2:.1f} ms  separate no_grad {b:.1f}/{b2:.1f} ms  ratio {min(b, b2) / min(a, a2):.2f}"
    )
