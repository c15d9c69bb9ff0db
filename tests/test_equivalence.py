"""The equivalence matrix: every path emotune computes a loss, a gradient, a score or a token on, against the model's
own forward, over every tested family (tests/families.py), in float32.

The reference is always the model itself: the training loss is the model's own loss with `labels` passed (the
positions outside the loss spans at -100), its gradients the LoRA gradients of that loss; label scores are the
log-softmax of the model's own logits, one unpadded row at a time; the classification head reads the language
model's own last hidden state; generation is greedy argmax over the model's own logits, one row at a time, without
a cache; merged weights give the adapted model's logits. Training is checked against the exact answer: the model's
own loss and gradients computed in float64. emotune's float32 loss agrees with it within 1e-5 relative, its float32
gradients are no further from it than 3x the model's own float32 gradients are (plus 1e-6), each measured relative
to the tensor's largest entry where that exceeds 1. A fixed tolerance between two float32 results would test the
rounding instead: on the Gemma 4 fixtures (sharp logits, as in a trained model) the model's own float32 gradients
sit up to 7e-5 of scale from the float64 ones, and a different summation order (a shared prefix, another CPU, other
thread counts) moves them by as much. Merged logits likewise: no further from the adapted model's float64 logits than
4x its own float32 logits are. A path a family cannot take exactly must say so (`cannot_share`) and fall back to the
plain path.

The quick loop runs every family on the plain path and on all of emotune's training paths at once (chunked loss with
a small chunk, shared prefix, lean LoRA, lean norm, gradient checkpointing, two accumulated passes), plus scoring,
the head, generation and merge on a few families; `slow` runs each path alone, and every path on every family.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset

from conftest import LABELS, build_tokenizer, make_rows
from emotune.core.config.data import PromptConfig
from emotune.core.config.train import LoraSettings
from emotune.data import prompt_messages
from emotune.eval.evaluate import generate_texts
from emotune.eval.scoring import LabelScorer, label_token_ids
from emotune.model import lean_lora, lean_norm
from emotune.model.head import classifier_from_causal, head_probabilities
from emotune.model.lora import attach_lora, checkpoint_activations
from emotune.model.prefix import cannot_share
from emotune.tasks.classify.task import encode_examples
from emotune.tasks.classify_head.objective import head_loss
from emotune.train.batches import LANGUAGE_MODEL, Example, collate, completion_loss, share_prefix
from families import BROUGHT_FAMILIES, FAMILIES, MORE_FAMILIES, SOFT_CAPPED, WHOLE_ROWS, build

CPU = torch.device("cpu")
SMALL_CHUNK = 5  # loss positions per projection chunk: every pass below has more, so the chunked path runs
REFERENCE = "gemma4-e4b"
TRIE_LABELS = ["sadness", "happy", "happy joy", "happy joy today", "love", "very scared"]  # shared token prefixes
SHORT_PROMPT = PromptConfig(system_prompt="classify the emotion : {labels} .", user_template="{text}")
TEXTS = ["i feel lonely today", "wow", "my friend was so happy this morning and i am delighted", "hate",
         "the work was really very gloomy and my friend was so lost today"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("families-tokenizer")
    build_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def classify_rows(tokenizer, n: int = 6) -> list[Example]:
    """Rows of different lengths (padding happens), longer than the sliding windows, sharing their prompt head."""
    rows = make_rows(1, seed=5)[:n]
    for i, row in enumerate(rows):
        row["text"] = " ".join([row["text"]] * (1 + i % 3))
    return encode_examples(Dataset.from_list(rows), tokenizer, PromptConfig(), LABELS, max_length=256)


def sft_rows(tokenizer) -> list[Example]:
    """Rows with several loss spans (a conversation's assistant turns): the label and a stretch of the user text."""
    rows = classify_rows(tokenizer)
    return [replace(r, spans=((r.completion_start - 9, r.completion_start - 4), (r.completion_start, len(r.input_ids))))
            for r in rows]


def adapted(model, seed: int = 0):
    """emotune's LoRA (all-linear on the language model, dropout 0) with B != 0, so every adapter has a gradient. A is
    drawn from the seeded generator too, as PEFT's default draws it (uniform in +-1/sqrt(fan_in)), not from the global
    random state, which the tests before it move: the float checks here compare roundings, which depend on the values."""
    model = attach_lora(model, LoraSettings(r=4, alpha=8, dropout=0.0))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "lora_A" in name:
                weight.copy_((torch.rand(weight.shape, generator=generator) * 2 - 1) / weight.shape[-1] ** 0.5)
            elif "lora_B" in name:
                weight.copy_(torch.randn(weight.shape, generator=generator) * 0.02)
    return model.train()


def reference_update(model, rows: list[Example], pad_id: int) -> tuple[float, dict[str, torch.Tensor]]:
    """The model's own mean cross-entropy over the loss tokens of `rows` (labels passed to it) and its gradients."""
    batch = collate(rows, pad_id, CPU)
    labels = torch.full_like(batch["input_ids"], -100)
    predicts = batch["predicts"]
    labels[:, 1:][predicts[:, :-1]] = batch["input_ids"][:, 1:][predicts[:, :-1]]
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels, use_cache=False).loss
    loss.backward()
    return float(loss), _grads(model)


