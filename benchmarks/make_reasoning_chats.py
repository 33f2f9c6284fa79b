"""Multi-turn reasoning chats, one row per user turn, for measuring prefix trees (issue 47).

A reasoning model's chat of K user turns is trained as K rows: row k is the conversation through the
assistant's k-th answer. Qwen3's chat template drops the reasoning (``reasoning_content``) of every
assistant turn before the last user query, so row k renders turns 1..k-1 without their reasoning and
turn k with it. Row k is not a prefix of row k+1; the two share the history up to turn k's question and
then diverge. One shared start per group holds only what rows begin alike; a trie holds every history
once.

The conversations are our own: a user planning an invented trip asks follow-up questions; the assistant
thinks (a few seeded sentences) and answers. Everything is seeded, so the file is the same on every
machine::

    python benchmarks/make_reasoning_chats.py --chats 24 --turns 6 --out runs/data/reasoning_6.jsonl \\
        --template-out runs/data/qwen3.jinja --count

``--count`` reads the rows through slipstream's own data path (Qwen3's template; SmolLM2's tokenizer
where its directory exists, else Qwen3's; ``response_only``) and prints the tokens a layer runs with the
rows whole, with today's one shared start per group, and as a trie (:mod:`slipstream.data.prefix_tree`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tool_chats import counting_tokenizer, template_file, write_jsonl  # noqa: E402

PLACES = ["Velmora", "Kaldun", "Orsk Ferry", "Tamsin Bay", "Lirra", "Hollow Marsh", "Pell Crossing"]
THINGS = [
    "the ferry",
    "the night market",
    "the hill fort",
    "the salt flats",
    "the old mill",
    "the lighthouse",
]
ASKS = [
    "How long should I stay in {place}?",
    "Is {thing} worth a detour from {place}?",
    "What should I pack for {place} in {month}?",
    "Can I get from {place} to {other} in a day?",
    "Where should I eat near {thing}?",
    "What is the cheapest way to see {thing}?",
    "Should I book {thing} ahead?",
    "Is {place} quiet in {month}?",
]
THOUGHTS = [
    "The user is weighing {place} against the rest of the trip.",
    "{thing} is a half-day visit at most, and it closes early in {month}.",
    "The road from {place} to {other} is slow after the rains.",
    "A budget matters here: they mentioned saving for {other}.",
    "In {month} the crowds thin out after the first week.",
    "I should give one clear recommendation, then the reason.",
    "They asked about {thing} before, so they care about sights more than food.",
]
ANSWERS = [
    "Two nights in {place} is enough: one for {thing}, one to rest.",
    "Yes, {thing} is worth it if you go early; skip it if you are short on time.",
    "Pack layers: {month} evenings in {place} are cold, and it rains most afternoons.",
    "Take the morning bus from {place}; you reach {other} before dark.",
    "Book {thing} a week ahead in {month}; walk-ins wait an hour or more.",
    "Stay near {thing}: it is quieter than the centre and the same price.",
]
MONTHS = ["March", "April", "May", "September", "October"]


def _fill(rng: random.Random, text: str) -> str:
    place, other = rng.sample(PLACES, 2)
    return text.format(place=place, other=other, thing=rng.choice(THINGS), month=rng.choice(MONTHS))


def conversation(rng: random.Random, turns: int, thought_sentences: int) -> list[dict]:
    """A system prompt, then ``turns`` user questions each answered after some reasoning."""
    messages = [
        {
            "role": "system",
            "content": "You are a careful travel planner. Think before you answer, then answer briefly.",
        }
    ]
    for _ in range(turns):
        messages.append({"role": "user", "content": _fill(rng, rng.choice(ASKS))})
        thinking = " ".join(_fill(rng, rng.choice(THOUGHTS)) for _ in range(thought_sentences))
        messages.append(
            {"role": "assistant", "reasoning_content": thinking, "content": _fill(rng, rng.choice(ANSWERS))}
        )
    return messages


def rows(chats: int, turns: int, thought_sentences: int, seed: int) -> list[dict]:
    """One row per user turn of every conversation: row k holds the messages through answer k."""
    rng = random.Random(seed)
    found = []
    for _ in range(chats):
        messages = conversation(rng, turns, thought_sentences)
        for k in range(1, turns + 1):
            found.append({"messages": messages[: 1 + 2 * k]})
    return found


def pairs(chats: int, turns: int, thought_sentences: int, seed: int) -> list[dict]:
    """A preference pair at every user turn of every conversation: the prompt is the conversation through
    question k (earlier answers as they were given), ``chosen`` the answer given (with its reasoning),
    ``rejected`` another answer with other reasoning. A chat's pairs share their history at every level."""
    rng = random.Random(seed)
    found = []
    for _ in range(chats):
        messages = conversation(rng, turns, thought_sentences)
        for k in range(1, turns + 1):
            chosen = messages[2 * k]
            while True:
                thinking = " ".join(_fill(rng, rng.choice(THOUGHTS)) for _ in range(thought_sentences))
                rejected = {
                    "role": "assistant",
                    "reasoning_content": thinking,
                    "content": _fill(rng, rng.choice(ANSWERS)),
                }
                if rejected["content"] != chosen["content"]:
                    break
            found.append({"prompt": messages[: 2 * k], "chosen": [chosen], "rejected": [rejected]})
    return found


