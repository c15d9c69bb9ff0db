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