def emotune_update(model, rows: list[Example], pad_id: int, paths: set[str]) -> tuple[float, dict[str, torch.Tensor], dict]:
    """emotune's loss over `rows` on `paths` (the training loop's arithmetic: summed losses of the passes over the
    step's loss tokens), its gradients, and the shared-prefix choice."""
    objective, choice = (share_prefix(LANGUAGE_MODEL, rows, "auto", model) if "shared_prefix" in paths
                         else (LANGUAGE_MODEL, {"used": False}))
    if "lean_lora" in paths:
        # every LoRA layer takes the lean forward but GPT-2's Conv1D ones (weights stored transposed), which run PEFT's
        conv1d = sum(type(m.get_base_layer()).__name__ == "Conv1D" for m in model.modules() if hasattr(m, "lora_A"))
        installed = lean_lora.install(model)
        assert (installed > 0 or conv1d > 0) and lean_lora.describe(model)["own_forward"] == conv1d
    if "lean_norm" in paths:
        lean_norm.install(model)
        norms = lean_norm.describe(model)
        # every Gemma norm takes the lean forward (Gemma 3n's and 4's too); other families have none it covers
        assert norms["own_forward"] == {} and (norms["norms"] > 0) == ("gemma" in type(model.get_base_model()).__name__.lower())
    if "checkpointing" in paths:
        checkpoint_activations(model)
    passes = [rows[:3], rows[3:]] if "accumulation" in paths else [rows]
    chunk = SMALL_CHUNK if "chunked" in paths else 10 ** 6
    model.zero_grad(set_to_none=True)
    tokens = sum(r.completion_tokens for r in rows)
    total = 0.0
    for part in passes:
        assert "chunked" not in paths or sum(r.completion_tokens for r in part) > SMALL_CHUNK  # several chunks run
        parts = completion_loss(model, objective.collate(part, pad_id, CPU), chunk)
        (parts.loss_sum / tokens).backward()
        total += float(parts.loss_sum.detach())
    lean_lora.restore(model)
    lean_norm.restore(model)
    return total / tokens, _grads(model), choice


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _scaled_error(grads: dict[str, torch.Tensor], exact: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each tensor's largest distance from the exact gradient, relative to its largest entry where that exceeds 1."""
    return {name: float((grads[name].double() - g).abs().max()) / max(1.0, float(g.abs().max())) for name, g in exact.items()}


def assert_same_update(exact, model_fp32, ours) -> None:
    """`ours` (emotune's float32 loss and gradients) against `exact` (the model's own, in float64): no further from it
    than 3x the model's own float32 result `model_fp32` is, the rounding float32 itself brings."""
    (loss, grads), (_, model_grads), (our_loss, our_grads) = exact, model_fp32, ours
    assert our_loss == pytest.approx(loss, rel=1e-5)
    assert grads.keys() == our_grads.keys() == model_grads.keys() and len(grads) > 0
    rounding = max(_scaled_error(model_grads, grads).values())
    errors = _scaled_error(our_grads, grads)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 3 * rounding + 1e-6, (worst, errors[worst], rounding)


def in_float64(model):
    """A float64 copy of `model`; mixture-of-experts layers loop over their experts (transformers' grouped-matmul
    kernel takes no float64)."""
    exact = copy.deepcopy(model).double()
    base = exact.get_base_model() if hasattr(exact, "get_base_model") else exact  # an adapted model, or a bare one
    if getattr(base.config, "_experts_implementation", None) not in (None, "eager"):
        base.set_experts_implementation("eager")
    return exact


def check_training(name: str, tokenizer, tokenizer_dir, paths: set[str], rows_of=classify_rows) -> dict:
    model = adapted(build(name, tokenizer_dir))
    rows = rows_of(tokenizer)
    exact = reference_update(in_float64(model), rows, tokenizer.pad_token_id)
    model_fp32 = reference_update(model, rows, tokenizer.pad_token_id)
    loss, grads, choice = emotune_update(model, rows, tokenizer.pad_token_id, paths)
    assert_same_update(exact, model_fp32, (loss, grads))
    if "shared_prefix" in paths:  # used, or refused with the reason run.json records
        assert choice["used"] or choice["reason"] == cannot_share(model), choice
    return choice


ALL_PATHS = {"chunked", "shared_prefix", "lean_lora", "lean_norm", "checkpointing", "accumulation"}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_training_loss_and_gradients_plain(name, tokenizer, tokenizer_dir):
    check_training(name, tokenizer, tokenizer_dir, set())


@pytest.mark.parametrize("name", list(FAMILIES))
def test_training_loss_and_gradients_on_every_path_at_once(name, tokenizer, tokenizer_dir):
    choice = check_training(name, tokenizer, tokenizer_dir, ALL_PATHS)
    assert choice["used"], choice  # every tested family runs rows after a shared prefix


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(ALL_PATHS))
@pytest.mark.parametrize("name", list(FAMILIES))
def test_training_loss_and_gradients_per_path(name, path, tokenizer, tokenizer_dir):
    check_training(name, tokenizer, tokenizer_dir, {path})


