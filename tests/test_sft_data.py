"""sft data: every row format, dataset_info.json, malformed rows (reported at once or skipped), cleaning and splits."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import write_jsonl
from emotune.core.config.load import load_config
from emotune.core.errors import UserError
from emotune.data.conversation_data import load_conversations
from emotune.data.conversations import Conversation


def _data(source: Path | str, *overrides: str):
    cfg = load_config(None, ["task=sft", f"data.source={source}", *overrides])
    return load_conversations(cfg.data, cfg.seed)


def _alpaca(n: int, prefix: str = "q", kind: str | None = None) -> list[dict]:
    return [{"instruction": f"{prefix} question {i}", "input": f"context {i}" if i % 2 else "", "output": f"answer {i}",
             **({"kind": kind} if kind else {})} for i in range(n)]


def test_alpaca_with_system_and_history(tmp_path):
    rows = _alpaca(30)
    rows[0].update(system="be brief", history=[["hi", "hello"], ["how are you", "fine"]])
    data = _data(write_jsonl(tmp_path / "a.jsonl", rows), "data.cleaning.duplicates=keep")
    every = [c for split in data.splits.values() for c in split]
    assert len(every) == 30
    first = next(c for c in every if c.system == "be brief")
    assert first.messages == (("user", "hi"), ("assistant", "hello"), ("user", "how are you"), ("assistant", "fine"),
                              ("user", "q question 0"), ("assistant", "answer 0"))
    second = next(c for c in every if c.messages[0][1].startswith("q question 1\n"))
    assert second.messages[0][1] == "q question 1\n\ncontext 1"


def test_input_separator_joins_instruction_and_input_and_decides_reuse(tmp_path):
    """data.input_separator: a blank line by default (the rows of every run made before it existed), any other text
    joins the row's own instruction and input and those of its H2O parent rows; prepared rows made with one separator
    are not the rows of another."""
    from emotune.tasks.sft.task import data_fingerprint

    rows = [{"id": i, "parent_id": i - 1 if i % 2 else None, "instruction": f"q {i}", "input": f"context {i}",
             "output": f"a {i}"} for i in range(20)]
    path = write_jsonl(tmp_path / "chained.jsonl", rows)
    for overrides, joined in (((), "\n\n"), (('data.input_separator=" | "',), " | ")):
        cfg = load_config(None, ["task=sft", f"data.source={path}", *overrides])
        assert cfg.data.input_separator == joined
        every = {c.response: c for split in load_conversations(cfg.data, cfg.seed).splits.values() for c in split}
        assert every["a 3"].messages == (("user", f"q 2{joined}context 2"), ("assistant", "a 2"),
                                         ("user", f"q 3{joined}context 3"), ("assistant", "a 3"))
    default, newline = (load_config(None, ["task=sft", *more]) for more in ((), ['data.input_separator="\\n"']))
    assert data_fingerprint(default) != data_fingerprint(newline)


@pytest.mark.parametrize(("override", "says"), [
    ("data.input_separator=\\n", "holds `\\n` as two characters"),  # unquoted: a backslash and an n
    ("data.input_separator=", "is empty"),
    ("data.input_separator=null", "must be text")])
def test_an_input_separator_that_joins_nothing_useful_is_refused_by_name(override, says):
    with pytest.raises(UserError, match=r"`data\.input_separator`: " + re.escape(says) + r".*in double quotes"):
        load_config(None, ["task=sft", override])


def test_an_sft_run_begun_before_the_input_separator_existed_resumes_with_the_blank_line_only(tmp_path):
    from emotune.core.config.build import dump_config
    from emotune.core.rundir import RunDir, open_run, write_json, write_text
    from emotune.tasks.sft.task import data_fingerprint

    default, newline = (load_config(None, ["task=sft", *more]) for more in ((), ['data.input_separator="\\n"']))
    assert '  input_separator: "\\n\\n"' in dump_config(default).splitlines()  # one line in config.yaml, not blank ones
    run = RunDir(tmp_path / "run")
    write_text(run.config, "\n".join(line for line in dump_config(default).splitlines() if "input_separator" not in line))
    write_json(run.run_json, {"status": "failed"})
    write_json(run.data_report, {"fingerprint": data_fingerprint(default)})
    with pytest.raises(UserError, match="different config or data"):
        open_run(run.root, dump_config(newline), overwrite=False, data_fingerprint=data_fingerprint(newline))
    open_run(run.root, dump_config(default), overwrite=False, data_fingerprint=data_fingerprint(default))


def test_sharegpt_with_tags_tools_and_function_turns(tmp_path):
    rows = [{"conversations": [{"from": "human", "value": f"weather in city {i}?"},
                               {"from": "function_call", "value": '{"name": "weather"}'},
                               {"from": "observation", "value": "sunny"},
                               {"from": "gpt", "value": f"it is sunny {i}"}],
             "system": "sys", "tools": '[{"name": "weather"}]'} for i in range(20)]
    data = _data(write_jsonl(tmp_path / "s.jsonl", rows))
    one = data.splits["train"][0]
    assert [r for r, _ in one.messages] == ["user", "assistant", "user", "assistant"]
    assert one.messages[1][1] == '{"name": "weather"}' and one.messages[2][1] == "sunny"
    assert one.system == "sys" and one.chat("default")[0]["content"] == 'sys\n\nTools available:\n[{"name": "weather"}]'
    assert Conversation.from_row(json.loads(json.dumps(one.as_row()))) == one  # as saved in the run's data/

    custom = [{"dialog": [{"speaker": "u", "text": f"hello {i}"}, {"speaker": "a", "text": f"hi {i}"}]} for i in range(20)]
    data = _data(write_jsonl(tmp_path / "c.jsonl", custom), "data.format=sharegpt", "data.columns.messages=dialog",
                 "data.tags.role_tag=speaker", "data.tags.content_tag=text", "data.tags.user_tag=u", "data.tags.assistant_tag=a")
    assert data.splits["train"][0].messages[1][1].startswith("hi ")


def test_openai_messages_in_parquet(tmp_path):
    rows = [{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": f"u {i}"},
                          {"role": "assistant", "content": f"a {i}"}]} for i in range(20)]
    path = tmp_path / "m.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    data = _data(path)
    one = data.splits["train"][0]
    assert one.system == "s" and one.messages[0][0] == "user" and one.messages[1][1].startswith("a ")


def test_per_turn_keys_that_parquet_fills_with_null_are_keys_not_given(tmp_path):
    """Parquet (also Arrow, save_to_disk and the hub) gives every turn every key some turn has: the `weight` of OpenAI's
    format, written on one answer only, was null on the other turns and every row was refused for a weight other than
    0 or 1; a `train_detail` key anywhere refused all rows. A null is a key not given."""
    rows = [{"messages": [{"role": "user", "content": f"u {i}"}, {"role": "assistant", "content": "draft", "weight": 0},
                          {"role": "user", "content": "again"}, {"role": "assistant", "content": f"a {i}"}]}
            for i in range(20)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "w.parquet")
    every = [c for s in _data(tmp_path / "w.parquet").splits.values() for c in s]
    assert len(every) == 20 and all(c.untrained == (0,) for c in every)
    for row in rows:
        row["messages"][1] = {"role": "assistant", "content": "draft", "training": False}
    rows[0]["messages"][3]["train_detail"] = [{"begin_offset": 0, "end_offset": 1, "train": True}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    every = [c for s in _data(tmp_path / "t.parquet", "data.skip_bad_rows=true").splits.values() for c in s]
    assert len(every) == 19 and all(c.untrained == (0,) for c in every)  # the row with train_detail alone refused


def test_a_json_array_under_jsonl_and_objects_over_several_lines_are_read(tmp_path):
    """A JSON array in a .jsonl file (which `datasets` reads) was refused for its first line, and objects written one
    after another over several lines (`jq '.[]'`, which classification data read) for a first line that is no object."""
    rows = _alpaca(20)
    (tmp_path / "array.jsonl").write_text(json.dumps(rows, indent=2), encoding="utf-8")
    (tmp_path / "jq.json").write_text("\n".join(json.dumps(r, indent=2) for r in rows), encoding="utf-8")
    for name in ("array.jsonl", "jq.json"):
        every = [c for s in _data(tmp_path / name).splits.values() for c in s]
        assert sorted(c.response for c in every) == sorted(r["output"] for r in rows)
    (tmp_path / "broken.jsonl").write_text(json.dumps(rows, indent=2)[:-40], encoding="utf-8")
    with pytest.raises(UserError, match=r"broken.jsonl` is not valid JSON: .* at line \d+, column \d+"):
        _data(tmp_path / "broken.jsonl")


def test_nan_that_pythons_json_writes_for_pandas_missing_values_is_no_value(tmp_path):
    """json.dumps of a DataFrame's records writes a missing value as `NaN`: the system prompt became the text "NaN", an
    empty input was joined as "NaN", and an empty history refused the row."""
    nan = float("nan")
    rows = [{"instruction": f"q {i}", "input": nan if i % 2 else f"context {i}", "output": f"a {i}", "system": nan,
             "history": nan, "images": nan, "kind": nan} for i in range(20)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    assert "NaN" in (tmp_path / "d.jsonl").read_text()
    every = [c for s in _data(tmp_path / "d.jsonl").splits.values() for c in s]
    assert len(every) == 20 and all(c.system is None and c.kind is None and len(c.messages) == 2 for c in every)
    assert sorted(c.messages[0][1] for c in every) == sorted(f"q {i}" if i % 2 else f"q {i}\n\ncontext {i}"
                                                             for i in range(20))


@pytest.mark.parametrize("name", ["d.csv", "d.tsv"])
def test_csv_cells_of_conversations_are_read_as_written(tmp_path, name):
    """Arrow typed CSV columns by their values, so an answer `0.50` was trained as `0.5`, `007` as `7.0` and an
    input `0.10` joined as `0.1`; conversations are text, as written."""
    delimiter = "\t" if name.endswith(".tsv") else ","
    lines = ["instruction", "input", "output"], *([f"price of item {i}", "0.10", "0.50" if i % 2 else "007"]
                                                   for i in range(20))
    (tmp_path / name).write_text("".join(delimiter.join(line) + "\n" for line in lines), encoding="utf-8")
    every = [c for s in _data(tmp_path / name).splits.values() for c in s]
    assert sorted({c.response for c in every}) == ["0.50", "007"]
    assert all(c.messages[0][1].endswith("\n\n0.10") for c in every)


def test_json_array_and_folder_of_split_files(tmp_path):
    folder = tmp_path / "split"
    folder.mkdir()
    (folder / "train.json").write_text(json.dumps(_alpaca(20)), encoding="utf-8")
    write_jsonl(folder / "test.jsonl", _alpaca(4, prefix="t"))
    data = _data(folder)
    assert len(data.splits["test"]) == 4 and len(data.splits["train"]) + len(data.splits["validation"]) == 20


def test_malformed_rows_reported_at_once_with_row_numbers(tmp_path):
    rows = _alpaca(20)
    rows[2]["output"] = ""
    rows[5]["output"] = "  "
    rows[7]["history"] = "not a list"
    rows[9]["instruction"] = None
    rows[9]["input"] = ""
    with pytest.raises(UserError) as err:
        _data(write_jsonl(tmp_path / "bad.jsonl", rows))
    message = str(err.value)
    assert "3 problems" in message and "rows 3, 6: the response" in message and "rows 8:" in message
    assert "rows 10: a user turn is empty" in message and "skip_bad_rows" in message

    turns = [{"conversations": [{"from": "gpt", "value": "x"}, {"from": "human", "value": "y"}]}] + \
            [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]} for i in range(20)]
    with pytest.raises(UserError, match="rows 1: the turns do not alternate"):
        _data(write_jsonl(tmp_path / "order.jsonl", turns))
    with pytest.raises(UserError, match="has no column 'output'"):
        _data(write_jsonl(tmp_path / "col.jsonl", [{"instruction": "x", "answer": "y"}] * 20), "data.format=alpaca")


def test_skip_bad_rows_counts_them(tmp_path, capsys):
    rows = _alpaca(25)
    rows[3]["output"] = ""
    data = _data(write_jsonl(tmp_path / "bad.jsonl", rows), "data.skip_bad_rows=true")
    assert sum(data.report["skipped_bad_rows"].values()) == 1
    assert sum(len(s) for s in data.splits.values()) == 24
    assert "skipped 1 malformed rows" in capsys.readouterr().out


def test_duplicates_and_leakage_on_the_whole_conversation(tmp_path):
    folder = tmp_path / "d"
    folder.mkdir()
    train = _alpaca(20) + [_alpaca(1)[0]]  # an exact repeat of row 0
    test = [{"instruction": "Q QUESTION 0!", "input": "", "output": "answer 0"},  # row 0 up to case and punctuation
            {"instruction": "q question 0", "input": "", "output": "another answer"}]  # same prompt, other answer: kept
    write_jsonl(folder / "train.jsonl", train)
    write_jsonl(folder / "test.jsonl", test)
    data = _data(folder)
    assert data.report["cleaning"]["duplicates"]["train"] == 1
    assert data.report["cleaning"]["leakage"]["test"] == 1
    assert [c.response for c in data.splits["test"]] == ["another answer"]


def test_dataset_info_mixes_two_datasets_and_takes_eval_dataset(tmp_path):
    write_jsonl(tmp_path / "alpaca_part.jsonl", _alpaca(30, prefix="alpaca"))
    write_jsonl(tmp_path / "chat_part.jsonl", [{"dialog": [{"role": "user", "content": f"chat question {i}"},
                                                           {"role": "assistant", "content": f"chat answer {i}"}]}
                                               for i in range(30)])
    write_jsonl(tmp_path / "held.jsonl", _alpaca(5, prefix="held"))
    info = {"a": {"file_name": "alpaca_part.jsonl", "num_samples": 10},
            "c": {"file_name": "chat_part.jsonl", "formatting": "sharegpt", "columns": {"messages": "dialog"},
                  "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}},
            "h": {"file_name": "held.jsonl"},
            "prefs": {"file_name": "alpaca_part.jsonl", "ranking": True}}
    (tmp_path / "dataset_info.json").write_text(json.dumps(info), encoding="utf-8")
    data = _data(tmp_path, "data.datasets=[a, c]", "data.max_samples=20")
    sources = [c.source for split in ("train", "validation", "test") for c in data.splits[split]]
    assert sources.count("a") == 10 and sources.count("c") == 20
    for split in ("validation", "test"):  # stratified by dataset
        assert {c.source for c in data.splits[split]} == {"a", "c"}

    data = _data(tmp_path, "data.datasets=[a, c]", "data.eval_datasets=[h]")
    assert [c.source for c in data.splits["test"]] == ["h"] * 5
    with pytest.raises(UserError, match="ranking"):
        _data(tmp_path, "data.datasets=[prefs]")
    with pytest.raises(UserError, match="name the datasets"):
        _data(tmp_path)
    with pytest.raises(UserError, match="data.datasets names `nope`, which .* does not define"):
        _data(tmp_path, "data.datasets=[nope]")
    # the test split's name was reported as data.datasets', the key that was right (LLaMA-Factory's eval_dataset)
    with pytest.raises(UserError, match="data.eval_datasets names `nope`, which .* does not define"):
        _data(tmp_path, "data.datasets=[a]", "data.eval_datasets=[nope]")


def _fake_hub(calls: list):
    """A stand-in for huggingface_hub.snapshot_download over two repositories, writing only the files that
    `allow_patterns` selects, as the real client does: acme/alpaca holds one alpaca JSON file (and the hub's
    metadata JSON), acme/chat a sharegpt configuration `en` as Parquet train and test files."""
    import fnmatch

    def snapshot_download(repo_id, repo_type=None, revision=None, local_dir=None, allow_patterns=None):
        calls.append((repo_id, tuple(allow_patterns)))
        root = Path(local_dir)
        if repo_id == "acme/alpaca":
            files = {"alpaca_data_en.json": lambda path: path.write_text(json.dumps(_alpaca(24, prefix="hub")), encoding="utf-8"),
                     "dataset_infos.json": lambda path: path.write_text('{"default": {"features": {}}}', encoding="utf-8")}
        elif repo_id == "acme/chat":
            def conversations(n, split):
                rows = [{"conversations": [{"from": "human", "value": f"{split} chat {i}"}, {"from": "gpt", "value": f"reply {i}"}]}
                        for i in range(n)]
                return lambda path: pq.write_table(pa.Table.from_pylist(rows), path)
            files = {"en/train-00000-of-00001.parquet": conversations(20, "train"),
                     "en/test-00000-of-00001.parquet": conversations(6, "test")}
        else:
            raise ValueError(f"Repository Not Found for url: https://huggingface.co/api/datasets/{repo_id}")
        for name, write in files.items():
            if any(fnmatch.fnmatch(Path(name).name, pattern) for pattern in allow_patterns):
                (root / name).parent.mkdir(parents=True, exist_ok=True)
                write(root / name)
        return local_dir

    return snapshot_download


def test_dataset_info_hub_entries_download_once_with_their_subset_and_split(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _fake_hub(calls))
    info = {"alp": {"hf_hub_url": "acme/alpaca"},
            "chat": {"hf_hub_url": "acme/chat", "formatting": "sharegpt", "subset": "en"},
            "chat_test": {"hf_hub_url": "acme/chat", "formatting": "sharegpt", "subset": "en", "split": "test"},
            "wrong_subset": {"hf_hub_url": "acme/chat", "formatting": "sharegpt", "subset": "fr"},
            "wrong_split": {"hf_hub_url": "acme/chat", "formatting": "sharegpt", "subset": "en", "split": "validation"},
            "missing": {"hf_hub_url": "acme/missing"}}
    (tmp_path / "dataset_info.json").write_text(json.dumps(info), encoding="utf-8")
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    data = _data(tmp_path, "data.datasets=[alp, chat]", "data.eval_datasets=[chat_test]", cache)
    train_sources = [c.source for split in ("train", "validation") for c in data.splits[split]]
    assert train_sources.count("alp") == 24 and train_sources.count("chat") == 20  # metadata JSON is not rows
    assert sorted(c.messages[0][1] for c in data.splits["test"]) == [f"test chat {i}" for i in range(6)]
    # Parquet first; JSON files only for the repository without Parquet; each downloaded once
    other = ("*.jsonl", "*.json", "*.csv", "*.tsv", "*.jsonl.gz", "*.json.gz", "*.csv.gz", "*.tsv.gz", "*.md")
    assert calls == [("acme/alpaca", ("*.parquet", "*.md")), ("acme/alpaca", other), ("acme/chat", ("*.parquet", "*.md"))]
    _data(tmp_path, "data.datasets=[alp, chat]", "data.eval_datasets=[chat_test]", cache)
    assert len(calls) == 3  # read from the cache

    with pytest.raises(UserError, match=r"wrong_subset`: the hub dataset acme/chat has no folder `fr` \(its `subset`\); folders found: en"):
        _data(tmp_path, "data.datasets=[wrong_subset]", cache)
    with pytest.raises(UserError, match=r"wrong_split`: the hub dataset acme/chat has no `validation` split \(found: train, test\)"):
        _data(tmp_path, "data.datasets=[wrong_split]", cache)
    with pytest.raises(UserError, match=r"could not download from the hf hub \(ValueError: Repository Not Found"
                                        r".*set data.source to that folder"):
        _data(tmp_path, "data.datasets=[missing]", cache)


def test_dataset_info_hub_entry_offline_is_a_clear_error(tmp_path):
    # HF_HUB_OFFLINE=1 (conftest): the real client refuses to connect, as it would with no network
    (tmp_path / "dataset_info.json").write_text(json.dumps({"alp": {"hf_hub_url": "acme/alpaca"}}), encoding="utf-8")
    with pytest.raises(UserError, match=r"data.source `hf:acme/alpaca`: could not download from the hf hub.*hf download acme/alpaca"):
        _data(tmp_path, "data.datasets=[alp]", f"data.cache_dir={tmp_path / 'cache'}")
    # the entry named, and how to point it at a downloaded copy (the message told to set data.source, which is the
    # dataset_info.json folder already)
    with pytest.raises(UserError, match=r"^dataset_info.json entry `alp` \(hf_hub_url: acme/alpaca\): .*For this entry: put "
                                        r"the downloaded folder in `.*` as `alpaca` and give the entry \"file_name\": \"alpaca\""):
        _data(tmp_path, "data.datasets=[alp]", f"data.cache_dir={tmp_path / 'cache'}")


def test_embedded_instruct_dataset_and_limits():
    data = _data("embedded", "data.test_limit=30")
    assert [len(data.splits[s]) for s in ("train", "validation")] == [540, 60]
    assert len(data.splits["test"]) == 30 and len({c.kind for c in data.splits["test"]}) == 6


def test_sft_config_refuses_classify_keys():
    with pytest.raises(UserError) as err:
        load_config(None, ["task=sft", "prompt.user_template={text}", "data.label_names=[a, b]", "eval.method=score"])
    assert "3 problems" in str(err.value)


def test_one_content_part_given_alone_is_its_text(tmp_path):
    """A content of one part not wrapped in a list ({"type": "text", "text": ...}) was trained as its JSON."""
    rows = [{"messages": [{"role": "user", "content": {"type": "text", "text": f"q {i}"}},
                          {"role": "assistant", "content": {"type": "text", "text": f"a {i}"}}]} for i in range(20)]
    every = [c for split in _data(write_jsonl(tmp_path / "m.jsonl", rows)).splits.values() for c in split]
    assert {c.messages for c in every} == {(("user", f"q {i}"), ("assistant", f"a {i}")) for i in range(20)}


def test_responses_api_text_parts_are_text(tmp_path):
    """Rows logged from OpenAI's Responses API ({"type": "input_text"} / {"type": "output_text"} parts) were refused
    as holding images, audio or video."""
    rows = [{"messages": [{"role": "user", "content": [{"type": "input_text", "text": f"q {i}"}]},
                          {"role": "assistant", "content": [{"type": "output_text", "text": f"a {i}"}]}]}
            for i in range(20)]
    every = [c for split in _data(write_jsonl(tmp_path / "m.jsonl", rows)).splits.values() for c in split]
    assert {c.messages for c in every} == {(("user", f"q {i}"), ("assistant", f"a {i}")) for i in range(20)}


def test_openai_rows_that_mix_string_and_list_content_are_read(tmp_path):
    """Arrow wants one type per field across rows, so a valid OpenAI file whose content is a string in one message and a
    list of text parts in another (or tool arguments as text and as an object) was refused whole."""
    rows = [{"messages": [{"role": "developer", "content": "be brief"},
                          {"role": "user", "content": [{"type": "text", "text": f"q {i}"}] if i % 2 else f"q {i}"},
                          {"role": "assistant", "content": f"a {i}",
                           "tool_calls": [{"function": {"arguments": {"x": 1} if i % 3 else "{}"}}]}]} for i in range(20)]
    data = _data(write_jsonl(tmp_path / "m.jsonl", rows))
    every = [c for split in data.splits.values() for c in split]
    assert len(every) == 20 and all(c.system == "be brief" for c in every)  # `developer` is OpenAI's system role
    assert {c.messages[0][1] for c in every} == {f"q {i}" for i in range(20)}


@pytest.mark.parametrize(("rows", "says"), [
    ([{"conversations": [{"from": "bot", "value": "q"}, {"from": "assistant", "value": "a"}]}],
     r"the role 'bot', which is none of data.tags \(user_tag 'human'"),
    ([{"conversations": [{"speaker": "human", "text": "q"}, {"speaker": "gpt", "text": "a"}]}],
     r"a turn has no `from` key \(data.tags.role_tag; its keys: `speaker`, `text`\)"),
    ([{"messages": [{"role": "user", "content": "q"}, {"role": "gpt", "content": "a"}]}],
     r"the role 'gpt', which is not one of OpenAI's"),
    ([{"conversations": [{"from": "human", "value": "q"}, {"from": "system", "value": "s"}, {"from": "gpt", "value": "a"}]}],
     r"a system turn comes after the first turn"),
    ([{"messages": [{"role": "user", "content": "<image>what is it"}, {"role": "assistant", "content": "a cat"}],
       "images": ["cat.png"]}], r"holds images, audio or video"),
    ([{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                    {"role": "assistant", "content": "a cat"}]}], r"holds images, audio or video"),
    ([{"instruction": "q", "output": ["good answer", "bad answer"]}], r"the response is a list, as in a ranking dataset"),
    ([{"instruction": "q", "chosen": "good", "rejected": "bad"}], r"is a preference dataset \(columns `chosen` and `rejected`\)"),
    # OpenAI's preference fine-tuning lines were "in none of the formats", with a fix (data.format) that cannot fit
    ([{"input": {"messages": [{"role": "user", "content": "q"}]},
       "preferred_output": [{"role": "assistant", "content": "good"}],
       "non_preferred_output": [{"role": "assistant", "content": "bad"}]}],
     r"is OpenAI's preference \(DPO\) fine-tuning data \(columns `preferred_output` and `non_preferred_output`\)"),
    # TRL's unpaired preference (KTO) rows were read as prompt-completion rows, training the bad completions too
    ([{"prompt": "q", "completion": "good", "label": True}, {"prompt": "q2", "completion": "bad", "label": False}],
     r"is an unpaired preference dataset \(TRL's KTO format.*Keep the rows whose label is true"),
    ([], r"holds no rows"),
    ([{"text": "### Human: q ### Assistant: a"}], r"has a `text` column and no prompt or answer .*language modelling"),
    # Axolotl's template-free rows were told to "set data.format and data.columns", which no setting can match
    ([{"segments": [{"label": False, "text": "<s>[INST] q [/INST]"}, {"label": True, "text": " a</s>"}]}],
     r"has a `segments` column: Axolotl's template-free input_output format.*Give the rows as messages"),
    ([{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}, {"role": "user", "content": "q2"},
                    {"role": "assistant", "content": "a"}]}], r"an earlier assistant turn is empty"),
    ([{"instruction": "q", "output": "a", "history": [["hi", ""]]}], r"an earlier assistant turn is empty"),
    # reasoning datasets (Qwen3/DeepSeek-R1 `reasoning_content`, gpt-oss `thinking`) were read with the reasoning left
    # out, training the answers without it and without a word
    ([{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "so"}]}],
     r"an assistant turn has its reasoning in a field of its own"),
    ([{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "thinking": "so"}]}],
     r"an assistant turn has its reasoning in a field of its own"),
    ([{"messages": [{"role": "user", "content": {"type": "image_url", "image_url": {"url": "x"}}},
                    {"role": "assistant", "content": "a cat"}]}], r"holds images, audio or video"),
])
def test_rows_emotune_cannot_train_on_say_why(tmp_path, rows, says):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{**row, "kind": str(i)} for i in range(10) for row in rows]))
    with pytest.raises(UserError, match=says) as err:
        _data(path)
    assert ("skip_bad_rows" in str(err.value)) == ("` rows " in str(err.value))  # the row hint only for row problems


@pytest.mark.parametrize(("entry", "says"), [
    ({"file_name": "s.jsonl", "columns": ["conversations"]}, r"`columns` must be an object of column names, not list"),
    ({"file_name": "s.jsonl", "tags": "from"}, r"`tags` must be an object of tags, not str"),
    ({"file_name": 5}, r"`file_name` must be a file or folder name, not int 5"),
    ({"file_name": "s.jsonl", "num_samples": "10"}, r"`num_samples` must be a whole number of rows >= 1, not '10'"),
    ({"file_name": "s.jsonl", "num_samples": -3}, r"`num_samples` must be a whole number of rows >= 1, not -3"),
    ({"file_name": "s.jsonl", "num_samples": 2.5}, r"`num_samples` must be a whole number of rows >= 1, not 2.5"),
    ({"file_name": "LICENSE"}, r"`.*LICENSE`: unsupported file type `\(no ending\)`"),
])
def test_dataset_info_entries_of_the_wrong_types_are_named(tmp_path, entry, says):
    """A list of columns or a file name that is a number ended in an AttributeError or TypeError; a negative
    num_samples silently took len - 3 rows."""
    write_jsonl(tmp_path / "s.jsonl", [{"conversations": [{"from": "human", "value": f"q{i}"},
                                                          {"from": "gpt", "value": f"a{i}"}]} for i in range(20)])
    (tmp_path / "LICENSE").write_text("MIT")
    (tmp_path / "dataset_info.json").write_text(json.dumps({"d": {"formatting": "sharegpt", **entry}}))
    with pytest.raises(UserError, match=says):
        _data(tmp_path, "data.datasets=[d]")


def test_save_to_disk_folders_of_conversations(tmp_path):
    """save_to_disk writes its own dataset_info.json, which was taken for LLaMA-Factory's ("name the datasets to
    train on"), and a DatasetDict's split folders were "no train file"."""
    import datasets

    rows = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}
            for i in range(30)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    assert sum(len(s) for s in _data(tmp_path / "one").splits.values()) == 30
    parts = {"train": rows[:20], "eval": rows[20:25], "test": rows[25:]}
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in parts.items()}).save_to_disk(str(tmp_path / "dict"))
    data = _data(tmp_path / "dict")
    assert {s: len(r) for s, r in data.splits.items()} == {"train": 20, "validation": 5, "test": 5}


