"""Load test of `emotune serve`: N concurrent clients for a bounded time, micro-batched vs unbatched, side by side.

    python bench/serve_load.py [--clients 32] [--seconds 20] [--model small|embedded|FOLDER]

Starts `emotune serve` on 127.0.0.1 (a subprocess) twice over the same adapter: once with micro-batching
(serve.max_batch_size=32) and once without (serve.max_batch_size=1). Each client sends one-text
/v1/classify requests back to back until the time is up; every request sent is then awaited. `errors`
are answers other than a 200 with a valid label; `lost` are requests that got no answer at all
(connection reset, 300 s timeout). Prints one JSON line for the batched run,
with the unbatched run's requests/s as a ratio.

`--model small` (default) is a random Gemma 3 with the packaged model's depth (18 layers) but a tiny
width and vocabulary, so a forward pass of 32 rows costs little more than one of 1 row, as on a GPU: the
numbers measure the server and its batching, not the CPU's arithmetic. `--model embedded` runs the
packaged Gemma 3 270M, which on a CPU is compute-bound per row (batching gains little there).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
# One intra-op thread for the server: on a small CPU the event loop, the clients and the model then
# do not spin-wait on each other inside every matrix product (which hurts small forward passes most).
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
LABELS = ["sadness", "joy", "love", "anger", "fear", "surprise"]


def build_run(model: str, folder: Path) -> Path:
    """A run-like folder: config.yaml + adapter/ (random non-zero LoRA, r 16, all linear layers)."""
    import torch
    import yaml
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from emotune.core.config.base import DEFAULT_SYSTEM_PROMPT, DEFAULT_USER_TEMPLATE
    from emotune.core.config.model import ModelConfig
    from emotune.model.loading import load_tokenizer, resolve_model_dir

    torch.manual_seed(0)
    if model == "small":
        source = str(build_small_model(folder / "small-gemma3"))
    else:
        source = model
    base_dir = resolve_model_dir(ModelConfig(source=source))
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                          LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False,
                                     task_type="CAUSAL_LM"))
    run_dir = folder / "runs" / "bench"
    peft.save_pretrained(run_dir / "adapter")
    load_tokenizer(base_dir, ModelConfig()).save_pretrained(run_dir / "adapter")
    meta = {"labels": LABELS, "system_prompt": DEFAULT_SYSTEM_PROMPT.replace("{labels}", ", ".join(LABELS)),
            "system_prompt_template": DEFAULT_SYSTEM_PROMPT, "user_template": DEFAULT_USER_TEMPLATE,
            "base_model": source, "eval": {}}
    (run_dir / "adapter" / "emotune.json").write_text(json.dumps(meta))
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"model": {"source": source}}))
    return run_dir


def build_small_model(folder: Path) -> Path:
    """Gemma 3 270M's depth (18 layers) at a tiny width, with the test suite's word-level tokenizer.

    Every forward pass then costs about the same whatever the batch size, as a small model on a GPU does;
    on a CPU the real model is compute-bound per row, so batching cannot show there what it does on a GPU.
    """
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build_tokenizer

    tokenizer = build_tokenizer(folder)
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=18, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=1024, sliding_window=512,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).save_pretrained(folder)
    return folder


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(run_dir: Path, max_batch_size: int, log: Path) -> tuple[subprocess.Popen, str]:
    return launch_server(run_dir, log, [f"serve.max_batch_size={max_batch_size}", "serve.max_queue=4096"])


def launch_server(run_dir: Path, log: Path, settings: list[str], env: dict | None = None,
                  wait_s: float = 300) -> tuple[subprocess.Popen, str]:
    """`emotune serve run_dir` on a free loopback port with `settings`, once /health answers 200: (process, url)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", **THREADS, **(env or {})}
    process = subprocess.Popen(
        [sys.executable, "-m", "emotune", "serve", str(run_dir), f"serve.port={port}", "device=cpu", *settings],
        env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + wait_s
    while time.time() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited early; see {log}:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise SystemExit(f"the server did not start within {wait_s:.0f} s; see {log}")


def stop_server(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)  # graceful: uvicorn finishes what is in flight
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()


class Connection:
    """One keep-alive HTTP/1.1 connection speaking just enough HTTP for this test.

    A hand-rolled client costs a fraction of httpx's CPU per request; on a small machine the clients
    share the cores with the server, so a heavy client would cap the measured requests/s.
    """

    def __init__(self, url: str):
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)
        self.reader = self.writer = None

    async def post(self, path: str, payload: dict, timeout: float = 300) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        body = json.dumps(payload).encode()
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        return await asyncio.wait_for(self._response(), timeout)

    async def _response(self) -> tuple[int, bytes]:
        head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(head[0].split()[1])
        headers = dict(line.lower().split(": ", 1) for line in head[1:] if ": " in line)
        body = await self.reader.readexactly(int(headers.get("content-length", 0)))
        if headers.get("connection") == "close":
            self.close()
        return status, body

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def load(url: str, texts: list[str], clients: int, seconds: float) -> dict:
    latencies: list[float] = []
    counts = {"sent": 0, "ok": 0, "errors": 0}
    stop_at = time.perf_counter() + seconds

    async def client(seed: int) -> None:
        rng, connection = random.Random(seed), Connection(url)
        while time.perf_counter() < stop_at:
            counts["sent"] += 1
            started = time.perf_counter()
            try:
                status, body = await connection.post("/v1/classify", {"model": "bench", "input": rng.choice(texts)})
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError):  # no answer at all: lost
                connection.close()
                continue
            good = status == 200 and json.loads(body)["data"][0]["label"] in LABELS
            counts["ok" if good else "errors"] += 1
            if good:
                latencies.append(time.perf_counter() - started)
        connection.close()

    began = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    elapsed = time.perf_counter() - began
    latencies.sort()
    return {**counts, "lost": counts["sent"] - counts["ok"] - counts["errors"], "seconds": elapsed,
            "rps": counts["ok"] / elapsed,
            "p50_ms": 1000 * statistics.median(latencies) if latencies else None,
            "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else None}


def mean_batch(url: str) -> float:
    """Texts per forward pass over the server's life, from its Prometheus counters."""
    values = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("emotune_batches_total", "emotune_classified_texts_total"):
            values[name] = float(value)
    return values["emotune_classified_texts_total"] / values["emotune_batches_total"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--model", default="small", help="small | embedded | a Hugging Face model folder")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from emotune.data import embedded_dataset_dir

    texts = [json.loads(line)["text"] for line in (embedded_dataset_dir() / "test.jsonl").read_text().splitlines()]
    with tempfile.TemporaryDirectory(prefix="emotune-bench-") as tmp:
        run_dir = build_run(args.model, Path(tmp))
        results = {}
        for mode, max_batch in (("batched", 32), ("unbatched", 1)):
            process, url = start_server(run_dir, max_batch, Path(tmp) / f"{mode}.log")
            try:
                asyncio.run(load(url, texts[:8], 2, 2.0))  # warm-up: first calls build caches
                results[mode] = asyncio.run(load(url, texts, args.clients, args.seconds))
                results[mode]["mean_batch"] = mean_batch(url)
            finally:
                stop_server(process)
    batched, unbatched = results["batched"], results["unbatched"]
    print(json.dumps({
        "clients": args.clients, "requests": batched["sent"], "ok": batched["ok"], "errors": batched["errors"],
        "lost": batched["lost"], "rps": round(batched["rps"], 1), "p50_ms": round(batched["p50_ms"], 1),
        "p99_ms": round(batched["p99_ms"], 1), "mean_batch": round(batched["mean_batch"], 1),
        "batched_vs_unbatched_rps": round(batched["rps"] / unbatched["rps"], 2),
        "unbatched": {k: round(v, 1) if isinstance(v, float) else v for k, v in unbatched.items()},
        "model": args.model, "seconds": args.seconds,
    }))


if __name__ == "__main__":
    main()
