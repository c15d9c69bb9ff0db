"""How sure a measurement is: seeded percentile-bootstrap intervals, and paired tests of "is B better than A".

Every interval here resamples rows with replacement (`resamples` times, 2,000 by default) and takes the
2.5th and 97.5th percentiles of the statistic over the resamples (numpy's linear quantiles). The draws
come from `numpy.random.default_rng(seed)`, so the same inputs always give the same interval; a paired
interval uses the same draws for both sides, so it measures the difference on the same rows.

- `bootstrap_ci` / `paired_bootstrap_delta`: the mean of per-row scores (sft's ROUGE-L, the probe).
- `classification_intervals` / `paired_classification`: accuracy and macro-F1 of predicted labels,
  macro-F1 recomputed over the full label list in every resample (a label missing from a resample
  scores 0, as in `evaluate.compute_metrics`), from per-resample confusion counts in one matrix product.
- `mcnemar`: the exact McNemar test on the rows one model gets right and the other wrong.
- `verdict`: "better", "worse", "within noise" or "mixed" from the paired test and the macro-F1 interval.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from scipy.stats import binomtest

CONFIDENCE = 0.95
RESAMPLES = 2000
SEED = 0
ALPHA = 0.05  # the paired test's significance level, 1 - CONFIDENCE
DRAWS_PER_CHUNK = 4_000_000  # row indices drawn at once: memory stays near this whatever the row count


# --------------------------------------------------------------------------------------------------
# The resampling core


def resample_indices(n: int, resamples: int, seed: int) -> Iterator[np.ndarray]:
    """Row indices of `resamples` resamples of `n` rows, as [chunk, n] arrays; the same (n, resamples, seed)
    always gives the same draws."""
    rng = np.random.default_rng(seed)
    chunk = max(1, DRAWS_PER_CHUNK // n)
    for start in range(0, resamples, chunk):
        yield rng.integers(0, n, size=(min(chunk, resamples - start), n))


def _check(n: int, confidence: float, resamples: int) -> None:
    if not n:
        raise ValueError("Cannot bootstrap an empty list of values.")
    if not 0 < confidence < 1 or resamples < 1:
        raise ValueError(f"confidence must be in (0, 1) and resamples >= 1 (got {confidence}, {resamples}).")


def _same_length(first, second, names: str) -> None:
    if len(first) != len(second):
        raise ValueError(f"The {names} must pair up, but their lengths differ: {len(first)} and {len(second)}.")


def _percentiles(samples: np.ndarray, confidence: float) -> np.ndarray:
    """[low, high] along the first axis (the resamples)."""
    tail = (1 - confidence) / 2
    return np.quantile(samples, [tail, 1 - tail], axis=0)


# --------------------------------------------------------------------------------------------------
# Means of per-row scores


def _bootstrap_means(columns: np.ndarray, resamples: int, seed: int) -> np.ndarray:
    """[resamples, k] means of the rows of `columns` (n × k), the same row draws for every column."""
    return np.concatenate([columns[idx].mean(axis=1) for idx in resample_indices(columns.shape[0], resamples, seed)])


def bootstrap_ci(values: list[float], confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
                 seed: int = SEED) -> tuple[float, float]:
    """Percentile-bootstrap interval for the mean of `values`; the same inputs always give the same interval."""
    _check(len(values), confidence, resamples)
    means = _bootstrap_means(np.asarray(values, dtype=float)[:, None], resamples, seed)[:, 0]
    low, high = _percentiles(means, confidence)
    return float(low), float(high)


def paired_bootstrap_delta(before: list[float], after: list[float], confidence: float = CONFIDENCE,
                           resamples: int = RESAMPLES, seed: int = SEED) -> dict[str, float]:
    """`{"delta", "low", "high"}`: mean(after) − mean(before) and its percentile-bootstrap interval, resampling
    the paired rows (row i of `before` and of `after` are the same item measured twice)."""
    _same_length(before, after, "before and after values")
    _check(len(before), confidence, resamples)
    pairs = np.column_stack([np.asarray(before, dtype=float), np.asarray(after, dtype=float)])
    means = _bootstrap_means(pairs, resamples, seed)
    low, high = _percentiles(means[:, 1] - means[:, 0], confidence)
    return {"delta": float(pairs[:, 1].mean() - pairs[:, 0].mean()), "low": float(low), "high": float(high)}


# --------------------------------------------------------------------------------------------------
# Accuracy and macro-F1 of predicted labels


def _label_indices(gold: list[str], predictions: list[list[str]], labels: list[str]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Gold and predicted labels as indices into `labels`; a prediction outside them (INVALID) is len(labels)."""
    index = {label: i for i, label in enumerate(labels)}
    unknown = sorted(set(gold) - set(index))
    if unknown:
        raise ValueError(f"Gold labels {unknown} are not in the label list {labels}.")
    for predicted in predictions:
        _same_length(gold, predicted, "gold and predicted labels")
    return (np.array([index[g] for g in gold], dtype=np.int64),
            [np.array([index.get(p, len(labels)) for p in predicted], dtype=np.int64) for predicted in predictions])


