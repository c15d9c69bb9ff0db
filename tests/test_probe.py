"""The forgetting probe: loading the packaged questions, option and letter scoring against slow references,
comparison.

The tiny fixture model's word-level vocabulary has no letters, so `letter_tokenizer` is the fixture's
tokenizer with four label words renamed to A–D: same ids and size, so the fixture model's weights fit it.
Option scoring uses the fixture's own tokenizer (`word_tokenizer`); every test option is made of its words.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from emotune.core.errors import UserError
from emotune.eval.probe import (
    INSTRUCTIONS,
    LETTERS,
    PROBE_PATH,
    ProbeQuestion,
    ProbeResult,
    compare_probe,
    letter_token_ids,
    load_probe,
    option_token_ids,
    render_prompt,
    score_probe,
)

RENAMED = ["sadness", "joy", "love", "anger"]  # label words the test questions do not use


@pytest.fixture(scope="module")
def letter_tokenizer(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("letter-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (tiny_model_dir / name).is_file():
            shutil.copy(tiny_model_dir / name, folder / name)
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    for old, new in zip(RENAMED, LETTERS, strict=False):
        vocab[new] = vocab.pop(old)
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def word_tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def make_questions() -> list[ProbeQuestion]:
    """Questions of different lengths and both languages, from words in the fixture vocabulary."""
    texts = ["my friend was so happy today", "work", "i am really nervous this morning and the work was very gloomy",
             "the morning", "i feel lonely", "this was so unexpected my friend"]
    options = [["happy", "so lonely", "really very furious", "scared"], ["grief", "great work", "rage", "wow"],
               ["crying today", "delighted", "annoyed", "panic"], ["tender", "caring", "adore", "my darling"]]
    return [ProbeQuestion(f"q{i}", "zh" if i % 3 == 2 else "en", "t", text, tuple(options[i % 4]), i % 4)
            for i, text in enumerate(texts)]


def reference_logprobs(model, tokenizer, question: ProbeQuestion) -> list[float]:
    """The slow way: the prompt written out here, one question, a full forward, log-softmax over the vocabulary."""
    options = "\n".join(f"{letter}. {choice}" for letter, choice in zip("ABCD", question.choices, strict=False))
    content = f"{question.question}\n\n{options}\n\n{INSTRUCTIONS[question.lang]}"
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0, -1].float(), dim=-1)
    return logprobs[tokenizer.convert_tokens_to_ids(list("ABCD"))].tolist()


def reference_option_scores(model, tokenizer, question: ProbeQuestion) -> list[float]:
    """The slow way: the question alone as the user turn, then one option at a time as the reply, a full
    forward over the whole row, log-softmax everywhere, the option tokens' log-probabilities summed / count."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question.question}], tokenize=False,
                                         add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    scores = []
    for choice in question.choices:
        ids = tokenizer(text + choice, add_special_tokens=False)["input_ids"]
        assert ids[:len(prompt)] == prompt and len(ids) > len(prompt)
        with torch.no_grad():
            logprobs = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
        picked = [logprobs[t - 1, ids[t]].item() for t in range(len(prompt), len(ids))]
        scores.append(sum(picked) / len(picked))
    return scores


def test_packaged_probe_loads_280_valid_questions():
    questions = load_probe()
    assert len(questions) == 280 and len({q.id for q in questions}) == 280
    assert {q.lang for q in questions} == {"en", "zh"}
    assert all(len(q.choices) == 4 and 0 <= q.answer < 4 for q in questions)
    assert questions[0].choices[questions[0].answer] == "Paris"


def test_limit_takes_a_deterministic_subset_stratified_by_language_and_spread_over_topics():
    subset = load_probe(limit=28)
    assert subset == load_probe(limit=28)
    assert sum(q.lang == "en" for q in subset) == 14 and sum(q.lang == "zh" for q in subset) == 14
    assert len({q.topic for q in subset if q.lang == "zh"}) == 7
    odd = load_probe(limit=7)
    assert len(odd) == 7 and {q.lang for q in odd} == {"en", "zh"}
    assert len(load_probe(limit=1000)) == 280
    with pytest.raises(UserError, match="at least 1"):
        load_probe(limit=0)


