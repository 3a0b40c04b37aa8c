"""The option model: every option declared on EngineOptions, SamplingParams (the run's defaults) and JobOptions is
a flag of the commands that take its object, with its help and default, and a ``--config`` key; flags and config
values reach the built objects. Walks the declarations, so an option added there is covered here."""

from __future__ import annotations

import json
import re
from dataclasses import Field, fields
from pathlib import Path
from types import NoneType, UnionType
from typing import Any, get_args, get_origin, get_type_hints

import pytest
import typer
import yaml
from typer.testing import CliRunner

from batchgen.api.options import OPTION_CLASSES, declared_options
from batchgen.cli.app import app
from batchgen.cli.bench import BENCH_ENGINE_OPTIONS, ONE_BATCH_ENGINE_OPTIONS
from batchgen.cli.config import load_config
from batchgen.cli.options import with_options
from batchgen.io.input_options import InputOptions
from batchgen.job.options import JobOptions
from batchgen.loop.options import EngineOptions
from batchgen.sampling.sampling_params import SamplingParams

COMMANDS = typer.main.get_command(app).commands  # type: ignore[attr-defined]


def _flag(field: Field[Any]) -> str:
    return "--" + field.name.replace("_", "-")


def _cli_default(field: Field[Any]) -> Any:
    return list(field.default) if isinstance(field.default, tuple) else field.default


@pytest.mark.parametrize("cls", OPTION_CLASSES, ids=lambda cls: cls.__name__)
def test_every_declared_option_is_a_flag_of_run_with_its_help_and_default(cls: type) -> None:
    params = {param.name: param for param in COMMANDS["run"].params}
    declared = declared_options(cls)
    assert declared
    for field in declared:
        param = params[field.name]
        assert _flag(field) in param.opts, field.name
        assert param.help and param.help == field.metadata["help"], field.name
        assert param.default == _cli_default(field), field.name
        assert not param.required, field.name


@pytest.mark.parametrize(
    ("command", "names"), [("bench", BENCH_ENGINE_OPTIONS), ("bench-one-batch", ONE_BATCH_ENGINE_OPTIONS)]
)
def test_the_benchmarks_take_engine_options_as_run_does_with_a_model_required(
    command: str, names: tuple[str, ...]
) -> None:
    params = {param.name: param for param in COMMANDS[command].params}
    run_params = {param.name: param for param in COMMANDS["run"].params}
    for name in names:
        param, in_run = params[name], run_params[name]
        assert (param.opts, param.secondary_opts, param.help) == (in_run.opts, in_run.secondary_opts, in_run.help)
        assert param.required == (name == "model")
        if name != "model":
            assert param.default == in_run.default, name


def _other_value(field: Field[Any], annotation: Any) -> Any:
    """A value of the field's type that is not its default (the objects are built unchecked, so any will do)."""
    if isinstance(annotation, UnionType):
        annotation = next(a for a in get_args(annotation) if a is not NoneType)
    if get_origin(annotation) is tuple:
        return ("a", "b") if get_args(annotation)[0] is str else (3, 5)
    if get_origin(annotation) is dict:
        return {"enable_thinking": False}
    default = field.default
    if annotation is bool:
        return not default
    if annotation is int:
        return (default or 0) + 3
    if annotation is float:
        return (default or 0.0) + 0.25
    assert annotation is str, (field.name, annotation)
    texts = {"json_schema": '{"type": "string"}', "choice": '["a", "b"]'}  # what the constraint checks take
    return texts.get(field.name, f"{default}-other")


def _probe_app(built: dict[str, Any]) -> typer.Typer:
    """A command taking all four objects and a ``--config``, as ``run`` does; it keeps what it was given."""

    @with_options()
    def probe(
        config: Path | None = typer.Option(None, is_eager=True, callback=load_config),
        *,
        options: EngineOptions,
        defaults: SamplingParams,
        job: JobOptions,
        columns: InputOptions,
    ) -> None:
        built.update({EngineOptions: options, SamplingParams: defaults, JobOptions: job, InputOptions: columns})

    probe_app = typer.Typer()
    probe_app.command()(probe)
    return probe_app


def _wanted() -> dict[type, dict[str, Any]]:
    return {
        cls: {f.name: _other_value(f, get_type_hints(cls)[f.name]) for f in declared_options(cls)}
        for cls in OPTION_CLASSES
    }


