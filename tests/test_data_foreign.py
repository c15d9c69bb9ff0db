"""sft data written by other tools (LLaMA-Factory, OpenAI, pandas/Arrow): read as they mean, or refused saying why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from emotune.core.config.load import load_config
from emotune.core.errors import UserError
from emotune.data.conversation_data import load_conversations


def _data(source: Path | str, *overrides: str):
    cfg = load_config(None, ["task=sft", f"data.source={source}", *overrides])
    return load_conversations(cfg.data, cfg.seed)


def _kto_rows(n: int) -> list[dict]:
    """LLaMA-Factory's kto_en_demo.json: OpenAI-style messages and a true/false `label`, every third one false."""
    return [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}],
             "label": i % 3 != 0} for i in range(n)]


def test_llamafactory_kto_entries_are_refused_with_the_rows_tagged_false(tmp_path):
    # the entry's kto_tag was ignored: rows tagged false (answers not to give) were trained as answers
    (tmp_path / "kto.json").write_text(json.dumps(_kto_rows(30)))
    (tmp_path / "kto_alpaca.json").write_text(json.dumps(
        [{"instruction": f"q {i}", "output": f"a {i}", "good": i % 3 != 0} for i in range(30)]))
    tags = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}
    (tmp_path / "dataset_info.json").write_text(json.dumps({
        "kto": {"file_name": "kto.json", "formatting": "sharegpt", "columns": {"messages": "messages", "kto_tag": "label"},
                "tags": tags},
        "kto_alpaca": {"file_name": "kto_alpaca.json", "columns": {"kto_tag": "good"}}}))
    for name, column in (("kto", "label"), ("kto_alpaca", "good")):
        with pytest.raises(UserError, match=rf"unpaired preference dataset \(KTO data: a true/false `{column}` column \(the "
                                            rf"dataset_info.json entry's kto_tag\).*10 of its 30 rows are tagged false.*"
                                            rf"Keep the rows whose {column} is true"):
            _data(tmp_path, f"data.datasets=[{name}]")
    with pytest.raises(UserError, match=r"true/false `label` column,.*10 of its 30 rows are tagged false"):
        _data(tmp_path / "kto.json")  # the same file alone, without its dataset_info.json


def _rft_rows(n: int) -> list[dict]:
    """OpenAI's reinforcement fine-tuning lines: messages ending with the user's turn, and fields for the grader."""
    return [{"messages": [{"role": "developer", "content": "Answer with a number."},
                          {"role": "user", "content": f"What is {i} + 1?"}], "reference_answer": str(i + 1)}
            for i in range(n)]


def test_openai_rft_data_is_named_with_its_grader_fields(tmp_path):
    # refused as "the turns do not alternate user/assistant", which they do: they only lack the answer
    path = tmp_path / "rft.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in _rft_rows(20)))
    for skip in ("false", "true"):  # skipping every row would only leave an empty split to explain
        with pytest.raises(UserError, match=r"holds prompts without answers: every row's conversation ends with a user "
                                            r"turn, and its other fields \(`reference_answer`\) are for a grader, as in "
                                            r"OpenAI's reinforcement fine-tuning \(RFT\) data") as err:
            _data(path, f"data.skip_bad_rows={skip}")
        assert "skip_bad_rows" not in str(err.value) and "alternate" not in str(err.value)


def test_a_row_that_ends_with_the_users_turn_is_told_so(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": f"a {i}"}]}
            for i in range(20)]
    rows[4]["messages"].append({"role": "user", "content": "and then?"})
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(UserError, match=r"rows 5: the conversation ends with a user turn, so it has no answer to train on"):
        _data(path)


