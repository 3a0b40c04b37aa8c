"""Warn about pass-through fields that look like sampling fields, so that a row written for another engine is not
silently half-understood, and about fields that pass through as JSON text, so that their new type is no surprise."""

from __future__ import annotations

import difflib
import functools
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchgen.io.input_options import InputOptions
from batchgen.io.input_row import FieldPlace
from batchgen.io.openai_fields import CHAT_URL
from batchgen.io.passthrough import TOOLS_FIELD
from batchgen.io.reader import RowReader
from batchgen.io.writer import OUTPUT_COLUMNS, is_json_text
from batchgen.sampling.row_fields import SAMPLING_FIELD_ALIASES, SAMPLING_FIELDS

# Names other engines (HF generate, vLLM, SGLang, OpenAI, TGI) use for sampling fields → batchgen's field, or None
# where batchgen has none; a row written for another engine is then told what it lost rather than run differently.
_FOREIGN_SAMPLING_NAMES: dict[str, str | None] = {
    "stop_sequences": "stop",
    "num_return_sequences": "n",
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_grammar": "ebnf",
    "guided_choice": "choice",
    "return_logprob": "logprobs",
    "top_logprobs_num": "top_logprobs",
    "top_n_tokens": "top_logprobs",
    "stop_strings": "stop",
    "eos_token_id": "stop_token_ids",
    "logprob_start_len": "prompt_logprobs_from",
    "no_stop_trim": "include_stop_str_in_output",
    "output_scores": "logprobs",
    **dict.fromkeys(
        (
            "best_of",
            "use_beam_search",
            "num_beams",
            "length_penalty",
            "early_stopping",
            "typical_p",
            "epsilon_cutoff",
            "eta_cutoff",
            "no_repeat_ngram_size",
            "detokenize",
            "spaces_between_special_tokens",
            "bad_words_ids",
            "logits_processors",
            "renormalize_logits",
            "return_text_in_logprobs",
        )
    ),
}
# Names whose meaning batchgen gives another way: what to write instead.
_FOREIGN_SAMPLING_NOTES = {
    "do_sample": "batchgen samples unless 'temperature' is 0: give temperature 0 for HF's do_sample false",
    "max_length": "HF's max_length counts the prompt too: give 'max_new_tokens', the tokens to generate",
    "min_length": "HF's min_length counts the prompt too: give 'min_new_tokens', the fewest tokens to generate",
    "sampling_params": "batchgen reads each sampling field at the top level of a row, not nested",
    # OpenAI's {"type": "json_schema", "json_schema": {"schema": ...}}: a batchgen row gives the schema itself.
    "response_format": "a batchgen row gives its schema itself as 'json_schema' (an OpenAI Batch line's body takes "
    "response_format)",
    "structured_outputs": "give 'json_schema', 'regex', 'ebnf' or 'choice' at the top level of a row",
    "guided_decoding": "give 'json_schema', 'regex', 'ebnf' or 'choice' at the top level of a row",
    "pad_token_id": "batchgen pads nothing: give each row its own ids, unpadded, as 'prompt_token_ids'",
    "attention_mask": "batchgen pads nothing: give each row its own ids, unpadded, as 'prompt_token_ids'",
    "bos_token_id": "the tokenizer adds its BOS to a 'prompt'; 'prompt_token_ids' are taken as they are",
}


# The hint for another engine's option that batchgen lacks.
NO_SUCH_OPTION = "batchgen has no such option"
# Every sampling field and alias by its lower-cased name: 'Temperature' is a misspelt 'temperature'.
_SAMPLING_NAMES_FOLDED = {key.lower(): key for key in (*SAMPLING_FIELDS, *SAMPLING_FIELD_ALIASES)}
# The similarity (difflib's ratio) from which a field's name is a misspelt sampling field's: 'temprature' and
# 'topk' are (0.95, 0.89); data such as 'top', 'num_tokens' or 'seeded' (0.8 to 0.86) is not.
_NEAR_MISS = 0.88


