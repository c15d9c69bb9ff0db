"""Metrics against hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from emotune.core.replies import INVALID
from emotune.eval.evaluate import compute_metrics, expected_calibration_error, probability_metrics


def test_classification_metrics_by_hand():
    gold = ["a", "a", "b", "b"]
    predicted = ["a", "b", "b", INVALID]
    m = compute_metrics(gold, predicted, ["a", "b"])
    assert m["accuracy"] == 0.5
    assert m["invalid"] == 1
    # a: 1 of 1 predicted a is right, 1 of 2 gold a found; b: 1 of 2 predicted b right, 1 of 2 gold b found
    assert m["per_class"]["a"] == {"precision": 1.0, "recall": 0.5, "f1": pytest.approx(2 / 3), "support": 2}
    assert m["per_class"]["b"] == {"precision": 0.5, "recall": 0.5, "f1": 0.5, "support": 2}
    assert m["macro_f1"] == pytest.approx((2 / 3 + 0.5) / 2)
    assert m["weighted_f1"] == pytest.approx((2 / 3 + 0.5) / 2)  # equal supports
    assert m["confusion_matrix"] == {"labels": ["a", "b", INVALID], "matrix": [[1, 1, 0], [0, 1, 1], [0, 0, 0]]}


def test_macro_f1_leaves_out_a_label_the_split_lacks_and_nobody_predicts():
    """A rare label the stratified split left out of the test rows scored F1 0: a model right on every row got
    macro-F1 2/3. Predicted though absent, it still scores 0 (false positives)."""
    m = compute_metrics(["a", "b", "a"], ["a", "b", "a"], ["a", "b", "c"])
    assert m["macro_f1"] == 1.0 and m["per_class"]["c"]["support"] == 0
    assert compute_metrics(["a", "b", "a"], ["a", "b", "c"], ["a", "b", "c"])["macro_f1"] == pytest.approx((2 / 3 + 1 + 0) / 3)


def test_probability_metrics_by_hand():
    labels = ["a", "b", "c"]
    gold = ["a", "b", "c", "a"]
    probs = np.array([[0.7, 0.2, 0.1],   # right, confidence 0.7
                      [0.5, 0.4, 0.1],   # wrong, gold is second: a top-2 hit
                      [0.2, 0.3, 0.5],   # right, confidence 0.5
                      [0.1, 0.3, 0.6]])  # wrong, gold is last: a top-2 miss
    m = probability_metrics(gold, probs, labels)
    assert m["top2_accuracy"] == 0.75
    assert m["log_loss"] == pytest.approx(-(math.log(0.7) + math.log(0.4) + math.log(0.5) + math.log(0.1)) / 4)
    # bins of width 0.1: [0.5, 0.6) holds one right and one wrong row at confidence 0.5 (gap 0),
    # [0.6, 0.7) one wrong row at 0.6 (gap 0.6), [0.7, 0.8) one right row at 0.7 (gap 0.3)
    assert m["ece"] == pytest.approx(0.25 * 0.6 + 0.25 * 0.3)


def test_calibration_error_is_zero_when_confidence_matches_accuracy():
    truth = np.array([0, 0, 0, 1])
    probs = np.array([[0.75, 0.25]] * 4)  # 75% confident, 75% right
    assert expected_calibration_error(truth, probs) == pytest.approx(0.0)
    assert expected_calibration_error(np.array([0]), np.array([[1.0, 0.0]])) == 0.0  # confidence 1.0: last bin


def test_two_labels_top2_is_trivially_one():
    m = probability_metrics(["a", "b"], np.array([[0.9, 0.1], [0.8, 0.2]]), ["a", "b"])
    assert m["top2_accuracy"] == 1.0


# --------------------------------------------------------------------------------------------------
# Chance levels of a split


def test_chance_levels_by_hand():
    from emotune.tasks.classify.report import chance_levels

    chance = chance_levels({"a": 6, "b": 3, "c": 1})  # shares 0.6, 0.3, 0.1; K = 3
    assert chance["rows"] == 10
    assert chance["uniform"]["accuracy"] == pytest.approx(1 / 3, abs=1e-6)
    # uniform: F1_k = 2 p_k / (K p_k + 1)
    assert chance["uniform"]["macro_f1"] == pytest.approx((1.2 / 2.8 + 0.6 / 1.9 + 0.2 / 1.3) / 3, abs=1e-6)
    assert chance["majority"] == {"label": "a", "accuracy": 0.6, "macro_f1": pytest.approx(0.75 / 3, abs=1e-6)}
    assert chance["stratified"]["accuracy"] == pytest.approx(0.36 + 0.09 + 0.01, abs=1e-6)
    assert chance["stratified"]["macro_f1"] == pytest.approx(1 / 3, abs=1e-6)


def test_majority_chance_equals_the_metrics_of_always_answering_it():
    from emotune.tasks.classify.report import chance_levels

    gold = ["a", "a", "b", "b", "b"]  # ties break to the first label in order; `c` is absent from the split
    labels = ["a", "b", "c"]
    chance = chance_levels({"a": 2, "b": 3, "c": 0})
    measured = compute_metrics(gold, ["b"] * len(gold), labels)
    assert chance["majority"]["label"] == "b"
    assert chance["majority"]["accuracy"] == pytest.approx(measured["accuracy"])
    assert chance["majority"]["macro_f1"] == pytest.approx(measured["macro_f1"], abs=1e-6)
    assert chance["majority"]["macro_f1"] == pytest.approx(0.75 / 2, abs=1e-6)  # F1_b over a and b: c has no F1
    assert chance_levels({"a": 2, "b": 2})["majority"]["label"] == "a"


@pytest.mark.parametrize("guesser", ["uniform", "stratified"])
def test_random_guessers_measured_on_a_large_split_approach_the_analytic_chance(guesser):
    from emotune.tasks.classify.report import chance_levels

    labels, shares = ["a", "b", "c", "d"], [0.55, 0.25, 0.15, 0.05]
    rng = np.random.default_rng(0)
    gold = list(rng.choice(labels, size=20_000, p=shares))
    counts = {label: gold.count(label) for label in labels}
    guess_shares = [0.25] * 4 if guesser == "uniform" else [counts[label] / len(gold) for label in labels]
    measured = compute_metrics(gold, list(rng.choice(labels, size=len(gold), p=guess_shares)), labels)
    chance = chance_levels(counts)[guesser]
    assert measured["accuracy"] == pytest.approx(chance["accuracy"], abs=0.01)
    assert measured["macro_f1"] == pytest.approx(chance["macro_f1"], abs=0.01)


def test_baseline_notes_explain_a_mostly_invalid_generate_baseline():
    from emotune.tasks.classify.report import baseline_notes, chance_levels

    chance = chance_levels({"joy": 3, "fear": 1})
    quiet = baseline_notes({"generate": {"rows": 4, "invalid": 1}}, chance)
    assert len(quiet) == 1 and "always joy" in quiet[0] and "beats all three" in quiet[0]
    both = baseline_notes({"generate": {"rows": 4, "invalid": 4}, "score": {"rows": 4, "invalid": 0}}, chance)
    assert len(both) == 2 and "4 of 4 invalid" in both[1] and "pretrained (not instruction-tuned)" in both[1]
    assert "eval.method=both" not in both[1]
    alone = baseline_notes({"generate": {"rows": 4, "invalid": 2}}, chance)
    assert "set eval.method=both" in alone[1]


def test_a_class_never_predicted_after_training_is_warned_about_in_the_terminal_table():
    from emotune.tasks.classify.report import compare, format_table

    labels = ["a", "b", "c"]
    gold = ["a", "a", "b", "b", "c", "c"]
    before = compute_metrics(gold, ["a", "b", "c", "a", "b", "c"], labels)
    after = compute_metrics(gold, ["a", "a", "b", "b", "b", "b"], labels)
    comparison = compare(before, after, labels)
    assert comparison["never_predicted"] == {"before": [], "after": ["c"]}
    table = format_table(comparison, labels)
    assert "recall c" in table and "never predicted c" in table
    assert "never predicted" not in format_table(compare(after, before, labels), labels)


def test_log_loss_of_a_confident_mistake_is_not_cut_at_float32s_epsilon():
    """The score method's probabilities are float32, and scikit-learn clips at the epsilon of the dtype it is given
    (1.2e-7): a row whose true label got 1e-12 counted as 15.9 nats instead of 27.6, so a confidently wrong fine-tuned
    model's log-loss read far lower than it was. The reference: scikit-learn's log-loss of the same values in float64."""
    import torch
    from sklearn.metrics import log_loss

    log_probs = torch.tensor([[-27.631, 0.0, -30.0], [0.0, -20.0, -25.0], [-1.0, -0.5, -3.0]]).log_softmax(-1)
    probs = log_probs.softmax(-1).numpy()
    assert probs.dtype == np.float32
    expected = log_loss([0, 0, 0], probs.astype(np.float64), labels=[0, 1, 2])
    assert probability_metrics(["a", "a", "a"], probs, ["a", "b", "c"])["log_loss"] == pytest.approx(expected, rel=1e-6)
    assert expected == pytest.approx(float(-log_probs[:, 0].mean()), rel=1e-5)
