"""Bootstrap intervals and the paired test: hand-computed values, a slow sklearn reference, determinism, and the
`intervals` / `paired` blocks of a classification comparison.json."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from sklearn.metrics import f1_score

from emotune.core.errors import UserError
from emotune.core.rundir import RunDir
from emotune.eval import stats
from emotune.eval.evaluate import EvalResult, compute_metrics
from emotune.eval.stats import (
    bootstrap_ci,
    classification_intervals,
    mcnemar,
    paired_bootstrap_delta,
    paired_classification,
    paired_comparison,
    resample_indices,
    verdict,
)

LABELS = ["a", "b", "c"]


def _outcomes(right_wrong: int, wrong_right: int, both_right: int = 0, both_wrong: int = 0):
    """gold/before/after for rows that are right before and wrong after (b), wrong before and right after (c), ..."""
    gold, before, after = [], [], []
    for count, was_right, is_right in ((right_wrong, True, False), (wrong_right, False, True),
                                       (both_right, True, True), (both_wrong, False, False)):
        gold += ["a"] * count
        before += ["a" if was_right else "b"] * count
        after += ["a" if is_right else "c"] * count
    return gold, before, after


# --------------------------------------------------------------------------------------------------
# McNemar and the verdict


def test_mcnemar_is_the_exact_binomial_on_the_discordant_rows():
    # b = 1, c = 6: P(X <= 1 | 7, 1/2) = (1 + 7) / 128; two-sided doubles it
    gold, before, after = _outcomes(1, 6, both_right=5, both_wrong=4)  # concordant rows change nothing
    assert mcnemar(gold, before, after) == {"b": 1, "c": 6, "p_value": pytest.approx(16 / 128, abs=1e-12)}
    # b = 0, c = 6: 2 / 64; b = 2, c = 10: 2 (1 + 12 + 66) / 4096
    assert mcnemar(*_outcomes(0, 6))["p_value"] == pytest.approx(2 / 64, abs=1e-12)
    assert mcnemar(*_outcomes(2, 10))["p_value"] == pytest.approx(158 / 4096, abs=1e-12)
    assert mcnemar(*_outcomes(10, 2)) == {"b": 10, "c": 2, "p_value": pytest.approx(158 / 4096, abs=1e-12)}
    assert mcnemar(*_outcomes(3, 3))["p_value"] == 1.0
    assert mcnemar(*_outcomes(0, 0, both_right=4)) == {"b": 0, "c": 0, "p_value": 1.0}  # nothing changed
    with pytest.raises(ValueError, match="pair up"):
        mcnemar(["a", "b"], ["a"], ["a", "b"])


@pytest.mark.parametrize("b, c, low, high, expected", [
    (1, 9, 0.01, 0.2, "better"),         # p = 0.021, interval above 0
    (1, 9, -0.01, 0.2, "within noise"),  # the macro-F1 interval contains 0
    (3, 6, 0.01, 0.2, "within noise"),   # p = 0.51
    (9, 1, -0.2, -0.01, "worse"),
    (1, 9, -0.2, -0.01, "mixed"),        # more rows right, macro-F1 significantly lower
])
def test_verdict_needs_the_paired_test_and_the_macro_f1_interval_to_agree(b, c, low, high, expected):
    test = mcnemar(*_outcomes(b, c))
    assert verdict(test, {"delta": (low + high) / 2, "low": low, "high": high}) == expected
    assert expected in stats.VERDICT_NOTES


# --------------------------------------------------------------------------------------------------
# Intervals


def test_intervals_of_two_rows_can_be_listed_by_hand():
    # rows x = (gold a, predicted a) and y = (gold b, predicted a); a resample is xx, xy/yx or yy:
    # accuracy 1, 1/2, 0; macro-F1 1 (F1_a 1; b neither drawn nor predicted has no F1), 1/3 (F1_a 2/3, F1_b 0), 0
    found = classification_intervals(["a", "b"], ["a", "a"], ["a", "b"])
    assert found["accuracy"] == {"value": 0.5, "interval": [0.0, 1.0]}
    assert found["macro_f1"] == {"value": pytest.approx(1 / 3, abs=1e-6), "interval": [0.0, 1.0]}
    # every row right: no resample can be anything else; an INVALID prediction is wrong for every label
    assert classification_intervals(["a", "b", "b"], ["a", "b", "b"], LABELS)["accuracy"]["interval"] == [1.0, 1.0]
    invalid = classification_intervals(["a", "a"], ["INVALID", "INVALID"], LABELS)
    assert invalid["accuracy"] == invalid["macro_f1"] == {"value": 0.0, "interval": [0.0, 0.0]}


def test_a_label_the_split_lacks_does_not_cap_macro_f1():
    """emotune's own stratified split can leave a rare label without test rows; it scored F1 0 there, so a model
    right on every row got macro-F1 2/3 (interval [2/3, 2/3]) instead of 1. A label predicted but absent still
    counts (its F1 is 0)."""
    gold = ["a", "b", "a", "b"]
    assert classification_intervals(gold, gold, ["a", "b", "c"], resamples=200)["macro_f1"] == \
        {"value": 1.0, "interval": [1.0, 1.0]}
    assert classification_intervals(gold, ["a", "b", "a", "c"], ["a", "b", "c"], resamples=200)["macro_f1"]["value"] == \
        pytest.approx((1 + 2 / 3 + 0) / 3, abs=1e-6)


def test_point_values_match_sklearn_and_paired_intervals_agree_with_single_ones():
    gold, before, after = _random_case(60, seed=4)
    paired = paired_classification(gold, before, after, LABELS, resamples=500, seed=2)
    for predicted, side in ((before, "before"), (after, "after")):
        single = classification_intervals(gold, predicted, LABELS, resamples=500, seed=2)  # the same draws
        assert paired["accuracy"][side] == single["accuracy"]["interval"]
        assert paired["macro_f1"][side] == single["macro_f1"]["interval"]
        assert single["macro_f1"]["value"] == pytest.approx(_macro_f1(gold, predicted), abs=1e-6)
    delta = _macro_f1(gold, after) - _macro_f1(gold, before)
    assert paired["macro_f1"]["delta"]["delta"] == pytest.approx(delta, abs=1e-6)


def _macro_f1(gold: list[str], predicted: list[str]) -> float:
    """sklearn's macro-F1 over the labels drawn or predicted (never INVALID), as emotune averages it."""
    present = [label for label in LABELS if label in set(gold) | set(predicted)]
    return f1_score(gold, predicted, labels=present, average="macro", zero_division=0)


