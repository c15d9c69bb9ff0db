"""`emotune predict` of an sft model on a file in its training data's format (Alpaca, ShareGPT, OpenAI messages, the
run's own split): each prompt is the one training built from the row (emotune.data.conversations), its reference
answer kept beside the reply; a file in no format is refused before weights load. Generation is replaced by a stub
that records the prompts: what is checked is what the model is asked."""

from __future__ import annotations

import csv
import json
import shutil

import pytest
import yaml

from conftest import trained_conversation, write_tiny_adapter
from emotune.cli import main
from emotune.core.config.sft import SftColumns, SftTags
from emotune.data.conversations import Conversation, normalise, with_tools

SYSTEM = "answer briefly"
SEPARATOR = "\n"  # not the default blank line: the run's own data.input_separator must be the one used


@pytest.fixture(scope="module")
def sft_run(tiny_model_dir, tmp_path_factory):
    return write_tiny_adapter(tiny_model_dir, tmp_path_factory.mktemp("sft-rows") / "rows", seed=2, task="sft",
                              overrides=(f"prompt.system_prompt={SYSTEM}", 'data.input_separator="\\n"',
                                         "eval.max_new_tokens=4"))


@pytest.fixture
def asked(monkeypatch):
    """The chat-templated prompts generation was given; each reply is `reply N`."""
    prompts: list[str] = []

    def generate(model, tokenizer, texts, max_new_tokens, batch_size, desc, processors=None):
        prompts.extend(texts)
        return [f"reply {n}" for n in range(len(texts))]

    monkeypatch.setattr("emotune.eval.evaluate.generate_texts", generate)
    return prompts


def _tokenizer(run):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(run / "adapter")


def _trained_prompt(tokenizer, conversation: Conversation) -> str:
    """The prompt part of the training row, as evaluation renders it (tasks/sft/task.py merge_check_inputs)."""
    return tokenizer.apply_chat_template(conversation.chat(SYSTEM, conversation.prompt_turns), tokenize=False,
                                         add_generation_prompt=True)


def _predict(run, source, out) -> int:
    return main(["predict", str(run), "--file", str(source), "--out", str(out)])


def test_an_alpaca_file_is_prompted_as_its_rows_were_trained(sft_run, asked, tmp_path, capsys):
    """An Alpaca file (a JSON array, as Alpaca datasets ship) had no `text` column and was refused; with
    --text-column instruction its `input` and `system` were dropped from the prompt without a word."""
    rows = [{"instruction": "translate to french", "input": "good morning", "system": "you translate",
             "output": "bonjour"},
            {"instruction": "say hi", "input": "", "output": "hi",
             "history": [["who are you", "a model"]]}]
    source, out = tmp_path / "alpaca.json", tmp_path / "out.csv"
    source.write_text(json.dumps(rows), encoding="utf-8")
    assert _predict(sft_run, source, out) == 0
    said = capsys.readouterr().out
    assert "read as alpaca rows with the run's data.columns and data.tags" in said and "`instruction`, `input`, `history`, `system`" in said
    assert "the reference (`output`) is kept beside the reply" in said
    tokenizer = _tokenizer(sft_run)
    expected = [_trained_prompt(tokenizer, normalise(row, "alpaca", SftColumns(), SftTags(), "x", input_separator=SEPARATOR))
                for row in rows]
    assert asked == expected
    assert "translate to french\ngood morning" in asked[0] and "you translate" in asked[0] and SYSTEM in asked[1]
    assert "bonjour" not in asked[0] and "a model" in asked[1]  # the reference left out; earlier turns kept
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in asked]
    assert ids == [tokenizer.apply_chat_template(c.chat(SYSTEM, c.prompt_turns), add_generation_prompt=True,
                                                 return_dict=False)
                   for c in (normalise(r, "alpaca", SftColumns(), SftTags(), "x", input_separator=SEPARATOR) for r in rows)]
    written = list(csv.DictReader(out.open(encoding="utf-8")))
    assert [(r["output"], r["predicted_output"]) for r in written] == [("bonjour", "reply 0"), ("hi", "reply 1")]