def test_tools_and_tool_calls_in_parquet_keep_their_own_keys(tmp_path):
    # Arrow gives every struct in a column the keys of all of them, null where one had none: a tool `now` was described
    # to the model with `"properties": {"city": null}` and `"required": null`, and its call trained with `"city": null`
    import pyarrow as pa
    import pyarrow.parquet as pq

    weather = {"name": "weather", "description": "the weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    now = {"name": "now", "parameters": {"type": "object", "properties": {}}}
    rows = []
    for i in range(20):
        tool, arguments = (weather, {"city": "Oslo"}) if i % 2 else (now, {})
        call = {"id": "c", "type": "function", "function": {"name": tool["name"], "arguments": arguments}}
        rows.append({"messages": [{"role": "user", "content": f"q {i}"},
                                  {"role": "assistant", "content": None, "tool_calls": [call]},
                                  {"role": "tool", "content": "done", "tool_call_id": "c"},
                                  {"role": "assistant", "content": f"a {i}"}],
                     "tools": [{"type": "function", "function": tool}]})
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "tools.parquet")
    data = _data(tmp_path / "tools.parquet", "data.cleaning.duplicates=keep")
    read = [c for split in data.splits.values() for c in split]
    assert len(read) == 20
    for c in read:
        i = int(c.messages[0][1].split()[1])
        assert json.loads(c.tools) == rows[i]["tools"]
        assert json.loads(c.messages[1][1]) == rows[i]["messages"][1]["tool_calls"]


def test_a_json_object_of_columns_is_read_row_by_row(tmp_path):
    # {"messages": [...]} was handed to Arrow whole, which refused it ("fields whose types differ between rows") where a
    # content is a text in one row and a list of parts in the next, as the same rows are read in a JSON array
    chats = [[{"role": "user", "content": f"q {i}"},
              {"role": "assistant", "content": f"a {i}" if i % 2 else [{"type": "text", "text": f"a {i}"}]}]
             for i in range(20)]
    path = tmp_path / "columns.json"
    path.write_text(json.dumps({"messages": chats, "kind": ["odd" if i % 2 else "even" for i in range(20)]}))
    data = _data(path)
    read = sorted((c.messages[0][1], c.response, c.kind) for split in data.splits.values() for c in split)
    assert read == sorted((f"q {i}", f"a {i}", "odd" if i % 2 else "even") for i in range(20))


@pytest.mark.parametrize("orient", ["columns", "index", "split"])
def test_pandas_to_json_layouts_are_read_as_rows(tmp_path, orient):
    # df.to_json(path), pandas' default (orient="columns"), was refused: "must hold a JSON array of objects ... it holds
    # something else", without a word on how to write it
    import pandas as pd

    from conftest import make_rows
    from emotune.core.config.data import DataConfig
    from emotune.data import load_data

    rows = make_rows(6, seed=0)
    pd.DataFrame(rows).to_json(tmp_path / "rows.json", orient=orient)
    data = load_data(DataConfig(source=str(tmp_path / "rows.json"), validation_size=6, test_size=6), seed=0)
    assert sum(len(split) for split in data.splits.values()) == len({r["text"] for r in rows})
    chats = pd.DataFrame({"instruction": [f"q {i}" for i in range(20)], "output": [f"a {i}" for i in range(20)]})
    chats.to_json(tmp_path / "chats.json", orient=orient)
    read = _data(tmp_path / "chats.json")
    assert sorted(c.response for split in read.splits.values() for c in split) == sorted(chats["output"])


def test_a_json_object_that_is_no_table_says_how_pandas_writes_rows(tmp_path):
    (tmp_path / "odd.json").write_text(json.dumps({"a": {"x": 1}, "b": {"y": 2}}))
    from emotune.core.config.data import DataConfig
    from emotune.data import load_data

    with pytest.raises(UserError, match=r'it holds something else. From pandas, write it with df.to_json\(path, '
                                        r'orient="records", lines=True\)'):
        load_data(DataConfig(source=str(tmp_path / "odd.json")), seed=0)