def _random_case(n: int, seed: int):
    rng = np.random.default_rng(seed)
    gold = [LABELS[i] for i in rng.integers(0, 3, n)]
    before = [(LABELS + ["INVALID"])[i] for i in rng.integers(0, 4, n)]
    after = [g if rng.random() < 0.6 else LABELS[rng.integers(0, 3)] for g in gold]
    return gold, before, after


def test_macro_f1_bootstrap_equals_a_slow_sklearn_loop_over_the_same_draws():
    gold, before, after = _random_case(30, seed=1)
    resamples, seed = 30, 5  # sklearn takes milliseconds a call: few resamples keep the loop short
    reference_f1, reference_accuracy = [], []
    for idx in np.concatenate(list(resample_indices(len(gold), resamples, seed))):
        g = [gold[i] for i in idx]
        reference_f1.append([_macro_f1(g, [p[i] for i in idx]) for p in (before, after)])
        reference_accuracy.append([np.mean([gold[i] == p[i] for i in idx]) for p in (before, after)])
    found = paired_classification(gold, before, after, LABELS, resamples=resamples, seed=seed)
    for name, samples in (("macro_f1", np.array(reference_f1)), ("accuracy", np.array(reference_accuracy))):
        low, high = np.quantile(samples, [0.025, 0.975], axis=0)
        assert found[name]["before"] == pytest.approx([low[0], high[0]], abs=1e-6)
        assert found[name]["after"] == pytest.approx([low[1], high[1]], abs=1e-6)
        delta_low, delta_high = np.quantile(samples[:, 1] - samples[:, 0], [0.025, 0.975])
        assert [found[name]["delta"]["low"], found[name]["delta"]["high"]] == pytest.approx([delta_low, delta_high], abs=1e-6)