def _scores(counts: np.ndarray, k: int, n: int, models: int) -> tuple[np.ndarray, np.ndarray]:
    """Accuracy and macro-F1 [rows, models] from confusion counts [rows, k * (1 + 2 * models)]: gold per label,
    then each model's predicted and correct per label. F1_k = 2 TP / (gold_k + predicted_k); macro-F1 averages the
    labels with gold_k + predicted_k > 0, as evaluate.compute_metrics does (a label neither drawn nor predicted has
    no F1)."""
    gold = counts[:, None, :k]
    model_counts = counts[:, k:].reshape(len(counts), models, 2, k)
    predicted, correct = model_counts[:, :, 0], model_counts[:, :, 1]
    denominator = gold + predicted
    f1 = np.divide(2 * correct, denominator, out=np.zeros_like(correct), where=denominator > 0)
    return correct.sum(axis=2) / n, f1.sum(axis=2) / np.maximum((denominator > 0).sum(axis=2), 1)


def _counts(idx: np.ndarray, gold: np.ndarray, predictions: list[np.ndarray], k: int) -> np.ndarray:
    """Confusion counts [resamples, k * (1 + 2 * models)] of the resamples whose row indices are `idx` [resamples,
    n]: gold per label, then per model predicted and correct per label (a prediction outside the labels, index k,
    counts nowhere). Tallied from the label indices, so memory follows `idx` alone: a one-hot matrix of the rows was
    n x k x (1 + 2 * models) float64, 800 MB at 200,000 rows and 100 labels."""
    rows = len(idx)
    offsets = (np.arange(rows) * (k + 1))[:, None]

    def tally(values: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
        drawn = None if weights is None else weights[idx].ravel()
        counts = np.bincount((offsets + values[idx]).ravel(), weights=drawn, minlength=rows * (k + 1))
        return counts.reshape(rows, k + 1)[:, :k]

    parts = [tally(gold)]
    for predicted in predictions:
        parts += [tally(predicted), tally(predicted, (predicted == gold).astype(float))]
    return np.hstack(parts).astype(float)  # integer counts, exact in float64


def _bootstrap_scores(gold: np.ndarray, predictions: list[np.ndarray], k: int, resamples: int, seed: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Point accuracy and macro-F1 [models], and their values in every resample [resamples, models]; every
    model is scored on the same draws."""
    n, models = len(gold), len(predictions)
    accuracy, macro_f1 = _scores(_counts(np.arange(n)[None, :], gold, predictions, k), k, n, models)
    sampled_accuracy, sampled_f1 = [], []
    for idx in resample_indices(n, resamples, seed):
        acc, f1 = _scores(_counts(idx, gold, predictions, k), k, n, models)
        sampled_accuracy.append(acc)
        sampled_f1.append(f1)
    return accuracy[0], macro_f1[0], np.concatenate(sampled_accuracy), np.concatenate(sampled_f1)


def _interval(low: float, high: float) -> list[float]:
    return [round(float(low), 6), round(float(high), 6)]


def classification_intervals(gold: list[str], predicted: list[str], labels: list[str], confidence: float = CONFIDENCE,
                             resamples: int = RESAMPLES, seed: int = SEED) -> dict[str, dict]:
    """`{"accuracy": {"value", "interval": [low, high]}, "macro_f1": {...}}` of one model's predictions
    (rounded to 6 decimals). A prediction outside `labels` (INVALID) is wrong for every class."""
    _check(len(gold), confidence, resamples)
    gold_idx, (pred_idx,) = _label_indices(gold, [predicted], labels)
    accuracy, macro_f1, sampled_accuracy, sampled_f1 = _bootstrap_scores(gold_idx, [pred_idx], len(labels), resamples, seed)
    out = {}
    for name, point, samples in (("accuracy", accuracy, sampled_accuracy), ("macro_f1", macro_f1, sampled_f1)):
        low, high = _percentiles(samples[:, 0], confidence)
        out[name] = {"value": round(float(point[0]), 6), "interval": _interval(low, high)}
    return out


def paired_classification(gold: list[str], before: list[str], after: list[str], labels: list[str],
                          confidence: float = CONFIDENCE, resamples: int = RESAMPLES, seed: int = SEED) -> dict[str, dict]:
    """Two models' predictions of the same rows: per metric (accuracy, macro_f1) `{"before": [low, high],
    "after": [low, high], "delta": {"delta", "low", "high"}}`, the delta being after − before with its
    paired interval (both models scored on the same resampled rows). Rounded to 6 decimals."""
    _check(len(gold), confidence, resamples)
    gold_idx, predictions = _label_indices(gold, [before, after], labels)
    accuracy, macro_f1, sampled_accuracy, sampled_f1 = _bootstrap_scores(gold_idx, predictions, len(labels), resamples, seed)
    out = {}
    for name, point, samples in (("accuracy", accuracy, sampled_accuracy), ("macro_f1", macro_f1, sampled_f1)):
        (before_low, after_low), (before_high, after_high) = _percentiles(samples, confidence)
        delta_low, delta_high = _percentiles(samples[:, 1] - samples[:, 0], confidence)
        out[name] = {"before": _interval(before_low, before_high), "after": _interval(after_low, after_high),
                     "delta": {"delta": round(float(point[1] - point[0]), 6), "low": round(float(delta_low), 6),
                               "high": round(float(delta_high), 6)}}
    return out


# --------------------------------------------------------------------------------------------------
# The paired test and its verdict


def mcnemar(gold: list[str], before: list[str], after: list[str]) -> dict:
    """Exact McNemar test on the same rows: `b` = rows right before and wrong after, `c` = wrong before and right
    after, `p_value` = the two-sided exact binomial p of b among the b + c discordant rows at 1/2 (no
    continuity correction; 1.0 when no row changed)."""
    _same_length(gold, before, "gold and before labels")
    _same_length(gold, after, "gold and after labels")
    b = sum(g == x and g != y for g, x, y in zip(gold, before, after, strict=False))
    c = sum(g != x and g == y for g, x, y in zip(gold, before, after, strict=False))
    p_value = float(binomtest(b, b + c, 0.5).pvalue) if b + c else 1.0
    return {"b": b, "c": c, "p_value": min(p_value, 1.0)}


VERDICT_NOTES = {
    "better": "significantly more rows right (p < 0.05) and a macro-F1 gain whose 95% interval lies above 0",
    "worse": "significantly more rows wrong (p < 0.05) and a macro-F1 loss whose 95% interval lies below 0",
    "within noise": "no difference this measurement can tell from chance (p ≥ 0.05, or the macro-F1 interval "
                    "contains 0)",
    "mixed": "significant changes in opposite directions: more rows right but a lower macro-F1, or the reverse",
}


def verdict(test: dict, macro_f1_delta: dict, alpha: float = ALPHA) -> str:
    """Whether the after is better than the before on the same rows (one of VERDICT_NOTES):

    - "better": it is right on significantly more rows (McNemar p < alpha, c > b) and the interval of its
      macro-F1 gain lies above 0;
    - "worse": the mirror image (p < alpha, b > c, the macro-F1 interval below 0);
    - "mixed": both are significant but disagree in direction (e.g. more rows right, but rarer labels lost);
    - "within noise": anything else — p ≥ alpha or the macro-F1 interval contains 0.
    """
    significant = test["p_value"] < alpha
    more_right = significant and test["c"] > test["b"]
    more_wrong = significant and test["b"] > test["c"]
    f1_up, f1_down = macro_f1_delta["low"] > 0, macro_f1_delta["high"] < 0
    if more_right and f1_up:
        return "better"
    if more_wrong and f1_down:
        return "worse"
    if (more_right and f1_down) or (more_wrong and f1_up):
        return "mixed"
    return "within noise"


def paired_comparison(gold: list[str], before: list[str], after: list[str], labels: list[str]) -> dict:
    """`{"intervals": paired_classification(...), "paired": {"mcnemar": {b, c, p_value}, "verdict"}}`: what
    comparison.json holds per method, and what `emotune compare` shows against its first run."""
    intervals = paired_classification(gold, before, after, labels)
    test = mcnemar(gold, before, after)
    return {"intervals": intervals, "paired": {"mcnemar": test, "verdict": verdict(test, intervals["macro_f1"]["delta"])}}


def format_interval(interval: list[float], signed: bool = False) -> str:
    """`[0.412, 0.533]`, or with `signed` `[+0.008, +0.100]`."""
    spec = "+.3f" if signed else ".3f"
    return f"[{interval[0]:{spec}}, {interval[1]:{spec}}]"