def test_turns_and_history_that_a_csv_file_holds_as_json_text_are_read_as_lists(tmp_path, capsys):
    # pandas' to_csv writes a list as its text: such a `messages` column read as "sharegpt format has no column
    # 'conversations'; set data.columns", a fix that cannot help, and an Alpaca `history` as "not a list of pairs"
    import pandas as pd

    chats = [{"messages": json.dumps([{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": f"a {i}"}])}
             for i in range(20)]
    pd.DataFrame(chats).to_csv(tmp_path / "chats.csv", index=False)
    data = _data(tmp_path / "chats.csv")
    assert sorted(c.response for split in data.splits.values() for c in split) == sorted(f"a {i}" for i in range(20))
    assert "`messages` read from JSON text" in capsys.readouterr().out
    alpaca = [{"instruction": f"q {i}", "output": f"a {i}", "history": json.dumps([["hi", "hello"]])} for i in range(20)]
    pd.DataFrame(alpaca).to_csv(tmp_path / "alpaca.csv", index=False)
    data = _data(tmp_path / "alpaca.csv")
    assert {c.messages[:2] for split in data.splits.values() for c in split} == {(("user", "hi"), ("assistant", "hello"))}


def test_llamafactory_openai_entries_are_read_as_messages(tmp_path):
    # LLaMA-Factory's third format (`"formatting": "openai"`) was refused: "its formats are alpaca and sharegpt"
    rows = [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q {i}"},
                          {"role": "assistant", "content": f"a {i}"}]} for i in range(20)]
    (tmp_path / "chat.json").write_text(json.dumps(rows))
    tags = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
            "system_tag": "system"}
    (tmp_path / "dataset_info.json").write_text(json.dumps({
        "plain": {"file_name": "chat.json", "formatting": "openai"},
        "tagged": {"file_name": "chat.json", "formatting": "openai", "columns": {"messages": "messages"}, "tags": tags}}))
    for name in ("plain", "tagged"):
        data = _data(tmp_path, f"data.datasets=[{name}]")
        read = [c for split in data.splits.values() for c in split]
        assert sorted(c.response for c in read) == sorted(f"a {i}" for i in range(20))
        assert {c.system for c in read} == {"be brief"}


@pytest.mark.parametrize("first", [[], None])
def test_the_format_is_told_by_the_first_turn_of_any_row(tmp_path, first):
    # a first row without turns made the whole OpenAI file ShareGPT: "(sharegpt format) has no column 'conversations';
    # set data.columns", where only that one row is wrong
    rows = [{"messages": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": f"a {i}"}]}
            for i in range(20)]
    rows[0]["messages"] = first
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(UserError, match=r"chat.jsonl` rows 1: ") as err:
        _data(path)
    assert "conversations" not in str(err.value)
    data = _data(path, "data.skip_bad_rows=true")
    assert sum(len(split) for split in data.splits.values()) == 19


def test_an_openai_refusal_is_the_answers_text(tmp_path):
    # a refusal beside a null content was "the response is empty", and a refusal content part "holds images, audio or
    # video"; both are the text the assistant answered with
    rows = [{"messages": [{"role": "user", "content": f"q {i}"},
                          {"role": "assistant", "content": f"a {i}", "refusal": None, "annotations": []}]}
            for i in range(20)]
    rows[3]["messages"][1] = {"role": "assistant", "content": None, "refusal": "I can't help with that."}
    rows[4]["messages"][1] = {"role": "assistant", "content": [{"type": "refusal", "refusal": "Nor with that."}]}
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    answers = {c.messages[0][1]: c.response for split in _data(path).splits.values() for c in split}
    assert answers["q 3"] == "I can't help with that." and answers["q 4"] == "Nor with that." and answers["q 5"] == "a 5"


def test_a_dataset_info_json_saved_with_a_byte_order_mark_is_read(tmp_path):
    # refused as "not readable JSON (Unexpected UTF-8 BOM (decode using utf-8-sig) ...)"; Windows editors save so
    rows = [{"instruction": f"q {i}", "output": f"a {i}"} for i in range(20)]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    (tmp_path / "dataset_info.json").write_bytes(b"\xef\xbb\xbf" + json.dumps({"mine": {"file_name": "rows.json"}}).encode())
    data = _data(tmp_path, "data.datasets=[mine]")
    assert sum(len(split) for split in data.splits.values()) == 20


def test_a_csv_header_that_names_a_read_column_twice_is_refused(tmp_path):
    # the rows kept the last `output` without a word, training the answers of the wrong column
    path = tmp_path / "rows.csv"
    path.write_text("instruction,output,output,note,note\n" + "".join(f"q {i},a {i},b {i},x,y\n" for i in range(20)))
    with pytest.raises(UserError, match=r"rows.csv` has 2 columns named `output` \(columns: instruction, output, output, "
                                        r"note, note\), so it is unclear which one to read"):
        _data(path)
    path.write_text("instruction,output,note,note\n" + "".join(f"q {i},a {i},x,y\n" for i in range(20)))
    assert sum(len(split) for split in _data(path).splits.values()) == 20  # a column no format reads may repeat


def test_trl_prompt_only_data_is_named(tmp_path):
    # "in none of the formats ...; set data.format and data.columns to match it": no setting gives answers it lacks
    path = tmp_path / "grpo.jsonl"
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"q {i}"}]}) + "\n" for i in range(20)))
    with pytest.raises(UserError, match=r"has a `prompt` column and no answers .*TRL's prompt-only format, for GRPO.*"
                                        r"Add each answer in a `completion` column\.") as err:
        _data(path)
    assert "data.format" not in str(err.value)
    path.write_text("".join(json.dumps({"prompt": f"q {i}", "solution": f"a {i}"}) + "\n" for i in range(20)))
    with pytest.raises(UserError, match=r"or name the column that holds it \(e.g. data.columns.prompt=prompt "
                                        r"data.columns.response=solution\)"):
        _data(path)
    data = _data(path, "data.columns.prompt=prompt", "data.columns.response=solution")
    assert sum(len(split) for split in data.splits.values()) == 20


