"""A chat data file of made-up facts, for A/B runs on a real model with "a user's" data.

Short rows, as most SFT chat sets have them (a question and a one- to few-sentence answer; a
share with a system prompt, a share with two turns), all text invented here, seeded, so the
file is the same on every machine:

    python benchmarks/make_chats.py --rows 3000 --out runs/data/chats.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

PLACES = ["Velmora", "Quorland", "Brindle Fen", "Astrakel", "Oddmere", "Tessary", "Kaldun", "Marrowgate"]
THINGS = ["lantern", "bridge", "library", "orchard", "lighthouse", "market", "observatory", "canal"]
COLOURS = ["amber", "teal", "crimson", "ivory", "slate", "ochre", "violet", "jade"]
PEOPLE = ["Ilsa Thorne", "Oren Vale", "Mira Quill", "Tobin Ash", "Sefa Rook", "Lena Marsh", "Pell Orrin"]
SYSTEMS = [
    "You are a concise assistant for the Atlas of Invented Places.",
    "Answer in one or two sentences.",
    "You are a helpful tour guide.",
]


def fact(rng: random.Random) -> tuple[str, str]:
    place, thing, person = rng.choice(PLACES), rng.choice(THINGS), rng.choice(PEOPLE)
    year, height, colour = rng.randint(1200, 1990), rng.randint(5, 900), rng.choice(COLOURS)
    kind = rng.randrange(4)
    if kind == 0:
        return (
            f"Who built the {thing} of {place}?",
            f"The {thing} of {place} was built by {person} in {year}.",
        )
    if kind == 1:
        return f"How tall is the {thing} in {place}?", f"The {thing} in {place} is {height} metres tall."
    if kind == 2:
        return (
            f"What colour is the {thing} of {place} painted?",
            f"It is painted {colour}, a tradition that {person} started in {year}.",
        )
    detail = " ".join(
        f"In {rng.randint(1200, 1990)} the {rng.choice(THINGS)} was rebuilt by {rng.choice(PEOPLE)}."
        for _ in range(rng.randint(2, 8))
    )
    return (
        f"Tell me the history of the {thing} of {place}.",
        f"The {thing} of {place} has a long history. {detail}",
    )


def row(rng: random.Random) -> dict:
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
    for _ in range(2 if rng.random() < 0.25 else 1):
        question, answer = fact(rng)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    partial = args.out.with_name(f".{args.out.name}.tmp")  # written whole, then renamed
    with open(partial, "w") as f:
        for _ in range(args.rows):
            f.write(json.dumps(row(rng)) + "\n")
    os.replace(partial, args.out)
    print(f"wrote {args.rows} chats to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
