"""The Modelfile's ``TEMPLATE``: the run's chat template in Ollama's Go syntax, where it renders the same.

Ollama does not render the Jinja chat template the run trained with: it renders a Go ``text/template`` over
``.System`` (every system message, joined by a blank line) and ``.Messages`` (every message, system ones
included, consecutive messages of one role merged by a blank line; ``collate`` in Ollama's
``template/template.go``). Four chat formats have a Go template here (ChatML, Llama 3, Gemma, Mistral's
tekken ``[INST]``), each with a Python renderer of what that Go template writes. The run's chat template is
rendered on a few probe conversations (with and without a system message, one turn and several, the
generation prompt asked for) and a format's TEMPLATE is written only where its renderer gives the very same
text on every probe; otherwise none, and Ollama takes the GGUF's own ``tokenizer.chat_template``.

BOS: llama.cpp puts BOS in front of the prompt itself where the GGUF's ``add_bos_token`` says so (Ollama's own
``llama3-instruct`` template writes no ``<|begin_of_text|>``), so the Jinja render's leading BOS text is
compared as that token and left out of the TEMPLATE; where the GGUF adds none, the TEMPLATE writes the BOS
text the chat template writes (llama.cpp reads special tokens in the prompt).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Probe conversations: contents without leading or trailing spaces (Llama 3's and Gemma's templates trim
# contents, which Go's template cannot; Ollama's own templates do not either), roles alternating after an
# optional leading system message, as every format here requires, ending on the user's turn (Ollama always
# asks for the assistant's next turn).
_SYSTEM = {"role": "system", "content": "You answer in one sentence."}
_FIRST = {"role": "user", "content": "What is the capital of Brindlemoor?"}
_REPLY = {"role": "assistant", "content": "Kelvar is the capital.\nIt lies on the coast."}
_SECOND = {"role": "user", "content": "And its river?"}
PROBES: tuple[tuple[dict[str, str], ...], ...] = (
    (_FIRST,),
    (_SYSTEM, _FIRST),
    (_FIRST, _REPLY, _SECOND),
    (_SYSTEM, _FIRST, _REPLY, _SECOND),
)

_SENTINEL = "\x00slipstream-system\x00"  # stands for a system text to be read off the run's own render


def collate(messages: list[dict[str, str]]) -> tuple[str, list[dict[str, str]]]:
    """Ollama's view of a conversation: ``.System``, every system message's content joined by a blank line,
    and ``.Messages``, every message (the system ones kept) with consecutive ones of one role, other than
    tool results, merged into one by a blank line."""
    system = [message["content"] for message in messages if message["role"] == "system"]
    collated: list[dict[str, str]] = []
    for message in messages:
        if collated and collated[-1]["role"] == message["role"] and message["role"] != "tool":
            collated[-1] = {**collated[-1], "content": collated[-1]["content"] + "\n\n" + message["content"]}
        else:
            collated.append({"role": message["role"], "content": message["content"]})
    return "\n\n".join(system), collated


def go_text(text: str) -> str:
    """``text`` as Go template source that writes it: as is where it can be (no ``{{``, nothing the
    Modelfile's ``\"\"\"`` quoting or its parser would drop), else a Go string literal in an action."""
    if "{{" not in text and '"""' not in text and all(char == "\n" or char.isprintable() for char in text):
        return text
    escaped = []
    for char in text:
        if char in '"\\':
            escaped.append("\\" + char)
        elif char == "\n":
            escaped.append("\\n")
        elif char.isprintable():
            escaped.append(char)
        else:
            escaped.append(f"\\U{ord(char):08x}")
    return '{{ "' + "".join(escaped) + '" }}'


@dataclass(frozen=True)
class SystemTurn:
    """What a template whose system message is a turn of its own writes there beyond the message: ``default``,
    the system turn's text where the conversation opens without one (None: no system turn then; SmolLM2's
    "You are a helpful AI assistant named SmolLM..."), and ``prefix``, written before the conversation's own
    system message (Llama 3.1's knowledge-cutoff and date lines, which are also its default)."""

    default: str | None = None
    prefix: str = ""

    def describe(self) -> str:
        if self.default is not None and self.default == self.prefix:
            return f"with the lines it writes at the head of every system turn ({self.prefix!r})"
        if self.default is not None:
            return f"with its default system prompt ({self.default!r})"
        return ""


PLAIN = SystemTurn()


@dataclass(frozen=True)
class ChatFormat:
    """A chat format Ollama can render: its Go template and a Python renderer of what that Go template writes
    for a conversation, both after ``leading`` (the BOS text, where the GGUF does not add BOS itself)."""

    name: str
    stops: tuple[str, ...]  # its end-of-turn tokens, Ollama's PARAMETER stop
    system_is_a_turn: bool = False  # whether a SystemTurn other than PLAIN applies

    def go_template(self, system: SystemTurn = PLAIN, leading: str = "") -> str:
        raise NotImplementedError

    def render(self, messages: list[dict[str, str]], system: SystemTurn = PLAIN, leading: str = "") -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class TurnFormat(ChatFormat):
    """Every message a turn, the system's too, ``open + role + after_role + content + close`` (ChatML, Llama
    3), then the assistant's opening as the generation prompt."""

    open: str = ""
    after_role: str = ""
    close: str = ""
    system_is_a_turn: bool = True

    def _turn(self, role: str, content: str) -> str:
        return self.open + role + self.after_role + content + self.close

    def go_template(self, system: SystemTurn = PLAIN, leading: str = "") -> str:
        plain = system.default is None and not system.prefix
        # "{{-" drops the whitespace before it: a line break there, for the reader, where no turn ends in one
        end = "{{ end }}" if self.close[-1:].isspace() else "\n{{- end }}"
        parts = [leading, "{{- range .Messages }}" if plain else "{{- range $i, $_ := .Messages }}"]
        if system.default is not None:  # as the Jinja does: only where the first message is not the system's
            parts.append(
                '\n{{- if and (eq $i 0) (ne .Role "system") }}'
                + self._turn("system", go_text(system.default))
                + end
            )
        parts.append(self.open + "{{ .Role }}" + self.after_role)
        if system.prefix:
            parts.append('{{ if and (eq $i 0) (eq .Role "system") }}' + go_text(system.prefix) + "{{ end }}")
        parts.append("{{ .Content }}" + self.close + end + self.open + "assistant" + self.after_role)
        return "".join(parts)

    def render(self, messages: list[dict[str, str]], system: SystemTurn = PLAIN, leading: str = "") -> str:
        _, collated = collate(messages)
        out = [leading]
        for index, message in enumerate(collated):
            first = index == 0
            if first and message["role"] != "system" and system.default is not None:
                out.append(self._turn("system", system.default))
            prefix = system.prefix if first and message["role"] == "system" else ""
            out.append(self._turn(message["role"], prefix + message["content"]))
        out.append(self.open + "assistant" + self.after_role)
        return "".join(out)


@dataclass(frozen=True)
class GemmaFormat(ChatFormat):
    """Gemma's turns, ``model`` the assistant's role; no system turn: the system text opens the first user
    turn, a blank line after it (Gemma 3's template; Gemma 2's refuses a system message)."""

    def go_template(self, system: SystemTurn = PLAIN, leading: str = "") -> str:
        return (
            leading + "{{- $first := true }}\n"
            "{{- range .Messages }}\n"
            '{{- if eq .Role "user" }}<start_of_turn>user\n'
            "{{ if and $first $.System }}{{ $.System }}\n\n{{ end }}{{ $first = false }}"
            "{{ .Content }}<end_of_turn>\n"
            '{{ else if eq .Role "assistant" }}<start_of_turn>model\n'
            "{{ .Content }}<end_of_turn>\n"
            "{{ end }}\n"
            "{{- end }}<start_of_turn>model\n"
        )

    def render(self, messages: list[dict[str, str]], system: SystemTurn = PLAIN, leading: str = "") -> str:
        system_text, collated = collate(messages)
        out, first = [leading], True
        for message in collated:
            if message["role"] == "user":
                opening = system_text + "\n\n" if first and system_text else ""
                out.append(f"<start_of_turn>user\n{opening}{message['content']}<end_of_turn>\n")
                first = False
            elif message["role"] == "assistant":
                out.append(f"<start_of_turn>model\n{message['content']}<end_of_turn>\n")
        out.append("<start_of_turn>model\n")
        return "".join(out)


@dataclass(frozen=True)
class MistralFormat(ChatFormat):
    """Mistral's tekken ``[INST]`` format (Mistral Nemo's template): ``[INST]user[/INST]assistant</s>``, no
    spaces, the system text opening the last user turn, a blank line after it; no generation prompt (the
    prompt ends on ``[/INST]``). The older v1 format (``[INST] user [/INST]``, spaced) is another format."""

    def go_template(self, system: SystemTurn = PLAIN, leading: str = "") -> str:
        return (
            leading + "{{- range $i, $_ := .Messages }}\n"
            '{{- if eq .Role "user" }}[INST]'
            "{{ if and $.System (eq (len (slice $.Messages $i)) 1) }}{{ $.System }}\n\n{{ end }}"
            "{{ .Content }}[/INST]\n"
            '{{- else if eq .Role "assistant" }}{{ .Content }}</s>\n'
            "{{- end }}\n"
            "{{- end }}"
        )

    def render(self, messages: list[dict[str, str]], system: SystemTurn = PLAIN, leading: str = "") -> str:
        system_text, collated = collate(messages)
        out = [leading]
        for index, message in enumerate(collated):
            if message["role"] == "user":
                last = index == len(collated) - 1
                opening = system_text + "\n\n" if last and system_text else ""
                out.append(f"[INST]{opening}{message['content']}[/INST]")
            elif message["role"] == "assistant":
                out.append(f"{message['content']}</s>")
        return "".join(out)


CHATML = TurnFormat("ChatML", ("<|im_end|>",), open="<|im_start|>", after_role="\n", close="<|im_end|>\n")
LLAMA3 = TurnFormat(
    "Llama 3",
    ("<|eot_id|>",),
    open="<|start_header_id|>",
    after_role="<|end_header_id|>\n\n",
    close="<|eot_id|>",
)
GEMMA = GemmaFormat("Gemma", ("<end_of_turn>",))
MISTRAL = MistralFormat("Mistral (tekken [INST])", ("</s>",))
FORMATS: tuple[ChatFormat, ...] = (CHATML, LLAMA3, GEMMA, MISTRAL)


@dataclass(frozen=True)
class OllamaTemplate:
    """What the Modelfile says about the chat: ``template`` (Go, None: Ollama takes the GGUF's own), the
    ``stops``, and ``why``, one line for the Modelfile's comment."""

    template: str | None
    stops: list[str]
    why: str
    format: str | None = None
    system: SystemTurn = PLAIN  # what the TEMPLATE writes about the system turn
    leading: str = ""  # the BOS text it opens with (where the GGUF adds none)


def render_chat_template(
    chat_template: str, messages: list[dict[str, str]], bos_token: str | None, eos_token: str | None
) -> str:
    """The conversation as transformers' ``apply_chat_template`` renders it, generation prompt asked for."""
    from transformers.utils.chat_template_utils import render_jinja_template

    specials = {name: token for name, token in (("bos_token", bos_token), ("eos_token", eos_token)) if token}
    rendered, _ = render_jinja_template(
        conversations=[[dict(message) for message in messages]],
        chat_template=chat_template,
        add_generation_prompt=True,
        **specials,
    )
    return rendered[0]


def _read_off(render: str, expected: str) -> str | None:
    """The text ``render`` (written with the sentinel where a system text goes) has there in ``expected``."""
    before, _, after = render.partition(_SENTINEL)
    found = re.fullmatch(re.escape(before) + "(.*?)" + re.escape(after), expected, flags=re.DOTALL)
    return found.group(1) if found else None


def _system_turns(fmt: ChatFormat, renders: dict[int, str], leading: str) -> list[SystemTurn]:
    """The SystemTurns to try for ``fmt``: PLAIN, and where the system is a turn, the default and prefix read
    off the run's renders of the first probe (no system message) and the second (one)."""
    turns = [PLAIN]
    if not fmt.system_is_a_turn:
        return turns
    default = prefix = None
    if 0 in renders:
        default = _read_off(fmt.render(list(PROBES[0]), SystemTurn(default=_SENTINEL), leading), renders[0])
    if 1 in renders:
        prefix = _read_off(fmt.render(list(PROBES[1]), SystemTurn(prefix=_SENTINEL), leading), renders[1])
    if default is not None or prefix:
        turns.append(SystemTurn(default=default, prefix=prefix or ""))
    return turns


def _first_difference(expected: str, got: str) -> int:
    at = next((i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b), None)
    return min(len(expected), len(got)) if at is None else at


def _difference(
    fmt: ChatFormat, system: SystemTurn, leading: str, renders: dict[int, str]
) -> tuple[int, int, str] | None:
    """None where ``fmt`` renders every probe as the run's template did, else how near it came: the probes
    it matched before one that differs, where that one differs, and the difference in words."""
    for matched, (index, expected) in enumerate(renders.items()):
        got = fmt.render(list(PROBES[index]), system, leading)
        if got != expected:
            at = _first_difference(expected, got)
            said = f"{expected[at : at + 24]!r} where {fmt.name} writes {got[at : at + 24]!r}"
            return (
                matched,
                at,
                f"{fmt.name}: probe {index} differs at character {at}: the template writes {said}",
            )
    return None


def ollama_template(
    chat_template: str | None,
    eos_token: str | None = None,
    bos_token: str | None = None,
    add_bos: bool = False,
) -> OllamaTemplate:
    """The Modelfile's TEMPLATE and stops for ``chat_template``: the one format whose Go template renders
    every probe exactly as the run's template does (after the BOS llama.cpp adds where ``add_bos``), else
    none, and why."""
    eos_stops = [eos_token] if eos_token else []

    def none(why: str) -> OllamaTemplate:
        return OllamaTemplate(None, eos_stops, why)

    if not chat_template:
        return none("the run has no chat template")
    # Llama 3.2's "Today Date: ..." (strftime_now): a fixed TEMPLATE cannot follow the date
    if "strftime_now" in chat_template:
        return none("the chat template writes today's date (strftime_now), which a fixed Go template cannot")
    renders: dict[int, str] = {}
    refuses_system = False
    for index, probe in enumerate(PROBES):
        try:
            renders[index] = render_chat_template(chat_template, list(probe), bos_token, eos_token)
        except Exception as error:  # a template that refuses a system message (Gemma 2) or fails outright
            if any(message["role"] == "system" for message in probe):
                refuses_system = True
                continue
            return none(f"the chat template does not render a plain conversation ({error})")
    if add_bos:  # llama.cpp adds BOS as a token: the TEMPLATE must not write it again
        if not bos_token or not all(render.startswith(bos_token) for render in renders.values()):
            return none(f"the GGUF adds BOS ({bos_token!r}) where the chat template does not write it")
        renders = {index: render[len(bos_token) :] for index, render in renders.items()}
    leadings = [""] + ([bos_token] if bos_token and not add_bos else [])

    matches: list[tuple[ChatFormat, SystemTurn, str]] = []
    nearest: tuple[int, int, str] = (-1, -1, "")  # probes matched, first difference's place, what differs
    for fmt in FORMATS:
        for leading in leadings:
            for system in _system_turns(fmt, renders, leading):
                difference = _difference(fmt, system, leading, renders)
                if difference is None:
                    matches.append((fmt, system, leading))
                else:
                    nearest = max(nearest, difference)
    found = {fmt.name for fmt, _, _ in matches}
    if not found:
        names = ", ".join(fmt.name for fmt in FORMATS)
        return none(f"the chat template renders as none of {names} (the nearest, {nearest[2]})")
    if len(found) > 1:
        return none(f"the chat template renders as several formats alike ({', '.join(sorted(found))})")
    fmt, system, leading = matches[0]
    stops = list(fmt.stops) + [stop for stop in eos_stops if stop not in fmt.stops]
    how = " ".join(
        part
        for part in (
            fmt.name,
            system.describe(),
            f"and the BOS text {leading!r} (the GGUF adds none)" if leading else "",
            f"(the chat template refuses a system message: the TEMPLATE places one as {fmt.name} does)"
            if refuses_system
            else "",
        )
        if part
    )
    template = fmt.go_template(system, leading)
    if '"""' in template:  # the Modelfile quotes the TEMPLATE in triple quotes
        return none('the TEMPLATE would hold """, which a Modelfile cannot quote')
    return OllamaTemplate(
        template,
        stops,
        f"{how}: renders as the run's chat template does on every probe conversation",
        fmt.name,
        system,
        leading,
    )


def modelfile_lines(
    gguf_name: str,
    chat_template: str | None,
    eos_token: str | None,
    bos_token: str | None = None,
    add_bos: bool = False,
) -> list[str]:
    """The Modelfile, line by line: FROM, the TEMPLATE (or a comment saying why there is none), the stops."""
    found = ollama_template(chat_template, eos_token, bos_token, add_bos)
    why = " ".join(found.why.split())  # one comment line
    lines = [f"FROM ./{gguf_name}"]
    if found.template is None:
        lines.append(
            f"# the chat template: the GGUF file's own (tokenizer.chat_template), as Ollama reads it: {why}"
        )
    else:
        lines += [f"# the chat template: {why}", f'TEMPLATE """{found.template}"""']
    lines += [f'PARAMETER stop "{stop}"' for stop in found.stops if '"' not in stop and "\n" not in stop]
    return lines