@pytest.mark.parametrize("system", [
    [{"text": "Be brief."}],  # Amazon Bedrock's conversation format (Nova)
    [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],  # Anthropic's system blocks
    {"role": "system", "content": "Be brief."},  # one OpenAI-style message
    {"role": "system", "parts": [{"text": "Be brief."}]},  # Gemini's systemInstruction
])
def test_a_system_column_of_text_blocks_is_their_text(tmp_path, system):
    # the system prompt trained was the blocks' JSON, `[{"text": "Be brief."}]`, without a word
    rows = [{"system": system, "messages": [{"role": "user", "content": [{"text": f"q {i}"}]},
                                            {"role": "assistant", "content": [{"text": f"a {i}"}]}]} for i in range(20)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert {c.system for split in _data(path).splits.values() for c in split} == {"Be brief."}
    alpaca = tmp_path / "alpaca.jsonl"
    alpaca.write_text("".join(json.dumps({"instruction": f"q {i}", "output": f"a {i}", "system": system}) + "\n"
                              for i in range(20)))
    assert {c.system for split in _data(alpaca).splits.values() for c in split} == {"Be brief."}


def test_gemini_tuning_rows_are_read_as_their_turns(tmp_path, capsys):
    # Vertex AI's tuning JSONL was "in none of the formats; set data.format and data.columns", and configured by hand
    # its systemInstruction was trained as JSON and a function call as an empty answer
    call = {"name": "weather", "args": {"city": "Oslo"}}
    rows = [{"systemInstruction": {"role": "system", "parts": [{"text": "Be brief."}]},
             "contents": [{"role": "user", "parts": [{"text": f"q {i}"}]},
                          {"role": "model", "parts": [{"functionCall": call}]},
                          {"role": "function", "parts": [{"functionResponse": {"name": "weather", "response": {"t": i}}}]},
                          {"role": "model", "parts": [{"text": f"a {i}"}]}]} for i in range(20)]
    path = tmp_path / "gemini.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    read = [c for split in _data(path).splits.values() for c in split]
    assert "read as Google's Gemini tuning rows" in capsys.readouterr().out
    assert len(read) == 20 and {c.system for c in read} == {"Be brief."}
    one = next(c for c in read if c.messages[0][1] == "q 3")
    assert [role for role, _ in one.messages] == ["user", "assistant", "user", "assistant"]
    assert json.loads(one.messages[1][1]) == [call] and json.loads(one.messages[2][1])["response"] == {"t": 3}
    assert one.response == "a 3"
    rows[0]["contents"][0]["parts"].append({"inlineData": {"mimeType": "image/png", "data": "AAAA"}})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(UserError, match=r"rows 1: the row holds images, audio or video"):
        _data(path)


def test_a_json_array_with_a_key_twice_in_an_object_is_refused_as_json_lines_are(tmp_path):
    # Python's json keeps the last of two equal keys: the second `output` (or `label`) was read without a word
    from emotune.core.config.data import DataConfig
    from emotune.data import load_data

    path = tmp_path / "rows.json"
    path.write_text("[" + ",".join(f'{{"instruction": "q {i}", "output": "a {i}", "output": "b {i}"}}'
                                   for i in range(20)) + "]")
    with pytest.raises(UserError, match=r"rows.json` has an object with the key `output` twice"):
        _data(path)
    path.write_text("[" + ",".join(f'{{"text": "t {i}", "label": "joy", "label": "sadness"}}' for i in range(20)) + "]")
    with pytest.raises(UserError, match=r"rows.json` has an object with the key `label` twice"):
        load_data(DataConfig(source=str(path)), seed=0)


def test_objects_one_after_another_with_a_key_twice_are_refused(tmp_path):
    path = tmp_path / "jq.json"
    # the key twice in a later object: the whole-file parse stops at the first object's end ("Extra data")
    path.write_text("".join(f'{{\n  "instruction": "q {i}",\n  "output": "a {i}"' + (f',\n  "output": "b {i}"' if i == 4 else "")
                            + "\n}\n" for i in range(20)))
    with pytest.raises(UserError, match=r"jq.json` has an object with the key `output` twice"):
        _data(path)


def _anthropic_rows(n: int, answer: list[dict]) -> list[dict]:
    """Anthropic Messages API conversations: content blocks, a tool_use block and its tool_result."""
    return [{"system": "be brief", "messages": [
        {"role": "user", "content": [{"type": "text", "text": f"q {i}"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "let me check"},
                                          {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "sunny"}]}]},
        {"role": "assistant", "content": answer + [{"type": "text", "text": f"a {i}"}]}]} for i in range(n)]


