"""The environment of examples/agent.yaml, in TRL's convention (``environment_factory``): an almanac of
invented rivers and towns the model cannot know, so it must look things up. A question names a river; the
answer (the mayor of the town where it springs) takes two lookups, one after the other: the river, then
the town. One instance per rollout; ``reset`` with the row's fields; ``get_reward`` scores the rollout's
tool use: 1.0 when it looked up the river and then its town."""

from __future__ import annotations

import json
from pathlib import Path

ALMANAC = json.loads((Path(__file__).parent / "data" / "almanac.json").read_text())


class Almanac:
    def reset(self, **row) -> None:
        self.river = row.get("river")
        self.town = ALMANAC["rivers"].get(self.river, {}).get("town")
        self.looked_up: list[str] = []

    def lookup(self, name: str) -> str:
        """Look a river or a town up in the almanac.

        Args:
            name: the river's or the town's name
        """
        self.looked_up.append(name)
        key = name.strip()
        if key in ALMANAC["rivers"]:
            river = ALMANAC["rivers"][key]
            return (
                f"The river {key} springs in the town of {river['town']} and is {river['length_km']} km long."
            )
        if key in ALMANAC["towns"]:
            town = ALMANAC["towns"][key]
            return f"{key} has {town['people']} inhabitants; its mayor is {town['mayor']}."
        return f"The almanac has no entry {name!r}."

    def get_reward(self) -> float:
        return 1.0 if self.river in self.looked_up and self.town in self.looked_up else 0.0