def test_sharegpt_and_messages_rows_bring_their_system_prompt_and_tools(sft_run, asked, tmp_path, capsys):
    tools = [{"name": "weather", "description": "today's weather", "parameters": {}}]
    rows = [{"conversations": [{"from": "human", "value": "is it sunny"}, {"from": "gpt", "value": "yes"}],
             "system": "you forecast", "tools": json.dumps(tools)},
            {"conversations": [{"from": "human", "value": "and tomorrow"}], "tools": tools}]
    source, out = tmp_path / "sharegpt.jsonl", tmp_path / "out.csv"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    assert _predict(sft_run, source, out) == 0
    assert "read as sharegpt rows" in capsys.readouterr().out
    tokenizer, text = _tokenizer(sft_run), json.dumps(tools)
    assert asked == [tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) for messages in (
        [{"role": "system", "content": with_tools("you forecast", text)}, {"role": "user", "content": "is it sunny"}],
        [{"role": "system", "content": with_tools(SYSTEM, text)}, {"role": "user", "content": "and tomorrow"}])]
    assert all("Tools available:" in p and "today's weather" in p for p in asked)
    written = list(csv.DictReader(out.open(encoding="utf-8")))
    assert [(r["reference"], r["output"]) for r in written] == [("yes", "reply 0"), ("", "reply 1")]

    # the run's own prepared split (data/test.jsonl) and OpenAI messages with tools: the same prompts
    asked.clear()
    saved = Conversation((("user", "is it sunny"), ("assistant", "yes")), "you forecast", "weather", "x", (), text)
    openai_row = {"messages": [{"role": "user", "content": "and tomorrow"}], "tools": tools}
    source.write_text(json.dumps(saved.as_row()) + "\n" + json.dumps(openai_row) + "\n", encoding="utf-8")
    assert _predict(sft_run, source, out) == 0
    assert asked == [_trained_prompt(tokenizer, saved), _trained_prompt(tokenizer, Conversation(
        (("user", "and tomorrow"), ("assistant", "-")), tools=text))]
    assert [r["reference"] for r in csv.DictReader(out.open(encoding="utf-8"))] == ["yes", ""]

    # a `text` column, or --text-column, is the prompt as before
    asked.clear()
    source.write_text(json.dumps({"text": "hello there", **rows[0]}) + "\n", encoding="utf-8")
    assert _predict(sft_run, source, out) == 0
    assert asked == [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                    {"role": "user", "content": "hello there"}],
                                                   tokenize=False, add_generation_prompt=True)]


def test_a_file_in_no_format_is_refused_before_weights_load(sft_run, tmp_path, monkeypatch, capsys):
    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded for a file that is refused")

    monkeypatch.setattr("emotune.deploy.predict.load_artifact_model", no_weights)
    source, out = tmp_path / "rows.jsonl", tmp_path / "out.csv"
    source.write_text(json.dumps({"question": "is it sunny", "answer": "yes"}) + "\n", encoding="utf-8")
    assert _predict(sft_run, source, out) == 2
    err = capsys.readouterr().err
    assert "reads as none of the sft formats (columns found: question, answer)" in err
    assert "--text-column NAME" in err and "alpaca (`instruction`" in err and "sharegpt (`conversations`" in err
    assert "Traceback" not in err and not out.exists()

    # a row that cannot be a prompt: refused with its number, and a good earlier output is left as it was
    out.write_text("kept\n", encoding="utf-8")
    source.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
                      + json.dumps({"messages": [{"role": "assistant", "content": "hi"}]}) + "\n", encoding="utf-8")
    assert _predict(sft_run, source, out) == 2
    err = capsys.readouterr().err
    assert "read as messages rows" in err and "row 2: the turns do not alternate" in err
    assert out.read_text(encoding="utf-8") == "kept\n"


# a zero-width space, a control character (bell) and an accent as a combining mark (not NFC): what training removes
# and normalises; `to<bell>day` is one unknown word to the fixture tokenizer, `today` a known one
DIRTY = "is it\u200b sunny to\x07day in the cafe\u0301"


def test_prompts_are_cleaned_as_the_training_turns_were(sft_run, asked, tmp_path):
    """An sft run cleans every turn of its rows (data.cleaning: control and invisible characters removed, NFC), not the
    system prompt; predict sent texts and rows as they were, so the same words were another prompt than the one trained
    on. An adapter whose emotune.json records no cleaning (saved before it did) reads them as sent, as before."""
    separator = ('data.input_separator="\\n"',)
    row = {"instruction": DIRTY, "input": "good\u200b morning", "system": "you\u200b translate", "output": "yes",
           "history": [["who\x07 are you", "a mo\u200bdel"]]}
    trained_text = trained_conversation({"instruction": DIRTY, "output": "yes"}, tmp_path / "text", separator)
    trained_row = trained_conversation(row, tmp_path / "row", separator)
    assert trained_text.messages[0][1] == "is it sunny today in the caf\u00e9"  # what the data layer made of it
    assert trained_row.system == row["system"] and trained_row.messages[1][1] == "a model"

    assert main(["predict", str(sft_run), DIRTY]) == 0
    source, out = tmp_path / "alpaca.jsonl", tmp_path / "out.csv"
    source.write_text(json.dumps(row) + "\n", encoding="utf-8")
    assert _predict(sft_run, source, out) == 0
    tokenizer = _tokenizer(sft_run)
    assert asked == [_trained_prompt(tokenizer, trained_text), _trained_prompt(tokenizer, trained_row)]
    assert [tokenizer(p, add_special_tokens=False)["input_ids"] for p in asked] == [
        tokenizer.apply_chat_template(c.chat(SYSTEM, c.prompt_turns), add_generation_prompt=True, return_dict=False)
        for c in (trained_text, trained_row)]

    old = tmp_path / "old"
    shutil.copytree(sft_run, old)
    meta = json.loads((old / "adapter" / "emotune.json").read_text(encoding="utf-8"))
    for key in ("cleaning", "data"):  # what an adapter saved before they were recorded lacks
        meta.pop(key, None)
    (old / "adapter" / "emotune.json").write_text(json.dumps(meta), encoding="utf-8")
    asked.clear()
    assert main(["predict", str(old), DIRTY]) == 0
    assert asked == [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": DIRTY}],
                                                   tokenize=False, add_generation_prompt=True)]