def test_anthropic_tool_blocks_are_kept_and_thinking_blocks_named(tmp_path):
    # every row was refused as holding "images, audio or video"
    path = tmp_path / "claude.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in _anthropic_rows(20, [])))
    one = next(c for split in _data(path).splits.values() for c in split if c.messages[0][1] == "q 3")
    call = {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Oslo"}}
    assert one.messages[1][1] == "let me check\n" + json.dumps(call) and one.messages[2][1] == "sunny"
    assert one.response == "a 3" and one.system == "be brief"
    path.write_text("".join(json.dumps(row) + "\n" for row in _anthropic_rows(20, [{"type": "thinking", "thinking": "so"}])))
    with pytest.raises(UserError, match=r"has its reasoning in a field of its own .*or a `thinking` content block"):
        _data(path)


def test_fasttext_lines_are_read_as_label_and_text(tmp_path):
    # refused as lines "with no `;` between text and label"; a line whose text held a `;` was split there
    from conftest import make_rows
    from emotune.core.config.data import DataConfig
    from emotune.data import load_data

    rows = make_rows(6, seed=0)
    rows[0] = {**rows[0], "text": rows[0]["text"] + "; and more"}
    path = tmp_path / "train.txt"
    path.write_text("".join(f"__label__{r['label']} {r['text']}\n" for r in rows))
    data = load_data(DataConfig(source=str(path), validation_size=6, test_size=6, cleaning={"duplicates": "keep"}), seed=0)
    read = sorted((t, lab) for split in data.splits.values() for t, lab in zip(split["text"], split["label"], strict=True))
    assert read == sorted((r["text"], r["label"]) for r in rows)
    path.write_text("".join(f"__label__{r['label']} __label__joy {r['text']}\n" for r in rows))
    with pytest.raises(UserError, match=r"fastText's format with several labels on lines 1, 2, 3, 4, 5 and 31 more"):
        load_data(DataConfig(source=str(path)), seed=0)


def _deep_rows(depth: int, *, first: str, second: str) -> list[str]:
    lines = [json.dumps({first: f"q {i}", second: "joy" if i % 2 else "sadness"}) for i in range(20)]
    lines[5] = json.dumps({first: "q", second: "joy"})[:-1] + ', "meta": ' + "[" * depth + "]" * depth + "}"
    return lines


def test_json_nested_beyond_the_readers_depth_is_named_not_a_traceback(tmp_path):
    # Python's json raised RecursionError through the command line
    lines = _deep_rows(2000, first="instruction", second="output")
    (tmp_path / "deep.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "deep.json").write_text("[" + ",".join(lines) + "]")
    with pytest.raises(UserError, match=r"deep.jsonl` line 6 nests lists or objects deeper than Python's JSON reader"):
        _data(tmp_path / "deep.jsonl")
    with pytest.raises(UserError, match=r"deep.json` nests lists or objects deeper than Python's JSON reader"):
        _data(tmp_path / "deep.json")


def test_jsonl_nested_deep_enough_to_crash_arrow_is_refused_before_it(tmp_path):
    # Arrow's JSON reader overflowed its stack (a segmentation fault, no message) on a classification JSONL file; a
    # child process, so that without the check the crash is this test's failure, not the test run's end
    import subprocess
    import sys

    path = tmp_path / "deep.jsonl"
    path.write_text("\n".join(_deep_rows(30000, first="text", second="label")) + "\n")
    script = ("from emotune.core.config.data import DataConfig\nfrom emotune.core.errors import UserError\n"
              "from emotune.data import load_data\n"
              f"try:\n    load_data(DataConfig(source={str(path)!r}), seed=0)\nexcept UserError as err:\n    print(err)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")})
    assert done.returncode == 0, done.stderr[-500:]
    assert "deep.jsonl` line 6 nests lists or objects deeper" in done.stdout