def sampling_name_hint(name: str) -> tuple[str | None, str | None]:
    """What ``name``, no sampling field of batchgen's, was probably meant as: ``(field, None)`` for a sampling
    field's name in other letter case, another engine's name for one or a near miss of one (``_NEAR_MISS``; not
    batchgen's own output columns, as in an output read back); ``(None, note)`` with what to write instead where
    batchgen gives its meaning another way (HF's ``do_sample``), or :data:`NO_SUCH_OPTION` for another engine's
    option batchgen lacks (``num_beams``); ``(None, None)`` for a name that looks like none of these."""
    if name in _FOREIGN_SAMPLING_NOTES:
        return None, _FOREIGN_SAMPLING_NOTES[name]
    meant = _SAMPLING_NAMES_FOLDED.get(name.lower())
    if meant is None and name in _FOREIGN_SAMPLING_NAMES:
        meant = _FOREIGN_SAMPLING_NAMES[name]
        if meant is None:
            return None, NO_SUCH_OPTION
    if meant is None and name not in OUTPUT_COLUMNS.names:
        close = difflib.get_close_matches(name.lower(), sorted(_SAMPLING_NAMES_FOLDED), n=1, cutoff=_NEAR_MISS)
        # A plural or a suffixed name of one is data ('seeds', 'top_ks', 'temperature_c'), not a misspelling.
        rest = name.lower()[len(close[0]) :] if close and name.lower().startswith(close[0]) else None
        if close and rest != "s" and not (rest or "").startswith("_"):
            meant = _SAMPLING_NAMES_FOLDED[close[0]]
    return meant, None


@functools.cache  # asked for every field of every row the Python API is given
def foreign_field_warning(name: str) -> str | None:
    """Why pass-through field ``name`` is probably a mistake (``field 'temprature' is not a sampling field (did you
    mean 'temperature'?); it is passed through unused``), or ``None`` for a field that looks like no sampling field
    (:func:`sampling_name_hint`)."""
    meant, note = sampling_name_hint(name)
    if meant is not None:
        return f"field '{name}' is not a sampling field (did you mean '{meant}'?); it is passed through unused"
    if note == NO_SUCH_OPTION:
        return f"field '{name}' is not supported: {NO_SUCH_OPTION}; it is passed through unused"
    return None if note is None else f"field '{name}' is not read ({note}); it is passed through unused"


def warn_about_passthrough_names(
    path: Path, names: list[str], options: InputOptions, places: Mapping[str, FieldPlace] | None = None
) -> None:
    """Print one warning per pass-through field of the input file ``path`` that looks like a sampling field
    batchgen does not read (:func:`foreign_field_warning`), but for the columns the column ``options`` read (a
    template's ``{max_length}`` is used, not unused). A field of ``places`` (a JSON Lines dataset's) is named with
    its first row and how many rows have it, so that a few stray rows of a large file can be found."""
    used = set(options.columns())
    for name in names:
        warning = foreign_field_warning(name) if name not in used else None
        if warning is not None:
            where = places.get(name) if places is not None else None
            print(f"batchgen: warning: {where or path}: {warning}", file=sys.stderr)


def warn_about_sampling_columns(path: Path, options: InputOptions) -> None:
    """Print one warning per column the column ``options`` name that is also a sampling field (a ``seed`` or ``n``
    column in a template): each row's value is then read as that field too, and does not pass through."""
    for name in options.columns():
        if name in SAMPLING_FIELDS or name in SAMPLING_FIELD_ALIASES:
            print(
                f"batchgen: warning: {path}: column '{name}', named by the column options, is also the sampling field "
                f"'{name}': each row's value sets it (and is not passed through); rename the column if it is only data",
                file=sys.stderr,
            )


