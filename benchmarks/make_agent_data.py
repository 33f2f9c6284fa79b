"""The data of examples/agent-sft.yaml and examples/agent.yaml: an almanac of invented rivers and towns,
SFT conversations that use its lookup tool, and GRPO prompts about other rivers.

A question names a river and asks for the mayor of the town where it springs: the answer takes two
lookups in turn (the river gives the town, the town gives the mayor), so every solved trajectory has two
tool turns. Names are composed here from seeded syllables, so the files are the same on every machine
and no model can know them.

- ``almanac.json``: ``{"rivers": {name: {"town", "length_km"}}, "towns": {name: {"mayor", "people"}}}``
  (read by examples/agent_env.py);
- ``agent_sft.jsonl``: ``{"messages": [...], "tools": [schema]}`` rows (user question, two tool calls
  with their results as the environment words them, the answer), for the SFT warm start;
- ``agent_prompts.jsonl``: ``{"prompt": [user], "river", "answer"}`` rows about rivers no SFT row names.

    python benchmarks/make_agent_data.py --out examples/data
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import tempfile
from pathlib import Path

ONSETS = ["br", "k", "v", "t", "m", "s", "d", "l", "g", "h", "r", "n", "th", "st", "f", "p", "z", "w"]
VOWELS = ["a", "e", "i", "o", "u", "ae", "ei", "ou"]
CODAS = ["", "n", "r", "l", "m", "s", "th", "nd", "rk", "ld"]
TOWN_ENDS = ["mora", "dun", "mere", "holt", "wick", "stead", "ford", "by", "ton", "vale"]
RIVER_ENDS = ["a", "en", "is", "ar", "wyn", "ette", "ine", "orr"]
FIRST = ["Ada", "Bram", "Cleo", "Dov", "Edda", "Finn", "Greta", "Hale", "Ines", "Joss", "Kai", "Lene", "Mads",
         "Nell", "Otto", "Pia", "Quin", "Rolf", "Sanne", "Teo", "Ulla", "Vik", "Wren", "Yara"]  # fmt: skip
QUESTIONS = [
    "Who is the mayor of the town where the river {river} springs?",
    "The river {river} springs in a town. Who is that town's mayor?",
    "Name the mayor of the town at the source of the river {river}.",
    "Which person is mayor of the town where the {river} rises?",
]


def _word(draw: random.Random, syllables: int) -> str:
    return "".join(draw.choice(ONSETS) + draw.choice(VOWELS) + draw.choice(CODAS) for _ in range(syllables))


def _unique(draw: random.Random, make, count: int) -> list[str]:
    found: list[str] = []
    while len(found) < count:
        name = make().capitalize()
        if name not in found:
            found.append(name)
    return found


def almanac(rivers: int, seed: int) -> dict:
    draw = random.Random(f"slipstream agent almanac {seed}")
    towns = _unique(draw, lambda: _word(draw, 1) + draw.choice(TOWN_ENDS), rivers)
    river_names = _unique(draw, lambda: _word(draw, 1) + draw.choice(RIVER_ENDS), rivers)
    surnames = _unique(draw, lambda: _word(draw, 2), rivers)
    return {
        "rivers": {
            name: {"town": town, "length_km": draw.randrange(12, 480)}
            for name, town in zip(river_names, towns, strict=True)
        },
        "towns": {
            town: {"mayor": f"{draw.choice(FIRST)} {surname}", "people": draw.randrange(300, 90_000)}
            for town, surname in zip(towns, surnames, strict=True)
        },
    }


def _environment(folder: Path):
    """examples/agent_env.py, loaded against the almanac just written (its tool's schema and wording)."""
    path = Path(__file__).resolve().parent.parent / "examples" / "agent_env.py"
    spec = importlib.util.spec_from_file_location("agent_env_for_data", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.ALMANAC = json.loads((folder / "almanac.json").read_text())
    return module


def _call(name: str) -> dict:
    return {"type": "function", "function": {"name": "lookup", "arguments": {"name": name}}}


def sft_row(env_module, schema: dict, river: str, question: str) -> dict:
    env = env_module.Almanac()
    env.reset(river=river)
    town = env.town
    first = env.lookup(river)
    second = env.lookup(town)
    mayor = env_module.ALMANAC["towns"][town]["mayor"]
    return {
        "messages": [
            {"role": "user", "content": question},
            {"role": "assistant", "content": "", "tool_calls": [_call(river)]},
            {"role": "tool", "name": "lookup", "content": first},
            {"role": "assistant", "content": "", "tool_calls": [_call(town)]},
            {"role": "tool", "name": "lookup", "content": second},
            {"role": "assistant", "content": f"The mayor of {town} is {mayor}."},
        ],
        "tools": [schema],
    }


def _write(path: Path, text: str) -> None:
    """Written whole or not at all (a temporary name, then renamed)."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(handle, "w") as out:
        out.write(text)
    os.replace(temporary, path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="examples/data")
    parser.add_argument("--rivers", type=int, default=160)
    parser.add_argument("--sft", type=int, default=96, help="rivers the SFT rows use; the rest are prompts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from transformers.utils import get_json_schema

    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    book = almanac(args.rivers, args.seed)
    _write(folder / "almanac.json", json.dumps(book, indent=1) + "\n")
    env_module = _environment(folder)
    schema = get_json_schema(env_module.Almanac().lookup)
    draw = random.Random(f"slipstream agent rows {args.seed}")
    rivers = list(book["rivers"])
    sft = [sft_row(env_module, schema, r, draw.choice(QUESTIONS).format(river=r)) for r in rivers[: args.sft]]
    prompts = [
        {
            "prompt": [{"role": "user", "content": draw.choice(QUESTIONS).format(river=r)}],
            "river": r,
            "answer": book["towns"][book["rivers"][r]["town"]]["mayor"],
        }
        for r in rivers[args.sft :]
    ]
    _write(folder / "agent_sft.jsonl", "".join(json.dumps(row) + "\n" for row in sft))
    _write(folder / "agent_prompts.jsonl", "".join(json.dumps(row) + "\n" for row in prompts))
    print(
        f"{len(book['rivers'])} rivers; {len(sft)} SFT conversations, {len(prompts)} GRPO prompts in {folder}"
    )


if __name__ == "__main__":
    main()
