"""End of turn from the tokenizer's own chat template (emotune.model.turns), for every family users bring:
what generation stops on, what label scoring appends, and that both are what training learns."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from datasets import Dataset

from chat_families import FAMILIES, build_family_tokenizer
from emotune.core.config.data import PromptConfig
from emotune.model.turns import end_of_turn_text, stop_token_ids, turn_end

LABELS = ["joy", "sadness", "anger"]
BY_NAME = {family.name: family for family in FAMILIES}


@pytest.fixture(scope="module", params=[f.name for f in FAMILIES])
def family(request):
    family = BY_NAME[request.param]
    return SimpleNamespace(spec=family, tokenizer=build_family_tokenizer(family))


def test_the_turn_token_is_the_one_the_family_closes_answers_with(family):
    end = turn_end(family.tokenizer)
    assert end.token == family.spec.turn_token
    assert end.token_id == family.tokenizer.convert_tokens_to_ids(family.spec.turn_token)
    assert end_of_turn_text(family.tokenizer) == family.spec.turn_token


def test_generation_stops_on_eos_the_turn_token_and_the_generation_config_s_ids(family):
    tokenizer = family.tokenizer
    configured = [tokenizer.convert_tokens_to_ids(t) for t in family.spec.generation_eos]
    stops = stop_token_ids(tokenizer, SimpleNamespace(eos_token_id=configured))
    assert stops[0] == tokenizer.eos_token_id
    assert set(stops) == {tokenizer.eos_token_id, turn_end(tokenizer).token_id, *configured}
    assert len(stops) == len(set(stops))
    assert turn_end(tokenizer).token_id in stop_token_ids(tokenizer)  # without a generation config too


def test_the_trained_completion_ends_with_the_token_scoring_appends(family):
    """Training's completion is what the template writes after the generation prompt; its first token after the
    label is the turn token that scoring appends and generation stops on (Gemma 4's thought channel included)."""
    from emotune.tasks.classify.task import encode_examples

    tokenizer = family.tokenizer
    rows = Dataset.from_list([{"text": "i feel happy", "label": "joy"}])
    [example] = encode_examples(rows, tokenizer, PromptConfig(), LABELS, max_length=512)
    completion = example.input_ids[example.completion_start:]
    joy = tokenizer.convert_tokens_to_ids("joy")
    assert joy in completion
    after_label = completion[completion.index(joy) + 1]
    assert after_label == turn_end(tokenizer).token_id
    assert after_label in stop_token_ids(tokenizer)


def test_a_trained_row_is_the_scoring_prompt_then_the_scored_label_then_the_turn_s_closing(family):
    """What training teaches is what scoring and generation read: the generation prompt as scoring renders it (Gemma 4's
    empty thought channel, Mistral v0.3's system prompt in the last user turn), then the label's scored tokens (no
    Qwen3 <think> block in between), then what the template writes after an answer."""
    from emotune.eval.scoring import label_token_ids, prompt_token_ids
    from emotune.tasks.classify.task import encode_examples

    tokenizer, prompt = family.tokenizer, PromptConfig()
    rows = Dataset.from_list([{"text": "i feel happy", "label": "sadness"}, {"text": "so angry", "label": "anger"}])
    examples = encode_examples(rows, tokenizer, prompt, LABELS, max_length=512)
    scored = dict(zip(LABELS, label_token_ids(tokenizer, prompt, LABELS), strict=True))
    closing = tokenizer(turn_end(tokenizer).suffix, add_special_tokens=False)["input_ids"]
    for example, row, prompt_ids in zip(examples, rows, prompt_token_ids(tokenizer, prompt, LABELS, rows["text"]),
                                        strict=True):
        assert example.input_ids[:example.completion_start] == prompt_ids
        assert example.input_ids[example.completion_start:] == scored[row["label"]] + closing


def test_scoring_appends_the_family_s_turn_token_to_ambiguous_labels(family):
    """`joy` and `joy ful` share a prefix, so every label is scored with its end of turn: `joy` then stop."""
    from emotune.eval.scoring import label_token_ids

    tokenizer = family.tokenizer
    sequences = label_token_ids(tokenizer, PromptConfig(), ["joy", "joy ful"])
    turn = tokenizer.convert_tokens_to_ids(family.spec.turn_token)
    assert [seq[-1] for seq in sequences] == [turn, turn]


def test_without_a_template_or_a_turn_token_the_eos_token_ends_a_turn():
    tokenizer = build_family_tokenizer(BY_NAME["qwen2.5"])
    tokenizer.chat_template = None
    assert turn_end(tokenizer).token is None and end_of_turn_text(tokenizer) == "<|im_end|>"
    assert stop_token_ids(tokenizer) == [tokenizer.eos_token_id]
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n\n' }}{% endfor %}"
    end = turn_end(tokenizer)
    assert end.suffix == "\n\n" and end.token is None  # plain text closes the turn: no token to stop on
    tokenizer.chat_template = "{{ raise_exception('no') }}"
    assert turn_end(tokenizer).suffix == "" and stop_token_ids(tokenizer) == [tokenizer.eos_token_id]


@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_templates_without_a_system_role_get_the_system_text_in_the_first_user_message(name):
    """Gemma 2's template raises `System role not supported`, Mixtral's `Conversation roles must alternate`, on the
    system message every classify prompt has: `emotune run` stopped with jinja's traceback. Templates with a system
    role are left as they are."""
    from emotune.model.prompt import prompt_messages
    from emotune.model.system_role import FOLD_MARK, fold_system_role

    spec = BY_NAME[name]
    tokenizer = build_family_tokenizer(spec)
    raw = spec.template if spec.template is not None else tokenizer.chat_template
    tokenizer.chat_template = raw  # as the checkpoint ships it, before emotune's loading wraps it
    assert FOLD_MARK not in raw
    assert fold_system_role(tokenizer) is (name in ("gemma2", "mixtral"))
    assert fold_system_role(tokenizer) is False  # once is enough: a saved, wrapped template is not wrapped again
    messages = prompt_messages("i feel happy", PromptConfig(system_prompt="be brief"), LABELS)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    user = messages[1]["content"]
    expected = {"gemma2": f"<bos><start_of_turn>user\nbe brief\n\n{user}<end_of_turn>\n<start_of_turn>model\n",
                "mixtral": f"<s>[INST] be brief\n\n{user} [/INST]"}
    if name in expected:
        assert rendered == expected[name]
        assert tokenizer.apply_chat_template(messages[1:], tokenize=False, add_generation_prompt=True) == \
            expected[name].replace("be brief\n\n", "")  # without a system message: the template's own rendering
    else:
        assert tokenizer.chat_template == raw and "be brief" in rendered
