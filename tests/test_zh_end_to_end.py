"""Chinese end to end: the shipped configs/zh-head-cpu.yaml on the packaged Chinese dataset, with a tiny Gemma 3 whose
tokenizer knows the dataset's characters, through data (Weibo cleaning) → train (2 steps) → eval → report. Every
figure saved during the run is checked: each character drawn comes from a font that has its glyph."""

from __future__ import annotations

import csv
import json
import unicodedata
from pathlib import Path

import pytest
from matplotlib.figure import Figure
from matplotlib.text import Text

import emotune
from emotune.cli import main
from test_fonts import glyph_sources

LABELS = ["喜悦", "愤怒", "悲伤", "恐惧", "惊讶", "厌恶", "中性"]
ZH_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "zh-head-cpu.yaml"


def build_chinese_tokenizer(folder: Path):
    """Word-level over single Chinese characters (BERT's CJK split) and whatever else the texts and prompts hold, with
    Gemma's special tokens and turn format: every character of the packaged dataset has its own id."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from emotune.core.config.load import load_config
    from emotune.model.loading import GEMMA_CHAT_TEMPLATE

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    normalizer = normalizers.BertNormalizer(clean_text=False, handle_chinese_chars=True, strip_accents=False,
                                            lowercase=False)
    splitter = pre_tokenizers.Sequence([pre_tokenizers.Split("\n", "isolated"), pre_tokenizers.WhitespaceSplit(),
                                        pre_tokenizers.Punctuation()])
    prompt = load_config(ZH_CONFIG).prompt
    texts = [prompt.system_prompt.format(labels="，".join(LABELS)), prompt.user_template, "user model", *LABELS]
    for split in (Path(emotune.__file__).parent / "datasets" / "emotion_zh").glob("*.jsonl"):
        texts += [json.loads(line)["text"] for line in split.read_text(encoding="utf-8").splitlines()]
    texts += [unicodedata.normalize("NFKC", t) for t in texts]
    words = {piece for t in texts for piece, _ in splitter.pre_tokenize_str(normalizer.normalize_str(t))}
    vocab = {tok: i for i, tok in enumerate(specials + sorted(words - set(specials)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer, tok.pre_tokenizer = normalizer, splitter
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", additional_special_tokens=["<start_of_turn>", "<end_of_turn>"])
    fast.chat_template = GEMMA_CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


@pytest.fixture(scope="module")
def zh_model_dir(tmp_path_factory) -> Path:
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    folder = tmp_path_factory.mktemp("tiny-gemma3-zh")
    tokenizer = build_chinese_tokenizer(folder)
    config = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=512,
                              sliding_window=64, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture
def figures_checked(monkeypatch):
    """Every Figure saved while the fixture is active: (its axes titles, texts drawn, characters no font covers)."""
    seen: list[tuple[str, list[str], set[str]]] = []
    original = Figure.savefig

    def checked_savefig(self, fname, *args, **kwargs):
        result = original(self, fname, *args, **kwargs)  # drawing first: tick labels exist after it
        texts = [t for t in self.findobj(Text) if t.get_text() and t.get_visible()]
        missing = {ch for t in texts for ch, path in glyph_sources(t).items() if path is None}
        titles = " | ".join(ax.get_title() for ax in self.axes)
        seen.append((titles, [t.get_text() for t in texts], missing))
        return result

    monkeypatch.setattr(Figure, "savefig", checked_savefig)
    return seen


@pytest.mark.slow
def test_chinese_labels_through_data_train_eval_and_figures(zh_model_dir, tmp_path, figures_checked, capsys):
    overrides = [f"model.source={zh_model_dir}", f"output_dir={tmp_path / 'runs'}", "name=zh", "data.train_limit=21",
                 "data.validation_limit=14", "data.test_limit=14", "train.max_steps=2", "train.batch_size=4",
                 "train.eval_steps=1", "train.save_steps=1", "train.logging_steps=1", "train.precision=fp32",
                 "train.early_stopping_patience=0", "eval.batch_size=7", f"model.cache_dir={tmp_path / 'cache'}"]
    assert main(["run", str(ZH_CONFIG), *overrides]) == 0
    run = tmp_path / "runs" / "zh"
    out = capsys.readouterr().out
    assert "weibo_reposts changed" in out and "F1 中性" in out

    # data: the labels in the dataset's order, Weibo cleaning counted
    report = json.loads((run / "data" / "data_report.json").read_text(encoding="utf-8"))
    assert report["labels"] == LABELS and report["labels_from"] == "the packaged dataset"
    assert all(sum(report["cleaning"]["changed"][step].values()) > 0
               for step in ("unicode_nfkc", "weibo_reposts", "weibo_topics", "weibo_emoticons"))
    # train → eval: the head's adapter, metrics and predictions carry the Chinese labels
    assert json.loads((run / "adapter" / "emotune.json").read_text(encoding="utf-8"))["labels"] == LABELS
    for stage in ("baseline", "finetuned"):
        metrics = json.loads((run / stage / "metrics.json").read_text(encoding="utf-8"))
        assert list(metrics["per_class"]) == LABELS and metrics["rows"] == 14
        with (run / stage / "predictions.csv").open(encoding="utf-8", newline="") as handle:
            rows = list(csv.DictReader(handle))
        assert {r["gold"] for r in rows} <= set(LABELS) and {r["predicted"] for r in rows} <= set(LABELS)
        assert f"p_{LABELS[0]}" in rows[0]
    stats = json.loads((run / "report" / "adapter_stats.json").read_text(encoding="utf-8"))
    assert stats["groups"]["score"]["kind"] == "full" and stats["groups"]["q_proj"]["kind"] == "lora"

    # figures: every one saved during the run draws every character from a font that has it
    titles = [title for title, _, _ in figures_checked]
    with_labels = ("Label distribution", "row-normalised", "Per-class F1")
    for expected in (*with_labels, "Gradient norm", "LoRA B entries after training"):
        assert any(expected in title for title in titles), (expected, titles)
    assert all(not missing for _, _, missing in figures_checked), [(t, m) for t, _, m in figures_checked if m]
    for title, texts, _ in figures_checked:
        if any(expected in title for expected in with_labels):
            assert set(LABELS) <= set(texts), (title, texts)
    page = (run / "report.html").read_text(encoding="utf-8")
    assert all(label in page for label in LABELS) and "<section id=training>" in page
