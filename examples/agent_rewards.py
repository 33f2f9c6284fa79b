"""The reward of examples/agent.yaml, in TRL's convention: each completion is the trajectory's list of
messages (assistant turns and tool results); the last assistant turn must name the row's ``answer``."""


def names_the_mayor(completions, answer, **kwargs):
    """1.0 when the final answer names the mayor (the row's answer), and it is not a tool call."""
    scores = []
    for messages, expected in zip(completions, answer, strict=True):
        last = messages[-1]
        final = last["role"] == "assistant" and not last.get("tool_calls")
        scores.append(1.0 if final and expected in last["content"] else 0.0)
    return scores