def test_a_config_file_sets_every_declared_option(tmp_path: Path) -> None:
    wanted = _wanted()
    config = tmp_path / "c.yaml"
    keys = {name.replace("_", "-"): value for values in wanted.values() for name, value in values.items()}
    config.write_text(yaml.safe_dump({k: list(v) if isinstance(v, tuple) else v for k, v in keys.items()}))
    built: dict[str, Any] = {}
    result = CliRunner().invoke(_probe_app(built), ["--config", str(config)])
    assert result.exit_code == 0, result.output
    for cls, values in wanted.items():
        assert {name: getattr(built[cls], name) for name in values} == values, cls.__name__


def test_flags_set_every_declared_option_and_the_rest_keep_their_defaults() -> None:
    wanted = _wanted()
    argv: list[str] = []
    for cls, values in wanted.items():
        declared = {f.name: f for f in declared_options(cls)}
        for name, value in values.items():
            if isinstance(value, bool):  # the flag that gives this value: --x, --no-x or --disable-x
                flag = declared[name].metadata.get("flag", f"{_flag(declared[name])}/--no-{_flag(declared[name])[2:]}")
                on, _, off = flag.partition("/")
                argv.append(on if value else off)
            else:
                for item in value if isinstance(value, tuple) else [value]:
                    argv += [_flag(declared[name]), json.dumps(item) if isinstance(item, dict) else str(item)]
    built: dict[str, Any] = {}
    result = CliRunner().invoke(_probe_app(built), argv)
    assert result.exit_code == 0, result.output
    for cls, values in wanted.items():
        assert {name: getattr(built[cls], name) for name in values} == values, cls.__name__
        undeclared = [f for f in fields(cls) if "help" not in f.metadata]
        assert all(getattr(built[cls], f.name) == f.default for f in undeclared), cls.__name__


@pytest.mark.parametrize(
    ("given", "expected"), [("true", 0), ("false", None), ("3", 3), ("0", 0), ("yes", 0), ("off", None), ("'3'", 3)]
)
def test_prompt_logprobs_takes_true_false_or_a_count_from_a_flag_a_config_file_and_a_keyword(
    tmp_path: Path, given: str, expected: int | None
) -> None:
    """Found by a user: a row's ``prompt_logprobs: true`` worked (input-output.md: "``true`` or a count N ≥ 0") but
    the flag, a config file and ``generate``'s keyword refused ``true``, as integer options. ``true`` is 0 (the
    prompt's own logprobs, no other tokens), ``false`` off, as on a row."""
    from batchgen.api.config_file import config_options
    from batchgen.api.options import options_of
    from batchgen.sampling.row_fields import make_sampling_params

    row_value = yaml.safe_load(given)  # what a YAML value, a JSONL row's field, holds: text stays text in a row
    if not isinstance(row_value, str):
        assert make_sampling_params(SamplingParams(), {"prompt_logprobs": row_value}, 100).prompt_logprobs == expected
        assert options_of(SamplingParams, {"prompt_logprobs": row_value}).prompt_logprobs == expected
    built: dict[str, Any] = {}
    result = CliRunner().invoke(_probe_app(built), ["--prompt-logprobs", given.strip("'")])
    assert result.exit_code == 0, result.output
    assert built[SamplingParams].prompt_logprobs == expected
    config = tmp_path / "c.yaml"
    config.write_text(f"prompt-logprobs: {given}\n")
    built.clear()
    result = CliRunner().invoke(_probe_app(built), ["--config", str(config)])
    assert result.exit_code == 0, result.output
    assert built[SamplingParams].prompt_logprobs == expected
    assert config_options(config)["prompt_logprobs"] == expected  # batchgen.run(config=...)


def test_prompt_logprobs_refuses_other_values_with_one_message_everywhere(tmp_path: Path) -> None:
    from batchgen.api.config_file import config_options
    from batchgen.api.options import options_of
    from batchgen.errors import BatchgenError

    message = 'must be true, false or a count of top logprobs, got "maybe"'
    result = CliRunner().invoke(_probe_app({}), ["--prompt-logprobs", "maybe"])  # click's box wraps the message
    assert result.exit_code == 2 and "must be true, false or a count" in result.output
    config = tmp_path / "c.yaml"
    config.write_text("prompt-logprobs: maybe\n")
    with pytest.raises(BatchgenError, match=f"^{config}: option 'prompt-logprobs': {message}$"):
        config_options(config)
    with pytest.raises(BatchgenError, match=f"^--prompt-logprobs: {message}$"):
        options_of(SamplingParams, {"prompt_logprobs": "maybe"})


