"""A verifiable task for online RL (GRPO): stock-room word problems whose answer is one number.

Each row is ``{"prompt": [messages], "answer": "<number>"}``: an invented stock room's short
inventory note (3-8 lines of item counts, some with a delivery or a breakage), then a question
that needs one or two of those counts added or subtracted, and the instruction to give the final
number inside ``<answer></answer>``. The prompt is 60-200 tokens in SmolLM2's chat template.
Rewarded by the built-ins ``answer_tag`` (the number in the tag equals ``answer``) and
``format_regex`` (the completion ends with the tag). All text comes from seeded word lists, so the
file is the same on every machine:

    python benchmarks/make_grpo_prompts.py --rows 400 --out runs/data/grpo_prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
from pathlib import Path

ITEMS = [
    "lanterns",
    "rope coils",
    "tin cups",
    "wool blankets",
    "oil jars",
    "candles",
    "nails boxes",
    "salt sacks",
    "paper reams",
    "ink bottles",
    "brass hinges",
    "glass panes",
    "iron pans",
    "clay pots",
]
PLACES = [
    "the harbour store",
    "the mill's back room",
    "the school cellar",
    "the ferry depot",
    "the inn's pantry",
]
KEEPERS = ["Mara", "Tobin", "Ilse", "Joss", "Wren", "Petra", "Oskar"]
SYSTEM = "You are a careful stock-room assistant. Think briefly, then give the final number inside <answer></answer>."


def problem(rng: random.Random, task: str = "sum") -> tuple[str, str]:
    items = rng.sample(ITEMS, rng.randint(3, 8))
    counts = {item: rng.randint(3, 60) for item in items}
    lines = [f"Inventory note from {rng.choice(KEEPERS)} at {rng.choice(PLACES)}:"]
    for item in items:
        lines.append(f"- {item}: {counts[item]}")
    if rng.random() < 0.5:
        arrived = rng.choice(items)
        extra = rng.randint(2, 20)
        lines.append(f"A delivery this morning brought {extra} more {arrived}.")
        counts[arrived] += extra
    if rng.random() < 0.4:
        broken = rng.choice(items)
        lost = rng.randint(1, min(5, counts[broken]))
        lines.append(f"{lost} of the {broken} were found broken and thrown away.")
        counts[broken] -= lost
    if task == "lookup":  # one count read off the note (after the delivery / breakage lines)
        item = rng.choice(items)
        question = f"How many {item} are there now?"
        text = (
            "\n".join(lines)
            + f"\n\nQuestion: {question} Reply with the number inside <answer></answer>, like <answer>7</answer>."
        )
        return text, str(counts[item])
    a, b = rng.sample(items, 2)
    if rng.random() < 0.6:
        question = f"How many {a} and {b} are there in all now?"
        answer = counts[a] + counts[b]
    else:
        question = f"How many more {a} than {b} are there now? (A negative number if there are fewer.)"
        answer = counts[a] - counts[b]
    text = "\n".join(lines) + f"\n\nQuestion: {question} Put the final number inside <answer></answer>."
    return text, str(answer)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--task",
        choices=("sum", "lookup"),
        default="sum",
        help="sum: add or subtract two counts; lookup: read one count off the note",
    )
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    rows = []
    for _ in range(args.rows):
        text, answer = problem(rng, args.task)
        prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
        rows.append({"prompt": prompt, "answer": answer})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=args.out.parent, prefix=f".{args.out.name}.")
    with os.fdopen(handle, "w", encoding="utf-8") as stream:
        stream.writelines(json.dumps(row) + "\n" for row in rows)
    os.replace(temporary, args.out)
    print(f"wrote {len(rows)} prompts to {args.out}")


if __name__ == "__main__":
    main()
