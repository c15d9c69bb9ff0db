"""Metrics against hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from emotune.evaluate import compute_metrics, expected_calibration_error, probability_metrics
from emotune.replies import INVALID


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