@pytest.mark.parametrize("name", [REFERENCE, "gemma3n", "qwen3", "phi3"])
def test_sft_loss_on_several_spans_chunked(name, tokenizer, tokenizer_dir):
    check_training(name, tokenizer, tokenizer_dir, {"chunked", "shared_prefix"}, rows_of=sft_rows)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_sft_loss_on_several_spans_every_family(name, tokenizer, tokenizer_dir):
    check_training(name, tokenizer, tokenizer_dir, ALL_PATHS, rows_of=sft_rows)


def test_soft_capped_families_really_cap(tokenizer, tokenizer_dir):
    """The fixtures' logits reach where a soft-cap of 30 changes them: an uncapped score would differ visibly."""
    from emotune.model.text import logit_softcap, softcap_suspended

    ids = torch.tensor([tokenizer("i feel lonely today my friend was so happy")["input_ids"]])
    for name in SOFT_CAPPED:
        model = build(name, tokenizer_dir)
        assert logit_softcap(model) == 30.0, name
        with torch.no_grad():
            capped = model(input_ids=ids).logits.log_softmax(-1)
            with softcap_suspended(model):
                uncapped = model(input_ids=ids).logits.log_softmax(-1)
        assert float((capped - uncapped).abs().max()) > 0.5, name
    # Gemma 2 also caps its attention logits (at 50): the fixture's reach past it, so every path is checked with it
    gemma2 = build("gemma2", tokenizer_dir)
    config = gemma2.config
    with torch.no_grad():
        capped = gemma2(input_ids=ids).logits
        object.__setattr__(config, "attn_logit_softcapping", None)
        for layer in gemma2.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        uncapped = gemma2(input_ids=ids).logits
    assert float((capped - uncapped).abs().max()) > 0.5


# --------------------------------------------------------------------------------------------------
# Label scoring, the classification head, generation, merge


def brute_force_log_probs(model, tokenizer, texts, prompt, labels) -> torch.Tensor:
    """Sum of the log-softmax of the model's own logits at every label token, one unpadded sequence at a time."""
    sequences = label_token_ids(tokenizer, prompt, labels)
    out = torch.zeros(len(texts), len(labels))
    for r, text in enumerate(texts):
        rendered = tokenizer.apply_chat_template(prompt_messages(text, prompt, labels), tokenize=False,
                                                 add_generation_prompt=True)
        prompt_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        for i, label_ids in enumerate(sequences):
            with torch.no_grad():
                logp = model(input_ids=torch.tensor([prompt_ids + label_ids])).logits[0].float().log_softmax(-1)
            out[r, i] = sum(logp[len(prompt_ids) - 1 + k, token] for k, token in enumerate(label_ids))
    return out


def check_scoring(name: str, tokenizer, tokenizer_dir, with_adapter: bool) -> None:
    model = build(name, tokenizer_dir)
    model = adapted(model).eval() if with_adapter else model
    expected = brute_force_log_probs(model, tokenizer, TEXTS, SHORT_PROMPT, TRIE_LABELS)
    got = LabelScorer(model, tokenizer, SHORT_PROMPT, TRIE_LABELS).log_probs(TEXTS, batch_size=3)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", [REFERENCE, "gemma4-text", "gemma3n", "phi3"])