@pytest.mark.parametrize(
    ("given", "expected"),
    [("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16"), (None, "auto"), ("yes", "yes")],
)
def test_dtype_takes_vllms_names_and_torch_dtypes(given: str | None, expected: str) -> None:
    """vLLM's ``--dtype half`` and ``float`` (found by an lm-eval user: refused), HF's ``torch_dtype=torch.bfloat16``;
    ``None`` is the default (a review found it refused once the option declared a parse); a flag's ``yes`` stays
    text (validate's to refuse by name), not a switch."""
    import torch

    from batchgen.api.config_file import parsed_text
    from batchgen.api.options import options_of

    assert options_of(EngineOptions, {"dtype": given}).dtype == expected
    assert options_of(EngineOptions, {"dtype": torch.bfloat16}).dtype == "bfloat16"
    if given is not None:
        (dtype,) = [f for f in fields(EngineOptions) if f.name == "dtype"]
        assert parsed_text(dtype, given) == expected


def test_chat_template_kwargs_run_level_value() -> None:
    """An object naming nothing asks for nothing (a review found ``{}`` recorded, so that a resume without the flag
    was refused); a value that is no JSON value is refused where the option is read (it crashed the run's metadata
    write); a row keeps its nulls, which take a run's argument away."""
    import datetime

    from batchgen.errors import FieldError
    from batchgen.io.input_options import chat_template_kwargs, template_arguments

    assert chat_template_kwargs({}) is None and chat_template_kwargs('{"a": null}') is None
    assert chat_template_kwargs({"a": 1, "b": None}) == {"a": 1}
    assert template_arguments({"a": None}) == {"a": None}
    with pytest.raises(FieldError, match="must hold JSON values only"):
        chat_template_kwargs({"day": datetime.date(2026, 12, 7)})


def test_a_schema_is_one_text_given_as_an_object_or_as_json_text() -> None:
    """``--json-schema`` from a config file (an object) and from a flag (its JSON text, any whitespace) record one
    text, which a resume compares; key order is kept (the order the model writes the properties in)."""
    from batchgen.api.options import options_of

    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    as_object = options_of(SamplingParams, {"json_schema": schema}).json_schema
    as_text = options_of(SamplingParams, {"json_schema": json.dumps(schema, indent=2)}).json_schema
    assert as_object == as_text == json.dumps(schema)


@pytest.mark.parametrize(
    ("key", "hint"),
    [
        ("guided_json", "did you mean 'json-schema'?"),
        ("stop-strings", "did you mean 'stop'?"),
        ("num_beams", "batchgen has no such option"),
        ("max_model_len", "did you mean 'context-length'?"),
    ],
)
def test_a_config_file_key_of_another_engine_is_named_as_a_keyword_is(key: str, hint: str, tmp_path: Path) -> None:
    """Found by a review: a config file's ``guided_json`` got no hint and ``stop-strings`` was pointed at
    ``stop-token-ids``, where a flag or a keyword of that name is pointed at batchgen's own."""
    from batchgen.api.config_file import OPTION_HINTS, read_config
    from batchgen.errors import BatchgenError

    config = tmp_path / "c.yaml"
    config.write_text(f"{key}: 1\n")
    with pytest.raises(BatchgenError, match=re.escape(f"{config}: unknown option '{key}' ({hint})") + "$"):
        read_config(config, set(OPTION_HINTS))


@pytest.mark.parametrize("name", ["tools", "continue_final_message", "add_generation_prompt"])
def test_chat_arguments_as_keywords_say_where_batchgen_takes_them(name: str) -> None:
    """vLLM's LLM.chat(messages, tools=..., continue_final_message=...) applies to every conversation; batchgen
    reads a row's own (found by helpers: a bare TypeError)."""
    from batchgen.api.options import OPTION_CLASSES, check_option_names

    with pytest.raises(TypeError) as raised:
        check_option_names({name: True}, OPTION_CLASSES, "generate")
    assert (
        str(raised.value)
        == f"generate() got an unexpected keyword argument '{name}' (give it in each row, by its messages)"
    )
