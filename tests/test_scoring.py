"""Scoring: exact label log-probabilities, checked against one unpadded full-sequence forward per (row, label)."""

from __future__ import annotations

import pytest
import torch

from emotune.core.config.data import PromptConfig
from emotune.data import prompt_messages
from emotune.eval.scoring import LabelScorer, LabelTrie, label_token_ids, score_label_probs

# Multi-token labels and labels that share a prefix ("happy" / "happy joy" / "happy joy today").
TRIE_LABELS = ["sadness", "happy", "happy joy", "happy joy today", "love", "very scared"]
SHORT_PROMPT = PromptConfig(system_prompt="classify the emotion : {labels} .", user_template="{text}")
TEXTS = ["i feel lonely today", "wow", "my friend was so happy this morning and i am delighted",
         "hate", "the work was really very gloomy", "scared"]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from emotune.core.config.model import ModelConfig
    from emotune.model.loading import load_model, load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir, ModelConfig())
    model = load_model(tiny_model_dir, torch.float32, torch.device("cpu"))
    return model, tokenizer


def brute_force_log_probs(model, tokenizer, texts, prompt, labels) -> torch.Tensor:
    """Sum of log-softmax over the full vocabulary at every label token, one unpadded sequence at a time."""
    sequences = label_token_ids(tokenizer, prompt, labels)
    out = torch.zeros(len(texts), len(labels))
    for r, text in enumerate(texts):
        rendered = tokenizer.apply_chat_template(prompt_messages(text, prompt, labels), tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        for i, label_ids in enumerate(sequences):
            ids = torch.tensor([prompt_ids + label_ids])
            with torch.no_grad():
                logp = model(input_ids=ids).logits[0].float().log_softmax(-1)
            out[r, i] = sum(logp[len(prompt_ids) - 1 + k, token] for k, token in enumerate(label_ids))
    return out


def test_end_of_turn_is_scored_only_when_labels_share_a_prefix(tiny):
    _, tokenizer = tiny
    eot = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    sequences = label_token_ids(tokenizer, SHORT_PROMPT, TRIE_LABELS)
    assert [len(s) for s in sequences] == [2, 2, 3, 4, 2, 3]
    assert all(s[-1] == eot for s in sequences)
    assert sequences[2][:1] == sequences[1][:1] and sequences[3][:2] == sequences[2][:2]
    disjoint = label_token_ids(tokenizer, SHORT_PROMPT, ["sadness", "very scared", "happy joy"])
    assert [len(s) for s in disjoint] == [1, 2, 2] and eot not in sum(disjoint, [])


def test_trie_shares_prefix_nodes():
    trie = LabelTrie.build([[5, 9], [5, 6, 9], [5, 6, 7, 9], [8, 9]])
    # nodes: (), (5,), (5,6), (5,6,7), (8,): one vocabulary projection each
    assert trie.n_nodes == 5
    assert sorted(map(tuple, trie.paths)) == [(5, 6, 7), (8,)]
    assert trie.steps[0][0][0] == trie.steps[1][0][0] == 0  # every label's first token is read at the prompt end


@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_scores_equal_brute_force(tiny, padding_side, batch_size):
    model, tokenizer = tiny
    expected = brute_force_log_probs(model, tokenizer, TEXTS, SHORT_PROMPT, TRIE_LABELS)
    scorer = LabelScorer(model, tokenizer, SHORT_PROMPT, TRIE_LABELS, padding_side=padding_side)
    got = scorer.log_probs(TEXTS, batch_size=batch_size)
    assert got.shape == (len(TEXTS), len(TRIE_LABELS))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_default_prompt_and_single_text(tiny):
    """The default prompt and labels (no shared prefix: no end-of-turn), and one text alone."""
    model, tokenizer = tiny
    labels = ["sadness", "joy", "love", "anger", "fear", "surprise"]
    prompt = PromptConfig()
    expected = brute_force_log_probs(model, tokenizer, TEXTS[:3], prompt, labels)
    torch.testing.assert_close(LabelScorer(model, tokenizer, prompt, labels).log_probs(TEXTS[:3], 2), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(LabelScorer(model, tokenizer, prompt, labels).log_probs(TEXTS[:1]), expected[:1], atol=1e-4, rtol=1e-4)


def test_rows_longer_than_the_sliding_window(tiny):
    """The tiny model's sliding window is 64 tokens: a long row next to short ones, padded, still scores exactly."""
    model, tokenizer = tiny
    assert model.config.sliding_window == 64
    texts = [" ".join(["i feel so lonely and lost today my friend"] * 7), "wow", "happy"]
    ids = LabelScorer(model, tokenizer, PromptConfig(), TRIE_LABELS).prompt_ids(texts)
    assert len(ids[0]) > 100 and len(ids[1]) < 64
    expected = brute_force_log_probs(model, tokenizer, texts, PromptConfig(), TRIE_LABELS)
    got = LabelScorer(model, tokenizer, PromptConfig(), TRIE_LABELS).log_probs(texts, batch_size=3)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_eager_attention(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from emotune.core.config.model import ModelConfig
    from emotune.model.loading import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir, ModelConfig())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="eager")
    expected = brute_force_log_probs(model, tokenizer, TEXTS, SHORT_PROMPT, TRIE_LABELS)
    torch.testing.assert_close(LabelScorer(model, tokenizer, SHORT_PROMPT, TRIE_LABELS).log_probs(TEXTS, 4), expected,
                               atol=1e-4, rtol=1e-4)


def test_score_label_probs_is_a_distribution_over_labels(tiny):
    model, tokenizer = tiny
    probs = score_label_probs(model, tokenizer, TEXTS, SHORT_PROMPT, TRIE_LABELS, batch_size=3)
    assert probs.dtype == torch.float32 and probs.shape == (len(TEXTS), len(TRIE_LABELS))
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(TEXTS)))
    expected = brute_force_log_probs(model, tokenizer, TEXTS, SHORT_PROMPT, TRIE_LABELS).softmax(-1)
    torch.testing.assert_close(probs, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.xdist_group("packaged")
def test_real_model_scores_equal_brute_force(packaged_model):
    """The packaged Gemma 3 270M and its tokenizer: `sadness` is two tokens, the vocabulary 262,144 wide."""
    from emotune.core.config.model import ModelConfig
    from emotune.model.loading import load_model, load_tokenizer

    model_dir = packaged_model.folder
    tokenizer = load_tokenizer(model_dir, ModelConfig())
    model = load_model(model_dir, torch.float32, torch.device("cpu")).eval()
    labels = ["sadness", "joy", "love", "anger", "fear", "surprise"]
    sequences = label_token_ids(tokenizer, PromptConfig(), labels)
    assert sequences[0] == [37918, 1788] and all(len(s) == 1 for s in sequences[1:])  # no shared prefix: no end-of-turn
    texts = ["i feel so alone tonight", "this is the best day of my whole life and i cannot stop smiling"]
    expected = brute_force_log_probs(model, tokenizer, texts, PromptConfig(), labels)
    got = LabelScorer(model, tokenizer, PromptConfig(), labels).log_probs(texts, batch_size=2)
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)