def test_intervals_are_deterministic_for_a_seed_and_handle_2000_rows_by_2000_resamples():
    gold, before, after = _random_case(2000, seed=7)
    first = paired_comparison(gold, before, after, LABELS)  # the defaults: 2,000 resamples, seed 0
    assert paired_comparison(gold, before, after, LABELS) == first
    other = paired_classification(gold, before, after, LABELS, seed=1)
    assert other != first["intervals"]
    for name in ("accuracy", "macro_f1"):
        one = first["intervals"][name]
        assert one["before"][0] < one["before"][1] and one["delta"]["low"] < one["delta"]["delta"] < one["delta"]["high"]
        assert one["delta"]["high"] - one["delta"]["low"] < 0.1  # 2,000 rows pin a difference to a few points
    assert first["paired"]["verdict"] == "better" and first["paired"]["mcnemar"]["c"] > first["paired"]["mcnemar"]["b"]
    with pytest.raises(ValueError, match="not in the label list"):
        classification_intervals(["z"], ["a"], LABELS)


# --------------------------------------------------------------------------------------------------
# Means of per-row scores (sft's ROUGE-L, the forgetting probe)


def test_bootstrap_ci_contains_the_mean_narrows_with_more_data_and_is_deterministic():
    values = [1.0] * 30 + [0.0] * 20
    low, high = bootstrap_ci(values)
    assert low < 0.6 < high and 0.4 < low and high < 0.8
    assert bootstrap_ci(values) == (low, high)
    spread = [i / 49 for i in range(50)]
    assert bootstrap_ci(spread) == bootstrap_ci(spread) != bootstrap_ci(spread, seed=1)
    wide = bootstrap_ci(values[:5] + values[-5:])
    assert wide[1] - wide[0] > high - low
    assert bootstrap_ci([0.3]) == (0.3, 0.3)
    with pytest.raises(ValueError):
        bootstrap_ci([])


def test_paired_bootstrap_delta_sees_a_clear_drop_and_no_change():
    before = [1.0] * 40 + [0.0] * 10
    after = [0.0] * 30 + [1.0] * 10 + [0.0] * 10
    drop = paired_bootstrap_delta(before, after)
    assert drop["delta"] == pytest.approx(-0.6) and drop["low"] <= -0.6 <= drop["high"] < 0
    assert paired_bootstrap_delta(before, before) == {"delta": 0.0, "low": 0.0, "high": 0.0}
    assert paired_bootstrap_delta(before, after) == drop
    with pytest.raises(ValueError, match="pair up"):
        paired_bootstrap_delta(before, after[:-1])


def test_mean_intervals_use_the_same_draws_as_the_label_intervals():
    # accuracy is the mean of per-row 0/1 scores, so both routes give the same interval
    gold, _, after = _random_case(80, seed=3)
    correct = [float(g == p) for g, p in zip(gold, after, strict=False)]
    assert list(bootstrap_ci(correct)) == pytest.approx(
        classification_intervals(gold, after, LABELS)["accuracy"]["interval"], abs=1e-6)


# --------------------------------------------------------------------------------------------------
# comparison.json of a classification run


def _result(texts: list[str], gold: list[str], predicted: list[str], method: str) -> EvalResult:
    metrics = {**compute_metrics(gold, predicted, LABELS), "method": method}
    return EvalResult(rows=[{"text": t, "gold": g, "predicted": p} for t, g, p in zip(texts, gold, predicted, strict=False)],
                      metrics=metrics)