def test_a_malformed_probe_file_names_every_bad_line_and_field(tmp_path):
    good = PROBE_PATH.read_text(encoding="utf-8").splitlines()[0]
    row = json.loads(good)
    bad_answer = json.dumps({**row, "answer": 4})
    three_choices = json.dumps({**row, "choices": ["a", "b", "c"]})
    no_question = json.dumps({k: v for k, v in row.items() if k != "question"})
    path = tmp_path / "probe.jsonl"
    path.write_text("\n".join([good, bad_answer, "{not json", three_choices, no_question]) + "\n")
    with pytest.raises(UserError) as err:
        load_probe(path)
    message = str(err.value)
    assert "4 problems" in message
    assert "line 2: field 'answer' is 4" in message and "line 3 is not valid JSON" in message
    assert "line 4: field 'choices'" in message and "line 5: field 'question' is missing" in message


def test_letter_token_ids_are_the_letters_after_the_prompt(letter_tokenizer, tiny_model_dir):
    prompt = render_prompt(letter_tokenizer, make_questions()[0])
    assert prompt.endswith("model\n") and "A. happy\nB. so lonely" in prompt
    assert letter_token_ids(letter_tokenizer, prompt) == letter_tokenizer.convert_tokens_to_ids(list("ABCD"))
    no_letters = AutoTokenizer.from_pretrained(tiny_model_dir)  # every letter is <unk>
    with pytest.raises(UserError, match="not all distinct"):
        letter_token_ids(no_letters, prompt)


def test_letter_scoring_equals_a_slow_one_question_reference(tiny_model, letter_tokenizer):
    questions = make_questions()
    result = score_probe(tiny_model, letter_tokenizer, questions, batch_size=4, method="letter")
    expected = [reference_logprobs(tiny_model, letter_tokenizer, q) for q in questions]
    assert torch.allclose(torch.tensor(result.letter_logprobs), torch.tensor(expected), atol=1e-5, rtol=0)
    assert result.predicted == [max(range(4), key=row.__getitem__) for row in expected]
    assert result.correct == [p == q.answer for p, q in zip(result.predicted, questions, strict=False)]
    assert result.accuracy == sum(result.correct) / len(questions)
    assert result.ci[0] <= result.accuracy <= result.ci[1]
    assert result.per_lang["en"]["n"] == 4 and result.per_lang["zh"]["n"] == 2


def test_letter_scoring_is_unchanged_by_batching_and_padding(tiny_model, letter_tokenizer):
    questions = make_questions()
    one = score_probe(tiny_model, letter_tokenizer, questions, batch_size=1, method="letter")
    all_at_once = score_probe(tiny_model, letter_tokenizer, questions, batch_size=16, method="letter")
    assert torch.allclose(torch.tensor(one.letter_logprobs), torch.tensor(all_at_once.letter_logprobs), atol=1e-5)
    assert one.predicted == all_at_once.predicted


def test_option_prompt_is_the_question_alone_and_every_option_word_is_in_the_vocabulary(word_tokenizer):
    question = make_questions()[0]
    prompt = render_prompt(word_tokenizer, question, "option")
    assert prompt.endswith("model\n") and question.question in prompt
    assert "A." not in prompt and "happy\n" not in prompt and INSTRUCTIONS["en"] not in prompt
    for q in make_questions():
        prompt_ids, options = option_token_ids(word_tokenizer, render_prompt(word_tokenizer, q, "option"), q.choices)
        assert [len(o) for o in options] == [len(c.split()) for c in q.choices]
        assert word_tokenizer.unk_token_id not in {t for o in options for t in o}
        assert word_tokenizer.unk_token_id not in prompt_ids


def test_option_scoring_equals_a_slow_one_row_reference(tiny_model, word_tokenizer):
    questions = make_questions()
    result = score_probe(tiny_model, word_tokenizer, questions, batch_size=5)
    expected = [reference_option_scores(tiny_model, word_tokenizer, q) for q in questions]
    assert result.method == "option" and result.summary()["method"] == "option"
    assert torch.allclose(torch.tensor(result.option_scores), torch.tensor(expected), atol=1e-5, rtol=0)
    assert result.letter_logprobs == result.option_scores  # the earlier name still reads the scores
    assert result.predicted == [max(range(4), key=row.__getitem__) for row in expected]
    assert result.correct == [p == q.answer for p, q in zip(result.predicted, questions, strict=False)]
    assert result.per_lang["en"]["n"] == 4 and result.per_lang["zh"]["n"] == 2


