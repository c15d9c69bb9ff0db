"""`emotune predict`: texts from the command line or a file through a run's adapter or merged model.

A classifier's labels come from the scoring method (the probability of each label as the model's reply,
over the label set), with its own system prompt, user template and chat template; a classification-head
model's from its `score` head over the bare text (emotune.model.head), with the token limit it was trained with.
An sft model answers in free text: a greedy generation with its own system prompt and chat template, each
text the user turn, its turns cleaned as its training turns were; a file without a text column is read as rows of
the run's training data format, each prompt built as training built it (emotune.deploy.predict_rows).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pandas as pd
import torch
from tqdm.auto import tqdm

from emotune.core.config.sft import SftTags
from emotune.core.errors import UserError
from emotune.core.rundir import atomic_file, json_text
from emotune.data.clean import clean_for_inference
from emotune.data.conversation_data import clean_chats_for_inference
from emotune.data.conversations import turn_text
from emotune.data.read import read_records
from emotune.data.roles import OPENAI_TAGS, role_sides
from emotune.data.sources import column_named, is_saved_dataset
from emotune.deploy.predict_rows import row_prompts
from emotune.eval.scoring import label_token_ids, prompt_token_ids, score_label_probs
from emotune.model.artifacts import Artifact, Fallback, find_artifact, load_artifact_model
from emotune.model.finite import FiniteLogits, NonFiniteOutput, nonfinite_rows, nonfinite_weights, not_finite_message
from emotune.model.head import head_probabilities
from emotune.model.loading import serving_dtype
from emotune.model.text import context_length
from emotune.runtime import device as device_mod

ENCODING = "utf-8"  # a file's byte-order mark still says UTF-16 or UTF-32, as the data layer reads it
LABEL_COLUMN = "label"  # only for the data layer's checks of CSV rows; a file to predict on needs no labels
DEFAULT_MAX_NEW_TOKENS = 128  # sft models whose emotune.json records no eval.max_new_tokens
TEXT_COLUMN = "text"  # --text-column's default


class Loaded:
    def __init__(self, artifact: Artifact, device: str = "auto"):
        self.artifact = artifact
        torch_device = device_mod.resolve_device(device)
        # model.dtype of the run's own config is honoured, else the dtype the run was measured in
        dtype = serving_dtype(artifact.model_cfg, torch_device, artifact.measured_dtype)
        self.model, self.tokenizer = load_artifact_model(artifact, dtype, torch_device)

    def refuse_nonfinite(self, where: str) -> NoReturn:
        """NonFiniteOutput for NaN or infinite scores at `where`, naming the weights at fault (one pass over them)."""
        dtype = next(p.dtype for p in self.model.parameters() if p.is_floating_point())
        raise NonFiniteOutput(not_finite_message(f"The model `{self.artifact.name}`", where, dtype,
                                                 nonfinite_weights(self.model)) + " Nothing was predicted.")


class Classifier(Loaded):
    """A loaded classifier: texts in, label probabilities out."""

    def probs(self, texts: list[str], batch_size: int = 16) -> torch.Tensor:
        texts = clean_for_inference(texts, self.artifact.meta.get("cleaning"))  # as its training rows were cleaned
        if self.artifact.has_head:
            return head_probabilities(self.model, self.tokenizer, texts, self.artifact.max_length, batch_size)
        return score_label_probs(self.model, self.tokenizer, texts, self.artifact.prompt, self.artifact.labels, batch_size)

    def check_finite(self, probs: torch.Tensor, what: str, first: int = 1) -> None:
        """Refuse probabilities that are NaN or infinite (texts `first`, `first` + 1, ... of `what`): no answer."""
        bad = nonfinite_rows(probs)
        if bad:
            self.refuse_nonfinite(_numbered([first + i for i in bad], what))

    def check_lengths(self, texts: list[str], what: str) -> None:
        """Before anything is scored: texts whose scoring prompt with the longest label runs past the model's context
        are refused (row numbers named), and those longer than the run trained on are counted in a warning. A head
        model cuts its texts at the length it trained with, as it did in training, so nothing is checked there."""
        if self.artifact.has_head:
            return
        a = self.artifact
        texts = clean_for_inference(texts, a.meta.get("cleaning"))
        longest_label = max(len(ids) for ids in label_token_ids(self.tokenizer, a.prompt, a.labels))
        lengths = [len(ids) + longest_label for ids in prompt_token_ids(self.tokenizer, a.prompt, a.labels, texts)]
        context = context_length(self.model)
        over = [n for n, length in enumerate(lengths, start=1) if context and length > context]
        if over:
            raise UserError(f"{_numbered(over, what)} with the prompt and the longest label come to more tokens "
                            f"(the longest: {max(lengths):,}) than the model's context of {context:,}: it cannot read "
                            "them whole. Shorten or split those texts, or leave them out; nothing was predicted.")
        trained = a.meta.get("max_length")
        longer = [n for n, length in enumerate(lengths, start=1) if isinstance(trained, int) and length > trained]
        if longer:
            print(f"Warning: {_numbered(longer, what)} with the prompt and the longest label come to more tokens than "
                  f"the run trained on (train.max_length={trained}); the model never saw rows that long, so their "
                  "labels are less certain.", file=sys.stderr, flush=True)


class Generator(Loaded):
    """A loaded sft model: texts in (each the user turn, or a conversation so far), greedy replies out."""

    def prompts(self, texts: list[str | list[dict]]) -> list[str]:
        """Each text's chat-templated prompt, its user and assistant turns cleaned as the run's training turns were
        (emotune.json's `cleaning`; an adapter that records none: as given)."""
        chats = [[{"role": "user", "content": text}] if isinstance(text, str) else text for text in texts]
        chats = clean_chats_for_inference(chats, self.artifact.meta.get("cleaning"))
        return [self.artifact.chat_prompt(self.tokenizer, chat) for chat in chats]

    def replies(self, texts: list[str | list[dict]], max_new_tokens: int, batch_size: int = 16, desc: str | None = None) -> list[str]:
        from transformers import LogitsProcessorList

        from emotune.eval.evaluate import generate_texts

        try:
            return generate_texts(self.model, self.tokenizer, self.prompts(texts), max_new_tokens, batch_size, desc,
                                  LogitsProcessorList([FiniteLogits()]))
        except NonFiniteOutput:  # NaN logits: greedy decoding would reply with token 0
            self.refuse_nonfinite("the next token of a reply")

    def check_lengths(self, texts: list[str | list[dict]], what: str, max_new_tokens: int) -> None:
        """Before anything is generated: prompts that with a reply of `max_new_tokens` run past the model's context
        are refused, rows named (a model with learned positions fails inside its forward, a rotary one generates
        from positions it never saw), as serve refuses such a chat with a 422."""
        context = context_length(self.model)
        if not context:
            return
        lengths = [len(ids) for ids in self.tokenizer(self.prompts(texts), add_special_tokens=False)["input_ids"]]
        over = [n for n, length in enumerate(lengths, start=1) if length + max_new_tokens > context]
        if over:
            raise UserError(f"{_numbered(over, what)} with a reply of up to {max_new_tokens:,} tokens come to more tokens "
                            f"(the longest prompt: {max(lengths):,}) than the model's context of {context:,}. Shorten "
                            "those texts, lower --max-new-tokens, or leave them out; nothing was predicted.")


def trained_max_new_tokens(artifact: Artifact) -> int:
    """The generation length the sft model was evaluated with, so predict answers as its report measured."""
    value = (artifact.meta.get("eval") or {}).get("max_new_tokens")
    return value if isinstance(value, int) and value >= 1 else DEFAULT_MAX_NEW_TOKENS


@dataclass(frozen=True)
class PredictIO:
    """Where `emotune predict` reads texts and puts answers: `texts` given as arguments (answers printed, one JSON
    line each), or the `text_column` of a data `file` (any format training reads), written with the answers added to
    `out`. No `text_column` (--text-column not given): `text`, or for an sft model a file without one read in its data's
    format."""

    texts: list[str]
    file: str | None = None
    out: str | None = None
    text_column: str | None = None
    encoding: str | None = None
    """The file's text encoding; None = the run's data.encoding (a run folder's config), else UTF-8."""


def predict_cli(target: str, io: PredictIO, batch_size: int, device: str, fallback: Fallback | None = None,
                max_new_tokens: int | None = None) -> int:
    """`fallback`: labels, prompt and base for an adapter made by another tool (from --config / --labels).
    `max_new_tokens`: sft models only (default: the length the run evaluated with)."""
    texts, file, out, text_column = io.texts, io.file, io.out, io.text_column
    if bool(texts) == bool(file):
        raise UserError("Give texts as arguments, or --file in.csv --out out.csv (not both, not neither).")
    if file and not out:
        raise UserError("--file needs --out, the CSV file the predictions are written to.")
    if io.encoding is not None and not file:
        raise UserError("--encoding is the text encoding of --file; texts given as arguments need none. Leave it out.")
    if out and not file:
        raise UserError(f"--out `{out}` is where the predictions of a --file go; texts given as arguments are answered "
                        "on the terminal, one JSON line each. Give --file in.csv --out out.csv, or leave out --out "
                        "(and redirect the lines to a file).")
    if file and Path(out).resolve() == Path(file).resolve():
        raise UserError(f"--out `{out}` is the --file being read, which writing the predictions would replace. Give "
                        "another file, e.g. --out predictions.csv.")
    if out and Path(out).is_dir():  # found before the model runs, not when the answers are written
        raise UserError(f"--out `{out}` is a folder; give the file to write, e.g. --out {Path(out) / 'predictions.csv'}.")
    if batch_size < 1:
        raise UserError("--batch-size must be a positive number of texts.")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise UserError("--max-new-tokens must be a positive number of tokens.")
    artifact = find_artifact(target, fallback=fallback)  # emotune.json only: no weights yet
    column = text_column or _trained_column(artifact)
    # bad input fails before weights load; an sft model's file without --text-column may be rows of its data's format
    required = text_column is not None or not artifact.answers_freely
    encoding = _encoding(io.encoding, artifact) if file else ENCODING
    rows, found = (_read_table(Path(file), column, required, artifact.answers_freely, encoding) if file
                   else (None, None))
    if artifact.answers_freely:
        prompts = None
        if rows is not None:
            rows, prompts = _sft_prompts(rows, artifact, Path(file), found)
        generator, new_tokens = Generator(artifact, device), max_new_tokens or trained_max_new_tokens(artifact)
        generator.check_lengths(texts if rows is None else prompts, "text" if rows is None else f"{Path(file).name}: row",
                                new_tokens)
        return _answer(generator, texts, rows, prompts, Path(out) if out else None, batch_size, new_tokens)
    if max_new_tokens is not None:
        raise UserError(f"--max-new-tokens is for sft models, which answer in free text; `{target}` is a classifier, "
                        "whose answer is one of its labels. Leave the flag out.")
    classifier = Classifier(artifact, device)
    if rows is None:
        classifier.check_lengths(texts, "text")
        probs = classifier.probs(texts, batch_size)
        classifier.check_finite(probs, "text")  # before a line is printed
        for text, row in zip(texts, probs.tolist(), strict=False):
            print(json_text({"text": text, **labelled(row, artifact.labels)}, indent=None))
        return 0
    texts = [_text(cell) for cell in rows[found]]
    classifier.check_lengths(texts, f"{Path(file).name}: row")
    probs = _probs_with_progress(classifier, texts, batch_size, f"{Path(file).name}: row")
    _write_table(rows, probs, artifact.labels, Path(out))
    print(f"Wrote {len(rows)} predictions to {out}", flush=True)
    return 0


def _answer(generator: Generator, texts: list[str], rows: pd.DataFrame | None, prompts: list | None, out: Path | None,
            batch_size: int, max_new_tokens: int) -> int:
    """An sft model's replies: one JSON line per text, or the input columns plus `output` in `out`."""
    if rows is None:
        for text, reply in zip(texts, generator.replies(texts, max_new_tokens, batch_size), strict=False):
            print(json_text({"text": text, "output": reply}, indent=None))
        return 0
    result = rows.copy()
    _add_column(result, "output", generator.replies(prompts, max_new_tokens, batch_size, "predict"))
    write_csv(result, out)
    print(f"Wrote {len(rows)} replies to {out}", flush=True)
    return 0


ROLES = {**role_sides(SftTags()), **role_sides(OPENAI_TAGS)}
"""OpenAI's roles and ShareGPT's default tags, tool results on the user's side and tool calls on the assistant's, as
an sft run's data reads them (emotune.data.conversations)."""


def _sft_prompts(rows: pd.DataFrame, artifact: Artifact, path: Path, column: str | None
                 ) -> tuple[pd.DataFrame, list[str | list[dict]]]:
    """The rows to write the replies beside and each row's prompt: the text column's cells (`column`: --text-column's,
    or the file's `text` in any capitals; None where it has neither), or else the rows read in the run's data format,
    a `reference` column added where the file keeps its references inside the turns."""
    if column is not None:
        return rows, [_prompt(cell, number, column) for number, cell in enumerate(rows[column].tolist(), start=1)]
    found = row_prompts(rows, artifact, path)
    print(found.description, flush=True)
    if found.references is None:
        return rows, found.prompts
    rows = rows.copy()
    _add_column(rows, "reference", found.references)
    return rows, found.prompts


def _prompt(cell: object, number: int, column: str) -> str | list[dict]:
    """A file's cell as an sft prompt: a text is the user turn; a conversation (a JSONL list of OpenAI `{role,
    content}` or ShareGPT `{from, value}` turns) is the conversation so far, its closing answers (the reference)
    left out. Its Python text (`[{'role': ...}]`) was sent as one user turn."""
    if not isinstance(cell, list):
        return _text(cell)
    turns = []
    for turn in cell:
        role = ROLES.get(turn.get("role", turn.get("from"))) if isinstance(turn, dict) else None
        content = turn_text(turn, OPENAI_TAGS if "role" in turn else SftTags()) if role else None
        if role is None or not isinstance(content, str) or (role == "system" and turns):
            raise UserError(f"Row {number} of column `{column}` is a list but not a conversation: give each turn a "
                            "`role` (system first, then user and assistant) and a text `content`, as in the run's data.")
        turns.append({"role": role, "content": content})
    while turns and turns[-1]["role"] == "assistant":  # the reference answer
        turns.pop()
    if not turns or turns[-1]["role"] != "user":
        raise UserError(f"Row {number} of column `{column}` has no user turn to answer; a conversation must hold one.")
    return turns


def _numbered(numbers: list[int], what: str) -> str:
    """`text 3`, `rows 2, 5, 9`, `rows 2, 5, 9, 11, 12 and 40 more`: which inputs, counted from 1."""
    shown = ", ".join(str(n) for n in numbers[:5])
    rest = f" and {len(numbers) - 5} more" if len(numbers) > 5 else ""
    return f"{what}{'s' if len(numbers) > 1 else ''} {shown}{rest}"


def labelled(probs: list[float], labels: list[str]) -> dict:
    best = max(range(len(labels)), key=probs.__getitem__)
    return {"label": labels[best], "probs": {label: round(p, 6) for label, p in zip(labels, probs, strict=False)}}


def _probs_with_progress(classifier: Classifier, texts: list[str], batch_size: int, what: str) -> torch.Tensor:
    """Every text's probabilities, a chunk at a time; a chunk with NaN stops it there (a broken model, found early)."""
    chunk = batch_size * 8  # large enough that the shared prompt head is computed rarely
    parts = []
    with tqdm(total=len(texts), desc="predict", unit="text") as bar:
        for start in range(0, len(texts), chunk):
            parts.append(classifier.probs(texts[start:start + chunk], batch_size))
            classifier.check_finite(parts[-1], what, first=start + 1)
            bar.update(len(parts[-1]))
    return torch.cat(parts) if parts else torch.empty(0, len(classifier.artifact.labels))


def _trained_column(artifact) -> str:
    """--text-column's default: the column a classifier's training read its texts from (emotune.json's `text_column`,
    data.text_column), so a file like its training data needs no flag; `text` for a model that records none."""
    column = artifact.meta.get("text_column") if not artifact.answers_freely else None
    return column if isinstance(column, str) and column else TEXT_COLUMN


def _encoding(given: str | None, artifact) -> str:
    """--encoding, checked; else the encoding the run read its data files in (data.encoding of a run folder's config:
    a file like its training data needs no flag); else UTF-8."""
    from emotune.core.config.data import known_encoding

    if given is not None:
        try:
            return known_encoding(given)
        except ValueError as err:
            raise UserError(f"--encoding `{given}` {err}.") from None
    data = artifact.config.get("data")
    trained = data.get("encoding") if isinstance(data, dict) else None
    return trained if isinstance(trained, str) and trained else ENCODING


def _read_table(path: Path, text_column: str, required: bool = True, sft: bool = False, encoding: str = ENCODING
                ) -> tuple[pd.DataFrame, str | None]:
    """Every row of the file in its order, every column kept, read by the data layer's readers as training data is
    (emotune.data.read: CSV/TSV cells as written, JSON/JSONL values, Parquet, Arrow/Feather, compressed, a
    save_to_disk folder of one split; nothing cleaned, dropped or split), and the column holding the texts:
    `text_column`, or the one name equal to it but for capitals and spaces (`Text`), as training finds its columns.
    Without one the file is refused where it is `required` (not for an sft model's file of rows in its data's format,
    emotune.deploy.predict_rows). A .txt file is read as the model's training reads one: `text;label` lines for a
    classifier, one prompt per line for an `sft` model."""
    if not path.exists():
        raise UserError(f"--file `{path}` does not exist.")
    if path.is_dir() and not (path / "state.json").is_file():
        _refuse_folder(path)
    notes: list[str] = []
    names, records = read_records(path, encoding, text_column, LABEL_COLUMN, notes, txt_lines=sft)
    for note in notes:
        print(f"Note: {note}", flush=True)
    rows = pd.DataFrame(records, columns=names, dtype=object)  # values as read: a text `007` stays `007`
    if rows.empty:
        raise UserError(f"--file `{path}` holds no rows to predict (a header or an empty table only). Give a file with "
                        "at least one row.")
    found = column_named(names, text_column)
    if found not in names:
        if required:
            raise UserError(f"`{path}` has no column `{text_column}` (columns: {', '.join(map(str, names)) or 'none'}). "
                            "Pass --text-column NAME.")
        return rows, None
    if names.count(found) > 1:
        raise UserError(f"`{path}` has {names.count(found)} columns named `{found}`, so it is unclear which one holds "
                        "the texts. Rename or remove the extra one in the header.")
    if found != text_column:
        print(f"Note: `{path}`: read the column `{found}` as {text_column} (the names differ in capitals or spaces "
              "only).", flush=True)
    return rows, found


def _refuse_folder(path: Path) -> NoReturn:
    """A folder that is not one saved Dataset: a DatasetDict's splits are named, or a data file asked for."""
    splits = [p.name for p in sorted(path.iterdir()) if p.is_dir() and is_saved_dataset(p)]
    if splits and (path / "dataset_dict.json").is_file():
        example = "test" if "test" in splits else splits[0]
        raise UserError(f"--file `{path}` is a save_to_disk folder of the splits {', '.join(splits)}; give the folder "
                        f"of the one to predict on, e.g. --file {path / example}.")
    raise UserError(f"--file `{path}` is a folder; give a data file (CSV, TSV, JSONL, JSON, Parquet, Arrow) or a "
                    "save_to_disk folder of one split.")


def _text(cell: object) -> str:
    """A cell as the text to classify: a missing one (a JSONL row without the key, a null) is an empty text."""
    return "" if cell is None or (isinstance(cell, float) and cell != cell) else str(cell)


def _write_table(rows: pd.DataFrame, probs: torch.Tensor, labels: list[str], out: Path) -> None:
    result = rows.copy()
    _add_column(result, "label", [labels[i] for i in probs.argmax(-1).tolist()] if len(rows) else [])
    for j, label in enumerate(labels):
        _add_column(result, f"p_{label}", probs[:, j].tolist() if len(rows) else [])
    write_csv(result, out)


def write_csv(result: pd.DataFrame, out: Path) -> None:
    """`result` as CSV that reads back row for row. Lines end in CRLF (RFC 4180's own ending): Python's csv writer
    before 3.11.9 / 3.12.3 quotes only the line ending's characters, so with pandas' `\n` a text holding a bare `\r`
    (an old Mac line break, a scraped page) went out unquoted and every reader split its row in two (CPython
    gh-67044, pandas #10018)."""
    with atomic_file(out) as tmp:
        result.to_csv(tmp, index=False, lineterminator="\r\n")


def _add_column(result: pd.DataFrame, name: str, values: list) -> None:
    """`values` as column `name`, or `predicted_<name>` where the input already has a `name` (a labelled test file's
    gold `label`, an Alpaca file's reference `output`): writing over it lost the input's column without a word."""
    column = name
    while column in result.columns:
        column = f"predicted_{column}"
    if column != name:
        print(f"Note: the input already has a column `{name}`; kept, and the prediction written as `{column}`.",
              flush=True)
    result[column] = values
