"""A best-of-N SFT set: every prompt with N accepted answers, each answer its own row, so N rows
share their prompt (the shared work a prefix-sharing packer runs once).

A prompt is a user question of 50-300 tokens (a word problem about invented places: travel
times, scaling a recipe, splitting a budget, with the context a user would give), half of them
after a short system prompt; each of its N answers (50-300 tokens) solves it correctly in its
own way (step by step, compact, as a list, with a check at the end), so the rows differ in the
answer only. Rows are ``{"messages": [...]}``; with ``--shuffle`` (the default) the rows of one
prompt are scattered through the file, so the packer has to find them. All text is composed
here from seeded word lists and templates, so the file is the same on every machine:

    python benchmarks/make_best_of_n.py --prompts 500 --answers 4 --out runs/data/best_of_4.jsonl --check

The summary counts tokens as ``make_tool_chats.py`` does (Qwen3's chat template, SmolLM2's
tokenizer where its directory exists, else Qwen3's): prompt and answer lengths, and the share
of all tokens that are a prompt repeated by another answer's row. ``--check`` runs the rows of
5 prompts (20 rows with N=4) through slipstream's data path (``response_only``): every row
tokenizes, only the answer is labelled, and the rows of a prompt share all of its tokens.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from pathlib import Path

from make_tool_chats import (
    CITIES,
    FIRST,
    check_rows,
    counting_tokenizer,
    group_prefixes,
    rendered_ids,
    template_file,
    write_jsonl,
)

SYSTEMS = [
    "You are a patient maths tutor. Show your working and give the final answer clearly.",
    "You are a helpful assistant. Answer accurately; round money to two decimals.",
    "You help small businesses with everyday planning questions. Be practical and precise.",
]
VEHICLES = [
    ("ferry", 18, 34),
    ("night train", 60, 110),
    ("cargo barge", 9, 16),
    ("coach", 55, 85),
    ("airship", 70, 130),
]
DISHES = [
    ("lantern stew", ["barley", "carrots", "smoked beans", "stock"]),
    ("harbour pie", ["flour", "butter", "white fish", "leeks"]),
    ("orchard cake", ["flour", "sugar", "apples", "eggs"]),
    ("fen soup", ["potatoes", "onions", "cream", "dill"]),
]
BUDGET_ITEMS = ["rent", "wages", "stock", "repairs", "advertising", "insurance", "training", "savings"]
BUSINESSES = ["bakery", "bicycle workshop", "bookshop", "ferry kiosk", "tea room", "print studio"]
ASIDES = [
    "I have tried to work it out myself but I keep getting a different number each time.",
    "This is for a planning meeting tomorrow, so I would like to be sure.",
    "My colleague says the answer is obvious, but I would like to see the reasoning.",
    "Please keep the units clear, because I will copy the result into a spreadsheet.",
    "Rounding to a sensible precision is fine.",
    "I am not very confident with percentages, so please go slowly.",
    "We had a similar question last month and got it wrong, which cost us a day.",
    "The numbers are from our notes, so they should be accurate.",
]


BACKGROUND = {
    "travel": [
        "I am planning a trip for my family and we have to be somewhere on time at the other end.",
        "My grandmother is meeting us at the station, so I need to tell her when to come.",
        "We are travelling with two children and a lot of luggage.",
        "The timetable on the website is confusing and the office is closed today.",
        "Last time we took this route we were late, and I do not want that to happen again.",
        "I only have the figures the company publishes, not an actual timetable.",
    ],
    "recipe": [
        "We are having friends over for the harvest festival this weekend.",
        "I usually cook for a small household, so I rarely scale recipes up or down.",
        "The recipe came from my aunt and is written on a card in grams.",
        "I want to buy the ingredients tomorrow morning at the market.",
        "Some of the guests are very hungry after the lantern parade, but a normal portion is fine.",
        "My kitchen scale only measures whole grams.",
    ],
    "budget": [
        "We opened two years ago and this is the first time we plan the quarter properly.",
        "Our accountant asked us to send the split before the end of the week.",
        "Last quarter we overspent on a few things and want to be stricter now.",
        "The percentages were agreed at our last team meeting.",
        "We keep the books in crowns, the local currency.",
        "I want to put the amounts on the noticeboard in the back office.",
    ],
}


def _context(rng: random.Random, kind: str, facts: list[str]) -> str:
    """The facts in order, after some background and with a few asides, as a user would write them."""
    background = rng.sample(BACKGROUND[kind], rng.randint(0, 5))
    return " ".join([*background, *facts, *rng.sample(ASIDES, rng.randint(0, 5))])


def travel(rng: random.Random) -> tuple[str, dict]:
    vehicle, low, high = rng.choice(VEHICLES)
    origin, destination = rng.sample(CITIES, 2)
    distance, speed = rng.randint(40, 900), rng.randint(low, high)
    stops, stop_minutes = rng.randint(0, 5), rng.choice([5, 10, 15, 20])
    depart = rng.randint(5, 20) * 60 + rng.choice([0, 15, 30, 45])
    minutes = round(distance / speed * 60) + stops * stop_minutes
    facts = [
        f"The {vehicle} from {origin} to {destination} covers {distance} km.",
        f"It travels at an average of {speed} km/h between stops.",
        f"It makes {stops} stop{'s' if stops != 1 else ''} of {stop_minutes} minutes each."
        if stops
        else "It runs without stopping.",
        f"It leaves {origin} at {depart // 60:02d}:{depart % 60:02d}.",
    ]
    question = f"{_context(rng, 'travel', facts)} What time does it arrive in {destination}, and how long is the journey?"
    arrive = (depart + minutes) % (24 * 60)
    return question, {
        "kind": "travel",
        "distance": distance,
        "speed": speed,
        "stops": stops,
        "stop_minutes": stop_minutes,
        "moving": round(distance / speed * 60),
        "minutes": minutes,
        "depart": depart,
        "arrive": arrive,
        "destination": destination,
        "vehicle": vehicle,
    }


def recipe(rng: random.Random) -> tuple[str, dict]:
    dish, ingredients = rng.choice(DISHES)
    serves, wanted = rng.choice([2, 4, 6]), rng.choice([3, 5, 8, 10, 12, 15])
    amounts = {name: rng.choice([50, 75, 100, 150, 200, 250, 300, 400]) for name in ingredients}
    facts = [f"My {dish} recipe serves {serves} people."] + [
        f"It uses {grams} g of {name}." for name, grams in amounts.items()
    ]
    question = (
        f"{_context(rng, 'recipe', facts)} How much of each ingredient do I need to serve {wanted} people?"
    )
    return question, {"kind": "recipe", "dish": dish, "serves": serves, "wanted": wanted, "amounts": amounts}


def budget(rng: random.Random) -> tuple[str, dict]:
    business, city = rng.choice(BUSINESSES), rng.choice(CITIES)
    total = rng.randint(20, 400) * 100
    items = rng.sample(BUDGET_ITEMS, rng.randint(3, 5))
    cuts = sorted(rng.sample(range(1, 20), len(items) - 1))
    shares = [(b - a) * 5 for a, b in zip([0, *cuts], [*cuts, 20], strict=True)]  # percentages summing to 100
    facts = [
        f"I run a {business} in {city} owned by {rng.choice(FIRST)} and me.",
        f"Our budget for next quarter is {total} crowns.",
    ] + [f"We want {share}% of it to go to {item}." for item, share in zip(items, shares, strict=True)]
    question = f"{_context(rng, 'budget', facts)} How many crowns is that for each item?"
    return question, {"kind": "budget", "total": total, "split": dict(zip(items, shares, strict=True))}


PROBLEMS = [travel, recipe, budget]


def _clock(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


def _duration(minutes: int) -> str:
    return f"{minutes // 60} h {minutes % 60:02d} min"


def answer(facts: dict, style: int, rng: random.Random) -> str:
    """One correct answer to the problem, written in ``style`` (0-3)."""
    if facts["kind"] == "travel":
        moving, stops = facts["moving"], facts["stops"] * facts["stop_minutes"]
        steps = [
            f"Time moving: {facts['distance']} km / {facts['speed']} km/h = {moving} minutes.",
            f"Time at stops: {facts['stops']} x {facts['stop_minutes']} min = {stops} minutes."
            if stops
            else "Time at stops: none, it runs straight through.",
            f"Journey: {moving} + {stops} = {facts['minutes']} minutes, that is {_duration(facts['minutes'])}.",
            f"Arrival: {_clock(facts['depart'])} + {_duration(facts['minutes'])} = {_clock(facts['arrive'])}.",
        ]
        final = (
            f"The {facts['vehicle']} arrives in {facts['destination']} at {_clock(facts['arrive'])}, "
            f"after a journey of {_duration(facts['minutes'])}."
        )
        check = (
            f"Check: {facts['speed']} km/h for {moving} minutes covers about "
            f"{facts['speed'] * moving / 60:.0f} km, which matches the {facts['distance']} km."
        )
    elif facts["kind"] == "recipe":
        factor = facts["wanted"] / facts["serves"]
        scaled = {name: grams * factor for name, grams in facts["amounts"].items()}
        steps = [f"Scale factor: {facts['wanted']} / {facts['serves']} = {factor:.3g}."] + [
            f"{name.capitalize()}: {grams} g x {factor:.3g} = {scaled[name]:.0f} g."
            for name, grams in facts["amounts"].items()
        ]
        final = (
            f"For {facts['wanted']} people you need "
            + ", ".join(f"{scaled[name]:.0f} g of {name}" for name in scaled)
            + "."
        )
        check = (
            f"Check: the total goes from {sum(facts['amounts'].values())} g to {sum(scaled.values()):.0f} g, "
            f"{factor:.3g} times as much, as it should."
        )
    else:
        parts = {item: facts["total"] * share / 100 for item, share in facts["split"].items()}
        steps = [
            f"{item.capitalize()}: {share}% of {facts['total']} = {parts[item]:.2f} crowns."
            for item, share in facts["split"].items()
        ]
        final = "The split is " + ", ".join(f"{parts[i]:.2f} crowns for {i}" for i in parts) + "."
        check = f"Check: {' + '.join(f'{v:.2f}' for v in parts.values())} = {sum(parts.values()):.2f}, the whole budget."
    opener = rng.choice(["", "Let's work it out. ", "Sure. ", "Here is the calculation. ", "Good question. "])
    if style == 0:  # step by step, numbered
        return (
            opener
            + "Step by step:\n"
            + "\n".join(f"{n}. {s}" for n, s in enumerate(steps, 1))
            + f"\n\n{final}"
        )
    if style == 1:  # answer first, then the working
        return f"{final}\n\nHow I got there: " + " ".join(steps)
    if style == 2:  # a list, then a check
        return opener + "\n".join(f"- {s}" for s in steps) + f"\n\n{check}\n\nSo: {final}"
    return (
        opener
        + "In prose: "
        + " Then, ".join(s[0].lower() + s[1:] for s in steps)
        + f" {check} {final}"
        + rng.choice(["", " Let me know if you want it rounded differently.", " Hope that helps!"])
    )


def prompt_rows(rng: random.Random, answers: int) -> list[dict]:
    question, facts = rng.choice(PROBLEMS)(rng)
    prompt = ([{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.5 else []) + [
        {"role": "user", "content": question}
    ]
    styles = [n % 4 for n in rng.sample(range(max(4, answers)), answers)]  # different styles first
    return [{"messages": [*prompt, {"role": "assistant", "content": answer(facts, s, rng)}]} for s in styles]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=500)
    parser.add_argument("--answers", type=int, default=4, help="accepted answers per prompt (N)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--shuffle",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="scatter the rows of a prompt through the file (--no-shuffle: adjacent)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="also run the rows of 5 prompts through slipstream's data path and check them",
    )
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    rows = [r for _ in range(args.prompts) for r in prompt_rows(rng, args.answers)]
    if args.shuffle:
        rng.shuffle(rows)
    write_jsonl(rows, args.out)
    print(f"wrote {len(rows)} rows ({args.prompts} prompts x {args.answers} answers) to {args.out}")
    with tempfile.TemporaryDirectory() as folder:
        tokenizer, name = counting_tokenizer(template_file(None, folder))
        summarise(rows, tokenizer, name, args.check)
    return 0


def summarise(rows: list[dict], tokenizer, name: str, check: bool) -> None:
    keys = [tuple(m["content"] for m in r["messages"][:-1]) for r in rows]  # the prompt
    ids = rendered_ids(tokenizer, rows)
    prefixes = group_prefixes(ids, keys)

    def count(texts: list[str]) -> list[int]:
        return [len(e.ids) for e in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]

    prompt_tokens = count([k[-1] for k in prefixes])  # the user's question
    answers = count([r["messages"][-1]["content"] for r in rows])
    total = sum(map(len, ids))
    repeated = sum(prefixes[k] for k in keys) - sum(prefixes.values())  # every prompt once is not repeated
    print(f"tokens counted with {name}, rendered with Qwen3's chat template")
    print(f"  rows: {len(rows)}, prompts: {len(prefixes)} (answers per prompt: {len(rows) // len(prefixes)})")
    print(
        f"  user question tokens: mean {statistics.mean(prompt_tokens):.0f}, min {min(prompt_tokens)}, "
        f"max {max(prompt_tokens)}"
    )
    print(f"  answer tokens: mean {statistics.mean(answers):.0f}, min {min(answers)}, max {max(answers)}")
    print(f"  tokens a prompt's rows share at their start: mean {statistics.mean(prefixes.values()):.0f}")
    print(
        f"  tokens that repeat a prompt already in another row: {repeated} of {total} ({repeated / total:.1%})"
    )
    if check:
        chosen = list(dict.fromkeys(keys))[:5]  # the first 5 prompts in file order, all their rows
        picked = [(r, k) for r, k in zip(rows, keys, strict=True) if k in chosen]
        checked = check_rows([r for r, _ in picked], tokenizer, [k for _, k in picked])
        groups, first_label = checked["groups"], {}
        for first, (_, key) in zip(checked["first_labels"], picked, strict=True):
            first_label[key] = min(first, first_label.get(key, first))
        print(
            f"check: {checked['rows']} rows of {len(chosen)} prompts through slipstream's data path "
            "(response_only): every row tokenized, only the answers labelled"
        )
        print(
            f"  shared prefix per prompt: {', '.join(str(groups[k]) for k in chosen)} tokens; "
            f"first labelled token: {', '.join(str(first_label[k]) for k in chosen)}"
        )
        if any(groups[k] < first_label[k] for k in chosen):
            raise SystemExit("check failed: the rows of a prompt do not share all of its tokens")
        print("  ok: the rows of each prompt share every prompt token")


if __name__ == "__main__":
    raise SystemExit(main())
