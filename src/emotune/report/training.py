"""The report's "What training did" section, for every task that trains LoRA: the gradient-norm curve from the
training log, and per target module group the adapter's weight norms and the histogram of its LoRA B entries
(emotune.model.adapter_stats, also written to report/adapter_stats.json).

Like the rest of the page it reads the run folder only (train/log_history.json, config.yaml, adapter/).
"""

from __future__ import annotations

import html
import math

import numpy as np

from emotune.core.figures import embed_figure
from emotune.core.rundir import RunDir, write_json
from emotune.model.adapter_stats import adapter_stats


def training_section(run: RunDir) -> str:
    parts = ["<section id=training><h2>What training did: gradient norms and adapter weights</h2>",
             _gradient_part(run), _adapter_part(run), "</section>"]
    return "\n".join(parts)


# --------------------------------------------------------------------------------------------------
# Gradient norm


def _gradient_part(run: RunDir) -> str:
    logged = [e for e in run.history() if "grad_norm" in e and "step" in e and _finite(e["grad_norm"])]
    if not logged:
        return "<h3>Gradient norm</h3><p>No gradient norms in the training log.</p>"
    clip = _max_grad_norm(run)
    fig = _gradient_figure(logged, clip)
    over = sum(1 for e in logged if clip and _largest(e) > clip)
    note = ("The total L2 norm of the gradient over all trainable parameters, before clipping, averaged over the "
            "optimizer steps between two log lines (the dashed line: the largest step of each window)"
            + (f"; the dotted line is the clipping threshold train.max_grad_norm = {clip:g}, exceeded in {over} of "
               f"{len(logged)} logged windows" if clip else "; no clipping (train.max_grad_norm = 0)") + ".")
    return ("<h3>Gradient norm</h3>" + embed_figure(fig, run.figures / "grad_norm.png", "gradient norm per step")
            + f"<p>{html.escape(note)}</p>")


def _gradient_figure(logged: list[dict], clip: float | None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [e["step"] for e in logged]
    mean = [e["grad_norm_mean"] if _finite(e.get("grad_norm_mean")) else e["grad_norm"] for e in logged]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    ax.plot(steps, mean, marker=".", label="mean of the window")
    if all("grad_norm_max" in e for e in logged):
        ax.plot(steps, [e["grad_norm_max"] if _finite(e["grad_norm_max"]) else math.nan for e in logged], linestyle="--",
                alpha=0.7, label="largest step")
    if clip:
        ax.axhline(clip, color="grey", linestyle=":", label=f"clipping threshold ({clip:g})")
    values = [v for v in mean if v > 0]
    if values and max(values) / min(values) > 20:
        ax.set_yscale("log")
    ax.set(xlabel="optimizer step", ylabel="gradient norm (before clipping)", title="Gradient norm")
    ax.legend()
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.15, top=0.9)
    return fig


def _max_grad_norm(run: RunDir) -> float | None:
    try:
        return float(run.saved_settings()["train"]["max_grad_norm"]) or None
    except (KeyError, TypeError, ValueError):
        return None


def _largest(entry: dict) -> float:
    """The largest step's gradient norm of a log line's window (null in the JSON when no step of it was finite)."""
    largest = entry.get("grad_norm_max")
    return largest if _finite(largest) else entry["grad_norm"]


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


# --------------------------------------------------------------------------------------------------
# Adapter weights


def _adapter_part(run: RunDir) -> str:
    if not (run.adapter / "adapter_config.json").is_file():
        return "<h3>Adapter weights</h3><p>No adapter in this run folder.</p>"
    stats = adapter_stats(run.adapter)
    write_json(run.adapter_stats, stats)
    groups = stats["groups"]
    parts = ["<h3>Adapter weights per target module group</h3>",
             f"<p>{html.escape(_weights_note(stats))} The numbers, per module and layer too, are in "
             "<code>report/adapter_stats.json</code>.</p>",
             _norms_table(groups)]
    lora = {name: g for name, g in groups.items() if g["kind"] == "lora"}
    if lora:
        parts.append(embed_figure(_histogram_figure(lora), run.figures / "lora_b_histogram.png",
                                  "histogram of the LoRA B entries per module group"))
    return "\n".join(parts)


def _weights_note(stats: dict) -> str:
    scaling = "alpha / sqrt(r)" if stats["use_rslora"] else "alpha / r"
    return (f"Frobenius norms of each LoRA module's A and B and of its weight change ‖ΔW‖ = s · ‖B·A‖ (s = {scaling}; "
            f"r = {stats['r']}, alpha = {stats['lora_alpha']:g}), averaged over the module group. B starts at zero, so "
            "before training every ΔW is 0 and every B entry is 0: the histogram shows what training wrote. Modules "
            "trained in full (such as the classification head) show the norm and entries of their weights in the table.")


def _norms_table(groups: dict[str, dict]) -> str:
    head = ("<tr><th>group</th><th>modules</th><th>mean ‖A‖</th><th>mean ‖B‖</th><th>mean ‖ΔW‖</th><th>max ‖ΔW‖</th>"
            "<th>‖W‖ (trained in full)</th><th>entries: std</th><th>max |entry|</th><th>share exactly 0</th></tr>")
    rows = []
    for name, g in groups.items():
        lora = g["kind"] == "lora"
        cells = [g["modules"], *((g["a_norm_mean"], g["b_norm_mean"], g["delta_norm_mean"], g["delta_norm_max"], None)
                                 if lora else (None, None, None, None, g["weight_norm_total"])),
                 g["entries_std"], g["entries_max_abs"], g["entries_zero_share"]]
        rows.append(f"<tr><th>{html.escape(name)}</th>" + "".join(f"<td class=num>{_num(c)}</td>" for c in cells) + "</tr>")
    return f"<table class=adapter-norms>{head}{''.join(rows)}</table>"


def _num(value) -> str:
    if value is None:
        return ""
    return str(value) if isinstance(value, int) else f"{value:.4g}"


def _histogram_figure(groups: dict[str, dict]):
    """One outline per LoRA group on one axes (a grid of panels costs seconds per page to lay out). Modules trained in
    full are left out: their weights are not B entries and live on another scale (their histogram is in the JSON)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    for name, g in groups.items():
        counts, edges = np.asarray(g["histogram"]["counts"], float), np.asarray(g["histogram"]["edges"])
        density = counts / max(counts.sum(), 1) / np.diff(edges)  # groups of any size on one scale
        ax.stairs(density, edges, label=name)
    ax.set(xlabel="entry value", ylabel="density", title="LoRA B entries after training, per module group")
    ax.legend(fontsize=8, ncol=2)
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.14, top=0.9)  # fixed margins: tight_layout costs a draw
    return fig