def test_single_token_labels_on_learned_positions(tiny_gpt2_dir):
    """GPT-2 looks positions up in a learned table: with every label a single token (no label tree after the prompt)
    the positions must still be integers, and the scores equal the brute-force ones."""
    from emotune.core.config.model import ModelConfig
    from emotune.model.loading import load_model, load_tokenizer

    tokenizer = load_tokenizer(tiny_gpt2_dir, ModelConfig())
    model = load_model(tiny_gpt2_dir, torch.float32, torch.device("cpu"))
    labels = ["sadness", "joy", "love"]
    assert all(len(s) == 1 for s in label_token_ids(tokenizer, PromptConfig(), labels))
    expected = brute_force_log_probs(model, tokenizer, TEXTS[:4], PromptConfig(), labels)
    got = LabelScorer(model, tokenizer, PromptConfig(), labels).log_probs(TEXTS[:4], batch_size=3)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_scoring_under_flash_attention_names_the_setting_to_change(tiny_gpt2_dir):
    """The scorer passes its own masks, which flash attention takes none of: the error named no setting ('Load the
    model with sdpa'), and sdpa is no choice for every model (Gemma 2 runs eager only)."""
    from emotune.core.config.model import ModelConfig
    from emotune.core.errors import UserError
    from emotune.model.loading import load_model, load_tokenizer

    tokenizer = load_tokenizer(tiny_gpt2_dir, ModelConfig())
    model = load_model(tiny_gpt2_dir, torch.float32, torch.device("cpu"))
    model.config._attn_implementation = "flash_attention_2"  # as loaded on a GPU with flash-attn
    with pytest.raises(UserError, match="model.attn_implementation=sdpa .*eager.*eval.method=generate"):
        LabelScorer(model, tokenizer, PromptConfig(), ["joy", "sadness"]).log_probs(["i am happy"])