def test_trl_prompt_completion_rows_train_on_the_completion_only(tmp_path):
    """TRL's prompt-completion datasets were 'in none of the formats'; mapped onto alpaca's columns, a conversational
    completion was refused as a ranking pair."""
    plain = [{"prompt": f"question {i}", "completion": f"answer {i}"} for i in range(20)]
    every = [c for s in _data(write_jsonl(tmp_path / "p.jsonl", plain)).splits.values() for c in s]
    assert len(every) == 20 and all(c.messages == (("user", c.messages[0][1]), ("assistant", c.messages[1][1]))
                                    for c in every)
    assert {c.response for c in every} == {f"answer {i}" for i in range(20)}
    chat = [{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"hi {i}"},
                        {"role": "assistant", "content": "hello"}, {"role": "user", "content": f"question {i}"}],
             "completion": [{"role": "assistant", "content": f"answer {i}"}]} for i in range(20)]
    every = [c for s in _data(write_jsonl(tmp_path / "c.jsonl", chat)).splits.values() for c in s]
    assert len(every) == 20 and all(c.system == "be brief" and len(c.messages) == 4 for c in every)
    assert all(c.untrained == (0,) for c in every)  # the prompt's answer carries no loss, as in TRL


def test_openai_tool_calls_beside_text_and_the_older_function_call_are_kept(tmp_path):
    """An answer with text and `tool_calls` kept the text only, so the model learnt "Let me check." without the call
    its tool result answers; the older `function_call` with `content: null` was an empty answer."""
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}
    rows = [{"messages": [{"role": "user", "content": f"weather {i}?"},
                          {"role": "assistant", "content": "Let me check.", "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                          {"role": "assistant", "content": None, "function_call": {"name": "log", "arguments": "{}"}},
                          {"role": "function", "name": "log", "content": "ok"},
                          {"role": "assistant", "content": f"sunny {i}"}]} for i in range(20)]
    one = _data(write_jsonl(tmp_path / "t.jsonl", rows)).splits["train"][0]
    assert one.messages[1][1] == "Let me check.\n" + json.dumps([call])
    assert one.messages[3][1] == json.dumps({"name": "log", "arguments": "{}"})


def test_the_functions_of_openais_older_function_calling_format_are_the_rows_tools(tmp_path):
    """OpenAI's older function-calling fine-tuning lines describe their functions in `functions` (beside `function_call`
    answers); they were left out, so the model learnt to call functions its prompt never described."""
    functions = [{"name": "weather", "description": "today's weather", "parameters": {"type": "object"}}]
    rows = [{"messages": [{"role": "user", "content": f"weather {i}?"},
                          {"role": "assistant", "function_call": {"name": "weather", "arguments": "{}"}},
                          {"role": "function", "name": "weather", "content": "sunny"},
                          {"role": "assistant", "content": f"sunny {i}"}], "functions": functions} for i in range(20)]
    every = [c for s in _data(write_jsonl(tmp_path / "f.jsonl", rows)).splits.values() for c in s]
    assert len(every) == 20 and all(c.tools == json.dumps(functions) for c in every)
    assert every[0].chat()[0] == {"role": "system", "content": "Tools available:\n" + json.dumps(functions)}


def test_the_results_of_parallel_tool_calls_are_one_user_turn(tmp_path):
    """OpenAI's fine-tuning format answers parallel tool calls with one `tool` message each; two results in a row were
    refused as turns that do not alternate. They are one user turn, in their order, and the answers stay trained."""
    calls = [{"id": str(k), "type": "function", "function": {"name": "weather", "arguments": json.dumps({"city": city})}}
             for k, city in enumerate(("Oslo", "Rome"))]
    rows = [{"messages": [{"role": "user", "content": f"weather in Oslo and Rome {i}?"},
                          {"role": "assistant", "tool_calls": calls},
                          {"role": "tool", "tool_call_id": "0", "content": "rain"},
                          {"role": "tool", "tool_call_id": "1", "content": "sunny"},
                          {"role": "assistant", "content": f"Oslo rain, Rome sunny {i}"}]} for i in range(20)]
    every = [c for s in _data(write_jsonl(tmp_path / "t.jsonl", rows)).splits.values() for c in s]
    assert len(every) == 20
    assert all([r for r, _ in c.messages] == ["user", "assistant", "user", "assistant"] for c in every)
    assert all(c.messages[1][1] == json.dumps(calls) and c.messages[2][1] == "rain\nsunny" and not c.untrained
               for c in every)


def test_a_row_with_tools_and_no_system_prompt_gets_the_runs_system_prompt(tmp_path):
    """The tools were written into the row's system prompt, so a row without one had a system prompt of tools only
    and prompt.system_prompt (LLaMA-Factory's default_system) never reached it."""
    rows = [{"conversations": [{"from": "human", "value": f"weather in city {i}?"}, {"from": "gpt", "value": f"sunny {i}"}],
             "tools": '[{"name": "weather"}]'} for i in range(20)]
    one = _data(write_jsonl(tmp_path / "s.jsonl", rows)).splits["train"][0]
    assert one.chat("be brief")[0] == {"role": "system", "content": 'be brief\n\nTools available:\n[{"name": "weather"}]'}
    assert one.chat()[0] == {"role": "system", "content": 'Tools available:\n[{"name": "weather"}]'}


def test_h2o_parent_id_chains_give_each_row_its_earlier_turns(tmp_path, capsys):
    """H2O LLM Studio's conversations are one row per turn, `parent_id` naming the row before; they were read as
    independent alpaca rows, so a follow-up ("and in Bergen?") trained without the question it follows."""
    import csv

    with open(tmp_path / "h2o.csv", "w", newline="", encoding="utf-8") as handle:
        out = csv.writer(handle)
        out.writerow(["id", "parent_id", "instruction", "output"])
        for i in range(12):
            out.writerow([f"a{i}", "", f"weather in Oslo {i}?", f"rain {i}"])
            out.writerow([f"b{i}", f"a{i}", f"and in Bergen {i}?", f"more rain {i}"])
            out.writerow([f"c{i}", f"b{i}", f"why {i}?", f"the coast {i}"])
    every = {c.response: c for s in _data(tmp_path / "h2o.csv").splits.values() for c in s}
    assert len(every) == 36
    assert every["the coast 3"].messages == (("user", "weather in Oslo 3?"), ("assistant", "rain 3"),
                                             ("user", "and in Bergen 3?"), ("assistant", "more rain 3"),
                                             ("user", "why 3?"), ("assistant", "the coast 3"))
    assert every["rain 3"].messages == (("user", "weather in Oslo 3?"), ("assistant", "rain 3"))
    assert "chained by parent_id" in capsys.readouterr().out

    rows = [{"id": i, "parent_id": 99 if i == 4 else None, "instruction": f"q {i}", "output": f"a {i}"} for i in range(20)]
    with pytest.raises(UserError, match=r"rows 5: the `parent_id` names an `id` no row has"):
        _data(write_jsonl(tmp_path / "broken.jsonl", rows))


def test_h2o_ids_that_pandas_wrote_as_decimals_name_their_rows(tmp_path):
    """pandas writes a numeric `parent_id` column with empty cells as decimals (`4.0`) beside the ids (`4`); read as
    the text written (as conversation CSVs are), `4.0` named no row."""
    import pandas as pd

    frame = pd.DataFrame({"id": range(20), "parent_id": [i - 1 if i % 2 else None for i in range(20)],
                          "instruction": [f"q {i}" for i in range(20)], "output": [f"a {i}" for i in range(20)]})
    frame.to_csv(tmp_path / "h2o.csv", index=False)
    assert "\n5,4.0,q 5,a 5\n" in (tmp_path / "h2o.csv").read_text()
    every = {c.response: c for s in _data(tmp_path / "h2o.csv").splits.values() for c in s}
    assert every["a 5"].messages == (("user", "q 4"), ("assistant", "a 4"), ("user", "q 5"), ("assistant", "a 5"))


def test_a_datasets_cache_folder_of_conversations_is_read_as_its_splits(tmp_path):
    """The folder `datasets` caches a loaded dataset in holds `<name>-<split>.arrow` files and a dataset_info.json of
    its own (builder_name, features, splits), which was taken for LLaMA-Factory's: "name the datasets to train on"."""
    import datasets

    rows = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}
            for i in range(26)]
    files = {"train": str(write_jsonl(tmp_path / "train.jsonl", rows[:20])),
             "test": str(write_jsonl(tmp_path / "test.jsonl", rows[20:]))}
    datasets.load_dataset("json", data_files=files, cache_dir=str(tmp_path / "cache"))
    folder = next((tmp_path / "cache").rglob("json-train.arrow")).parent
    assert (folder / "dataset_info.json").is_file()
    data = _data(folder)
    assert sorted(c.response for c in data.splits["test"]) == [f"answer {i}" for i in range(20, 26)]
    assert sum(len(s) for s in data.splits.values()) == 26


