"""Weibo cleaning (data.cleaning.weibo_reposts / weibo_topics / weibo_emoticons / unicode_nfkc) on hand-written posts:
what each step keeps and removes, what it must leave alone, the order of the steps, and the counts in the data report.
Also the packaged Chinese dataset through the shipped zh config's cleaning."""

from __future__ import annotations

import pyarrow as pa
import pytest

from conftest import write_jsonl
from emotune.core.config.data import CleaningConfig, DataConfig
from emotune.core.config.load import load_config
from emotune.data import load_data
from emotune.data.clean import clean_text
from emotune.data.prepare import format_cleaning

ONLY_TEXT_STEPS = dict(control_chars=False, whitespace=False, unicode_nfc=False)
WEIBO_STEPS = ("unicode_nfkc", "weibo_reposts", "weibo_topics", "weibo_emoticons")


def _clean(values: list[str], **options) -> tuple[list[str], dict[str, int]]:
    cleaned, changed = clean_text(pa.array(values, pa.string()), CleaningConfig(**options))
    return cleaned.to_pylist(), changed


# --------------------------------------------------------------------------------------------------
# Repost chains


REPOST = "转发微博 //@熬夜冠军小赵:太离谱了//@奶茶续命的阿琳: 这是什么"
ONLY_CHAIN = "//@围观群众甲: 啊这 //@吃瓜第一线: 前台的机器人自己走出门了"


def test_repost_drop_keeps_the_poster_s_own_text_and_a_bare_chain_becomes_empty():
    out, changed = _clean([REPOST, ONLY_CHAIN, "我也想要／／＠小王：真好看"], weibo_reposts="drop", **ONLY_TEXT_STEPS)
    assert out == ["转发微博", "", "我也想要"]
    assert changed == {"weibo_reposts": 3}


def test_repost_unwrap_removes_the_markers_and_keeps_every_text():
    out, _ = _clean([REPOST, ONLY_CHAIN], weibo_reposts="unwrap", **ONLY_TEXT_STEPS)
    assert out == ["转发微博 太离谱了 这是什么", "啊这 前台的机器人自己走出门了"]


def test_what_is_not_a_repost_chain_is_left_alone():
    untouched = ["详见 https://weibo.com/u/123/posts 的说明", "@小王: 明天见", "路径 a//b@c 不是转发", "比分 2//3"]
    for action in ("drop", "unwrap"):
        out, changed = _clean(untouched, weibo_reposts=action, **ONLY_TEXT_STEPS)
        assert out == untouched and changed == {"weibo_reposts": 0}


def test_reposts_run_before_mentions_so_the_chain_is_not_rewritten_first():
    out, _ = _clean(["好耶//@小王: 哈哈 @小李 快看"], weibo_reposts="unwrap", mentions="replace")
    assert out == ["好耶 哈哈 @user 快看"]


def test_mentions_of_chinese_names_are_found_right_after_chinese_text():
    # a name runs to the next space or punctuation mark (Weibo puts a space after a mention it inserts)
    out, _ = _clean(["谢谢@小王 和 @anna，还有@熬夜冠军-小赵 邮箱 bob@mail.org café@x.fr"], mentions="replace")
    assert out == ["谢谢@user 和 @user，还有@user 邮箱 bob@mail.org café@x.fr"]


# --------------------------------------------------------------------------------------------------
# Topic tags


def test_topic_tags_unwrap_or_drop():
    posts = ["#高考放榜# 终于出分了", "今天#暴雨预警#又来了", "#开学##返校#明天见", "＃全角话题＃好多人"]
    unwrapped, changed = _clean(posts, weibo_topics="unwrap", **ONLY_TEXT_STEPS)
    assert unwrapped == ["高考放榜 终于出分了", "今天暴雨预警又来了", "开学返校明天见", "全角话题好多人"]
    assert changed == {"weibo_topics": 4}
    dropped, _ = _clean(posts, weibo_topics="drop")  # whitespace on: the space the tag left is trimmed
    assert dropped == ["终于出分了", "今天又来了", "明天见", "好多人"]


def test_a_hash_that_is_not_a_tag_is_left_alone():
    untouched = ["我用C#和F#写代码", "住5#楼3单元", "#没有闭合的井号", "# 标题 #", "空的##", "第一行#\n第二行#", "x#y z#w"]
    for action in ("unwrap", "drop"):
        out, changed = _clean(untouched, weibo_topics=action, **ONLY_TEXT_STEPS)
        assert out == untouched, action
        assert changed == {"weibo_topics": 0}


# --------------------------------------------------------------------------------------------------
# Emoticon codes


def test_emoticon_codes_unwrap_or_drop():
    posts = ["[哈哈][哈哈]太好了[doge]", "又加班[泪]", "笑死[笑cry]", "［吃惊］全角括号"]
    unwrapped, changed = _clean(posts, weibo_emoticons="unwrap", **ONLY_TEXT_STEPS)
    assert unwrapped == ["哈哈哈哈太好了doge", "又加班泪", "笑死笑cry", "吃惊全角括号"]
    assert changed == {"weibo_emoticons": 4}
    dropped, _ = _clean(posts, weibo_emoticons="drop", **ONLY_TEXT_STEPS)
    assert dropped == ["太好了", "又加班", "笑死", "全角括号"]


