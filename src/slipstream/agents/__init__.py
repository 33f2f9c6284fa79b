"""Agents: multi-turn, tool-calling rollouts for GRPO in TRL's convention.

- :mod:`.tools`: ``grpo.tools`` (functions) and ``grpo.environment`` (a class whose methods are the
  tools, ``reset`` and an optional ``get_reward``), loaded and checked at start, called with a timeout.
- :mod:`.calls`: a turn's tool calls parsed in the chat template's own format, and the tokens a tool's
  result adds to the trajectory, rendered as the template renders a ``tool`` message.
- :mod:`.rollouts`: the trajectories: a turn, its tools, the next turn, until the model answers.
"""