def test_half_an_emoji_escaped_in_json_is_the_replacement_character(tmp_path):
    # JavaScript writes an emoji cut in two as `\ud83d` alone; Python reads it into a string UTF-8 cannot hold, and
    # Arrow raised UnicodeEncodeError through the command line. A whole pair (Python's json.dumps) stays the emoji.
    from emotune.core.config.data import DataConfig
    from emotune.data import load_data

    texts = [f"t {i} " + ("\\ud83d" if i % 2 else "\\ud83d\\ude00") for i in range(20)]
    rows = [f'{{"text": "{t}", "label": "{"joy" if i % 3 else "sadness"}"}}' for i, t in enumerate(texts)]
    for name, content in (("a.jsonl", "\n".join(rows) + "\n"), ("a.json", "[" + ",".join(rows) + "]")):
        (tmp_path / name).write_text(content)
        data = load_data(DataConfig(source=str(tmp_path / name), validation_size=4, test_size=4,
                                    cleaning={"unicode_nfc": False}), seed=0)
        read = {t for split in data.splits.values() for t in split["text"]}
        assert read == {f"t {i} " + ("\ufffd" if i % 2 else "\U0001f600") for i in range(20)}
    chats = [f'{{"instruction": "{t}", "output": "a"}}' for t in texts]
    (tmp_path / "chat.jsonl").write_text("\n".join(chats) + "\n")
    prompts = {c.messages[0][1] for split in _data(tmp_path / "chat.jsonl").splits.values() for c in split}
    assert prompts == {f"t {i} " + ("\ufffd" if i % 2 else "\U0001f600") for i in range(20)}


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.json"])
def test_a_nan_label_is_a_missing_label_not_a_second_type(tmp_path, name):
    # pandas' missing label, written by Python's json as NaN, was "the `label` field holds values of several types
    # (float, str); give it one type", where the row has no label at all
    from emotune.core.config.data import DataConfig
    from emotune.data import load_data

    rows = [{"text": f"t {i}", "label": float("nan") if i == 5 else ["joy", "sadness"][i % 2]} for i in range(20)]
    lines = [json.dumps(row) for row in rows]
    (tmp_path / name).write_text("\n".join(lines) + "\n" if name.endswith("l") else "[" + ",".join(lines) + "]")
    with pytest.raises(UserError, match=r"1 row\(s\) have no label \(rows 6\)"):
        load_data(DataConfig(source=str(tmp_path / name)), seed=0)