RENAMED = SftColumns(prompt="question", query="context", response="answer")


@pytest.fixture(scope="module")
def renamed_run(tiny_model_dir, tmp_path_factory):
    """A run whose Alpaca rows name their columns otherwise, with a separator other than the default."""
    return write_tiny_adapter(tiny_model_dir, tmp_path_factory.mktemp("sft-renamed") / "renamed", seed=3, task="sft",
                              overrides=(f"prompt.system_prompt={SYSTEM}", 'data.input_separator="\\n"',
                                         *(f"data.columns.{key}={value}" for key, value in
                                           RENAMED.model_dump(exclude_defaults=True).items())))


def test_an_export_reads_rows_with_the_columns_its_emotune_json_records(renamed_run, asked, tmp_path, capsys):
    """An export's config.yaml holds the model section only, and an adapter folder may travel without its run: predict
    read their files with emotune's default column names, so a file with the run's own columns was refused. The sft
    adapter's emotune.json records them now; one saved before it did falls back to the defaults, as before."""
    export, alone = tmp_path / "export", tmp_path / "elsewhere" / "adapter-copy"
    assert main(["export", str(renamed_run), "--out", str(export)]) == 0
    assert set(yaml.safe_load((export / "config.yaml").read_text(encoding="utf-8"))) == {"model"}
    shutil.copytree(renamed_run / "adapter", alone)
    row = {"question": "translate to french", "context": "good morning", "system": "you translate", "answer": "bonjour"}
    source, out = tmp_path / "alpaca.json", tmp_path / "out.csv"
    source.write_text(json.dumps([row]), encoding="utf-8")
    trained = normalise(row, "alpaca", RENAMED, SftTags(), "x", input_separator=SEPARATOR)
    expected = [_trained_prompt(_tokenizer(renamed_run), trained)]
    for target in (export, export / "adapter", alone):
        capsys.readouterr()
        asked.clear()
        assert _predict(target, source, out) == 0, target
        said = capsys.readouterr().out
        assert "with the run's data.columns and data.tags as its emotune.json records them" in said, said
        assert "`question`, `context`, `system`; instruction and input joined by '\\n'" in said
        assert asked == expected and "translate to french\ngood morning" in asked[0]
        written = list(csv.DictReader(out.open(encoding="utf-8")))
        assert [(r["answer"], r["output"]) for r in written] == [("bonjour", "reply 0")]

    meta = json.loads((alone / "emotune.json").read_text(encoding="utf-8"))
    del meta["data"]
    (alone / "emotune.json").write_text(json.dumps(meta), encoding="utf-8")
    assert _predict(alone, source, out) == 2
    assert "Column names: emotune's default column names" in capsys.readouterr().err


