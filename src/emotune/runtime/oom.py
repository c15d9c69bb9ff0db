"""Out of memory: the one detector (training's recovery and evaluation's batching both ask it), what a failed
step leaves behind, and batches that halve when they do not fit.

A GPU allocator raises torch.OutOfMemoryError (CUDA and ROCm alike); the CPU allocator raises a RuntimeError
("DefaultCPUAllocator: can't allocate memory"); Python's own allocations raise MemoryError. Training
(emotune.train.recovery) changes its settings step by step; evaluation only halves its batch.
"""

from __future__ import annotations

import gc

import torch
from tqdm import tqdm

from emotune.core.errors import UserError

CPU_OOM = "can't allocate memory"  # the CPU allocator's message: "DefaultCPUAllocator: can't allocate memory: ..."


def is_out_of_memory(err: BaseException) -> bool:
    """A GPU allocator's OutOfMemoryError (CUDA, ROCm), or the CPU allocator's failure to allocate."""
    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and ("out of memory" in text or CPU_OOM in text)


def free_memory(optimizer: torch.optim.Optimizer) -> None:
    """What a failed step left: its partial gradients, its activations (unreachable once the error is gone),
    and the cached blocks the GPU allocator keeps."""
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def run_in_batches(order: list[int], batch_size: int, step, desc: str | None = None) -> None:
    """Call `step(rows)` on consecutive batches of `order`; out of memory halves the batch and retries it."""
    with tqdm(total=len(order), desc=desc, unit="row", disable=desc is None) as bar:
        start = 0
        while start < len(order):
            batch = order[start:start + batch_size]
            try:
                step(batch)
            except (torch.OutOfMemoryError, RuntimeError) as err:
                if not is_out_of_memory(err):
                    raise
                if batch_size == 1:
                    raise UserError("Evaluation ran out of memory with one row per batch. Use a smaller model, "
                                    "model.dtype=bfloat16, or a device with more memory.") from None
                batch_size = max(1, batch_size // 2)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                print(f"Out of memory: retrying with eval batch size {batch_size}", flush=True)
                continue
            start += len(batch)
            bar.update(len(batch))
