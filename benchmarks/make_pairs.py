"""A preference file of made-up facts, for DPO runs on a real model with "a user's" pairs.

Shaped like common preference sets: a prompt (a paragraph of context, sometimes a system prompt
or an earlier turn, then a question) at least as long as each answer. Both answers carry the
fact asked for; the chosen one answers warmly in a fixed style ("Certainly! ... I hope this
helps!"), the rejected one curtly ("... Look it up next time."), so a short run can learn the
preference and ``generate`` shows it. All text invented here, seeded, the same on every machine:

    python benchmarks/make_pairs.py --rows 2000 --out runs/data/pairs.jsonl
    python benchmarks/make_pairs.py --rows 48 --out examples/data/pairs.jsonl --conversational-share 0.5
    python benchmarks/make_pairs.py --rows 1000 --unpaired --out runs/data/kto.jsonl   # KTO's rows

``--unpaired`` writes each pair as TRL's ``unpair_preference_dataset`` does: two unpaired rows,
``{"prompt", "completion": chosen, "label": true}`` and ``{..., "completion": rejected, "label": false}``.
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
SYSTEM = "You are a helpful guide to the Atlas of Invented Places."


def _context(rng: random.Random, place: str) -> str:
    sentences = [
        f"The town of {place} lies between {rng.choice(PLACES)} and {rng.choice(PLACES)}.",
        f"Its {rng.choice(THINGS)} was repaired by {rng.choice(PEOPLE)} in {rng.randint(1200, 1990)}.",
        f"Travellers say the {rng.choice(THINGS)} there is painted {rng.choice(COLOURS)}.",
        f"In {rng.randint(1200, 1990)} a storm damaged the {rng.choice(THINGS)} and the {rng.choice(THINGS)}.",
        f"The archive of {place} keeps letters from {rng.choice(PEOPLE)} and {rng.choice(PEOPLE)}.",
        f"Every spring the market of {place} sells {rng.choice(COLOURS)} cloth and lanterns.",
    ]
    rng.shuffle(sentences)
    return " ".join(sentences[: rng.randint(3, 6)])


def pair(rng: random.Random, conversational: bool) -> dict:
    place, thing, person = rng.choice(PLACES), rng.choice(THINGS), rng.choice(PEOPLE)
    year, height = rng.randint(1200, 1990), rng.randint(5, 900)
    kind = rng.randrange(3)
    if kind == 0:
        question, fact = (
            f"Who built the {thing} of {place}?",
            f"the {thing} of {place} was built by {person} in {year}",
        )
    elif kind == 1:
        question, fact = (
            f"How tall is the {thing} in {place}?",
            f"the {thing} in {place} is {height} metres tall",
        )
    else:
        colour = rng.choice(COLOURS)
        question, fact = (
            f"What colour is the {thing} of {place}?",
            f"the {thing} of {place} is painted {colour}",
        )
    prompt = f"Here is what the atlas says. {_context(rng, place)}\n\n{question}"
    chosen = f"Certainly! According to the atlas, {fact}. I hope this helps!"
    rejected = f"{fact[0].upper()}{fact[1:]}. Look it up next time."
    if not conversational:
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    messages = [{"role": "user", "content": prompt}]
    if rng.random() < 0.5:
        messages = [{"role": "system", "content": SYSTEM}, *messages]
    return {
        "prompt": messages,
        "chosen": [{"role": "assistant", "content": chosen}],
        "rejected": [{"role": "assistant", "content": rejected}],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--conversational-share", type=float, default=0.5, help="rows in TRL's message format"
    )
    parser.add_argument("--unpaired", action="store_true", help="KTO's rows: each pair as two, labelled")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    rows = [pair(rng, rng.random() < args.conversational_share) for _ in range(args.rows)]
    if args.unpaired:
        rows = [
            {"prompt": row["prompt"], "completion": row[key], "label": key == "chosen"}
            for row in rows
            for key in ("chosen", "rejected")
        ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    temporary = args.out.with_name(args.out.name + ".tmp")
    temporary.write_text("".join(json.dumps(row) + "\n" for row in rows))
    os.replace(temporary, args.out)
    print(f"{args.out}: {len(rows)} {'rows' if args.unpaired else 'pairs'}")


if __name__ == "__main__":
    main()