def count_pairs(path: Path, template: Path) -> dict:
    """The pairs as slipstream reads them, counted as they pack today (each prompt once per pair) and as
    prefix trees across pairs (:mod:`slipstream.data.pair_trees`, the whole set one trie)."""
    from slipstream.data.pair_trees import pair_tree_items
    from slipstream.data.pairs import load_pairs

    tokenizer, name = counting_tokenizer(template)
    found, _ = load_pairs(path, tokenizer, max_seq_len=1 << 20)
    _, report = pair_tree_items(found, 1 << 20)
    return {
        "tokenizer": name,
        "pairs": len(found),
        "prompt_twice": sum(
            2 * len(p["prompt_ids"]) + len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in found
        ),
        "prompt_once_a_pair": report.unshared_tokens,
        "trees": report.shared_tokens,
        "today_vs_trees": round(report.unshared_tokens / report.shared_tokens, 3),
        "saved_by_level": report.saved_by_level,
    }


def count(path: Path, template: Path) -> dict:
    """The rows as slipstream reads them (response_only), counted whole, by one start and as a trie."""
    from slipstream.data.prefix_tree import trie_report
    from slipstream.data.samples import load_samples

    tokenizer, name = counting_tokenizer(template)
    samples, _ = load_samples(path, tokenizer, response_only=True)
    report = trie_report(samples)
    return {
        "tokenizer": name,
        "rows": report.rows,
        "whole": report.whole,
        "one_start": report.one_start,
        "trie": report.trie,
        "depth": report.depth,
        "trie_vs_one_start": round(report.one_start / report.trie, 3),
        "tokens_by_level": report.tokens_by_level,
        "saved_by_level": report.saved_by_level,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chats", type=int, default=24)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--thought-sentences", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--template-out", type=Path, default=None, help="write Qwen3's template here")
    parser.add_argument("--count", action="store_true")
    parser.add_argument(
        "--pairs",
        action="store_true",
        help="preference pairs (prompt / chosen / rejected), one per user turn",
    )
    args = parser.parse_args(argv)
    make = pairs if args.pairs else rows
    write_jsonl(make(args.chats, args.turns, args.thought_sentences, args.seed), args.out)
    template = template_file(args.template_out, str(args.out.parent))
    what = "pairs" if args.pairs else "rows"
    print(f"wrote {args.chats * args.turns} {what} ({args.chats} chats x {args.turns} turns) to {args.out}")
    if args.count:
        print(json.dumps((count_pairs if args.pairs else count)(args.out, template), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
