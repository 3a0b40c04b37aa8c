"""Map a dataset's own columns onto the fields batchgen reads (``prompt``, ``messages``, ``id``), as the
:class:`~batchgen.io.input_options.InputOptions` say, before a row is checked. The source columns stay in the row, so
they still pass through to the output (``question`` next to the answer)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from batchgen.errors import BatchgenError
from batchgen.io.input_options import InputOptions
from batchgen.io.passthrough import PROMPT_FIELDS

# ShareGPT's speakers → chat roles; another "from" is taken as the role itself.
_SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
# Read as chat messages when a dataset has no prompt field and no option says where the prompt is.
CONVERSATIONS = "conversations"
# A template field's !r, !s and !a, as str.format applies them.
_CONVERSIONS: dict[str, Callable[[Any], str]] = {"r": repr, "s": str, "a": ascii}
# An error message lists at most this many of the dataset's columns.
_COLUMNS_SHOWN = 8

# What mapping one row gives: its fields, the dataset column behind each batchgen field it set (for messages), and
# ``(column, message)`` when the row cannot be mapped.
Mapped = tuple[dict[str, Any], dict[str, str], tuple[str, str] | None]


class ColumnMapping:
    """The column options of one run, checked against the dataset's columns.

    Args:
        options: the run's input options (already validated).
        columns: the dataset's columns: those of all its shards' schemas, or every key of the JSONL rows.
        source: the dataset's name, for messages.

    Raises:
        BatchgenError: a column the options name is not among ``columns``; or the dataset has its own ``prompt``,
            ``messages``, ``prompt_token_ids`` (or ``id``) column, which an option would hide.
    """

    def __init__(self, options: InputOptions, columns: Collection[str], source: str) -> None:
        self.options = options
        self.messages_column = options.messages_column
        own = [name for name in PROMPT_FIELDS if name in columns]
        if not options.maps_prompt and not own and CONVERSATIONS in columns:
            self.messages_column = CONVERSATIONS
        for name in options.columns():
            if name not in columns:
                shown = ", ".join(f"'{c}'" for c in list(columns)[:_COLUMNS_SHOWN])
                more = f" and {len(columns) - _COLUMNS_SHOWN} more" if len(columns) > _COLUMNS_SHOWN else ""
                raise BatchgenError(f"{source}: {self._flag_of(name)}: no column '{name}' (it has {shown}{more})")
        used = set(options.columns())
        hidden = [name for name in own if name not in used] if options.maps_prompt else []
        if options.id_column not in (None, "id") and "id" in columns and "id" not in used:
            hidden.append("id")
        if hidden:
            raise BatchgenError(
                f"{source}: the dataset has its own '{hidden[0]}' column, which {self._flag_of(hidden[0])} would "
                f"replace; rename that column, or leave the option out to use it"
            )
        self.template = options.template_fields() if options.prompt_template is not None else None

    def _flag_of(self, column: str) -> str:
        """The flag that names ``column`` (or replaces the field ``column``); for ``conversations`` read as messages
        without one, what batchgen does instead."""
        o = self.options
        if column in (o.id_column, "id") and o.id_column is not None:
            return f"--id-column {o.id_column}"
        if o.prompt_column is not None:
            return f"--prompt-column {o.prompt_column}"
        if o.messages_column is not None:
            return f"--messages-column {o.messages_column}"
        if o.prompt_template is not None:
            return "--prompt-template"
        return f"reading '{column}' as the chat messages (the dataset has no prompt field)"

    @property
    def active(self) -> bool:
        """Whether rows are changed at all."""
        return self.options.maps_prompt or self.messages_column is not None or self.options.id_column is not None

    def apply(self, data: dict[str, Any]) -> Mapped:
        """Map one row (``data`` is not changed): ``prompt``, ``messages`` and ``id`` set from their columns."""
        if not self.active:
            return data, {}, None
        data, fields = dict(data), dict[str, str]()
        o = self.options
        for column, target in ((o.id_column, "id"), (o.prompt_column, "prompt"), (self.messages_column, "messages")):
            if column is None:
                continue
            value, fields[target] = data.get(column), column
            if value is None:
                return data, fields, (column, f"null or missing; {self._flag_of(column)} needs a value in every row")
            data[target] = value
            if target == "messages":
                data[target] = chat_messages(value)
                if data[target] == [] and value != []:
                    return data, fields, (column, "holds only assistant turns: there is nothing to answer")
        if self.template is not None:
            prompt, problem = self._fill(data)
            if problem is not None:
                return data, fields, problem
            data["prompt"] = prompt
        return data, fields, None

    def _fill(self, data: dict[str, Any]) -> tuple[str, tuple[str, str] | None]:
        """The template filled with the row's columns; or ``(column, why not)``."""
        assert self.template is not None
        parts = []
        for literal, column, spec, conversion in self.template:
            parts.append(literal)
            if column is None:
                continue
            value = data.get(column)
            if value is None:
                return "", (column, "null or missing; --prompt-template needs a value in every row")
            if conversion:
                value = _CONVERSIONS[conversion](value)
            try:
                parts.append(format(value, spec))
            except (ValueError, TypeError) as e:
                return "", (column, f"--prompt-template cannot format it with '{spec}': {e}")
        return "".join(parts), None


def chat_messages(value: Any) -> Any:
    """A messages column's value as chat messages: ShareGPT items (``{"from": "human", "value": ...}``) become
    ``{"role": "user", "content": ...}`` (``gpt`` → ``assistant``, ``system`` → ``system``, another speaker is
    its own role; an item's tool calls and other text keys stay), ``{role, content}`` items stay; trailing
    assistant turns are dropped, so that the model answers the last user turn. A value of another shape is returned
    unchanged, for :func:`batchgen.io.rows.parse_row` to reject."""
    if not isinstance(value, list):
        return value
    messages = []
    for item in value:
        if isinstance(item, dict) and item.get("role") is None and isinstance(item.get("from"), str):
            # Its tool calls and other text stay (tool_call_id, name: found by a helper); not a trainer's weight.
            rest = {
                key: part
                for key, part in item.items()
                if key not in ("from", "value", "role", "content") and (key == "tool_calls" or isinstance(part, str))
            }
            item = {"role": _SHAREGPT_ROLES.get(item["from"], item["from"]), "content": item.get("value"), **rest}
        messages.append(item)
    while messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
        messages.pop()
    return messages