def test_rows_in_a_parquet_file_are_prompted_as_the_same_rows_in_jsonl(sft_run, asked, tmp_path, capsys):
    """An sft run trained on Parquet (a hub dataset's files) could not predict on its test split: `unsupported type
    .parquet`. Read by the data layer, its nested turns give the prompts and references the JSONL rows give."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": [{"role": "user", "content": "is it sunny"}, {"role": "assistant", "content": "yes"}]},
            {"messages": [{"role": "system", "content": "you forecast"}, {"role": "user", "content": "and tomorrow"}]}]
    jsonl, parquet = tmp_path / "rows.jsonl", tmp_path / "rows.parquet"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    written = {}
    for source in (jsonl, parquet):
        asked.clear()
        out = tmp_path / f"{source.suffix[1:]}.csv"
        assert _predict(sft_run, source, out) == 0
        assert "read as messages rows" in capsys.readouterr().out
        written[source.suffix] = (list(asked), [r["reference"] for r in csv.DictReader(out.open(encoding="utf-8"))])
    assert written[".parquet"] == written[".jsonl"]
    assert written[".parquet"][1] == ["yes", ""] and "you forecast" in written[".parquet"][0][1]


def test_a_text_column_in_other_capitals_is_the_prompt(sft_run, asked, tmp_path, capsys):
    """A CSV whose header says `Text` was read as rows of an sft format and refused (`has no text column`)."""
    source, out = tmp_path / "in.csv", tmp_path / "out.csv"
    source.write_text("Id,Text\n007,hello there\n008,0.50\n", encoding="utf-8")
    assert _predict(sft_run, source, out) == 0
    assert "read the column `Text` as text" in capsys.readouterr().out
    tokenizer = _tokenizer(sft_run)
    assert asked == [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
                                                   tokenize=False, add_generation_prompt=True)
                     for text in ("hello there", "0.50")]
    assert [(r["Id"], r["Text"], r["output"]) for r in csv.DictReader(out.open(encoding="utf-8"))] == [
        ("007", "hello there", "reply 0"), ("008", "0.50", "reply 1")]


def test_an_alpaca_file_with_capitalised_headers_is_prompted_as_training_reads_it(sft_run, asked, tmp_path):
    """`Instruction`/`Input` headers (a spreadsheet's) were refused as no sft format, as training refused them."""
    source, out = tmp_path / "alpaca.csv", tmp_path / "out.csv"
    source.write_text("Instruction,Input\ntranslate to french,good morning\n", encoding="utf-8")
    assert _predict(sft_run, source, out) == 0
    row = {"instruction": "translate to french", "input": "good morning", "output": "(reference)"}
    conversation = normalise(row, "alpaca", SftColumns(), SftTags(), "x", input_separator=SEPARATOR)
    assert asked == [_trained_prompt(_tokenizer(sft_run), conversation)]
    assert [r["Instruction"] for r in csv.DictReader(out.open(encoding="utf-8"))] == ["translate to french"]


def test_turns_a_csv_file_holds_as_json_text_are_prompted_as_the_same_rows_in_jsonl(sft_run, asked, tmp_path, capsys):
    """A CSV file stores a `messages` list as JSON text, which training reads as the turns; predict --file too."""
    rows = [{"messages": [{"role": "user", "content": "is it sunny"}, {"role": "assistant", "content": "yes"}]}]
    jsonl, csv_file = tmp_path / "rows.jsonl", tmp_path / "rows.csv"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    with csv_file.open("w", encoding="utf-8", newline="") as handle:
        csv.writer(handle).writerows([["messages"], *([json.dumps(r["messages"])] for r in rows)])
    written = {}
    for source in (jsonl, csv_file):
        asked.clear()
        out = tmp_path / f"{source.suffix[1:]}.out.csv"
        assert _predict(sft_run, source, out) == 0
        written[source.suffix] = (list(asked), [r["reference"] for r in csv.DictReader(out.open(encoding="utf-8"))])
    assert written[".csv"] == written[".jsonl"] and written[".csv"][1] == ["yes"]


def test_gemini_tuning_rows_are_prompted_as_the_same_rows_in_openai_messages(sft_run, asked, tmp_path):
    gemini = {"systemInstruction": {"parts": [{"text": "you forecast"}]},
              "contents": [{"role": "user", "parts": [{"text": "is it sunny"}]}, {"role": "model", "parts": [{"text": "yes"}]}]}
    openai = {"messages": [{"role": "system", "content": "you forecast"}, {"role": "user", "content": "is it sunny"},
                           {"role": "assistant", "content": "yes"}]}
    written = {}
    for name, row in (("gemini", gemini), ("openai", openai)):
        asked.clear()
        source, out = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.csv"
        source.write_text(json.dumps(row) + "\n", encoding="utf-8")
        assert _predict(sft_run, source, out) == 0
        written[name] = (list(asked), [r["reference"] for r in csv.DictReader(out.open(encoding="utf-8"))])
    assert written["gemini"] == written["openai"] and written["gemini"][1] == ["yes"]


def test_a_reference_answer_under_a_capitalised_role_is_kept_beside_the_reply(sft_run, asked, tmp_path):
    """A ShareGPT row ending with from: GPT (training reads it as the answer) was prompted with the answer inside,
    as a user turn would be, and its reference was lost."""
    written = {}
    for name, answer in (("lower", "gpt"), ("capitals", "GPT")):
        asked.clear()
        row = {"conversations": [{"from": "human", "value": "is it sunny"}, {"from": answer, "value": "yes"}]}
        source, out = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.csv"
        source.write_text(json.dumps(row) + "\n", encoding="utf-8")
        assert _predict(sft_run, source, out) == 0
        written[name] = (list(asked), [r["reference"] for r in csv.DictReader(out.open(encoding="utf-8"))])
    assert written["capitals"] == written["lower"] and written["lower"][1] == ["yes"]
