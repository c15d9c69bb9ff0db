"""The adapter folder format: one writer, one reader, used by train, eval, export, predict and serve.

An emotune adapter folder holds PEFT's files (`adapter_config.json`, `adapter_model.safetensors`), the
tokenizer with its chat template, and `emotune.json`: the task, label set, prompt and base model the
adapter was trained with (an sft adapter: its system prompt, base model, the text steps its turns were cleaned
with and how its rows were read; a classify_head adapter: its labels, token limit and base model, with the trained
`score` head in PEFT's weights file, saved there as a module trained in full), so it can be measured and served with
exactly the training prompt.

Adapters written by other tools (plain PEFT, LLaMA-Factory, TRL; `adapter_model.bin` too, which PEFT
reads with `torch.load(weights_only=True)`) have no `emotune.json`. They load when what it would say is
given another way (`Fallback`: a config's labels and prompt, or command-line flags); otherwise the
error says which pieces are missing.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import ValidationError

from emotune.core.config.data import PromptConfig
from emotune.core.config.model import ModelConfig
from emotune.core.errors import UserError, first_line
from emotune.core.rundir import RunDir, atomic_dir, json_text, read_json
from emotune.model.prompt import system_prompt
from emotune.model.weight_files import damage

META = "emotune.json"
PEFT_CONFIG = "adapter_config.json"
# What emotune.json must hold, by the `task` it names (written by that task's adapter_meta; no `task`: classify).
REQUIRED_META = {"classify": ("labels", "system_prompt_template", "user_template", "base_model"),
                 "sft": ("task", "base_model"), "classify_head": ("task", "labels", "base_model")}
HEAD_TASKS = ("classify_head",)  # models that answer through a classification head (emotune.model.head), not with text
DEFAULT_HEAD_MAX_LENGTH = 256  # train.max_length's default, for a head adapter whose emotune.json records none


@dataclass
class Fallback:
    """What to use for an adapter without emotune.json (None = not given)."""

    labels: list[str] | None = None
    prompt: PromptConfig | None = None
    base_model: str | None = None
    source: str = "the config"  # named in the error, e.g. "the --labels/--system-prompt flags"
    task: str = "classify"  # sft: no labels or user template; `system_prompt` is the whole prompt
    system_prompt: str | None = None


@dataclass
class Artifact:
    """A servable model on disk (a classifier, or an sft model that answers in free text): a LoRA adapter over
    a base model, or a merged full model."""

    name: str
    path: Path  # the adapter folder, or the merged model folder
    merged: bool
    meta: dict
    model_cfg: ModelConfig = field(default_factory=ModelConfig)  # how to find the base model (unused when merged)
    config: dict = field(default_factory=dict)
    """The run's resolved config as saved (its config.yaml, beside the folder given or the model folder); {} when
    none is at hand (an adapter folder alone, another tool's adapter). An export's config.yaml holds its `model`
    section only."""

    @property
    def task(self) -> str:
        return self.meta.get("task", "classify")

    @property
    def measured_dtype(self) -> str | None:
        """The dtype the run evaluated its model in ("float32", "bfloat16"; None for adapters from elsewhere or older
        runs): predict and serve load in it where they can (emotune.model.loading.serving_dtype)."""
        return self.meta.get("measured_dtype")

    @property
    def peft_name(self) -> str:
        """The name PEFT registers this adapter under. PEFT makes it a key of module dicts and an attribute of
        the wrapped layers, so a run named like a module attribute (`cpu`, `to`, `eval`, `default`) or holding
        a dot cannot be used as it is; the run's name stays the name users see."""
        return peft_adapter_name(self.name)

    @property
    def labels(self) -> list[str]:
        return list(self.meta["labels"])

    def base_dir(self) -> Path:
        """The base model's folder (emotune.model.loading.resolve_model_dir). A local base that is no longer where the
        run recorded it (moved, renamed, another machine) is named with the file that records it, the fix being there:
        the command has no model.source of its own to set."""
        from emotune.core.errors import read_from
        from emotune.model.loading import EMBEDDED_MODEL, HUB_PREFIXES, looks_like_hub_id, resolve_model_dir

        try:
            return resolve_model_dir(self.model_cfg)
        except UserError:
            source = self.model_cfg.source
            if (source == EMBEDDED_MODEL or source.startswith(HUB_PREFIXES) or looks_like_hub_id(source)
                    or Path(source).expanduser().exists()):
                raise
            config = self.path.parent / "config.yaml"
            where = (f"model.source in `{config}`" if self.config.get("model") and config.is_file()
                     else f"base_model in `{self.path / META}`")
            raise UserError(f"The base model `{self.name}` was trained on is not at `{source}`{read_from(source)} any "
                            f"more ({where} names it). Put the base model back there, or set {where} to the folder "
                            "where it is now (the same model), then run the same command.") from None

    @property
    def has_head(self) -> bool:
        """A classification-head model: label probabilities from its `score` head, no prompt, no text out."""
        return self.task in HEAD_TASKS

    @property
    def max_length(self) -> int:
        """A head model's token limit per text: the one it was trained and evaluated with."""
        return int(self.meta.get("max_length") or DEFAULT_HEAD_MAX_LENGTH)

    @property
    def prompt(self) -> PromptConfig:
        """The prompt the model was trained with: its template, or the system prompt recorded whole where the
        template renders differently now (an adapter trained before labels holding a comma were quoted)."""
        template, recorded = self.meta["system_prompt_template"], self.meta.get("system_prompt")
        if recorded and "{labels}" in template and self.task == "classify" and \
                system_prompt(PromptConfig(system_prompt=template), self.labels) != recorded:
            template = recorded
        return PromptConfig(system_prompt=template, user_template=self.meta["user_template"])

    @property
    def answers_freely(self) -> bool:
        """Whether the model answers in free text (an instruction-tuned chat model) rather than with one of its
        labels: what deployment formats ask to choose sampling, stop rules and descriptions."""
        return self.task == "sft"

    @property
    def sft_system_prompt(self) -> str | None:
        """The system prompt an sft model was trained with for rows without their own (None: none)."""
        return self.meta.get("system_prompt") if self.task == "sft" else None

    def chat_prompt(self, tokenizer, text: str | list[dict]) -> str:
        """The chat-templated prompt this model answers `text` under: a classifier's system prompt and user
        template, or an sft model's system prompt with `text` as the user turn (or, a list of messages, as the
        conversation so far; its own system turn replaces the model's)."""
        from emotune.model.turns import rendered_chat  # a str that tokenizes as training read it (generate_texts)

        return rendered_chat(tokenizer, self.chat_messages(text), generation_prompt=True)

    def chat_messages(self, text: str | list[dict]) -> list[dict]:
        """The messages of `chat_prompt`."""
        if self.task == "sft":
            system = self.sft_system_prompt
            turns = [{"role": "user", "content": text}] if isinstance(text, str) else list(text)
            own = bool(turns) and turns[0]["role"] == "system"
            messages = ([{"role": "system", "content": system}] if system and not own else []) + turns
        else:
            from emotune.model.prompt import prompt_messages

            messages = prompt_messages(text, self.prompt, self.labels)
        return messages

    @property
    def foreign(self) -> bool:
        """Trained by another tool: the labels and prompt came from a Fallback."""
        return bool(self.meta.get("foreign"))


# --------------------------------------------------------------------------------------------------
# Writer


def write_adapter(model, tokenizer, target: Path, meta: dict, state_dict: dict | None = None,
                  convert_from: Path | None = None) -> Path:
    """Adapter weights + config, tokenizer (with its chat template) and `meta` as emotune.json, atomically.
    `state_dict`: the full trainable weights when the model's own are sharded (FSDP). `convert_from`: the starting
    adapter of a PiSSA/OLoRA/LoftQ run, to save the adapter converted onto the original base (emotune.model.init_methods)."""
    extra = {"state_dict": state_dict} if state_dict is not None else {}
    if convert_from is not None:
        extra["path_initial_model_for_weight_conversion"] = str(convert_from)
    with atomic_dir(target) as partial:
        model.save_pretrained(partial, **extra)
        tokenizer.save_pretrained(partial)
        (partial / META).write_text(json_text(meta), encoding="utf-8")
    return target


def write_full_model(model, tokenizer, target: Path, meta: dict) -> Path:
    """A fully or freeze-fine-tuned model (`train.finetuning`) as a whole model folder, in the layout of a merged
    export (`emotune export --merge`): weights and config, generation config stopping on the chat template's
    end-of-turn token, tokenizer, and `meta` as emotune.json, atomically. Saved in the dtypes the weights have."""
    from emotune.model.turns import stop_token_ids

    with atomic_dir(target) as partial:
        if meta.get("task") not in HEAD_TASKS and getattr(model, "generation_config", None) is not None:
            model.generation_config.eos_token_id = stop_token_ids(tokenizer, model.generation_config)
            model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(partial, safe_serialization=True)
        tokenizer.save_pretrained(partial)
        (partial / META).write_text(json_text(meta), encoding="utf-8")
    return target


def is_adapter(folder: Path) -> bool:
    return (folder / PEFT_CONFIG).is_file()


def is_full_model(folder: Path) -> bool:
    """A whole model folder with emotune's meta: a merged export, or a run's fully or freeze-fine-tuned model."""
    return (folder / "config.json").is_file() and (folder / META).is_file()


def has_trained(run: RunDir) -> bool:
    """Whether the run folder holds what its training saves: the adapter, or the model itself (full / freeze)."""
    return is_adapter(run.adapter) or is_full_model(run.model)


def trained_outputs(run: RunDir, finetuning: str) -> list[Path]:
    """The files a finished run's training leaves, by `train.finetuning`."""
    if finetuning == "lora":
        return [run.adapter / PEFT_CONFIG, run.adapter / META]
    return [run.model / "config.json", run.model / META]


def read_meta(folder: Path) -> dict | None:
    """emotune.json of `folder`, None when there is none; an unreadable or incomplete one is an error."""
    path = folder / META
    if not path.is_file():
        return None
    meta = read_json(path)
    if not isinstance(meta, dict):
        raise UserError(f"`{path}` is not a JSON object. Re-export the run, or restore the file.")
    required = REQUIRED_META.get(meta.get("task", "classify")) if isinstance(meta.get("task", "classify"), str) else None
    if required is None:
        raise UserError(f"`{path}` names task {meta.get('task')!r}, which this emotune does not know. Upgrade emotune to "
                        "the version that trained the adapter.")
    missing = [k for k in required if k not in meta]
    if missing:
        raise UserError(f"`{path}` lacks {', '.join(missing)}. It was not written by emotune; delete it to load the "
                        "adapter as one made by another tool (labels and prompt from the config or flags).")
    wrong = _wrong_types(meta)
    if wrong:
        raise UserError(f"`{path}` has {'; '.join(wrong)}. It was edited or not written by emotune; re-export the run, "
                        "or delete it to load the adapter as one made by another tool.")
    return meta


def _wrong_types(meta: dict) -> list[str]:
    """What in emotune.json has a type its readers cannot use (labels: distinct non-empty strings)."""
    wrong = [f"`{key}` that is not text" for key in ("system_prompt", "system_prompt_template", "user_template",
                                                     "base_model") if key in meta and not isinstance(meta[key], (str, type(None)))]
    if "max_length" in meta and not (type(meta["max_length"]) is int and meta["max_length"] >= 1):
        wrong.append("`max_length` that is not a positive whole number")
    labels = meta.get("labels")
    if "labels" in meta and not (isinstance(labels, list) and labels and all(isinstance(x, str) and x.strip() for x in labels)
                                 and len(set(labels)) == len(labels)):
        wrong.append("`labels` that are not a list of distinct, non-empty texts")
    return wrong


# --------------------------------------------------------------------------------------------------
# Reader


def find_artifact(target: str | Path, name: str | None = None, fallback: Fallback | None = None) -> Artifact:
    """Accept a run folder, an export folder, an adapter folder or a merged model folder."""
    target = Path(target).expanduser()
    if not target.exists():
        raise UserError(f"`{target}` does not exist, so it is neither an adapter folder nor a run folder. Give a run "
                        f"folder (runs/<name>), an export folder, or an adapter folder holding {PEFT_CONFIG}.")
    if target.is_file():  # `emotune export merge_lora.yaml`, LLaMA-Factory's way, was told the file "holds no adapter"
        raise UserError(f"`{target}` is a file, not a folder: give a finished run folder (runs/<name>), the output of "
                        "`emotune export`, or a PEFT adapter folder. A config file is no adapter: train it with `emotune "
                        "run CONFIG`, then `emotune export runs/<name> --merge` does what `llamafactory-cli export` does.")
    run = RunDir(target)
    candidates = [(run.adapter, False), (run.model, True), (target, False), (target / "merged", True), (target, True)]
    for folder, merged in candidates:
        marker = folder / ("config.json" if merged else PEFT_CONFIG)
        if marker.is_file() and (folder / META).is_file():
            meta, config = read_meta(folder), _run_config(target, folder)
            artifact = Artifact(name=name or default_name(target), path=folder, merged=merged, meta=meta,
                                model_cfg=_model_config(config, meta, folder), config=config)
            if not merged:
                check_adapter_weights(folder)
            return artifact
    for folder in (run.adapter, target):
        if is_adapter(folder):
            artifact = _foreign_adapter(folder, name or default_name(target), fallback)
            check_adapter_weights(folder)  # after what the adapter lacks to be used at all
            return artifact
    raise UserError(f"`{target}` holds no emotune adapter, PEFT adapter or merged model (looked for {PEFT_CONFIG}, or config.json next to "
                    f"{META}, in the folder and in adapter/, model/ and merged/). Point at a finished run folder (runs/<name>), "
                    "the output of `emotune export`, or a PEFT adapter folder.")


def _foreign_adapter(folder: Path, name: str, fallback: Fallback | None) -> Artifact:
    """An adapter trained by another tool: PEFT's config names the base; labels and prompt come from `fallback`."""
    fallback = fallback or Fallback(source="nothing (no config or flags were given)")
    peft_config = read_json(folder / PEFT_CONFIG) or {}
    base = fallback.base_model or peft_config.get("base_model_name_or_path")
    base = base if isinstance(base, str) and base.strip() else None  # none, or not a name: refused below as missing
    if fallback.task == "sft":  # free text: the system prompt (none is a valid one) and the base are all it needs
        if not base:
            raise UserError(f"`{folder}` is an adapter made by another tool (no {META}) whose {PEFT_CONFIG} names no "
                            f"base model, and {fallback.source} did not say. Set model.source in the config.")
        meta = {"task": "sft", "system_prompt": fallback.system_prompt, "base_model": base, "foreign": True}
        return Artifact(name=name, path=folder, merged=False, meta=meta, model_cfg=ModelConfig(source=base))
    missing = [what for what, value in (("the label set", fallback.labels), ("the prompt", fallback.prompt),
                                        ("the base model", base)) if not value]
    if missing:
        raise UserError(f"`{folder}` is an adapter made by another tool (no {META}), so emotune cannot tell "
                        f"{' or '.join(missing)} it was trained with, and {fallback.source} did not say. Give them: "
                        "`emotune eval CONFIG adapter=DIR` takes them from the config (data.label_names, the prompt "
                        "section, model.source); `emotune predict DIR --config FILE` (or --labels a,b,c for the labels) "
                        "and `emotune serve DIR FILE.yaml` from a config file. Before/after numbers are only "
                        "comparable with the prompt and labels the adapter was trained with.")
    meta = {"task": "classify", "labels": list(fallback.labels), "system_prompt_template": fallback.prompt.system_prompt,
            "user_template": fallback.prompt.user_template, "base_model": base, "foreign": True}
    return Artifact(name=name, path=folder, merged=False, meta=meta, model_cfg=ModelConfig(source=base))


def check_adapter_weights(folder: Path) -> None:
    """Refuse an adapter folder without its weights, or whose safetensors file is cut short or empty, before a
    command copies it or loads a base model for it (PEFT then fails with a traceback, or takes the folder for a hub
    id). A pickled adapter_model.bin (another tool's) is left to the loader."""
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        if (folder / "adapter_model.bin").is_file():
            return
        raise UserError(f"`{folder}` has {PEFT_CONFIG} but no adapter weights (adapter_model.safetensors). The adapter "
                        "was not saved whole: train it again, or restore the file.")
    why = damage(weights)
    if why is not None:
        raise UserError(f"`{weights}` is not a readable safetensors file ({why}). Re-run the training or re-export "
                        "the adapter, or restore the file.")


def check_adapter_files(folder: Path) -> None:
    """Refuse, before any weight is loaded, an adapter whose files PEFT would fail on half-way: an unreadable
    adapter_config.json or safetensors file, or LoRA matrices whose rank is not the config's."""
    config = read_json(folder / PEFT_CONFIG)
    if not isinstance(config, dict) or not isinstance(config.get("peft_type"), str):
        raise UserError(f"`{folder / PEFT_CONFIG}` is not a PEFT adapter config (a JSON object with `peft_type`). "
                        "Re-export the adapter, or restore the file.")
    weights = folder / "adapter_model.safetensors"
    try:
        from safetensors import safe_open

        with safe_open(weights, "pt") as f:  # reads the header and checks that the data covers it
            shapes = {key: f.get_slice(key).get_shape() for key in f.keys()}  # noqa: SIM118 (not a dict)
    except Exception as err:  # noqa: BLE001 (safetensors raises its own error type for every kind of damage)
        raise UserError(f"`{weights}` is not a readable safetensors file ({err}). Re-export the adapter.") from None
    if config["peft_type"] != "LORA":
        return
    ranks = {config.get("r")} | set((config.get("rank_pattern") or {}).values())
    for key, shape in shapes.items():
        rank = _lora_rank(key, shape)
        if rank is not None and rank not in ranks:
            raise UserError(f"`{weights}` holds `{key}` with shape {shape}, i.e. LoRA rank {rank}, but "
                            f"`{folder / PEFT_CONFIG}` says r={config.get('r')}. The config and the weights come "
                            "from different adapters; re-export the adapter.")


def _lora_rank(key: str, shape: list[int]) -> int | None:
    """The rank a LoRA matrix was saved with: A is [r, in], B is [out, r] (conv: [out, r, k, k])."""
    if len(shape) < 2:
        return None
    if ".lora_A." in key or ".lora_embedding_A" in key:
        return shape[0]
    if ".lora_B." in key or ".lora_embedding_B" in key:
        return shape[1]
    return None


def fallback_from(cfg=None, labels: list[str] | None = None, source: str = "the config") -> Fallback:
    """A Fallback from a config the user gave (its label names, prompt and base model) and/or a label flag;
    from an sft config, its system prompt and base model."""
    if getattr(cfg, "task", "classify") == "sft":
        return Fallback(task="sft", system_prompt=cfg.prompt.system_prompt, base_model=cfg.model.source, source=source)
    return Fallback(labels=labels or (cfg.data.label_names if cfg is not None else None),
                    prompt=getattr(cfg, "prompt", None), base_model=cfg.model.source if cfg is not None else None,
                    source=source)


def peft_adapter_name(name: str) -> str:
    """A PEFT adapter name for a user-visible one: an identifier no torch module has as an attribute, distinct
    for distinct names (a digest keeps `a.b` and `a_b` apart)."""
    digest = hashlib.sha1(name.encode("utf-8")).hexdigest()[:8]
    return f"emotune_{re.sub(r'[^A-Za-z0-9_]', '_', name)}_{digest}"


def default_name(target: Path) -> str:
    """The run's name: RUN, RUN/adapter, RUN/export, RUN/export/adapter and RUN/export/merged are all `RUN`."""
    folder = target.resolve()
    if folder.name in ("adapter", "merged") and folder.parent.name == "export":
        folder = folder.parent
    in_run = folder.name == "model" and (folder.parent / "run.json").is_file()  # a full / freeze run's model/
    name = folder.parent.name if folder.name in ("adapter", "merged", "export") or in_run else folder.name
    # the name travels in URLs, JSON `model` fields and vLLM's name=path flags
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "adapter"


def _run_config(target: Path, folder: Path) -> dict:
    """The run's config.yaml (source, cache and chat template of its model; an sft run's data columns) when it is at
    hand, beside `target` or the model folder; else {}."""
    for config_file in (RunDir(target).config, RunDir(folder.parent).config):
        if config_file.is_file():
            try:
                raw = yaml.safe_load(config_file.read_text(encoding="utf-8"))
            except (yaml.YAMLError, UnicodeDecodeError) as err:
                raise UserError(f"`{config_file}` is not readable YAML ({first_line(err)}). Restore the run's "
                                f"config.yaml, or move it away to use the base model {META} names.") from None
            return raw if isinstance(raw, dict) else {}
    return {}


def _model_config(config: dict, meta: dict, folder: Path) -> ModelConfig:
    """How to find the base: the run's config.yaml's `model` section, else the base model emotune.json names."""
    try:
        return ModelConfig.model_validate(config.get("model") or {"source": meta["base_model"]})
    except ValidationError as err:
        problems = "; ".join(".".join(["model", *map(str, e["loc"])]) + f": {e['msg']}" for e in err.errors())
        raise UserError(f"The run's config.yaml beside `{folder}` has a `model` section emotune cannot read "
                        f"({problems}). Fix it there, or move config.yaml away to use the base model {META} "
                        "names.") from None


def check_matches(artifact: Artifact, labels: list[str], system_prompt_text: str) -> None:
    """Refuse to measure an adapter with other labels or another prompt than it was trained with."""
    meta, problems = artifact.meta, []
    if meta.get("labels") and meta["labels"] != labels:
        problems.append(f"it was trained on labels {meta['labels']}, the data has {labels} (set data.label_names)")
    if meta.get("system_prompt") and meta["system_prompt"] != system_prompt_text:
        problems.append(f"it was trained with a different system prompt (set prompt.system_prompt to the one in "
                        f"{artifact.path / META})")
    if problems:
        raise UserError(f"The adapter `{artifact.path}` does not match this evaluation: {'; '.join(problems)}. "
                        "Before/after numbers are only comparable with the training prompt and labels.")


def load_artifact_model(artifact: Artifact, dtype, device):
    """The model (PEFT-wrapped for adapters) and tokenizer, ready for inference. A head model is its classifier
    (emotune.model.head): a merged one through emotune's loader, an adapter over the base's language model."""
    from emotune.model.head import classifier_from_causal, load_classifier
    from emotune.model.loading import load_model, load_tokenizer

    if artifact.merged:
        load = load_classifier if artifact.has_head else load_model
        return load(artifact.path, dtype, device).eval(), load_tokenizer(artifact.path, ModelConfig())
    from peft import PeftModel

    base_dir = artifact.base_dir()
    base = load_model(base_dir, dtype, device)
    if artifact.has_head:
        base = classifier_from_causal(base, artifact.labels)  # its fresh head is replaced by the adapter's trained one
    model = PeftModel.from_pretrained(base, artifact.path, adapter_name=artifact.peft_name)
    tokenizer_dir = artifact.path if (artifact.path / "tokenizer_config.json").is_file() else base_dir
    return model.eval(), load_tokenizer(tokenizer_dir, artifact.model_cfg if tokenizer_dir == base_dir else ModelConfig())