def test_classify_comparison_json_gains_intervals_and_the_paired_test(tmp_path):
    from emotune.tasks.classify.task import compare, format_comparison, write_comparison

    gold, before, after = _random_case(90, seed=11)
    texts = [f"row {i}" for i in range(len(gold))]
    results = [{m: _result(texts, gold, predicted, m) for m in ("generate", "score")} for predicted in (before, after)]
    comparison = compare(*results, SimpleNamespace(labels=LABELS))
    write_comparison(comparison, RunDir(tmp_path))
    saved = json.loads((tmp_path / "comparison.json").read_text(encoding="utf-8"))
    for one in (saved, *saved["methods"].values()):
        assert set(one) >= {"method", "rows", "metrics", "intervals", "paired"}
        for name in ("accuracy", "macro_f1"):
            block = one["intervals"][name]
            assert set(block) == {"before", "after", "delta"} and set(block["delta"]) == {"delta", "low", "high"}
            assert block["delta"]["delta"] == pytest.approx(one["metrics"][name]["delta"], abs=1e-6)
            assert block["before"][0] <= one["metrics"][name]["before"] <= block["before"][1]
        assert set(one["paired"]) == {"mcnemar", "verdict"} and set(one["paired"]["mcnemar"]) == {"b", "c", "p_value"}
        assert one["paired"] == {"mcnemar": mcnemar(gold, before, after),
                                 "verdict": verdict(mcnemar(gold, before, after), block["delta"])}
    assert saved["intervals"] == saved["methods"]["generate"]["intervals"]  # the headline is the first method's
    assert "intervals" not in saved["metrics"] and len(saved["metrics"]) == 4 + 3 * len(LABELS)  # old keys only

    text = format_comparison(saved, SimpleNamespace(labels=LABELS), SimpleNamespace(eval=SimpleNamespace(split="test")))
    assert text.count("\n95% interval ") == 2 and text.count("Verdict: ") == 2
    macro = next(line for line in text.splitlines() if line.startswith("macro-F1") and "[" in line)
    assert stats.format_interval(saved["intervals"]["macro_f1"]["after"]) in macro

    shuffled = [{m: _result(texts[::-1], gold[::-1], after[::-1], m) for m in ("generate", "score")}]
    with pytest.raises(UserError, match="different rows"):
        compare(results[0], shuffled[0], SimpleNamespace(labels=LABELS))


def test_head_comparison_carries_the_same_blocks():
    from emotune.tasks.classify_head.report import compare, format_comparison

    gold, before, after = _random_case(40, seed=2)
    texts = [f"t{i}" for i in range(40)]
    comparison = json.loads(json.dumps(compare({"head": _result(texts, gold, before, "head")},
                                               {"head": _result(texts, gold, after, "head")},
                                               SimpleNamespace(labels=LABELS))))
    assert set(comparison["methods"]["head"]["intervals"]) == {"accuracy", "macro_f1"}
    assert comparison["paired"]["verdict"] in stats.VERDICT_NOTES
    text = format_comparison(comparison, SimpleNamespace(labels=LABELS), SimpleNamespace(eval=SimpleNamespace(split="test")))
    assert "exact McNemar" in text and "Verdict: " in text


def test_the_classification_bootstrap_holds_no_one_hot_matrix_of_the_rows():
    """The resamples' confusion counts came from an n x k x (1 + 2 x models) float64 one-hot matrix: 383 MiB at
    50,000 rows and 100 labels (800 MB at 200,000), beside the draws themselves. Tallied from the label indices, the
    peak follows the draws alone (numpy's allocations, as tracemalloc counts them); the intervals are the same."""
    import tracemalloc

    k, n = 100, 50_000
    labels = [f"label {i}" for i in range(k)]
    draw = np.random.default_rng(0)
    gold, before, after = ([labels[i] for i in draw.integers(0, k, n)] for _ in range(3))
    tracemalloc.start()
    try:
        paired_classification(gold, before, after, labels, resamples=20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100 * 2**20, peak / 2**20
