"""Model outputs that are not numbers: which rows, which weights, and the one message predict, serve and eval give.

A model whose weights hold NaN or infinity (an adapter saved after training diverged, a broken conversion, a full
fine-tune made elsewhere) computes NaN for every text; one run in float16 can overflow on some texts only. Its
probabilities are no answer, and JSON has no NaN either: the server failed with a 500 naming a JSON encoder, and
`predict` wrote empty probabilities and the first label. Every caller checks with `nonfinite_rows` (or, for
generation, `FiniteLogits`) and refuses with `not_finite_message`, naming the rows and, where it scanned them, the
weights at fault. A measurement that generates many replies marks the rows with `NonFiniteSeen` instead and
checks once per batch.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

from emotune.core.errors import UserError


class NonFiniteOutput(UserError):
    """A model computed NaN or infinity where a probability or a logit belongs. `rows`: the rows at fault where the
    raiser knew them (generate_texts' prompt indices), for the caller's message."""

    def __init__(self, message: str, rows: list[int] | None = None):
        super().__init__(message)
        self.rows = rows


def nonfinite_rows(scores: torch.Tensor) -> list[int]:
    """The rows of [rows, values] `scores` (probabilities or logits) that are no answer: NaN or +infinity anywhere,
    or nothing but -infinity. Logits may hold -infinity (a token masked out), so a row counts by its largest value,
    which NaN propagates to."""
    return (~torch.isfinite(scores.detach().amax(-1))).nonzero().flatten().tolist()


def nonfinite_weights(model: torch.nn.Module, skip: tuple[str, ...] = ()) -> list[str]:
    """Names of `model`'s parameters and buffers holding NaN or infinity; those of the adapters named in `skip` (one
    PEFT model holding several, `...lora_A.<adapter>.weight`) are left out. One pass over the weights: called once a
    model has answered with NaN, to say where it comes from."""
    found = []
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        parts = name.split(".")
        if any(adapter in parts for adapter in skip) or not tensor.is_floating_point():
            continue
        if not bool(torch.isfinite(tensor.detach()).all()):
            found.append(name)
    return found


CAUSES = "a checkpoint saved after training diverged, a broken adapter file or a failed conversion"
FIX = "use the original files or an earlier, good copy of the model, or train, convert or export it again"
WHERE_DTYPE = "`model.dtype`: in the config given to the command, or the run's config.yaml"
OVERFLOW_FIX = {torch.float16: f"run it in bfloat16 or float32 ({WHERE_DTYPE}): float16's narrow range is the usual cause",
                torch.bfloat16: f"run it in float32 ({WHERE_DTYPE})"}


def not_finite_message(subject: str, where: str, dtype: torch.dtype, weights: list[str] | None = None) -> str:
    """`subject` (`The model `x``) computed NaN or infinity for `where` (`input[0]`, `rows 3, 7 of in.csv`): why,
    and what to do. `weights`: the parameters `nonfinite_weights` found (an empty list: it found none), or None when
    they were not scanned. Only a reduced precision (float16, bfloat16) is blamed for an overflow."""
    head = f"{subject} computed scores that are not numbers (NaN or infinity) for {where}, so it has no answer to give"
    dtype_name = str(dtype).removeprefix("torch.")
    overflow = OVERFLOW_FIX.get(dtype)
    if weights:
        names = ", ".join(weights[:3]) + (f" and {len(weights) - 3} more" if len(weights) > 3 else "")
        return f"{head}: its weights hold NaN or infinity ({names}), as {CAUSES} leaves them. To fix it, {FIX}."
    if weights is not None and overflow:
        return f"{head}. Its weights are all finite, so its {dtype_name} computation overflowed on this input: {overflow}."
    if weights is not None:
        return (f"{head}. Its weights are all finite, yet its {dtype_name} computation overflowed on this input: weights "
                f"or activations of extreme size, as {CAUSES} can leave. To fix it, {FIX}.")
    if overflow:
        return (f"{head}. Either its weights hold NaN or infinity ({CAUSES}; to fix it, {FIX}), or its {dtype_name} "
                f"computation overflowed on this input (to fix it, {overflow}).")
    return f"{head}. Its weights hold NaN or infinity, or values of extreme size, as {CAUSES} leaves them. To fix it, {FIX}."


class FiniteLogits(LogitsProcessor):
    """Stops `generate` with NonFiniteOutput at the first step whose logits are no answer: greedy decoding would
    pick token 0 from NaN logits, a reply of padding, and sampling fails inside torch.multinomial."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not bool(torch.isfinite(scores.amax(-1)).all()):  # as nonfinite_rows counts them, one sync per step
            raise NonFiniteOutput("The model computed logits that are not numbers (NaN or infinity).")
        return scores


class NonFiniteSeen(LogitsProcessor):
    """Marks the rows of a `generate` call whose logits were no answer at some step, as `nonfinite_rows` counts them,
    without stopping it: `rows()` reads them once the call returns. One sync per batch where FiniteLogits syncs every
    step, for measurements generating many replies; the cost per step is one reduction over the logits, as greedy
    decoding's own argmax."""

    def __init__(self):
        self.seen: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        bad = ~torch.isfinite(scores.detach().amax(-1))
        self.seen = bad if self.seen is None else self.seen | bad
        return scores

    def rows(self) -> list[int]:
        """The rows marked since the last call (indices into the batch), and a fresh start for the next batch."""
        seen, self.seen = self.seen, None
        return [] if seen is None else seen.nonzero().flatten().tolist()
