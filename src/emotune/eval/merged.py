"""The fine-tuned evaluation at the base model's speed: the LoRA adapter merged into the weights for it.

Unmerged, every adapted layer runs its base product plus the two LoRA products (in a bf16 model with
casts to and from the adapter's float32), which about halves `generate`'s speed. PEFT's
`merge_adapter()` folds W + B·A·scale into the base weight, so each layer is one product again.

The merge is not exact: the sum is rounded to the weights' dtype (bf16 keeps 8 bits of mantissa), so
the merged model's logits differ slightly from the unmerged one's. Before the evaluation, `CHECK_ROWS`
of the evaluated rows (each task's `merge_check_inputs`) run through both; the logits compared are the
ones a prediction is read from: a causal model's at the last prompt position (the next token), a head
classifier's class logits. Then, by `eval.merge_adapters`:

    auto    merged when the largest |logit difference| ≤ eval.merge_tolerance; otherwise unmerged again,
            with a note, and the evaluation runs as trained
    always  merged whatever the check found (still measured and recorded)
    never   the unmerged adapter; nothing is checked

After the evaluation the adapter is unmerged and every weight the merge touched is copied back from a
copy kept on the CPU while merged: PEFT's unmerge subtracts the delta again, which in bf16 leaves up to
one rounding step per weight behind, and the model should be exactly the trained one afterwards (for
another evaluation, saving, or more training). The copy costs host memory the size of the adapted
layers' weights (Gemma 3 270M, all-linear: 100M parameters) and no accelerator memory. What was decided
and measured is returned as a record that goes into the evaluation's metrics.json (key `merge`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from emotune.core.errors import UserError
from emotune.model.finite import nonfinite_rows
from emotune.runtime.device import dtype_name

CHECK_ROWS = 8  # evaluated rows compared merged vs unmerged before the evaluation


def has_adapter(model) -> bool:
    """Whether `model` is a PEFT model whose adapter layers could be merged."""
    if not (hasattr(model, "peft_config") and hasattr(model, "merge_adapter")):
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer

    return any(isinstance(m, BaseTunerLayer) for m in model.modules())


@contextmanager
def merged_for_eval(model, sample: list[list[int]], mode: str, tolerance: float) -> Iterator[dict]:
    """Run the body with `model`'s adapter merged (as `mode` and the check decide); yields the record.

    `sample`: token ids of evaluated rows, as the model reads them. The model is unmerged and its weights
    restored bit for bit when the body ends, also when it fails."""
    from emotune.model.quantization import is_quantized

    if mode == "never" or not has_adapter(model) or is_quantized(model):
        why = ("eval.merge_adapters=never" if mode == "never" else "the model has no adapter layers to merge"
               if not has_adapter(model) else "the base is quantized (model.quantization), and a merge into its "
               "weights would round the sum back to 4 or 8 bits; evaluated as trained")
        yield {"mode": mode, "merged": False, "note": f"evaluated unmerged: {why}"}
        return
    unmerged = last_logits(model, sample)
    if unmerged.numel() and nonfinite_rows(unmerged):
        # the evaluation refuses this model, naming the weights that hold NaN: merged, the base weights would too
        yield {"mode": mode, "merged": False, "note": "evaluated unmerged: the model computed NaN or infinity on the "
                                                      "checked rows, and a merge would spread it into the base weights"}
        return
    saved, refused = _merge(model, mode)
    if saved is None:  # PEFT refused to merge (auto only; `always` raised)
        yield {"mode": mode, "merged": False, "note": f"evaluated unmerged: PEFT cannot merge this adapter ({refused})"}
        return
    try:
        record = _compare(unmerged, last_logits(model, sample), tolerance, model)
        record["mode"] = mode
        keep = mode == "always" or record["max_logit_diff"] <= tolerance
        record["merged"] = keep
        if not keep:
            _unmerge(model, saved)
            saved = None
            record["note"] = (f"evaluated unmerged: merging moved a logit by {record['max_logit_diff']:.4g} on "
                              f"{record['rows_checked']} checked rows, above eval.merge_tolerance={tolerance:g}")
        yield record
    finally:
        if saved is not None:
            _unmerge(model, saved)


def describe(record: dict) -> str:
    """One line for the terminal: what the evaluation runs with, and why."""
    if "max_logit_diff" not in record:
        return f"Adapter: {record['note']}"
    checked = (f"{record['rows_checked']} rows checked: largest logit difference {record['max_logit_diff']:.4g} "
               f"(eval.merge_tolerance {record['tolerance']:g}), predictions agree on {record['agreement']:.0%}")
    if record["merged"]:
        return f"Adapter merged into the {record['dtype']} weights for the evaluation; {checked}"
    return f"Note: adapter {record['note']}; {checked}"


@torch.inference_mode()
def last_logits(model, sample: list[list[int]]) -> torch.Tensor:
    """[rows, width] float32 logits a prediction is read from: the last position of a causal model's output,
    or a head classifier's class logits; one row at a time, so no padding enters the comparison."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    rows = []
    try:
        for ids in sample:
            input_ids = torch.tensor([ids], device=device)
            # a head classifier ignores logits_to_keep; a causal model then projects only the last position
            logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False,
                           logits_to_keep=1).logits
            rows.append((logits[0, -1] if logits.dim() == 3 else logits[0]).float().cpu())
    finally:
        model.train(was_training)
    return torch.stack(rows) if rows else torch.empty(0, 0)


def _compare(unmerged: torch.Tensor, merged: torch.Tensor, tolerance: float, model) -> dict:
    rows = unmerged.shape[0]
    diff = float((merged - unmerged).abs().max()) if rows else 0.0
    agree = float((merged.argmax(-1) == unmerged.argmax(-1)).float().mean()) if rows else 1.0
    return {"rows_checked": rows, "max_logit_diff": round(diff, 6), "agreement": round(agree, 4),
            "tolerance": tolerance, "dtype": dtype_name(next(model.parameters()).dtype), "note": None}


def _adapted_weights(model) -> list[torch.nn.Parameter]:
    """The base layers' own parameters (weight, bias) under every adapter layer: what a merge writes into."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    found: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            for param in module.get_base_layer().parameters(recurse=False):
                found.setdefault(id(param), param)  # tied weights once
    return list(found.values())


@torch.no_grad()
def _merge(model, mode: str) -> tuple[list[tuple[torch.nn.Parameter, torch.Tensor]] | None, str | None]:
    """Copy the weights the merge writes into to the CPU, then merge: (the copy, None), or (None, PEFT's reason)
    when PEFT refuses (mode auto)."""
    saved = [(param, param.detach().to("cpu", copy=True)) for param in _adapted_weights(model)]
    try:
        model.merge_adapter()
    except (ValueError, NotImplementedError, RuntimeError) as err:  # gptq, replicated layers, tuners without merge
        _unmerge(model, saved)
        if mode == "always":
            raise UserError(f"eval.merge_adapters=always, but PEFT cannot merge this adapter ({err}). Set "
                            "eval.merge_adapters=auto or never to evaluate it unmerged.") from None
        return None, str(err)
    return saved, None


@torch.no_grad()
def _unmerge(model, saved: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
    """PEFT's unmerge (its bookkeeping), then the saved weights back, exactly."""
    model.unmerge_adapter()
    for param, original in saved:
        param.data.copy_(original)