def test_a_gzip_compressed_conversation_file_is_read(tmp_path):
    import gzip

    rows = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}
            for i in range(20)]
    (tmp_path / "chat.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    assert sum(len(s) for s in _data(tmp_path / "chat.jsonl.gz").splits.values()) == 20


def test_llamafactory_pretraining_entries_are_named_as_plain_text(tmp_path):
    """LLaMA-Factory's stage pt entries (wiki_demo.txt: one document per line; c4_demo.jsonl: a text column, both
    registered with columns {prompt: text}) were read as emotune's classification `text;label` lines ('lines have no
    `;` between text and label') or told to set data.columns to an `output` no such file has."""
    (tmp_path / "wiki.txt").write_text("Anarchism is a political philosophy.\n\nAutism is a condition; it varies.\n")
    write_jsonl(tmp_path / "c4.jsonl", [{"text": f"document {i}"} for i in range(5)])
    info = {"wiki_demo": {"file_name": "wiki.txt", "columns": {"prompt": "text"}},
            "c4_demo": {"file_name": "c4.jsonl", "columns": {"prompt": "text"}}}
    (tmp_path / "dataset_info.json").write_text(json.dumps(info), encoding="utf-8")
    for name in info:
        with pytest.raises(UserError, match=r"has a `text` column and no prompt or answer .*LLaMA-Factory's stage pt"):
            _data(tmp_path, f"data.datasets=[{name}]")


def test_hold_out_counts_of_rows_for_conversations(tmp_path):
    """data.validation_size=5 (a count, as LLaMA-Factory's val_size: 5 and datasets' train_test_split read it) was
    refused as out of (0, 0.5)."""
    data = _data(write_jsonl(tmp_path / "a.jsonl", _alpaca(40)), "data.validation_size=5", "data.test_size=3")
    assert {name: len(rows) for name, rows in data.splits.items()} == {"train": 32, "validation": 5, "test": 3}


def test_sharegpt_turns_with_openais_role_names_are_read_under_the_default_tags(tmp_path):
    """`conversations` whose turns say from: user / assistant / tool (as Axolotl's and Unsloth's ShareGPT readers
    take them) were refused under the default tags (human, gpt); set data.tags and only its names are read."""
    rows = [{"conversations": [{"from": "system", "value": "be brief"}, {"from": "user", "value": f"q {i}"},
                               {"from": "assistant", "value": "call"}, {"from": "tool", "value": "42"},
                               {"from": "gpt", "value": f"a {i}"}]} for i in range(20)]
    data = _data(write_jsonl(tmp_path / "s.jsonl", rows))
    every = [c for split in data.splits.values() for c in split]
    assert len(every) == 20 and all(c.system == "be brief" for c in every)
    assert {tuple(c.messages[1:3]) for c in every} == {(("assistant", "call"), ("user", "42"))}
    assert {(c.messages[0], c.messages[3]) for c in every} == {(("user", f"q {i}"), ("assistant", f"a {i}"))
                                                                for i in range(20)}


def test_columns_named_in_other_capitals_or_with_spaces_are_read_under_their_names(tmp_path, capsys):
    """A spreadsheet's `Instruction`, `Input`, `Output ` headers were refused as "in none of the formats", while a
    classifier's data found `Text` for data.text_column; a file with both `output` and `Output` keeps its own."""
    rows = _alpaca(20)
    lines = ["Instruction,Input,Output \n", *(f"{r['instruction']},{r['input']},{r['output']}\n" for r in rows)]
    (tmp_path / "d.csv").write_text("".join(lines), encoding="utf-8")
    every = sorted((c.messages[0][1], c.response) for s in _data(tmp_path / "d.csv").splits.values() for c in s)
    write_jsonl(tmp_path / "same.jsonl", rows)
    assert every == sorted((c.messages[0][1], c.response) for s in _data(tmp_path / "same.jsonl").splits.values() for c in s)
    assert "`Instruction` read as `instruction`, `Input` read as `input`, `Output ` read as `output`" in capsys.readouterr().out
    both = [{**r, "Output": "other"} for r in rows]
    write_jsonl(tmp_path / "both.jsonl", both)
    assert {c.response for s in _data(tmp_path / "both.jsonl").splits.values() for c in s} == {r["output"] for r in rows}


def test_role_names_in_other_capitals_are_read_as_their_roles(tmp_path):
    """ShareGPT turns from `Human` / `GPT` / `System ` and messages with role `User` / `Assistant` (hand-made and
    converted files) were refused as "none of data.tags"; an unknown role is still refused by name."""
    share = [{"conversations": [{"from": "System ", "value": "be brief"}, {"from": "Human", "value": f"q {i}"},
                                {"from": "GPT", "value": f"a {i}"}]} for i in range(20)]
    chat = [{"messages": [{"role": "User", "content": f"q {i}"}, {"role": "ASSISTANT", "content": f"a {i}"}]}
            for i in range(20)]
    for name, rows in (("s", share), ("m", chat)):
        every = [c for split in _data(write_jsonl(tmp_path / f"{name}.jsonl", rows)).splits.values() for c in split]
        assert sorted(c.messages for c in every) == sorted((("user", f"q {i}"), ("assistant", f"a {i}"))
                                                           for i in range(20))
        assert {c.system for c in every} == ({"be brief"} if name == "s" else {None})
    bad = [{"conversations": [{"from": "Humans", "value": "q"}, {"from": "gpt", "value": "a"}]}] * 20
    with pytest.raises(UserError, match="role 'Humans'"):
        _data(write_jsonl(tmp_path / "bad.jsonl", bad))
