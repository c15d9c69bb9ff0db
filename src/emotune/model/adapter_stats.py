"""What training did to the adapter, read from its saved weights: norms per LoRA module and per target group, and
histograms of the LoRA B entries (seed 000's "weight histogram after training").

For every adapted module PEFT saves A (r x in) and B (out x r); the module's weight change is
ΔW = s · B·A with s = alpha / r (alpha / sqrt(r) with rsLoRA). B starts at zero and A at random, so
before training ΔW = 0 and every B entry is 0: the B histogram after training shows exactly what
training wrote, and a group whose B stayed near zero learned little. Reported per module:
‖A‖_F, ‖B‖_F and ‖ΔW‖_F = s · ‖B·A‖_F (Frobenius norms; ‖B·A‖_F is computed from the r x r products
BᵀB and A·Aᵀ, so no out x in matrix is formed). Modules trained in full (`modules_to_save`, such as
the classification head `score`) are reported by the norm and histogram of their weights, since their
starting weights are not saved.

Groups are the module's own name without the layer (`q_proj`, `down_proj`, ..., `score`); `layer` is the
first number in the module's path (None for modules outside the decoder layers).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

HISTOGRAM_BINS = 41
LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?:embedding_)?(?P<part>A|B)(?:\.[^.]+)?(?:\.weight)?$")
SKIPPED = ("lora_magnitude_vector",)  # DoRA's magnitudes: not a weight change of the LoRA kind
PEFT_PREFIX = "base_model.model."


def adapter_stats(adapter_dir: Path) -> dict:
    """The statistics of the adapter saved in `adapter_dir` (PEFT's adapter_config.json and weights)."""
    config = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    weights = _read_weights(adapter_dir)
    pairs, full = _split(weights)
    alpha, rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora", False))
    modules = [_lora_module(name, a, b, alpha, rslora) for name, (a, b) in sorted(pairs.items())]
    modules += [_full_module(name, w) for name, w in sorted(full.items())]
    b_entries = {}
    for name, (_a, b) in pairs.items():
        b_entries.setdefault(group_of(name), []).append(b.ravel())
    for name, w in full.items():
        b_entries.setdefault(group_of(name), []).append(w.ravel())
    groups = {group: _group(group, [m for m in modules if m["group"] == group], np.concatenate(parts))
              for group, parts in b_entries.items()}
    order = sorted(groups, key=lambda g: (groups[g]["kind"] != "lora", g))
    return {"norms": "Frobenius: a_norm = ‖A‖, b_norm = ‖B‖, delta_norm = ‖ΔW‖ = scaling · ‖B·A‖ (LoRA modules); "
                     "weight_norm = ‖W‖ (modules trained in full)",
            "r": config.get("r"), "lora_alpha": alpha, "use_rslora": rslora,
            "groups": {g: groups[g] for g in order}, "modules": modules}


def group_of(module: str) -> str:
    """`model.layers.3.self_attn.q_proj` -> `q_proj`; `model.altup_projections.0` -> `altup_projections`."""
    parts = [p for p in module.split(".") if not p.isdigit()]
    return parts[-1] if parts else module


def layer_of(module: str) -> int | None:
    return next((int(p) for p in module.split(".") if p.isdigit()), None)


def _read_weights(adapter_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of the adapter as float32 numpy (bf16/fp16 files too); `.bin` adapters of other tools as well."""
    import torch

    path = adapter_dir / "adapter_model.safetensors"
    if path.is_file():
        from safetensors.torch import load_file

        tensors = load_file(str(path))
    else:
        tensors = torch.load(adapter_dir / "adapter_model.bin", map_location="cpu", weights_only=True)
    return {key.removeprefix(PEFT_PREFIX): t.detach().float().numpy() for key, t in tensors.items()}


def _split(weights: dict[str, np.ndarray]) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], dict[str, np.ndarray]]:
    """({module: (A, B)}, {module: weight of a module trained in full})."""
    parts: dict[str, dict[str, np.ndarray]] = {}
    full = {}
    for key, value in weights.items():
        if any(s in key for s in SKIPPED):
            continue
        match = LORA_KEY.match(key)
        if match:
            parts.setdefault(match["module"], {})[match["part"]] = value
        elif key.endswith(".weight") and value.ndim == 2:  # a bias of a module trained in full adds little
            full[key.removesuffix(".weight")] = value
    return {m: (p["A"], p["B"]) for m, p in parts.items() if set(p) == {"A", "B"}}, full


def _lora_module(name: str, a: np.ndarray, b: np.ndarray, alpha: float, rslora: bool) -> dict:
    rank = a.shape[0]  # A is (r, in) for linear layers, (r, vocab) for embeddings; B is (out, r) for both
    scaling = alpha / (math.sqrt(rank) if rslora else rank)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    product = float(np.sum((b64.T @ b64) * (a64 @ a64.T)))  # ‖B·A‖² = tr(BᵀB · A·Aᵀ); both factors r x r
    return {"module": name, "group": group_of(name), "layer": layer_of(name), "kind": "lora", "rank": int(rank),
            "scaling": scaling, "a_norm": float(np.linalg.norm(a64)), "b_norm": float(np.linalg.norm(b64)),
            "delta_norm": scaling * math.sqrt(max(product, 0.0))}


def _full_module(name: str, w: np.ndarray) -> dict:
    return {"module": name, "group": group_of(name), "layer": layer_of(name), "kind": "full",
            "shape": list(w.shape), "weight_norm": float(np.linalg.norm(w.astype(np.float64)))}


def _group(group: str, modules: list[dict], entries: np.ndarray) -> dict:
    """Totals over a group's modules and the histogram of its B entries (its weights, for a module trained in full)."""
    kind = modules[0]["kind"]
    limit = float(np.abs(entries).max()) if entries.size else 0.0
    counts, edges = np.histogram(entries, bins=HISTOGRAM_BINS, range=(-limit, limit) if limit > 0 else (-1.0, 1.0))
    out = {"kind": kind, "modules": len(modules), "entries": int(entries.size),
           "entries_std": float(entries.std()) if entries.size else 0.0, "entries_max_abs": limit,
           "entries_zero_share": float(np.mean(entries == 0)) if entries.size else 1.0,
           "histogram": {"counts": counts.tolist(), "edges": edges.tolist()}}
    if kind == "lora":
        deltas = [m["delta_norm"] for m in modules]
        out.update(delta_norm_total=math.sqrt(sum(d * d for d in deltas)), delta_norm_mean=float(np.mean(deltas)),
                   delta_norm_max=max(deltas), a_norm_mean=float(np.mean([m["a_norm"] for m in modules])),
                   b_norm_mean=float(np.mean([m["b_norm"] for m in modules])))
    else:
        out.update(weight_norm_total=math.sqrt(sum(m["weight_norm"] ** 2 for m in modules)))
    return out