def test_a_csv_label_column_mixing_ids_and_names_is_refused(tmp_path):
    # read as six labels (0, 1, 2, anger, joy, sadness) without a word; JSON Lines refuses the same column
    from emotune.core.config.data import DataConfig
    from emotune.data import load_data

    names = ["joy", "sadness", "anger"]
    path = tmp_path / "rows.csv"
    path.write_text("text,label\n" + "".join(f"t {i},{i % 3 if i % 2 else names[i % 3]}\n" for i in range(60)))
    with pytest.raises(UserError, match=r"the labels mix whole numbers \(0, 1, 2\) with names \(anger, joy, sadness\)"):
        load_data(DataConfig(source=str(path)), seed=0)
    data = load_data(DataConfig(source=str(path), label_names=["0", "1", "2", "anger", "joy", "sadness"]), seed=0)
    assert len(data.labels) == 6  # where they are six labels, saying so reads them


def test_how_an_sft_csv_file_was_read_is_said(tmp_path, capsys):
    # the notes of the shared reader (a `;`-separated .csv read with `;`) were dropped for sft data
    path = tmp_path / "rows.csv"
    path.write_text("instruction;output\n" + "".join(f"q {i};a {i}\n" for i in range(20)))
    assert sum(len(split) for split in _data(path).splits.values()) == 20
    assert "rows.csv`: the header is separated by `;`, not commas" in capsys.readouterr().out


def test_jsonl_files_joined_with_cat_keep_the_later_ones_byte_order_mark_out(tmp_path):
    # `cat a.jsonl b.jsonl` where b was saved with a byte-order mark: refused at b's first line as "Unexpected UTF-8
    # BOM (decode using utf-8-sig)", a fix no setting gives
    from emotune.core.config.data import DataConfig
    from emotune.data import load_data

    def joined(rows: list[dict]) -> bytes:
        half = len(rows) // 2
        lines = [json.dumps(row).encode() + b"\n" for row in rows]
        return b"".join(lines[:half]) + b"\xef\xbb\xbf" + b"".join(lines[half:])

    path = tmp_path / "joined.jsonl"
    path.write_bytes(joined([{"text": f"t {i}", "label": ["joy", "sadness"][i % 2]} for i in range(40)]))
    data = load_data(DataConfig(source=str(path), validation_size=4, test_size=4), seed=0)
    assert sum(len(split) for split in data.splits.values()) == 40
    path.write_bytes(joined([{"instruction": f"q {i}", "output": f"a {i}"} for i in range(20)]))
    assert sum(len(split) for split in _data(path).splits.values()) == 20
