"""Chat templates and a tool-calling conversation for the tests of chat rows, and a model with another template."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

# A chat template for tool use, in the shape of Qwen2.5's and Llama 3.1's: each tool and each call's arguments as JSON.
TOOL_TEMPLATE = (
    "{% if tools %}[tools]{% for tool in tools %}{{ tool | tojson }};{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% for call in m.tool_calls or [] %}<call {{ call.id }}>{{ call.function.name }} "
    "{{ call.function.arguments | tojson }}</call>{% endfor %}"
    "{% if m.tool_call_id %}<for {{ m.tool_call_id }}>{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
# A user's question, the assistant's call (its content null, as OpenAI's API gives it) and the tool's answer.
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
]


def with_chat_template(model: Path, template: str, directory: Path) -> Path:
    """``directory``: the model ``model`` (its files linked) with its tokenizer's chat template ``template``."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(directory)
    for path in model.iterdir():
        if not (directory / path.name).exists():
            (directory / path.name).symlink_to(path)
    return directory
