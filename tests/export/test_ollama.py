"""The Modelfile's TEMPLATE (:mod:`slipstream.export.ollama`): on real chat templates (``chat_templates/``,
sources in its README) the format is found by rendering the template, and the Go template, executed by Go's
own ``text/template`` with Ollama's view of the conversation (``ollama_render/main.go``), writes exactly what
the Jinja template writes. Where Go is not installed those checks skip; the Python ones always run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from slipstream.export.gguf_export import modelfile
from slipstream.export.ollama import (
    CHATML,
    FORMATS,
    PROBES,
    SystemTurn,
    collate,
    ollama_template,
    render_chat_template,
)

TEMPLATES = Path(__file__).parent / "chat_templates"
RENDERER = Path(__file__).parent / "ollama_render" / "main.go"


@dataclass(frozen=True)
class RealTemplate:
    file: str
    bos: str | None
    eos: str
    add_bos: bool  # whether the model's tokenizer, and so its GGUF, adds BOS
    format: str | None  # the format found, None: no TEMPLATE
    stops: tuple[str, ...]
    refuses_system: bool = False

    @property
    def text(self) -> str:
        return (TEMPLATES / self.file).read_text(encoding="utf-8")

    def found(self):
        return ollama_template(self.text, self.eos, self.bos, self.add_bos)


REAL = [
    RealTemplate(
        "smollm2-135m-instruct.jinja", "<|im_start|>", "<|im_end|>", False, "ChatML", ("<|im_end|>",)
    ),
    RealTemplate("qwen3.jinja", None, "<|im_end|>", False, "ChatML", ("<|im_end|>",)),
    RealTemplate(
        "llama-3-8b-instruct.jinja", "<|begin_of_text|>", "<|eot_id|>", True, "Llama 3", ("<|eot_id|>",)
    ),
    RealTemplate(
        "llama-3.1-8b-instruct.jinja", "<|begin_of_text|>", "<|eot_id|>", True, "Llama 3", ("<|eot_id|>",)
    ),
    RealTemplate("gemma-2-2b-it.jinja", "<bos>", "<eos>", True, "Gemma", ("<end_of_turn>", "<eos>"), True),
    RealTemplate("gemma-3-it.jinja", "<bos>", "<eos>", True, "Gemma", ("<end_of_turn>", "<eos>")),
    RealTemplate(
        "mistral-nemo-instruct-2407.jinja", "<s>", "</s>", True, "Mistral (tekken [INST])", ("</s>",)
    ),
    # no TEMPLATE: today's date in the system turn, and the v1 tokenizer's spaced [INST] ... [/INST]
    RealTemplate(
        "llama-3.2-3b-instruct.jinja", "<|begin_of_text|>", "<|eot_id|>", True, None, ("<|eot_id|>",)
    ),
    RealTemplate("mistral-7b-instruct-v0.1.jinja", "<s>", "</s>", True, None, ("</s>",), True),
]
WITH_A_TEMPLATE = [real for real in REAL if real.format]

_SYSTEM = {"role": "system", "content": 'Be brief. Say "{{ .System }}" if asked.'}
_USER = {"role": "user", "content": "Héllo — what's 2 + 2?\nTwo lines."}
_ASSISTANT = {"role": "assistant", "content": '4, {{ .Content }} and """ stay text.'}
_AGAIN = {"role": "user", "content": "And 3 + 3?"}
# the probes and longer conversations, contents without surrounding spaces (Llama 3 and Gemma trim them)
CONVERSATIONS = [
    *PROBES,
    (_USER, _ASSISTANT, _AGAIN, _ASSISTANT, _USER),
    (_SYSTEM, _USER, _ASSISTANT, _AGAIN, _ASSISTANT, _USER),
]
# what only Ollama's collate reaches: consecutive messages of one role, a second system message
COLLATED = [
    (_USER, _AGAIN),
    (_SYSTEM, _SYSTEM, _USER, _ASSISTANT, _ASSISTANT, _AGAIN),
    (_SYSTEM, _USER, _ASSISTANT, _SYSTEM, _AGAIN),
]


def _jinja(real: RealTemplate, conversation) -> str | None:
    """The run's render as Ollama must write it: the BOS llama.cpp adds left out; None where it refuses."""
    if real.refuses_system and any(message["role"] == "system" for message in conversation):
        return None
    text = render_chat_template(real.text, list(conversation), real.bos, real.eos)
    if real.add_bos:
        assert text.startswith(real.bos)
        text = text[len(real.bos) :]
    return text


# ----------------------------------------------------------------------------- Python: always run


@pytest.mark.parametrize("real", REAL, ids=lambda real: real.file)
def test_each_real_template_gets_the_format_it_renders_as_and_its_stops(real):
    found = real.found()
    assert found.format == real.format, found.why
    assert found.stops == list(real.stops)
    assert (found.template is not None) == (real.format is not None)


def test_smollm2s_default_system_prompt_is_written_only_where_the_conversation_has_none():
    found = REAL[0].found()
    default = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert found.system == SystemTurn(default=default) and "default system prompt" in found.why
    without, with_one = (CHATML.render(list(PROBES[i]), found.system) for i in (0, 1))
    assert without.startswith(f"<|im_start|>system\n{default}<|im_end|>\n")
    assert default not in with_one and with_one.count("You answer in one sentence.") == 1  # once, not twice


def test_llama_31s_date_lines_head_every_system_turn_and_llama_32s_date_of_today_gives_no_template():
    llama31 = next(real for real in REAL if real.file.startswith("llama-3.1")).found()
    lines = "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
    assert (
        llama31.system == SystemTurn(default=lines, prefix=lines)
        and "head of every system turn" in llama31.why
    )
    assert llama31.template.count(lines) == 2  # the system turn it adds, and before the conversation's own
    llama32 = next(real for real in REAL if real.file.startswith("llama-3.2")).found()
    assert llama32.template is None and "strftime_now" in llama32.why