def test_option_scoring_is_unchanged_by_batching_and_padding(tiny_model, word_tokenizer):
    questions = make_questions()
    one = score_probe(tiny_model, word_tokenizer, questions, batch_size=1)
    some = score_probe(tiny_model, word_tokenizer, questions, batch_size=3)  # rows of mixed lengths together
    all_at_once = score_probe(tiny_model, word_tokenizer, questions, batch_size=64)
    for other in (some, all_at_once):
        assert torch.allclose(torch.tensor(one.option_scores), torch.tensor(other.option_scores), atol=1e-5, rtol=0)
        assert one.predicted == other.predicted


def test_an_unknown_method_is_refused(tiny_model, word_tokenizer):
    with pytest.raises(UserError, match="option, letter"):
        score_probe(tiny_model, word_tokenizer, make_questions(), method="logits")


@pytest.mark.parametrize("method", ["option", "letter"])
def test_score_probe_restores_the_training_mode(tiny_model, letter_tokenizer, method):
    tiny_model.train()
    score_probe(tiny_model, letter_tokenizer, make_questions()[:2], method=method)
    assert tiny_model.training
    tiny_model.eval()


def result_with(correct: list[bool]) -> ProbeResult:
    """A result whose question i is answered correctly exactly when correct[i]."""
    questions = [ProbeQuestion(f"q{i}", "en" if i % 2 else "zh", "t", "?", ("a", "b", "c", "d"), 0)
                 for i in range(len(correct))]
    return ProbeResult.from_scores(questions, [[0.0, -1.0, -1.0, -1.0] if ok else [-1.0, 0.0, -1.0, -1.0]
                                               for ok in correct])


def test_compare_probe_flags_a_clear_drop_only():
    before = result_with([True] * 80 + [False] * 20)
    drop = compare_probe(before, result_with([True] * 40 + [False] * 60))
    assert drop["accuracy_before"] == 0.8 and drop["accuracy_after"] == 0.4
    assert drop["delta"] == pytest.approx(-0.4) and drop["high"] < 0 and drop["flagged"]
    assert drop["per_lang"]["en"]["n"] == 50

    same = compare_probe(before, before)
    assert same["delta"] == 0 and not same["flagged"]
    small = compare_probe(before, result_with([True] * 78 + [False] * 22))  # two questions: noise
    assert small["delta"] == pytest.approx(-0.02) and small["low"] < 0 <= small["high"] and not small["flagged"]
    with pytest.raises(ValueError, match="same questions"):
        compare_probe(before, result_with([True] * 99))
    assert drop["method"] == "option"
    letters = ProbeResult.from_scores([ProbeQuestion(i, g, "t", "?", ("a", "b", "c", "d"), 0)
                                       for i, g in zip(before.ids, before.langs, strict=False)], before.option_scores, "letter")
    with pytest.raises(ValueError, match="scored the same way"):
        compare_probe(before, letters)


@pytest.mark.slow
@pytest.mark.xdist_group("packaged")
def test_real_gemma_tokenizer_and_model_agree_with_the_reference(packaged_model):
    """The packaged Gemma 3 270M: letters are its single tokens A–D, and batched scoring of a few real probe
    questions equals the one-question reference, in both methods."""
    model = AutoModelForCausalLM.from_pretrained(packaged_model.folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(packaged_model.folder)
    questions = load_probe(limit=4)
    ids = letter_token_ids(tokenizer, render_prompt(tokenizer, questions[0]))
    assert tokenizer.convert_ids_to_tokens(ids) == list("ABCD")
    result = score_probe(model, tokenizer, questions, batch_size=4, method="letter")
    expected = [reference_logprobs(model, tokenizer, q) for q in questions]
    assert torch.allclose(torch.tensor(result.letter_logprobs), torch.tensor(expected), atol=1e-4, rtol=0)
    result = score_probe(model, tokenizer, questions, batch_size=8)
    expected = [reference_option_scores(model, tokenizer, q) for q in questions]
    assert torch.allclose(torch.tensor(result.option_scores), torch.tensor(expected), atol=1e-4, rtol=0)