def test_label_scores_equal_the_models_own(name, tokenizer, tokenizer_dir):
    check_scoring(name, tokenizer, tokenizer_dir, with_adapter=name == REFERENCE)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_label_scores_equal_the_models_own_every_family(name, tokenizer, tokenizer_dir):
    check_scoring(name, tokenizer, tokenizer_dir, with_adapter=True)


@pytest.mark.parametrize("name", list(MORE_FAMILIES))
def test_label_scores_equal_the_models_own_beyond_the_matrix(name, tokenizer, tokenizer_dir):
    """Granite divides its logits by 8 and Cohere multiplies them by 1/16 after the output layer; Llama 4 attends in
    chunks of positions and its `get_decoder()` is the causal model itself: the scores are still the model's own."""
    check_scoring(name, tokenizer, tokenizer_dir, with_adapter=True)


@pytest.mark.parametrize("name", list(MORE_FAMILIES))
def test_more_families_train_on_every_path(name, tokenizer, tokenizer_dir):
    """Llama 4's chunked attention under the shared prefix's explicit masks; Granite's and Cohere's logit scale in the
    chunked loss (their forwards scale what the identity head passes through, which the chunks then project): the
    same update as the model's own loss."""
    choice = check_training(name, tokenizer, tokenizer_dir, ALL_PATHS)
    assert choice["used"], choice


@pytest.mark.parametrize("name", list(BROUGHT_FAMILIES))
def test_brought_families_score_and_train_as_their_own_forward(name, tokenizer, tokenizer_dir):
    """GPT-2's Conv1D layers, GPT-NeoX's and Phi-2's partial rotary, Falcon's fused qkv and ALiBi, OLMo 2's norms after
    the blocks, Gemma 2's attention and final soft-caps, SmolLM3's NoPE layers, Qwen3-MoE's fused experts: label scores
    and the update on every training path are the model's own. Falcon-RW's and BLOOM's ALiBi counts positions from
    the attention mask, which no explicit position reaches: they score and train whole rows (the prefix path stopped
    with a traceback in their forwards)."""
    check_scoring(name, tokenizer, tokenizer_dir, with_adapter=True)
    choice = check_training(name, tokenizer, tokenizer_dir, ALL_PATHS)
    assert choice["used"] == (name not in WHOLE_ROWS), choice


def check_head(name: str, tokenizer, tokenizer_dir) -> None:
    """The head's probabilities and loss on a padded batch against the model's own last hidden state, row by row,
    judged in float64: emotune's float32 may be no further from it than 3x the model's own float32 is (a fixed
    float32 tolerance failed on gemma3-4b where the batched result was the closer of the two: 3.2e-5 against 6.0e-5)."""
    causal = build(name, tokenizer_dir)
    classifier = classifier_from_causal(causal, LABELS, seed=0, init_std=1.0)
    probs = head_probabilities(classifier, tokenizer, TEXTS, max_length=64, batch_size=3)
    score = classifier.score.weight.detach()
    own = _head_logits(causal, score, tokenizer, torch.float32)
    exact = _head_logits(in_float64(causal), score, tokenizer, torch.float64)
    _no_further_than_own(probs.double(), own.softmax(-1).double(), exact.softmax(-1))
    from emotune.tasks.classify_head.objective import collate_rows

    rows = [Example(tokenizer(t)["input_ids"], 0, label=i % len(LABELS)) for i, t in enumerate(TEXTS)]
    batch = collate_rows(rows, tokenizer.pad_token_id, CPU)
    with torch.no_grad():
        loss = head_loss(classifier, batch).loss_sum
    losses = [F.cross_entropy(logits, batch["labels"], reduction="sum").double() for logits in (own, exact)]
    _no_further_than_own(loss.double().reshape(1), losses[0].reshape(1), losses[1].reshape(1))


def _head_logits(causal, score: torch.Tensor, tokenizer, dtype: torch.dtype) -> torch.Tensor:
    """Each text alone through the model's own decoder, its last hidden state times the head's weight."""
    body, rows = causal.get_decoder(), []
    for text in TEXTS:
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        with torch.no_grad():
            hidden = body(input_ids=ids).last_hidden_state[0, -1]
        rows.append(F.linear(hidden.to(dtype), score.to(dtype)))
    return torch.stack(rows)


def _no_further_than_own(ours: torch.Tensor, own: torch.Tensor, exact: torch.Tensor) -> None:
    ours_error, own_error = float((ours - exact).abs().max()), float((own - exact).abs().max())
    scale = float(exact.abs().max())
    assert ours_error <= 3 * own_error + 1e-6 * scale, (ours_error, own_error)