def warn_about_json_text_fields(path: Path, schema: pa.Schema) -> None:
    """Print one warning per pass-through field of the JSONL file ``path`` whose values share no one type, so that
    it passes through as JSON text (a string column)."""
    for field in schema:
        if is_json_text(field):
            print(
                f"batchgen: warning: {path}: field '{field.name}': no one type stores all its values unchanged, its "
                "objects are all empty, or they nest over 64 deep; it passes through as JSON text (a string column)",
                file=sys.stderr,
            )


def warn_about_fields(reader: RowReader, built_in_max: int | None, tokenizer: Any, columns_out: bool) -> None:
    """Print the warnings about the fields of ``reader``'s dataset a run gives: :func:`warn_about_passthrough_names`,
    :func:`warn_about_sampling_columns`, :func:`warn_about_json_text_fields` (``columns_out``: the output stores typed
    columns, Arrow or Parquet; a JSON Lines output holds the values themselves), :func:`warn_about_open_lines`
    (``built_in_max``: the run's built-in ``max_new_tokens`` where no option or generation_config.json set one),
    :func:`warn_about_unrendered_tools` (``tokenizer``: the model's, or ``None``)."""
    schema = reader.passthrough_schema
    chats = "messages" in reader.field_places or reader.mapping.messages_column is not None
    if TOOLS_FIELD in reader.field_places and chats:  # a dataset of prompts keeps its tools as data (xLAM's)
        warn_about_unrendered_tools(reader.field_places[TOOLS_FIELD], tokenizer)
    warn_about_passthrough_names(reader.path, schema.names, reader.options, reader.field_places)
    warn_about_sampling_columns(reader.path, reader.options)
    if columns_out:
        warn_about_json_text_fields(reader.path, schema)
    if reader.openai is not None and reader.openai.url is not None and built_in_max is not None:
        warn_about_open_lines(reader.path, reader.openai.url, reader.field_places, built_in_max)


def warn_about_open_lines(path: Path, url: str, places: Mapping[str, FieldPlace], built_in_max: int) -> None:
    """Print one warning where request lines of the OpenAI Batch file ``path`` (endpoint ``url``) give no
    ``max_tokens`` (nor ``max_completion_tokens``) and no option sets the run's: such a line stops at
    ``built_in_max`` tokens, where vLLM's run-batch runs a chat line to the end of the context and stops a
    completions line at 16 tokens (its ``CompletionRequest``'s default, OpenAI's), so that no answer is cut short or
    run long unannounced. ``places`` counts the rows of each field (each good line has its prompt field)."""
    chat = url == CHAT_URL
    prompt_rows = sum(places[name].rows for name in ("messages", "prompt", "prompt_token_ids") if name in places)
    bounded = sum(places[name].rows for name in ("max_tokens", "max_completion_tokens") if name in places)
    if prompt_rows > bounded:
        kind, vllm = ("chat", "runs them to the end of the context") if chat else ("completions", "stops them at 16")
        advice = "for longer answers" if chat else "(16 for vLLM's)"
        print(
            f"batchgen: warning: {path}: {prompt_rows - bounded} of {prompt_rows} {kind} request lines give no "
            f"max_tokens: each stops after {built_in_max} tokens (--max-new-tokens's default), where vllm run-batch "
            f"{vllm}; set --max-new-tokens {advice}",
            file=sys.stderr,
        )


def warn_about_unrendered_tools(place: FieldPlace, tokenizer: Any) -> None:
    """Print one warning where rows give ``tools`` (at ``place``) and no chat template of ``tokenizer`` mentions
    them: the template leaves them out of the prompt, as vLLM's and transformers' would, which a user who chose a
    model for tool use should hear (SmolLM2's template has no tools)."""
    templates = getattr(tokenizer, "chat_template", None)
    texts = templates.values() if isinstance(templates, dict) else [templates] if isinstance(templates, str) else []
    if texts and not any("tools" in text for text in texts):
        print(
            f"batchgen: warning: {place}: field 'tools': the model's chat template does not render tools, so they "
            "are not in these rows' prompts (as in vLLM); use a model whose template does",
            file=sys.stderr,
        )
