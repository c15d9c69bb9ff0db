"""sft training rows and loss: loss spans against the chat template's own rendering, chunked loss equal to the
full cross-entropy, classification's loss unchanged, and a 2-step `emotune run` with task: sft."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
import torch.nn.functional as F

from conftest import CUES, FILLER, LABELS, collate_row_by_row, write_jsonl
from emotune.data.conversations import Conversation
from emotune.tasks.sft.rows import encode, loss_spans, truncate
from emotune.train.batches import Example, chunked_loss, collate, completion_loss


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


CONVERSATION = Conversation((("user", "i feel so lonely today"), ("assistant", "sadness"),
                             ("user", "this morning was great"), ("assistant", "joy really"),
                             ("user", "i am scared"), ("assistant", "fear")), system="classify the emotion")


def _words(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_loss_on_every_assistant_turn_against_the_template(tokenizer):
    messages = CONVERSATION.chat()
    ids, spans = loss_spans(tokenizer, messages)
    assert ids == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    end_of_turn = _words(tokenizer, "<end_of_turn>\n")
    answers = [text for role, text in CONVERSATION.messages if role == "assistant"]
    assert [ids[s:e] for s, e in spans] == [_words(tokenizer, a) + end_of_turn for a in answers]
    masked = set(range(len(ids))) - {i for s, e in spans for i in range(s, e)}
    assert not any(ids[i] in _words(tokenizer, " ".join(answers)) for i in masked)  # nothing else carries loss

    last_only = encode(CONVERSATION, tokenizer, None, mask_history=True)
    assert last_only.loss_spans == (spans[-1],) and last_only.input_ids == ids
    first = CONVERSATION.messages[:2]
    with_default = encode(Conversation(first), tokenizer, "classify the emotion", False)
    assert with_default == encode(Conversation(first, system="classify the emotion"), tokenizer, None, False)
    assert with_default != encode(Conversation(first, system="reply"), tokenizer, "classify the emotion", False)  # the row's own wins


DROPS_REASONING = (  # a template that, like reasoning models' templates, drops past reasoning from the history
    "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{% set text = m['content'].split('reasoning:')[-1] if (m['role'] == 'assistant' and not loop.last) else m['content'] %}"
    "{{ '<start_of_turn>' + role + '\n' + text | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


def test_loss_spans_for_a_template_that_rewrites_earlier_turns(tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = DROPS_REASONING
    messages = [{"role": "user", "content": "i am happy"}, {"role": "assistant", "content": "reasoning: smiling joy"},
                {"role": "user", "content": "i am scared"}, {"role": "assistant", "content": "reasoning: panic fear"}]
    ids, spans = loss_spans(tok, messages)
    assert ids == tok.apply_chat_template(messages, tokenize=True, return_dict=False)
    eot = tok.convert_tokens_to_ids("<end_of_turn>")
    assert ids[spans[0][0]:spans[0][1]] == _words(tok, "smiling joy") + [eot]  # as the whole rendering shows it
    assert ids[spans[1][0]:spans[1][1]] == _words(tok, "reasoning: panic fear") + _words(tok, "<end_of_turn>\n")


def test_truncation_clips_spans():
    example = Example(list(range(20)), 5, spans=((5, 8), (12, 20)))
    assert truncate(example, 14).loss_spans == ((5, 8), (12, 14))
    assert truncate(example, 4).completion_tokens == 0


def _reference_collate(examples, pad_id):
    """collate as it was before rows could carry several spans (classification's single tail span)."""
    return collate_row_by_row(examples, pad_id, lambda e: [(e.completion_start, len(e.input_ids))])


def _reference_loss(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   logits_to_keep=batch["predicts"], use_cache=False).logits.float()
    return (F.cross_entropy(logits, batch["targets"], reduction="none") * batch["token_weights"]).sum()


def _grads(model):
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_classification_loss_and_gradients_unchanged(model, tokenizer, tiny_model_dir, data_dir):
    from emotune.core.config.load import load_config
    from emotune.data import load_data
    from emotune.tasks.classify.task import encode_examples

    cfg = load_config(None, [f"data.source={data_dir}", f"data.label_names=[{', '.join(LABELS)}]"])
    data = load_data(cfg.data, cfg.seed)
    rows = encode_examples(data.splits["train"], tokenizer, cfg.prompt, data.labels, 256,
                           class_weights={label: 1.0 + i / 10 for i, label in enumerate(LABELS)})[:8]
    rows.append(Example(rows[0].input_ids, len(rows[0].input_ids)))  # a row whose label was cut away
    new, old = collate(rows, tokenizer.pad_token_id, torch.device("cpu")), _reference_collate(rows, tokenizer.pad_token_id)
    assert all(torch.equal(new[k], old[k]) for k in old)
    model.zero_grad()
    loss_new = completion_loss(model, new).loss_sum
    loss_new.backward()
    grads_new = _grads(model)
    model.zero_grad()
    loss_old = _reference_loss(model, old)
    loss_old.backward()
    assert torch.equal(loss_new, loss_old)
    assert all(torch.equal(a, b) for a, b in zip(grads_new, _grads(model), strict=False))
    model.zero_grad()


def test_chunked_loss_equals_full_cross_entropy(model, tokenizer):
    rows = [encode(CONVERSATION, tokenizer, None, False), encode(Conversation(CONVERSATION.messages[:4]), tokenizer, "x", False)]
    batch = collate(rows, tokenizer.pad_token_id, torch.device("cpu"))
    model.zero_grad()
    full = completion_loss(model, batch, chunk_tokens=10 ** 6)
    full.loss_sum.backward()
    full_grads = _grads(model)
    model.zero_grad()
    chunked = completion_loss(model, batch, chunk_tokens=3)  # several chunks, the last one short
    chunked.loss_sum.backward()
    # float32, summed in another order: equal to rounding (relative 1e-5 on the loss, absolute 1e-6 on gradients)
    assert chunked.tokens == full.tokens and int(chunked.correct) == int(full.correct)
    torch.testing.assert_close(chunked.loss_sum, full.loss_sum, rtol=1e-5, atol=0)
    for a, b in zip(_grads(model), full_grads, strict=False):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    model.zero_grad()

    torch.manual_seed(0)
    hidden, weight = torch.randn(50, 8, requires_grad=True), torch.randn(30, 8, requires_grad=True)
    targets, weights = torch.randint(0, 30, (50,)), torch.rand(50)
    logits = torch.tanh(hidden @ weight.T / 5.0) * 5.0
    (F.cross_entropy(logits, targets, reduction="none") * weights).sum().backward()
    expected = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    chunked_loss(hidden, weight, targets, weights, chunk_tokens=7, softcap=5.0).loss_sum.backward()
    torch.testing.assert_close((hidden.grad, weight.grad), expected, rtol=1e-5, atol=1e-6)


def _sft_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = rng.choice(LABELS)
        rows.append({"instruction": "classify the emotion of this text",
                     "input": " ".join(rng.sample(FILLER, 4) + [rng.choice(CUES[label])]),
                     "output": label, "kind": "single" if i % 2 else "history",
                     **({"history": [["i am happy", "joy"]]} if i % 2 == 0 else {})})
    return rows


@pytest.mark.slow
def test_two_step_sft_run(tiny_model_dir, tmp_path):
    from emotune.core.config.load import load_config
    from emotune.pipeline import run

    write_jsonl(tmp_path / "sft.jsonl", _sft_rows(60, seed=1))
    cfg = load_config(None, [
        "task=sft", f"model.source={tiny_model_dir}", f"data.source={tmp_path / 'sft.jsonl'}", f"output_dir={tmp_path / 'runs'}",
        "name=sft", "train.max_steps=2", "train.batch_size=4", "train.gradient_accumulation_steps=1",
        "train.gradient_checkpointing=false", "train.precision=fp32", "train.eval_steps=1", "train.save_steps=1",
        "train.logging_steps=1", "train.learning_rate=0.01", "eval.batch_size=4", "eval.max_new_tokens=3",
        "eval.probe=false", f"model.cache_dir={tmp_path / 'cache'}"])
    comparison = run(cfg)
    folder = tmp_path / "runs" / "sft"
    saved = json.loads((folder / "comparison.json").read_text())
    assert saved == comparison
    for name in ("rouge_l", "bleu", "exact_match", "perplexity", "loss"):
        assert set(saved["metrics"][name]) == {"before", "after", "delta"}
    assert saved["metrics"]["loss"]["after"] < saved["metrics"]["loss"]["before"]
    assert set(saved["per_kind"]) == {"single", "history"}
    page = (folder / "report.html").read_text()
    assert "Sample rows" in page and "Rows that got worse" in page and "Forgetting check" in page
    assert json.loads((folder / "adapter" / "emotune.json").read_text())["task"] == "sft"
    header = (folder / "finetuned" / "predictions.csv").read_text().splitlines()[0]
    assert header == "prompt,reference,output,kind,rouge_l,bleu,exact_match"
    assert json.loads((folder / "run.json").read_text())["status"] == "finished"
    merge = json.loads((folder / "finetuned" / "metrics.json").read_text())["merge"]
    assert merge["merged"] is True and merge["max_logit_diff"] < 1e-4 and merge["agreement"] == 1.0, merge


def test_comparison_with_probe_and_intervals():
    import dataclasses

    from emotune.eval.probe import ProbeResult, load_probe
    from emotune.tasks.sft.report import _probe_section, compare, format_comparison

    questions = load_probe(limit=40)
    def probe(right: int) -> dict:  # the first `right` questions answered correctly
        scores = [[0.0 if k == (q.answer if i < right else (q.answer + 1) % 4) else -5.0 for k in range(4)]
                  for i, q in enumerate(questions)]
        result = ProbeResult.from_scores(questions, scores)
        return json.loads(json.dumps({**dataclasses.asdict(result), "accuracy": result.accuracy}))

    def stage(score: float, loss: float, right: int) -> dict:
        rows = [{"rouge_l": score, "bleu": score, "exact_match": score} for _ in range(10)]
        kinds = {"k": {"rouge_l": score, "bleu": score, "exact_match": score, "n": 10}}
        metrics = {"rows": 10, "rouge_l": score, "bleu": score, "exact_match": score, "loss": loss,
                   "perplexity": math.exp(loss), "per_kind": kinds, "probe_accuracy": right / 40}
        return {"metrics": metrics, "rows": rows, "probe": probe(right)}

    comparison = compare(stage(0.2, 2.0, 40), stage(0.5, 1.0, 10))
    assert comparison["metrics"]["rouge_l"] == {"before": 0.2, "after": 0.5, "delta": 0.3}
    assert comparison["metrics"]["probe_accuracy"]["delta"] == -0.75
    assert comparison["intervals"]["rouge_l"]["low"] == pytest.approx(0.3)
    assert comparison["probe"]["flagged"] is True
    assert "Flagged" in _probe_section(comparison, None) and "response perplexity" in format_comparison(comparison)


def test_answers_with_weight_0_carry_no_loss_and_the_data_keeps_the_mark(tokenizer, tmp_path):
    """OpenAI's fine-tuning format marks answers not to learn with "weight": 0; they were trained on like any other."""
    from emotune.core.config.sft import SftColumns
    from emotune.data.conversations import normalise
    from emotune.data.roles import OPENAI_TAGS

    row = {"messages": [{"role": "user", "content": "i feel so lonely today"},
                        {"role": "assistant", "content": "joy", "weight": 0},
                        {"role": "user", "content": "this morning was great"},
                        {"role": "assistant", "content": "joy really", "weight": 1}]}
    conversation = normalise(row, "messages", SftColumns(), OPENAI_TAGS, "f")
    assert conversation.untrained == (0,)
    assert Conversation.from_row(json.loads(json.dumps(conversation.as_row()))) == conversation  # as saved in data/
    _, spans = loss_spans(tokenizer, conversation.chat())
    assert encode(conversation, tokenizer, None, mask_history=False).loss_spans == (spans[1],)
    row["messages"][3]["weight"] = 0
    assert "last assistant turn has weight 0" in normalise(row, "messages", SftColumns(), OPENAI_TAGS, "f")
    row["messages"][3]["weight"] = 0.5
    assert "other than 0 or 1" in normalise(row, "messages", SftColumns(), OPENAI_TAGS, "f")


def test_training_rows_all_cut_before_their_answer_are_refused(tokenizer):
    """Every row cut at train.max_length before its answer trained on nothing (loss 0) and reported the base as trained."""
    from emotune.core.config.load import load_config
    from emotune.core.errors import UserError
    from emotune.data.conversation_data import ConversationData
    from emotune.tasks.sft.task import training_rows

    data = ConversationData({"train": [CONVERSATION] * 3, "validation": [CONVERSATION], "test": [CONVERSATION]}, "x")
    with pytest.raises(UserError, match="Every one of the 3 train rows is cut at train.max_length=8 before its answer"):
        training_rows(data, tokenizer, load_config(None, ["task=sft", "train.max_length=8"]))
    train, validation = training_rows(data, tokenizer, load_config(None, ["task=sft", "train.max_length=256"]))
    assert len(train) == 3 and len(validation) == 1


def test_axolotl_training_flags_are_honoured_or_refused(tokenizer):
    """Axolotl's per-turn `training` flag (message_field_training) was ignored: an answer marked `training: false` was
    trained on, and a user turn marked `training: true` was silently not."""
    from emotune.core.config.sft import SftColumns
    from emotune.data.conversations import normalise
    from emotune.data.roles import OPENAI_TAGS

    def turns(*extra):
        messages = [{"role": "system", "content": "be kind", "training": False},
                    {"role": "user", "content": "i feel so lonely today", "training": False},
                    {"role": "assistant", "content": "joy", "training": False},
                    {"role": "user", "content": "this morning was great"},
                    {"role": "assistant", "content": "joy really", "train": True}]
        for index, key, value in extra:
            messages[index][key] = value
        return normalise({"messages": messages}, "messages", SftColumns(), OPENAI_TAGS, "f")

    conversation = turns()
    assert conversation.untrained == (0,) and conversation.system == "be kind"
    _, spans = loss_spans(tokenizer, conversation.chat())
    assert encode(conversation, tokenizer, None, mask_history=False).loss_spans == (spans[1],)
    assert "last assistant turn has weight 0 (or training: false)" in turns((4, "train", False))
    assert "marked `training: true`" in turns((1, "training", True))
    assert "not true or false" in turns((2, "training", "no"))
    assert "`train_detail`" in turns((4, "train_detail", [{"begin_offset": 0, "end_offset": 2, "train": True}]))


@pytest.mark.parametrize("name", ["gemma3", "gemma4", "qwen3", "llama3", "mistral", "phi4"])
def test_the_last_answer_is_learned_after_the_generation_prompt_generation_reads(name):
    """A row ends with the prompt evaluation, serving and vLLM render for its last answer (Gemma 4's empty thought
    channel, Mistral v0.3's system prompt in the last user turn), then the answer and its closing; earlier answers keep
    their own text as spans (Mistral v0.3's no longer reach into the user turn before them); templates where the
    generation prompt already starts the finished answer keep their rendering."""
    from chat_families import FAMILIES, build_family_tokenizer

    tokenizer = build_family_tokenizer(next(f for f in FAMILIES if f.name == name))
    messages = Conversation((("user", "i feel happy"), ("assistant", "joy"), ("user", "i am sad"),
                             ("assistant", "sadness one"), ("user", "hi"), ("assistant", "anger")),
                            system="label the text").chat()
    ids, spans = loss_spans(tokenizer, messages)
    asked = tokenizer.apply_chat_template(messages[:-1], tokenize=True, add_generation_prompt=True, return_dict=False)
    finished = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert ids[:spans[-1][0]] == asked
    last = tokenizer.decode(ids[spans[-1][0]:spans[-1][1]])  # Qwen3's finished answer opens with an empty <think>
    assert last.startswith("<think>" if name == "qwen3" else "anger") and "anger" in last
    assert ids == finished if finished[:len(asked)] == asked else ids != finished
    for (start, end), answer in zip(spans[:-1], ["joy", "sadness one"], strict=True):
        assert tokenizer.decode(ids[start:end]).startswith(answer) and turn_token(tokenizer) in ids[start:end]


def turn_token(tokenizer) -> int:
    from emotune.model.turns import stop_token_ids

    return stop_token_ids(tokenizer)[-1] if len(stop_token_ids(tokenizer)) > 1 else tokenizer.eos_token_id


def test_each_rendering_a_row_needs_is_made_once(tokenizer, monkeypatch):
    """A row and its loss spans ask for the same renderings (the whole conversation; the turns before each answer with
    the generation prompt): the chat template renders each once, two per turn pair here."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "how are you"}, {"role": "assistant", "content": "fine"}]
    expected = loss_spans(tokenizer, messages)
    calls = []
    render = type(tokenizer).apply_chat_template

    def counted(self, conversation, *args, **kwargs):
        calls.append((len(conversation), kwargs.get("add_generation_prompt")))
        return render(self, conversation, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "apply_chat_template", counted)
    assert loss_spans(tokenizer, messages) == expected
    assert sorted(calls) == [(1, True), (2, False), (3, True), (4, False)], calls


def test_the_per_row_bleu_interval_sits_beside_the_mean_per_row_bleu_not_corpus_bleu():
    """predictions.csv's `bleu` is each row's sentence BLEU, but its paired interval was stored under `bleu`, the key
    of corpus BLEU, and the report showed it in the "BLEU (corpus)" row: beside a corpus-BLEU change of +0.400, an
    interval of the mean sentence BLEU's change, [-0.100, -0.100], that says the opposite."""
    import re

    from emotune.eval.stats import paired_bootstrap_delta
    from emotune.tasks.sft.report import _metrics_section, compare

    def stage(corpus: float, sentence: float) -> dict:
        rows = [{"rouge_l": 0.5, "bleu": sentence, "exact_match": 0.0} for _ in range(8)]
        metrics = {"rows": 8, "loss": 1.0, "perplexity": math.e, "rouge_l": 0.5, "bleu": corpus,
                   "sentence_bleu": sentence, "exact_match": 0.0, "per_kind": {}, "max_new_tokens": 16}
        return {"metrics": metrics, "rows": rows}

    before, after = stage(0.1, 0.3), stage(0.5, 0.2)
    comparison = compare(before, after)
    assert comparison["intervals"]["sentence_bleu"] == paired_bootstrap_delta([0.3] * 8, [0.2] * 8)
    assert "bleu" not in comparison["intervals"]
    page = _metrics_section(before, after, comparison)
    cells = {title: re.findall(r"<td[^>]*>([^<]*)</td>", row)
             for title, row in re.findall(r"<tr><th>([^<]*)</th>(.*?)</tr>", page)}
    assert cells["BLEU (corpus)"] == ["0.100", "0.500", "+0.400", ""]
    assert cells["BLEU (mean per row)"] == ["0.300", "0.200", "-0.100", "[-0.100, -0.100]"]


def test_the_per_kind_bleu_is_named_as_the_mean_per_row_bleu_it_is():
    """The per-kind table's "BLEU" column holds each kind's mean sentence BLEU (metrics.json's per_kind `bleu`), beside
    a headline table whose "BLEU" is corpus BLEU: a kind scoring 0.300 under a headline of 0.050 read as one metric."""
    from emotune.eval.textmetrics import summarize
    from emotune.tasks.sft.report import TITLES, _kinds_section, compare

    rows = [{"kind": "qa", "rouge_l": 0.5, "bleu": 0.3, "exact_match": 0.0, "prediction": "a b c d e", "reference": "x"}]
    per_kind = summarize(rows)["per_kind"]
    assert per_kind["qa"]["bleu"] == 0.3  # the mean sentence BLEU
    stage = {"metrics": {"rows": 1, "per_kind": per_kind}, "rows": []}
    page = _kinds_section(compare(stage, stage))
    assert f"<th colspan=3>{TITLES['sentence_bleu']}</th>" in page and "<th colspan=3>BLEU</th>" not in page