@pytest.mark.parametrize("name", [REFERENCE, "gemma3-4b", "qwen2.5"])
def test_classification_head_reads_the_models_own_last_hidden_state(name, tokenizer, tokenizer_dir):
    check_head(name, tokenizer, tokenizer_dir)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_classification_head_every_family(name, tokenizer, tokenizer_dir):
    check_head(name, tokenizer, tokenizer_dir)


def greedy_by_hand(model, tokenizer, prompt: str, new_tokens: int) -> str:
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    stops = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_turn>")}
    out = []
    for _ in range(new_tokens):
        with torch.no_grad():
            token = int(model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax())
        if token in stops:
            break
        out.append(token)
    return tokenizer.decode(out, skip_special_tokens=True).strip()


def check_generation(name: str, tokenizer, tokenizer_dir) -> None:
    model = build(name, tokenizer_dir)
    prompts = [tokenizer.apply_chat_template(prompt_messages(t, SHORT_PROMPT, LABELS), tokenize=False,
                                             add_generation_prompt=True) for t in TEXTS]
    got = generate_texts(model, tokenizer, prompts, max_new_tokens=4, batch_size=3, desc=None)
    assert got == [greedy_by_hand(model, tokenizer, p, 4) for p in prompts]


@pytest.mark.parametrize("name", [REFERENCE, "llama3"])
def test_generation_is_greedy_over_the_models_own_logits(name, tokenizer, tokenizer_dir):
    check_generation(name, tokenizer, tokenizer_dir)


def test_generation_ignores_the_checkpoints_decoding_settings(tokenizer, tokenizer_dir):
    """Qwen/Qwen2.5-0.5B-Instruct's generation_config.json asks for sampling with a repetition penalty of 1.1:
    evaluation turned sampling off but kept the penalty, so its greedy replies were not the argmax of the model's own
    logits (every label word, listed in the prompt, was penalised; so was a word the reply repeated). On the Gemma 3
    fixture, whose greedy replies repeat words (the Qwen2.5 one repeats a single token, which the penalty leaves first)."""
    model = build("gemma3-1b", tokenizer_dir)
    model.generation_config.update(do_sample=True, repetition_penalty=1.1, temperature=0.7, top_p=0.8, top_k=20)
    prompts = [tokenizer.apply_chat_template(prompt_messages(t, SHORT_PROMPT, LABELS), tokenize=False,
                                             add_generation_prompt=True) for t in TEXTS]
    got = generate_texts(model, tokenizer, prompts, max_new_tokens=4, batch_size=3, desc=None)
    assert got == [greedy_by_hand(model, tokenizer, p, 4) for p in prompts]
    assert model.generation_config.repetition_penalty == 1.1  # the checkpoint's own, as a merged export writes it


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_generation_every_family(name, tokenizer, tokenizer_dir):
    check_generation(name, tokenizer, tokenizer_dir)


def check_merge(name: str, tokenizer, tokenizer_dir) -> None:
    model = adapted(build(name, tokenizer_dir)).eval()
    ids = torch.tensor([tokenizer(" ".join(TEXTS))["input_ids"]])
    with torch.no_grad():
        exact = in_float64(model)(input_ids=ids).logits
        before = model(input_ids=ids).logits
        merged = copy.deepcopy(model).merge_and_unload()
        after = merged(input_ids=ids).logits
    assert not any("lora" in n for n, _ in merged.named_parameters())
    # against the adapted model's logits in float64: the merged float32 model no further from them than 4x the adapted
    # float32 model is (both ~1e-5 of the logits' scale on Gemma 4; the rounding of the folded weights adds to it)
    rounding, error = (float((logits.double() - exact).abs().max()) for logits in (before, after))
    assert error <= 4 * rounding + 1e-7 * float(exact.abs().max()), (error, rounding)


@pytest.mark.parametrize("name", [REFERENCE, "phi4"])
def test_merged_weights_give_the_adapted_logits(name, tokenizer, tokenizer_dir):
    check_merge(name, tokenizer, tokenizer_dir)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_merge_every_family(name, tokenizer, tokenizer_dir):
    check_merge(name, tokenizer, tokenizer_dir)



@pytest.mark.slow
@pytest.mark.parametrize("name", list(BROUGHT_FAMILIES))
def test_brought_families_head_generation_and_merge(name, tokenizer, tokenizer_dir):
    check_head(name, tokenizer, tokenizer_dir)
    check_generation(name, tokenizer, tokenizer_dir)
    check_merge(name, tokenizer, tokenizer_dir)
