"""OpenAI Batch output lines from a job's result rows: ``{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}``, one a request, in input order, ``body`` a ``chat.completion`` or
``text_completion`` object (an error object with status 400 for a bad line).

The job keeps its resumable Arrow partial output as for any input; this renders the assembled rows when the
finished output is put in place (:meth:`batchgen.io.partial_output.PartialOutput.finalize`).
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchgen.errors import BatchgenError
from batchgen.io.openai_batch import OpenAIBatchInput
from batchgen.io.openai_fields import CHAT_URL
from batchgen.io.openai_order import requests_in_input_order
from batchgen.io.row_ids import NO_ID, id_text
from batchgen.io.token_bytes import token_bytes
from batchgen.io.writer import json_line

_FIELD = re.compile(r"field '([^']*)'")


def wants_openai_output(output_format: str, openai: OpenAIBatchInput | None, out: Path) -> bool:
    """Whether ``out`` gets OpenAI Batch output lines: ``openai``, or ``auto`` for an OpenAI Batch input and a
    ``.jsonl`` output.

    Raises:
        BatchgenError: ``openai`` for an output that is not ``.jsonl``, or for an input that is not OpenAI Batch.
    """
    if output_format == "openai":
        if openai is None:  # first: the input decides whether the option fits at all, the suffix only how
            raise BatchgenError("--output-format openai needs an OpenAI Batch input (lines of custom_id, url, body)")
        if out.suffix.lower() != ".jsonl":
            raise BatchgenError(f"--output-format openai writes JSON Lines: give --out a .jsonl path, not {out}")
        return True
    return output_format == "auto" and openai is not None and out.suffix.lower() == ".jsonl"


def openai_output(
    dataset: Path, openai: OpenAIBatchInput | None, lines: bool, model: str, tokenizer: Any, run_seed: int
) -> OpenAIOutput | None:
    """For an OpenAI Batch input: note the loaded ``model`` (:meth:`OpenAIBatchInput.expect_model`) and, when the
    output gets OpenAI Batch ``lines`` (:func:`wants_openai_output`), the renderer of its lines; else ``None``."""
    if openai is None:
        return None
    openai.expect_model(model)
    return OpenAIOutput(dataset, openai, model, tokenizer, run_seed) if lines else None


@dataclass
class OpenAIOutput:
    """Renders the assembled Arrow IPC output of an OpenAI Batch input as OpenAI Batch output lines.

    Attributes:
        dataset: the input file (read again for the input order of the ids).
        openai: the input's OpenAI side (its endpoint).
        model: the model name the bodies report (``--model`` as given: what ran, whatever ``body.model`` said).
        tokenizer: the engine's tokenizer for token strings (``None``: ``token_id:N``, as vLLM writes ids).
        run_seed: the run's seed; the line, request and completion ids are digests of it and the row's id, so a
            resumed run writes the ids an uninterrupted one would.
    """

    dataset: Path
    openai: OpenAIBatchInput
    model: str
    tokenizer: Any
    run_seed: int
    _tokens: dict[int, str] = field(default_factory=dict)
    _anchor: tuple[int, str] | None = None

    def render(self, assembled: Path, out: Path) -> None:
        """Write the OpenAI Batch lines of the rows of ``assembled`` (an Arrow IPC file of result rows) to ``out``:
        one line per input row (its ``n`` samples are its ``choices``), in input order; rows whose id the input
        no longer has go last.

        Raises:
            OSError: ``out`` cannot be written.
            pyarrow.ArrowException: ``assembled`` cannot be read.
        """
        table = pa.ipc.open_file(pa.memory_map(str(assembled))).read_all()
        created = int(time.time())
        seen: dict[str, int] = {}
        with out.open("w", encoding="utf-8") as f:
            for rows in requests_in_input_order(table, self.dataset):
                rid = rows[0]["id"]
                seen[rid] = seen.get(rid, -1) + 1
                f.write(json_line(self.line(rows, seen[rid], created)))

    def line(self, rows: list[dict[str, Any]], ordinal: int, created: int) -> dict[str, Any]:
        """The output line of one request: its result rows (its samples, by ``sample_index``, or one error row);
        ``ordinal`` counts earlier lines with the same id (a duplicate id's error line)."""
        first = rows[0]
        digest = hashlib.sha256(f"{self.run_seed}\0{first['id']}\0{ordinal}".encode("utf-8", "surrogatepass"))
        hexes = digest.hexdigest()
        custom_id = first.get("custom_id")
        if custom_id is None:  # a line whose custom_id is not a string: echoed as given
            custom_id = self.openai.given_ids.get(first["id"])
        line: dict[str, Any] = {"id": f"batch_req_{hexes[:32]}", "custom_id": custom_id}
        failure = None
        if first["finish_reason"] == "error":
            error = first["error"] or ""
            param = _FIELD.search(error)
            body: dict[str, Any] = {
                "error": {
                    "message": error,
                    "type": "invalid_request_error",
                    "param": param[1] if param else None,
                    "code": None,
                }
            }
            status = 400
            # Also in the line's error, where vLLM's run-batch writes it, so a pipeline checking either finds it.
            failure = {"code": "invalid_request_error", "message": error}
        else:
            body, status = self.completion(rows, hexes[32:], created), 200
        line["response"] = {"status_code": status, "request_id": f"req_{hexes[32:64]}", "body": body}
        line["error"] = failure
        return line

    def completion(self, rows: list[dict[str, Any]], hexes: str, created: int) -> dict[str, Any]:
        """The ``chat.completion`` / ``text_completion`` object of a request's samples ``rows``."""
        chat = self.openai.url == CHAT_URL
        choices = []
        for row in rows:
            choice: dict[str, Any] = {"index": row["sample_index"]}
            text = row["text"] if row["text"] is not None else ""
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
                choice["logprobs"] = self._chat_logprobs(row)
            else:
                choice["text"] = text
                choice["logprobs"] = self._completion_logprobs(row)
            choice["finish_reason"] = row["finish_reason"]
            choice["stop_reason"] = self._stop_reason(row)
            choices.append(choice)
        prompt_tokens = rows[0]["prompt_tokens"]
        completion_tokens = sum(row["completion_tokens"] for row in rows)
        return {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{hexes}",
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": self.model,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    def _stop_reason(self, row: dict[str, Any]) -> int | str | None:
        """vLLM's ``stop_reason`` of a choice: the stop string that ended it, the stop token id (an int), or
        ``None`` for the tokenizer's EOS token or a row that did not stop. A row's ``matched_stop`` is text either
        way: a token stop is the one whose id ends ``output_token_ids`` (a stop string is the text of tokens before
        it, which ends with that string)."""
        matched, ids = row["matched_stop"], row["output_token_ids"] or []
        if row["finish_reason"] != "stop" or matched is None:
            return None
        if ids and matched == str(ids[-1]):
            eos = getattr(self.tokenizer, "eos_token_id", None)
            return None if ids[-1] == eos else ids[-1]
        return matched

    def token(self, token_id: int) -> str:
        """A token's text as OpenAI reports it, special tokens included: what it adds to a text after another token
        (so a SentencePiece token keeps the leading space that decoding it alone drops, and the tokens of a reply
        join to its text); a token holding part of a character reads U+FFFD, as in vLLM (its chat ``bytes`` are its
        own: :func:`~batchgen.io.token_bytes.token_bytes`)."""
        text = self._tokens.get(token_id)
        if text is None:
            if self.tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                if self._anchor is None:  # the token decoded before each one: the last of "a"'s
                    anchor_id = int(self.tokenizer.encode("a", add_special_tokens=False)[-1])
                    self._anchor = (anchor_id, self._decode(anchor_id))
                anchor_id, anchor = self._anchor
                pair = self._decode(anchor_id, token_id)
                text = pair[len(anchor) :] if pair.startswith(anchor) else self._decode(token_id)
            self._tokens[token_id] = text
        return text

    def _decode(self, *ids: int) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False))

    def _chat_logprobs(self, row: dict[str, Any]) -> dict[str, Any] | None:
        """``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`` (OpenAI's chat shape), or ``None``
        when the request did not ask for logprobs."""
        if row["output_logprobs"] is None:
            return None
        tops = row["top_logprobs"] or [[] for _ in row["output_token_ids"]]
        content = []
        for token_id, logprob, top in zip(row["output_token_ids"], row["output_logprobs"], tops):
            entry = self._chat_token(token_id, logprob)
            entry["top_logprobs"] = [self._chat_token(t["id"], t["logprob"]) for t in top]
            content.append(entry)
        return {"content": content}

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token(token_id)
        return {"token": text, "logprob": logprob, "bytes": token_bytes(self.tokenizer, token_id, text)}

    def _completion_logprobs(self, row: dict[str, Any]) -> dict[str, Any] | None:
        """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` (OpenAI's completions shape; each
        offset where the token's string starts in the joined ``tokens``, as vLLM computes it), or ``None`` when not
        asked for. Each step's
        ``top_logprobs`` holds the chosen token and then the N most likely: up to N + 1 entries, the chosen one
        alone for ``logprobs: 0`` (OpenAI's API reference: "the API will always return the logprob of the sampled
        token, so there may be up to logprobs+1 elements"; vLLM's completions do the same)."""
        if row["output_logprobs"] is None:
            return None
        tokens = [self.token(t) for t in row["output_token_ids"]]
        offsets, offset = [], 0
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        logprobs = row["output_logprobs"]
        tops = row["top_logprobs"] or [[] for _ in tokens]
        steps = []
        for token, logprob, top in zip(tokens, logprobs, tops):
            step = {token: logprob}
            for t in top:  # two ids of one text: the likelier one's logprob (the chosen one's first)
                step.setdefault(self.token(t["id"]), t["logprob"])
            steps.append(step)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": steps, "text_offset": offsets}


def result_fields(line: dict[str, Any]) -> dict[str, Any]:
    """The ``id``, ``sample_index`` and ``finish_reason`` (``error`` or not) ``batchgen status`` counts a JSONL
    output line by: an OpenAI Batch output line's (one request, by its ``custom_id``), else the line itself."""
    response = line.get("response")
    # A batchgen row has its own finish_reason, and may pass a custom_id and a response of its input through.
    if "custom_id" not in line or not isinstance(response, dict) or "finish_reason" in line:
        return line
    failed = response.get("status_code") != 200 or line.get("error") is not None
    custom_id = line["custom_id"]
    # A custom_id echoed as given (5, "", 4.0) is its error row's id's value (error_row_id): "5", '""', "4".
    rid = NO_ID if custom_id is None else id_text(custom_id)
    return {"id": rid, "sample_index": 0, "finish_reason": "error" if failed else "done"}
