"""Load prompt files into :class:`PromptRecord` lists and tokenize them.

Supported sources: ``.parquet``, ``.jsonl``, ``.json`` (a list of objects) and a directory written by
Hugging Face ``datasets``' ``save_to_disk``. Rows are numbered from 0 in error messages (the index a
``datasets`` user would type); JSON-lines errors also give the 1-based line number an editor shows.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.config.errors import DataError, MissingPathError
from posttrain.data.fields import VERL_ANSWER_KEY, available_paths, get_path, has_path, is_verl_row
from posttrain.data.records import PromptRecord

log = logging.getLogger("posttrain")

_SUFFIXES = (".parquet", ".jsonl", ".json")
_OVERLONG_MODES = ("filter", "error")


# --------------------------------------------------------------------------- loading


def load_records(
    path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer"
) -> list[PromptRecord]:
    """Read every row of ``path`` into a :class:`PromptRecord`.

    ``prompt_key`` names the prompt field (a string or a list of ``{"role", "content"}`` messages);
    ``answer_key`` names the ground-truth field (string or number; null gives None). A row without it is a
    DataError unless ``answer_key`` is empty: ``data.answer_key=""`` says the reward needs no answers (every
    ground truth is then None). Either key may be a dotted path into nested fields
    (``reward_model.ground_truth``). With the default ``answer_key="answer"`` and a file in verl's layout
    that has no ``answer`` field, ``reward_model.ground_truth`` is used (and logged). All other top-level
    fields go to ``PromptRecord.extra`` (a nested answer's parent stays there too).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: unsupported format, or a malformed row (the message names file, row and field).
    """
    path = Path(path)
    if not path.exists():
        raise MissingPathError(f"prompt data file not found: {path}")
    rows = list(iter_rows(path))
    answer_key = _answer_key_for(path, rows, answer_key)
    records = [_row_to_record(row, where, path, prompt_key, answer_key) for where, row in rows]
    if not records:
        raise DataError(f"{path}: no rows found; a prompt data file needs at least one row")
    return records


def first_records(
    path: str | os.PathLike, prompt_key: str = "prompt", answer_key: str = "answer", rows: int = 8
) -> list[PromptRecord]:
    """The first ``rows`` records of a prompt file, read and checked as :func:`load_records` reads them all
    (`posttrain explain` checks the data keys with them without reading a large file whole)."""
    path = Path(path)
    if not path.exists():
        raise MissingPathError(f"prompt data file not found: {path}")
    head = list(itertools.islice(iter_rows(path), rows))
    answer_key = _answer_key_for(path, head, answer_key)
    return [_row_to_record(row, where, path, prompt_key, answer_key) for where, row in head]


def _answer_key_for(path: Path, rows: list[tuple[str, Any]], answer_key: str) -> str:
    """The default answer key, or verl's ``reward_model.ground_truth`` for a file in verl's layout."""
    if answer_key == "answer" and rows and is_verl_row(rows[0][1]) and "answer" not in rows[0][1]:
        _say_verl_layout(str(path))
        return VERL_ANSWER_KEY
    return answer_key


@functools.cache  # one line per file and process: the checks read a file's first rows, the run then all of them
def _say_verl_layout(path: str) -> None:
    """Say (a warning: the user sees it) that the answers come from another field than data.answer_key names."""
    log.warning("%s is in verl's layout: the answers are read from %s", path, VERL_ANSWER_KEY)


def iter_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """Yield ``(location, row)`` pairs of a .jsonl, .json or .parquet file or a saved dataset directory, checked as
    UTF-8; ``location`` is e.g. ``"row 3"`` or ``"row 3 (line 5)"``, for error messages."""
    if path.is_dir():
        yield from _iter_saved_dataset(path)
    elif path.suffix == ".jsonl":
        yield from _iter_jsonl(path)
    elif path.suffix == ".json":
        yield from _iter_json(path)
    elif path.suffix == ".parquet":
        yield from _iter_parquet(path)
    else:
        raise DataError(
            f"{path}: unsupported prompt file type {path.suffix!r}; use one of {', '.join(_SUFFIXES)} "
            "or a directory saved with datasets' save_to_disk"
        )


def _iter_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    row = 0
    with path.open(encoding="utf-8", errors="surrogateescape") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue  # blank lines (often a trailing newline) are not rows
            where = f"row {row} (line {line_no})"
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}: {where}: invalid JSON: {_json_problem(exc)}") from exc
            yield where, _check_utf8(value, f"{path}: {where}")
            row += 1


def _json_problem(exc: json.JSONDecodeError) -> str:
    """json's reason and column as one phrase: some reasons already end in "at" ("Invalid control character
    at"), so appending " at column N" read "at at column"."""
    reason = exc.msg.removesuffix(" at").rstrip(":")
    return f"{reason} (column {exc.colno})"


def _check_utf8(value: Any, where: str, field_name: str = "") -> Any:
    """``value`` unchanged; a DataError naming the field when a string in it held bytes that are not UTF-8.

    The file is decoded with ``surrogateescape``, so a bad byte survives JSON parsing as a lone surrogate
    and can be traced to its field instead of failing the whole file at an anonymous byte offset.
    """
    if isinstance(value, str):
        bad = next((i for i, ch in enumerate(value) if "\udc80" <= ch <= "\udcff"), None)
        if bad is not None:
            raise DataError(
                f"{where}: field {field_name or '(key)'!r} is not valid UTF-8 (byte 0x{ord(value[bad]) - 0xDC00:02x} "
                f"at character {bad}); re-save the file as UTF-8"
            )
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_utf8(key, where, field_name or str(key))
            _check_utf8(item, where, field_name or str(key))
    elif isinstance(value, list):
        for item in value:
            _check_utf8(item, where, field_name)
    return value


def _iter_json(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8", errors="surrogateescape")
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: invalid JSON at line {exc.lineno}: {_json_problem(exc)}") from exc
    if not isinstance(data, list):
        raise DataError(
            f"{path}: a .json prompt file must hold a list of objects, got {type(data).__name__}; "
            "use .jsonl for one object per line"
        )
    for i, row in enumerate(data):
        yield f"row {i}", _check_utf8(row, f"{path}: row {i}")


def _iter_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError(
            "reading .parquet prompt files needs pyarrow: pip install 'posttrain[data]'"
        ) from exc
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:  # truncated, not parquet at all, or an unreadable schema
        raise DataError(
            f"{path}: not a readable parquet file ({type(exc).__name__}: {exc}); the file is truncated, "
            "damaged or in another format: write it again (e.g. datasets' to_parquet), or rename a JSON "
            "file to .json / .jsonl"
        ) from exc
    for i, row in enumerate(table.to_pylist()):
        yield f"row {i}", row


def _iter_saved_dataset(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import datasets
    except ImportError as exc:
        raise ImportError(
            "reading a saved datasets directory needs the datasets package: pip install 'posttrain[data]'"
        ) from exc
    if not any((path / name).is_file() for name in ("state.json", "dataset_dict.json")):
        raise DataError(
            f"{path} is a directory but not a dataset saved with datasets' save_to_disk (no state.json or "
            "dataset_dict.json in it); name a .jsonl, .json or .parquet file, or a save_to_disk directory"
        )
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        splits = ", ".join(str(path / name) for name in loaded)
        raise DataError(f"{path} holds several splits; point to one split directory: {splits}")
    for i, row in enumerate(loaded):
        yield f"row {i}", row


def _row_to_record(row: Any, where: str, path: Path, prompt_key: str, answer_key: str) -> PromptRecord:
    if not isinstance(row, dict):
        raise DataError(
            f"{path}: {where}: expected an object with a {prompt_key!r} field, got {type(row).__name__}"
        )
    if not has_path(row, prompt_key):
        raise DataError(
            f"{path}: {where}: missing field {prompt_key!r}; available fields: {sorted(available_paths(row))}. "
            "Set data.prompt_key to the field that holds the prompt (a dotted path reaches nested fields)"
        )
    source = f"{path}: {where}"
    prompt = _check_prompt(get_path(row, prompt_key), f"{source}: field {prompt_key!r}")
    if answer_key and not has_path(row, answer_key):
        raise DataError(
            f"{path}: {where}: missing field {answer_key!r}; available fields: {sorted(available_paths(row))}. "
            "Name the field that holds the answer (data.answer_key; for SFT responses sft.response_key; a "
            "dotted path such as reward_model.ground_truth reaches nested fields), or set "
            "data.answer_key='' when the reward needs no answers"
        )
    answer = (
        _check_answer(get_path(row, answer_key), f"{source}: field {answer_key!r}") if answer_key else None
    )
    extra = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
    return PromptRecord(
        prompt=prompt, ground_truth=answer, extra=extra, source=f"{source}: field {prompt_key!r}"
    )


def _check_prompt(value: Any, where: str) -> str | list[dict[str, str]]:
    """Return ``value`` if it is a string or a list of chat messages, else raise naming ``where``."""
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: the prompt is empty; remove the row or give it a prompt")
        return value
    if not isinstance(value, list) or not value:
        raise DataError(
            f"{where}: a prompt must be a string or a non-empty list of {{'role', 'content'}} messages, "
            f"got {type(value).__name__}"
        )
    messages = []
    for i, message in enumerate(value):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise DataError(
                f"{where}: message {i} must be a dict with string 'role' and 'content', got {message!r}"
            )
        # Parquet/datasets may add null columns of sibling messages; keep only the chat fields.
        messages.append({"role": message["role"], "content": message["content"]})
    return messages


def _check_answer(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise DataError(f"{where}: the answer must be a string or a number, got {type(value).__name__}")


# --------------------------------------------------------------------------- tokenizing


@dataclass(frozen=True)
class TokenizedPrompts:
    """Prompt token ids aligned with the records kept.

    Attributes:
        prompt_ids: one list of token ids per kept record.
        records: the kept records, in input order (``records[i]`` produced ``prompt_ids[i]``).
        n_filtered: how many records were dropped for exceeding ``max_prompt_length``.
    """

    prompt_ids: list[list[int]]
    records: list[PromptRecord]
    n_filtered: int


def tokenize_prompts(
    records: Sequence[PromptRecord],
    tokenizer: Any,
    max_prompt_length: int,
    overlong: str = "filter",
    apply_chat_template: bool | None = None,
) -> TokenizedPrompts:
    """Tokenize prompts, dropping (``overlong="filter"``) or rejecting (``"error"``) overlong ones.

    ``apply_chat_template=None`` applies the template when ``tokenizer.chat_template`` is set. With the
    template, a string prompt becomes one user message and the generation prompt is appended; without
    it, the string is encoded with the tokenizer's own special tokens (e.g. BOS).
    """
    if overlong not in _OVERLONG_MODES:
        raise DataError(f"overlong={overlong!r} is not supported; use one of {_OVERLONG_MODES}")
    if max_prompt_length < 1:
        raise DataError(f"max_prompt_length={max_prompt_length} must be >= 1, e.g. 512")
    if not records:
        raise DataError("records is empty; tokenize_prompts needs at least one prompt")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if apply_chat_template is None:
        apply_chat_template = has_template
    elif apply_chat_template and not has_template:
        raise DataError(
            "apply_chat_template=True but the tokenizer has no chat_template; "
            "set apply_chat_template=False or use a tokenizer with a chat template"
        )

    kept_ids: list[list[int]] = []
    kept: list[PromptRecord] = []
    for row, record in enumerate(records):
        where = record.source or f"row {row}"
        ids = encode_prompt(record.prompt, tokenizer, apply_chat_template, where=where)
        if len(ids) <= max_prompt_length:
            kept_ids.append(ids)
            kept.append(record)
        elif overlong == "error":
            raise DataError(
                f"{where}: prompt is {len(ids)} tokens, longer than data.max_prompt_length={max_prompt_length} "
                "(data.overlong_prompts=error); raise data.max_prompt_length or set "
                "data.overlong_prompts=filter to drop such prompts"
            )
    if not kept:
        raise DataError(
            f"all {len(records)} prompts are longer than max_prompt_length={max_prompt_length}; raise it"
        )
    return TokenizedPrompts(prompt_ids=kept_ids, records=kept, n_filtered=len(records) - len(kept))


def warn_dropped(n_dropped: int, n_total: int, what: str, max_prompt_length: int) -> None:
    """Log how many ``what`` prompts were dropped for exceeding data.max_prompt_length (nothing when none)."""
    if n_dropped:
        log.warning(
            "%d of %d %s prompts are longer than data.max_prompt_length=%d tokens and were dropped "
            "(raise data.max_prompt_length to keep them)",
            n_dropped,
            n_total,
            what,
            max_prompt_length,
        )


def warn_truncated(n_cut: int, n_total: int, what: str, max_response_length: int) -> None:
    """One warning line when ``what`` targets were cut at data.max_response_length (nothing when none): a cut
    target trains (or scores) the model on a response without its end."""
    if n_cut:
        log.warning(
            "%d of %d %s targets are longer than data.max_response_length=%d tokens (EOS included) and were "
            "cut (raise data.max_response_length to keep them whole)",
            n_cut,
            n_total,
            what,
            max_response_length,
        )


def encode_prompt(
    prompt: str | list[dict[str, str]], tokenizer: Any, apply_chat_template: bool, where: str = "prompt"
) -> list[int]:
    """Token ids of one prompt, ready for generation (see :func:`tokenize_prompts`)."""
    if apply_chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        # Render to text first: the template already holds BOS etc., so encoding must not add them twice.
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    elif isinstance(prompt, str):
        ids = tokenizer(prompt)["input_ids"]
    else:
        raise DataError(
            f"{where}: the prompt is a list of chat messages but no chat template is applied; "
            "use a tokenizer with a chat_template or plain-string prompts"
        )
    if not ids:
        raise DataError(f"{where}: the prompt encodes to zero tokens; remove empty prompts from the data")
    return list(ids)