def test_a_template_the_gguf_adds_bos_to_but_that_writes_none_gets_no_template():
    qwen3 = REAL[1].text
    found = ollama_template(qwen3, "<|im_end|>", "<|endoftext|>", add_bos=True)
    assert found.template is None and "adds BOS" in found.why


def test_where_the_gguf_adds_no_bos_the_template_writes_the_bos_text_the_chat_template_writes():
    llama3 = next(real for real in REAL if real.file.startswith("llama-3-8b"))
    found = ollama_template(llama3.text, llama3.eos, llama3.bos, add_bos=False)
    assert found.format == "Llama 3" and found.template.startswith("<|begin_of_text|>{{- range")
    assert "the GGUF adds none" in found.why


def test_a_template_that_matches_no_format_gets_no_template_and_says_why():
    found = ollama_template("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}", "</s>")
    assert found.template is None and found.stops == ["</s>"]
    assert "renders as none of ChatML, Llama 3, Gemma, Mistral" in found.why
    v1 = REAL[-1].found()
    assert "nearest, Mistral (tekken [INST])" in v1.why and "' What is the capital" in v1.why
    assert ollama_template(None, "</s>").why == "the run has no chat template"


def test_the_modelfile_carries_the_template_its_reason_and_the_stops():
    real = REAL[0]
    text = modelfile("m.gguf", real.text, real.eos, bos_token=real.bos, add_bos=real.add_bos)
    found = real.found()
    assert text.startswith("FROM ./m.gguf\n# the chat template: ChatML with its default system prompt")
    assert text.split('TEMPLATE """', 1)[1].split('"""', 1)[0] == found.template  # as Ollama unquotes it
    assert text.endswith('"""\nPARAMETER stop "<|im_end|>"\n')
    none = modelfile("m.gguf", REAL[-1].text, "</s>", bos_token="<s>", add_bos=True)
    assert "TEMPLATE" not in none and none.splitlines()[1].startswith(
        "# the chat template: the GGUF file's own"
    )
    assert none.endswith('PARAMETER stop "</s>"\n') and len(none.splitlines()) == 3


def test_collate_keeps_system_messages_and_merges_consecutive_ones_of_a_role():
    system, messages = collate([_SYSTEM, _SYSTEM, _USER, _USER, {"role": "tool", "content": "a"}])
    assert system == _SYSTEM["content"] + "\n\n" + _SYSTEM["content"]
    assert [m["role"] for m in messages] == ["system", "user", "tool"]
    assert messages[1]["content"] == _USER["content"] + "\n\n" + _USER["content"]
    tools = collate([{"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}])[1]
    assert len(tools) == 2  # tool results keep their own messages


# ----------------------------------------------------------------------------- Go's text/template


@pytest.fixture(scope="session")
def go_render(tmp_path_factory):
    """``render(template, messages)``: Ollama's prompt for a conversation, from Go's text/template; the
    program is built once a session."""
    go = shutil.which("go")
    if go is None:
        pytest.skip("Go's text/template checks the TEMPLATE: apt-get install golang-go")
    folder = tmp_path_factory.mktemp("ollama-render")
    binary = folder / "ollama-render"
    env = {**os.environ, "GOPROXY": "off", "GOTOOLCHAIN": "local", "GOFLAGS": "", "GO111MODULE": "on"}
    env.setdefault("GOCACHE", str(folder / "go-cache"))
    built = subprocess.run(
        [go, "build", "-o", str(binary), RENDERER.name],
        cwd=RENDERER.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr

    def render(template: str, messages) -> str:
        request = json.dumps({"template": template, "messages": list(messages)}).encode()
        done = subprocess.run([str(binary)], input=request, capture_output=True, timeout=60)
        assert done.returncode == 0, done.stderr.decode()
        return done.stdout.decode("utf-8")  # bytes: no newline translation

    return render


@pytest.mark.parametrize("real", WITH_A_TEMPLATE, ids=lambda real: real.file)
def test_go_renders_the_template_as_the_runs_chat_template_does(real, go_render):
    found = real.found()
    compared = 0
    for conversation in CONVERSATIONS:
        expected = _jinja(real, conversation)
        if expected is None:
            continue
        assert go_render(found.template, conversation) == expected, conversation
        compared += 1
    assert compared >= 3  # Gemma 2 refuses the conversations with a system message


@pytest.mark.parametrize("real", WITH_A_TEMPLATE, ids=lambda real: real.file)
def test_the_python_renderer_is_what_go_writes_under_ollamas_collate(real, go_render):
    """The renderer detection compares with is the Go template's, on what only Ollama's collate reaches too
    (consecutive messages of one role, two system messages) and where the run's template refuses a system
    message (Gemma 2)."""
    found = real.found()
    fmt = next(fmt for fmt in FORMATS if fmt.name == found.format)
    assert fmt.go_template(found.system, found.leading) == found.template
    for conversation in [*CONVERSATIONS, *COLLATED]:
        expected = fmt.render(list(conversation), found.system, found.leading)
        assert go_render(found.template, conversation) == expected, conversation


def test_a_system_text_go_would_read_as_an_action_is_written_as_a_go_string(go_render):
    system = SystemTurn(default='Say "{{ hi }}"\tthen\\stop """ here', prefix="Note {{: ")
    template = CHATML.go_template(system)
    assert '"""' not in template  # a Modelfile quotes the TEMPLATE in """
    for conversation in CONVERSATIONS:
        assert go_render(template, conversation) == CHATML.render(list(conversation), system)
