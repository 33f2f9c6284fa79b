"""A tiny reward model where a config names one an earlier stage makes (docs/rlhf.md: the GRPO config names
the reward model its stage 2 exports), so that config can be loaded and validated before that stage ran."""

from __future__ import annotations

import json
from pathlib import Path

import yaml


def stand_in_reward_models(config_path: Path, folder: Path) -> list[str]:
    """``--set`` overrides putting a tiny sequence classifier in place of every ``grpo.rewards`` model
    directory ``config_path`` names that does not exist yet; [] where it names none."""
    from tests.test_rewards import _reward_model_dir

    rewards = (yaml.safe_load(config_path.read_text()).get("grpo") or {}).get("rewards") or []
    specs, missing = [], False
    for spec in rewards:
        name = spec.get("function") if isinstance(spec, dict) else spec
        if (
            isinstance(name, str)
            and ":" not in name
            and "/" in name
            and not (config_path.parent / name).exists()
        ):
            made = str(_reward_model_dir(folder / f"reward-{len(specs)}"))
            spec, missing = ({**spec, "function": made} if isinstance(spec, dict) else made), True
        specs.append(spec)
    return [f"grpo.rewards={json.dumps(specs)}"] if missing else []
