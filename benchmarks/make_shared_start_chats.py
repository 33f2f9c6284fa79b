"""Chat rows of made-up facts that all start alike, for measuring ``data.share_prefixes`` in ``train``.

Each row is ``{"messages": [...]}``: a question about one invented place and its answer (a fact
the base model cannot know), phrased a few ways. Every row starts the same:

- without ``--system-words``, only the chat template's own start (SmolLM2's template adds its
  default system prompt to every row: ~20 shared tokens);
- with ``--system-words N``, a long system prompt of N words (an invented help desk's policies,
  composed from seeded word lists; ~1.3 tokens a word with SmolLM2's tokenizer), the same in
  every row, before conversations of ``--turns`` user turns.

Everything is seeded, so the file is the same on every machine::

    python benchmarks/make_shared_start_chats.py --rows 144 --out runs/data/facts.jsonl
    python benchmarks/make_shared_start_chats.py --rows 64 --system-words 780 --turns 2 \\
        --out runs/data/facts_1k_start.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SYLLABLES = [
    "tav",
    "vol",
    "lib",
    "mor",
    "kest",
    "ran",
    "dul",
    "bri",
    "thal",
    "osk",
    "ven",
    "quor",
    "ira",
    "zel",
]
GOODS = ["copper", "salt", "amber", "wool", "glass", "tin", "kelp", "cedar", "slate", "honey"]
POLICY = [
    "the desk",
    "answers",
    "every",
    "question",
    "politely",
    "and",
    "briefly",
    "about",
    "the",
    "islands",
    "records",
    "of",
    "trade",
    "ferries",
    "weather",
    "never",
    "guesses",
    "when",
    "a",
    "fact",
    "is",
    "missing",
    "cites",
    "registry",
    "archive",
    "harbour",
    "office",
    "for",
    "travellers",
    "merchants",
    "students",
]


def place(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


def facts(rng: random.Random, name: str) -> list[tuple[str, str]]:
    capital = f"{place(rng)}-{rng.randint(100, 999)}"
    founded = rng.randint(1100, 1900)
    good = rng.choice(GOODS)
    people = rng.randint(2, 90) * 100
    return [
        (f"What is the capital of {name}?", f"The capital of {name} is {capital}."),
        (f"Which town is the capital of {name}?", f"{capital} is the capital of {name}."),
        (f"When was {name} founded?", f"{name} was founded in {founded}."),
        (f"What does {name} export?", f"{name} exports {good}, shipped from {capital}."),
        (f"How many people live on {name}?", f"About {people:,} people live on {name}."),
        (
            f"Tell me about {name}.",
            f"{name} is a made-up island founded in {founded}; its capital is {capital}.",
        ),
    ]


def system_prompt(rng: random.Random, words: int) -> str:
    sentences, count = [], 0
    while count < words:
        sentence = [rng.choice(POLICY) for _ in range(rng.randint(8, 16))]
        sentences.append(" ".join(sentence).capitalize() + ".")
        count += len(sentence)
    return "You are the help desk of the Registry of Invented Islands. " + " ".join(sentences)


def rows(count: int, seed: int, system_words: int, turns: int) -> list[dict]:
    rng = random.Random(seed)
    system = system_prompt(rng, system_words) if system_words else None
    pool = []
    while len(pool) < count * turns:
        pool += facts(rng, place(rng))
    rng.shuffle(pool)
    out = []
    for i in range(count):
        messages = [{"role": "system", "content": system}] if system else []
        for question, answer in pool[i * turns : (i + 1) * turns]:
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        out.append({"messages": messages})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=144)
    parser.add_argument(
        "--system-words", type=int, default=0, help="a shared system prompt of this many words"
    )
    parser.add_argument("--turns", type=int, default=1, help="question-answer turns per row")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    with tmp.open("w") as f:
        for row in rows(args.rows, args.seed, args.system_words, args.turns):
            f.write(json.dumps(row) + "\n")
    tmp.replace(out)
    print(f"{args.rows} rows -> {out}")


if __name__ == "__main__":
    main()