def test_brackets_that_are_not_emoticons_are_left_alone():
    untouched = ["见参考文献[1]和[12]", "选项[a]", "[see note]", "[ ]和[]", "[2026]年", "[哈哈哈哈哈哈哈哈哈]太长", "[哈 哈]"]
    for action in ("unwrap", "drop"):
        out, changed = _clean(untouched, weibo_emoticons=action, **ONLY_TEXT_STEPS)
        assert out == untouched and changed == {"weibo_emoticons": 0}


# --------------------------------------------------------------------------------------------------
# NFKC, defaults, order, counts


def test_nfkc_folds_full_width_forms_and_is_off_by_default():
    post = "新ＡＰＰ２０２６版！"
    assert _clean([post], unicode_nfkc=True, **ONLY_TEXT_STEPS) == (["新APP2026版!"], {"unicode_nfkc": 1})
    assert _clean([post])[0] == [post]  # the defaults (English data) leave full-width forms as they are


def test_weibo_steps_are_off_by_default():
    cfg = CleaningConfig()
    assert (cfg.unicode_nfkc, cfg.weibo_reposts, cfg.weibo_topics, cfg.weibo_emoticons) == (False, "keep", "keep", "keep")
    posts = [REPOST, "#话题# [哈哈] 引用[1]"]
    out, changed = _clean(posts)
    assert out == posts and not set(changed) & set(WEIBO_STEPS)


def test_every_weibo_step_together_in_order():
    post = "＃高考放榜＃ 终于出分了［哈哈］！ //@同学甲: 恭喜[鼓掌]"
    out, changed = _clean([post, "普通的一句话"], unicode_nfkc=True, weibo_reposts="drop", weibo_topics="drop",
                          weibo_emoticons="drop")
    assert out == ["终于出分了!", "普通的一句话"]
    assert {k: changed[k] for k in WEIBO_STEPS} == {"unicode_nfkc": 1, "weibo_reposts": 1, "weibo_topics": 1,
                                                      "weibo_emoticons": 1}


def test_weibo_steps_are_counted_per_split_in_the_data_report(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [
        {"text": "#高考放榜# 终于出分了[哈哈]", "label": "喜悦"}, {"text": "好气啊//@小王: 真的吗", "label": "愤怒"},
        {"text": "//@小王: 只有转发链", "label": "愤怒"}, {"text": "今天天气不错", "label": "喜悦"}])
    write_jsonl(tmp_path / "validation.jsonl", [{"text": "开心[哈哈]", "label": "喜悦"}, {"text": "烦死了", "label": "愤怒"}])
    write_jsonl(tmp_path / "test.jsonl", [{"text": "#周末# 出去玩", "label": "喜悦"}, {"text": "不爽", "label": "愤怒"}])
    cfg = DataConfig(source=str(tmp_path), cleaning=CleaningConfig(weibo_reposts="drop", weibo_topics="drop",
                                                                    weibo_emoticons="drop", unicode_nfkc=True))
    data = load_data(cfg, seed=0)
    changed, dropped = data.report["cleaning"]["changed"], data.report["cleaning"]["dropped"]
    assert changed["weibo_reposts"] == {"train": 2, "validation": 0, "test": 0}
    assert changed["weibo_topics"] == {"train": 1, "validation": 0, "test": 1}
    assert changed["weibo_emoticons"] == {"train": 1, "validation": 1, "test": 0}
    assert dropped["too_short"]["train"] == 1  # the row that was only a repost chain
    assert sorted(data.splits["train"]["text"]) == sorted(["终于出分了", "好气啊", "今天天气不错"])
    line = format_cleaning(data.report)
    assert "weibo_reposts changed 2" in line and "too_short removed 1 (train 1)" in line


def test_the_zh_config_cleans_the_packaged_chinese_dataset():
    cfg = load_config("configs/zh-head-cpu.yaml")
    assert cfg.data.source == "embedded:emotion_zh"
    data = load_data(cfg.data, cfg.seed)
    assert data.labels == ["喜悦", "愤怒", "悲伤", "恐惧", "惊讶", "厌恶", "中性"]
    changed = data.report["cleaning"]["changed"]
    assert all(sum(changed[step].values()) > 0 for step in WEIBO_STEPS), changed
    texts = [t for split in data.splits.values() for t in split["text"]]
    assert not any("//@" in t or "[哈哈]" in t or "#高考放榜#" in t or "ＡＰＰ" in t for t in texts)
    assert data.report["rows"] == {"train": 860, "validation": 143, "test": 191}  # unwrap keeps every row


def test_an_unknown_packaged_dataset_is_a_clear_error():
    from emotune.core.errors import UserError

    with pytest.raises(UserError, match="embedded:emotion_zh"):
        load_data(DataConfig(source="embedded:emotion_fr"), seed=0)
