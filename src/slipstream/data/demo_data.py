"""The built-in demo dataset: chats a small model can learn, with real-world length spread.

Three tasks whose answers follow from the prompt, so a tiny model's loss clearly falls:
adding pairs of numbers, reversing a list of words, and recalling values by key. Each row's
size is drawn from a log-normal distribution, as real fine-tuning sets are long-tailed: in
the demo tokenizer's tokens the median row is about 300 tokens and a few percent run past
2048, so packing has to truncate or split. Everything comes from ``random.Random(seed)``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

Row = dict[str, list[dict[str, str]]]

_WORD_LINES = (
    "apple river stone cloud green house water light music paper table window garden",
    "bread chair smile happy quick slow bright dark summer winter spring autumn morning",
    "evening night friend family school teacher doctor market street city village forest",
    "mountain ocean island bridge road train plane boat horse tiger rabbit eagle fish bird",
    "flower tree grass leaf root seed fruit lemon orange banana cherry grape honey sugar",
    "salt pepper coffee butter cheese milk egg rice soup salad dinner lunch breakfast kitchen",
    "door floor wall roof harbor lamp clock phone letter story poem song dance game ball",
    "ticket money price shop bank office engine wheel metal silver gold copper iron glass",
    "wood cotton silk wool shirt coat shoe hat dress ring watch pocket bag box basket bottle",
    "cup plate spoon knife fork bowl pencil book library museum theater cinema hospital",
    "church castle tower palace farm field valley desert beach lake hill cave star moon sun",
    "planet rocket storm rain snow wind thunder fire smoke shadow mirror picture color red",
    "blue yellow purple brown white black simple gentle brave calm clever eager fair kind",
    "proud quiet strong young ancient modern early late north south east west",
    "paint sand piano violin drum blanket pillow",
)
WORDS: tuple[str, ...] = tuple(word for line in _WORD_LINES for word in line.split())  # 200 words

# Row size: a log-normal "token budget", capped so the tail stops a little past 2048 tokens.
MEDIAN_BUDGET = 300
SIGMA = 0.95
MAX_BUDGET = 3000
MIN_BUDGET = 24


def demo_rows(num_rows: int = 2000, seed: int = 0) -> list[Row]:
    """``num_rows`` chat rows (one user turn, one assistant turn), the same for the same seed."""
    rng = random.Random(seed)
    tasks: tuple[Callable[[random.Random, int], tuple[str, str]], ...] = (_addition, _reversal, _recall)
    rows = []
    for _ in range(num_rows):
        budget = min(MAX_BUDGET, max(MIN_BUDGET, rng.lognormvariate(math.log(MEDIAN_BUDGET), SIGMA)))
        prompt, answer = rng.choice(tasks)(rng, int(budget))
        rows.append(
            {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}
        )
    return rows


def _number(rng: random.Random) -> int:
    digits = rng.randint(1, 4)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def _addition(rng: random.Random, budget: int) -> tuple[str, str]:
    pairs = [(_number(rng), _number(rng)) for _ in range(max(1, budget // 8))]  # ~8 tokens a pair
    prompt = "Add each pair: " + "; ".join(f"{a}+{b}" for a, b in pairs)
    return prompt, "; ".join(str(a + b) for a, b in pairs)


def _reversal(rng: random.Random, budget: int) -> tuple[str, str]:
    words = [rng.choice(WORDS) for _ in range(max(2, budget // 2))]  # ~2 tokens a word
    return "Reverse the words: " + " ".join(words), " ".join(reversed(words))


def _recall(rng: random.Random, budget: int) -> tuple[str, str]:
    count = max(1, budget // 6)  # ~6 tokens a key=value pair
    keys = rng.sample(range(1, 4 * count + 10), count)
    values = {key: rng.choice(WORDS) for key in keys}
    asked = rng.sample(keys, min(count, 1 + count // 8))
    prompt = (
        "Remember: "
        + ", ".join(f"k{key}={value}" for key, value in values.items())
        + ". Question: "
        + " ".join(f"what is k{key}?" for key in asked)
    )
    return prompt, "; ".join(values[key] for key in asked)
