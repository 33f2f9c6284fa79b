"""A tool file of TRL's kind (Qwen3's real tokenizer, ``qwen3_tokenizer``, is the suite's: tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

TOOLS = '''
import asyncio
import time


def lookup(key: str) -> str:
    """Look a key up in the almanac.

    Args:
        key: the entry to look up
    """
    return {"velmora": "a bridge town", "kaldun": "a mountain pass"}.get(key.lower(), "no such entry")


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


async def slow_echo(text: str) -> str:
    """Echo the text back, after a moment.

    Args:
        text: what to echo
    """
    await asyncio.sleep(0.01)
    return text


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError("the almanac is closed")


async def nap(seconds: float) -> str:
    """Sleep a while.

    Args:
        seconds: how long
    """
    await asyncio.sleep(seconds)
    return "slept"


def hangs(x: int) -> int:
    """Never returns in time.

    Args:
        x: anything
    """
    time.sleep(5)
    return x


def stubborn(x: int) -> str:
    """Swallows whatever interrupts it.

    Args:
        x: anything
    """
    try:
        time.sleep(5)
    except BaseException:
        return "finished anyway"
    return "slept"


class Unprintable:
    def __str__(self):
        raise ValueError("no text")


def odd(x: int) -> str:
    """Returns something that cannot be printed.

    Args:
        x: anything
    """
    return Unprintable()


def undocumented(x):
    return x


class Almanac:
    """A TRL environment: reset() with the row's fields, tools as methods, get_reward() at the end."""

    def reset(self, **kwargs):
        self.answer = kwargs.get("answer")
        self.looked_up = []
        return None

    def find(self, key: str) -> str:
        """Find an entry.

        Args:
            key: the entry
        """
        self.looked_up.append(key)
        return f"{key}: {len(key)}"

    def get_reward(self):
        return 1.0 if self.looked_up else 0.0


class NoReset:
    def find(self, key: str) -> str:
        """Find.

        Args:
            key: the entry
        """
        return key
'''


@pytest.fixture
def tool_file(tmp_path) -> Path:
    path = tmp_path / "tools.py"
    path.write_text(TOOLS)
    return path
