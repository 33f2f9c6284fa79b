"""Does llama.cpp, reading the exported GGUF, recall what the run trained? (issue 48's acceptance)

Asks every question of a chat file (``examples/data/chats.jsonl``: made-up facts about an island) through the
chat template, greedy, ``--max-tokens`` tokens, three ways: the merged transformers model (the reference),
and llama.cpp (``llama-cpp-python``) on each GGUF file given. For each, the answers that hold the trained
answer's fact (its last word), and for llama.cpp the answers identical to the merged model's own. The prompt
tokens are the merged tokenizer's (``apply_chat_template``), handed to both runtimes as ids, so the two
answer the very same prompts. For llama.cpp also its speed: tokens generated over the answers' wall time
(each prompt's processing included, ``--threads`` threads).

    python benchmarks/gguf_recall.py --merged MERGED_DIR --gguf out/f16.gguf out/q8_0.gguf
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def load_chats(path: Path) -> list[tuple[str, str]]:
    chats = []
    for line in path.read_text().splitlines():
        messages = json.loads(line)["messages"]
        chats.append((messages[0]["content"], messages[1]["content"]))
    return chats


def holds(answer: str, trained: str) -> bool:
    """The trained answer's last word (its fact: "Harrowick", "November", "Saltreach") in the answer."""
    last = trained.strip().rstrip(".!").split()[-1].strip(",;:'\"").lower()
    return last in answer.lower()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--merged", required=True, type=Path)
    parser.add_argument("--gguf", nargs="+", type=Path, required=True)
    parser.add_argument("--chats", type=Path, default=Path("examples/data/chats.jsonl"))
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    args = parser.parse_args()

    import llama_cpp
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.merged)
    model = AutoModelForCausalLM.from_pretrained(args.merged, dtype=torch.float32).eval()
    chats = load_chats(args.chats)
    stops = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")} - {None}
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        for q, _ in chats
    ]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]

    started = time.perf_counter()
    reference = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=args.max_tokens, do_sample=False, eos_token_id=list(stops)
            )
            reference.append(tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True))
    record = {
        "questions": len(chats),
        "merged": {
            "holds_trained_answer": sum(holds(a, t) for a, (_, t) in zip(reference, chats, strict=True)),
            "seconds": round(time.perf_counter() - started, 1),
        },
    }
    for path in args.gguf:
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, verbose=False, seed=0, n_threads=args.threads)
        started = time.perf_counter()
        answers = []
        generated = 0
        for ids in prompts:
            llm.reset()
            found: list[int] = []
            for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
                if token in stops or len(found) >= args.max_tokens:
                    break
                found.append(token)
            generated += len(found)
            answers.append(tokenizer.decode(found, skip_special_tokens=True))
        seconds = time.perf_counter() - started
        llm.close()
        record[path.name] = {
            "holds_trained_answer": sum(holds(a, t) for a, (_, t) in zip(answers, chats, strict=True)),
            "identical_to_merged": sum(
                a.strip() == r.strip() for a, r in zip(answers, reference, strict=True)
            ),
            "seconds": round(seconds, 1),
            # prompt processing included: llama.cpp's whole answer, as a user waits for it
            "generated_tokens": generated,
            "tokens_per_s": round(generated / seconds, 1),
            "example": {"question": chats[2][0], "answer": answers[2], "merged": reference[2]},
        }
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
