"""The engine: one base model, adapters by name, every model call under one lock.

Every adapter's LoRA lives in one PEFT model over the base. A classification-head adapter's LoRA is loaded
there too, renamed to the causal model's modules (emotune.model.head.causal_adapter), and its trained head sits on
a classifier that reads the base's language model (`Loaded.head`), so heads, generative classifiers and sft
models share one copy of the base weights.

A merged model folder (`emotune export --merge`: a generative classifier, an sft model or a head model) is
served alone, without a base, under the run's name with its own task, labels and prompt, loaded as
`emotune predict` loads it.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from emotune.core.config.data import PromptConfig
from emotune.core.config.model import ModelConfig
from emotune.core.config.run import RunConfig
from emotune.core.errors import UserError, first_line
from emotune.data.clean import clean_for_inference
from emotune.eval.scoring import LabelScorer, score_label_probs
from emotune.model.artifacts import Artifact, Fallback, find_artifact, load_artifact_model
from emotune.model.finite import NonFiniteOutput, nonfinite_rows, nonfinite_weights, not_finite_message
from emotune.model.head import causal_adapter, classifier_from_causal, head_probabilities
from emotune.model.loading import load_base, load_tokenizer, serving_dtype
from emotune.runtime import device as device_mod

BASE_MODEL = "base"
PROBE_TEXT = "Hello"  # the text every model answers once when loaded (Engine._probe)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json")


class ModelGone(LookupError):
    """The model a queued request named was unloaded before its turn came."""


@dataclass
class Loaded:
    name: str
    artifact: Artifact | None  # None for the base model
    tokenizer: Any
    created: int = field(default_factory=lambda: int(time.time()))
    head: torch.nn.Module | None = None  # a head model's classifier (over the base's language model, or merged)


class Engine:
    def __init__(self, model_cfg: ModelConfig, device: str = "auto", merged: Artifact | None = None):
        """The base model of `model_cfg`; or, given a merged model, that model alone (no base, no adapters)."""
        self.device = device_mod.resolve_device(device)
        self.lock = threading.Lock()
        self.busy_since: float | None = None  # time.monotonic() when the model call running now began
        self.scorers: dict[str, LabelScorer] = {}  # per adapter; the cached prompt head depends on the weights
        self.tokenizers: dict[str, Any] = {}  # by the fingerprint of their files (tokenizer_for)
        if merged is not None:
            model, tokenizer = load_artifact_model(merged, serving_dtype(merged.model_cfg, self.device, merged.measured_dtype), self.device)
            self.base_source, self.model, self.causal = str(merged.path), model, None
            head = model if merged.has_head else None  # a generative model is scored and generated from as it is
            self.models: dict[str, Loaded] = {merged.name: Loaded(merged.name, merged, tokenizer, head=head)}
            return
        self.base_source = model_cfg.source
        base = load_base(model_cfg, self.device)  # model.dtype honoured, as in training and evaluation
        self.base_dir, self.dtype = base.model_dir, base.model.dtype
        self.model = base.model.eval()
        self.causal = base.model  # the same object once PEFT wraps `model`; head classifiers read its language model
        self.models = {BASE_MODEL: Loaded(BASE_MODEL, None, base.tokenizer)}

    @property
    def is_peft(self) -> bool:
        return hasattr(self.model, "peft_config") and hasattr(self.model, "get_base_model")  # a PeftModel

    def add_adapter(self, artifact: Artifact, tokenizer: Any = None) -> None:
        """Load an adapter under its name (called on the worker thread; `tokenizer` from `tokenizer_for`, which
        need not run there). All or nothing: if PEFT fails half-way (it wraps layers before it reads the weights),
        what it registered is taken out again, so the models served before are unchanged and the name can be
        loaded again. An adapter that does not fit this base (its layers' names or shapes, its head, its tokenizer)
        is a UserError saying what differs."""
        self.check_loadable(artifact)
        tokenizer = tokenizer if tokenizer is not None else self.tokenizer_for(artifact)
        self._check_vocabulary(artifact, tokenizer)
        with self.lock:
            served = self.model
            try:
                head = self._attach_head(artifact) if artifact.has_head else self._attach(artifact)
                loaded = Loaded(artifact.name, artifact, tokenizer, head=head)
                with self._active(loaded):
                    self._probe(loaded)
            except BaseException as err:
                self._detach(artifact.peft_name)
                misfit = _misfit(err)
                if misfit is None:  # not the adapter's files: out of memory, a device failure
                    raise
                raise UserError(f"Adapter `{artifact.name}` does not fit this server's base model `{self.base_source}`: "
                                f"{misfit} It was not loaded.") from None
            finally:
                if self.model is not served:  # the first adapter wrapped the model: every scorer starts afresh
                    self.scorers.clear()
            self.models[artifact.name] = loaded

    def tokenizer_for(self, artifact: Artifact) -> Any:
        """The adapter folder's tokenizer; one already loaded from identical files is shared (a tokenizer of a
        large vocabulary takes seconds to load, and adapters of one base usually carry the same files). A folder
        without one (an adapter made by another tool) reads with the base model's, as `emotune predict` does."""
        if not (artifact.path / "tokenizer_config.json").is_file() and BASE_MODEL in self.models:
            return self.models[BASE_MODEL].tokenizer
        key = _tokenizer_fingerprint(artifact.path)
        if key not in self.tokenizers:
            try:
                self.tokenizers[key] = load_tokenizer(artifact.path, ModelConfig())
            except UserError:
                raise
            except Exception as err:  # noqa: BLE001 (transformers and tokenizers raise many types for damaged files)
                raise UserError(f"The tokenizer in `{artifact.path}` cannot be loaded ({type(err).__name__}: "
                                f"{first_line(err)}). Restore its tokenizer files from the run that trained the adapter, "
                                "or delete them all (tokenizer_config.json with them) to use the base model's.") from None
        return self.tokenizers[key]

    def _check_vocabulary(self, artifact: Artifact, tokenizer: Any) -> None:
        """A tokenizer with more tokens than the base has embeddings (and than its own tokenizer has) belongs to
        another model: a text holding one of the extra tokens indexes past the embedding table, an IndexError on the
        CPU and on a GPU a device-side assert that breaks every later request."""
        rows = self.causal.get_input_embeddings().num_embeddings
        own = len(self.models[BASE_MODEL].tokenizer)
        if len(tokenizer) > max(rows, own):
            raise UserError(f"Adapter `{artifact.name}`'s tokenizer has {len(tokenizer):,} tokens, but this server's base "
                            f"model `{self.base_source}` has embeddings for {rows:,} (its own tokenizer: {own:,}), so a "
                            "text holding one of the others would fail inside the model. The tokenizer comes from "
                            "another model: serve the adapter from a server started with the base it was trained on, "
                            f"or replace the tokenizer files in `{artifact.path}` with the base model's.")

    def check_loadable(self, artifact: Artifact) -> None:
        """An adapter needs this server's base: refused on a server of a merged model, or of another base."""
        if self.causal is None:
            raise UserError(f"This server serves the merged model `{self.base_source}` alone, which has no base model "
                            f"to put adapter `{artifact.name}` on. Serve adapters from a server started with their run "
                            "folders (or with no target: the base model).")
        check_base(artifact, self.base_source)

    def remove_adapter(self, name: str) -> None:
        with self.lock:
            if name not in self.models:
                raise ModelGone(f"The model `{name}` was unloaded already.")
            loaded, served = self.models.pop(name), self.model
            self.scorers.pop(name, None)
            self._detach(loaded.artifact.peft_name)
            if self.model is not served:  # the last adapter left: the plain base again
                self.scorers.clear()

    def _attach(self, artifact: Artifact) -> None:
        from peft import PeftModel

        if self.is_peft:
            self.model.load_adapter(artifact.path, adapter_name=artifact.peft_name)
        else:
            self.model = PeftModel.from_pretrained(self.model, artifact.path, adapter_name=artifact.peft_name).eval()

    def _attach_head(self, artifact: Artifact) -> torch.nn.Module:
        """The head adapter's LoRA beside the other adapters, and a classifier with its trained head over the base's
        language model (which runs with whichever adapter `using` made active)."""
        from peft import get_peft_model
        from peft.utils import set_peft_model_state_dict

        config, weights, head = causal_adapter(self.causal, artifact.path)
        classifier = classifier_from_causal(self.causal, artifact.labels)  # reads through the LoRA attached below
        _check_head(artifact, head.shape, classifier.score.weight.shape)
        if self.is_peft:
            self.model.add_adapter(artifact.peft_name, config)
        else:
            self.model = get_peft_model(self.model, config, adapter_name=artifact.peft_name).eval()
        loaded = set_peft_model_state_dict(self.model, weights, adapter_name=artifact.peft_name)
        if loaded.unexpected_keys:
            raise UserError(f"Adapter `{artifact.name}` holds weights this base model has no place for "
                            f"({', '.join(loaded.unexpected_keys[:3])}, ...); was it trained on another base model?")
        with torch.no_grad():
            classifier.score.weight.copy_(head)
        return classifier.eval()

    def _detach(self, peft_name: str) -> None:
        """Take out the adapter PEFT holds as `peft_name`, whole or half-loaded. Without adapters left the plain base model is served
        again: a PeftModel with no adapter cannot run with its adapters disabled."""
        if self.is_peft:
            if peft_name in self.model.peft_config:
                self.model.delete_adapter(peft_name)
            if self.model.peft_config:
                return
            self.model = self.model.base_model.model  # get_base_model() needs an active adapter
        _strip_adapter_layers(self.model)

    @contextmanager
    def using(self, name: str):
        """Hold the lock with `name` active: the base runs with every adapter disabled."""
        with self.lock, self._busy():
            if name not in self.models:
                raise ModelGone(f"The model `{name}` was unloaded before this request's turn came.")
            with self._active(self.models[name]) as loaded:
                yield loaded

    @contextmanager
    def _active(self, loaded: Loaded):
        """`loaded` active (the lock held by the caller): the base with every adapter disabled."""
        context = nullcontext()  # the plain base, or a merged model served alone
        if self.is_peft and loaded.artifact is None:
            context = self.model.disable_adapter()
        elif self.is_peft:
            self.model.set_adapter(loaded.artifact.peft_name)
        with context:
            yield loaded

    def check_finite(self, name: str) -> None:
        """The base or merged model answers PROBE_TEXT with finite scores (adapters are probed as they load)."""
        with self.using(name) as loaded:
            self._probe(loaded)

    def _probe(self, loaded: Loaded) -> None:
        """One forward pass over a short text, `loaded` active: a model whose weights hold NaN or infinity (a broken
        checkpoint or conversion) answers every request with NaN, which is refused here, when it loads, naming the
        weights at fault (NonFiniteOutput), instead of failing every request it is sent."""
        with torch.no_grad():
            if loaded.head is not None:
                scores = head_probabilities(loaded.head, loaded.tokenizer, [PROBE_TEXT], 16, 1)
            else:
                ids = loaded.tokenizer(PROBE_TEXT, return_tensors="pt")["input_ids"].to(self.device)
                scores = self.model(input_ids=ids).logits[:, -1]
        if not nonfinite_rows(scores):
            return
        model = loaded.head if loaded.head is not None else self.model
        others = tuple(m.artifact.peft_name for m in self.models.values()
                       if m.artifact is not None and m.name != loaded.name and not m.artifact.merged)
        raise NonFiniteOutput(not_finite_message(f"The model `{loaded.name}`", "a short test text when it was loaded",
                                                 self.dtype_of(loaded), nonfinite_weights(model, skip=others))
                              + " It was not loaded.")

    def dtype_of(self, loaded: Loaded) -> torch.dtype:
        """The dtype `loaded` computes in (its first floating-point weight's)."""
        model = loaded.head if loaded.head is not None else self.model
        return next(p.dtype for p in model.parameters() if p.is_floating_point())

    @contextmanager
    def _busy(self):
        self.busy_since = time.monotonic()
        try:
            yield
        finally:
            self.busy_since = None

    def classify(self, name: str, texts: list[str], prompt: PromptConfig, labels: list[str], batch_size: int) -> torch.Tensor:
        with self.using(name) as loaded:
            if loaded.artifact is not None:  # texts as the model's training rows were cleaned (emotune.json)
                texts = clean_for_inference(texts, loaded.artifact.meta.get("cleaning"))
            if loaded.head is not None:  # the head reads the bare text: no prompt, labels from the head
                return head_probabilities(loaded.head, loaded.tokenizer, texts, loaded.artifact.max_length, batch_size)
            if loaded.artifact is None:  # the base with request-chosen labels: nothing worth keeping
                return score_label_probs(self.model, loaded.tokenizer, texts, prompt, labels, batch_size)
            # an adapter's scorer keeps the KV cache of its prompt head, so one request costs only its own text
            scorer = self.scorers.get(name)
            if scorer is None:
                scorer = self.scorers[name] = LabelScorer(self.model, loaded.tokenizer, prompt, labels)
            return scorer.log_probs(texts, batch_size).softmax(-1)


def _strip_adapter_layers(model: torch.nn.Module) -> None:
    """Put back the plain layers PEFT wrapped, in place (as `PeftModel.unload` does); also on a model a failed
    `PeftModel.from_pretrained` left half-wrapped, where there is no PeftModel to call `unload` on."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if hasattr(child, "unload_and_optionally_merge_module"):
                plain = child.unload_and_optionally_merge_module(merge=False, safe_merge=False, adapter_names=None)
                setattr(parent, child_name, plain)
            elif isinstance(child, BaseTunerLayer):
                setattr(parent, child_name, child.get_base_layer())
    model.__dict__.pop("peft_config", None)  # PEFT notes its config on the model it wraps


def _check_head(artifact: Artifact, shape: torch.Size, wanted: torch.Size) -> None:
    """A head adapter's trained `score` head [labels, hidden] must be the one its labels need over this base."""
    if shape == wanted:
        return
    if shape[1] != wanted[1]:
        raise UserError(f"Adapter `{artifact.name}`'s `score` head reads hidden states of size {shape[1]}, but this "
                        f"server's base model has {wanted[1]}: the adapter was trained on another base model. Serve it "
                        "from a server started with that base. It was not loaded.")
    raise UserError(f"Adapter `{artifact.name}`'s `score` head has {shape[0]} rows, one per label it was trained on, but "
                    f"its emotune.json lists {wanted[0]} labels: the file was edited or comes from another run. Restore "
                    "emotune.json (the labels in the order its run trained them), or re-export the run. It was not "
                    "loaded.")


SIZE_MISMATCH = re.compile(r"size mismatch for (\S+): copying a param with shape torch\.Size\((\[[^\]]*\])\) from "
                           r"checkpoint, the shape in current model is torch\.Size\((\[[^\]]*\])\)")


def _misfit(err: BaseException) -> str | None:
    """What PEFT found wrong with an adapter on this base, and what to do, in sentences; None for a failure that says
    nothing about the adapter's files (out of memory, a device error): that one stays the server's."""
    text = str(err)
    mismatches = SIZE_MISMATCH.findall(text) if isinstance(err, RuntimeError) else []
    if mismatches:  # load_state_dict names every tensor; the first one and a count are enough
        name, saved, here = mismatches[0]
        name = re.sub(r"^base_model\.model\.|\.emotune_[A-Za-z0-9_]+(?=\.weight$)", "", name)
        more = f", and {len(mismatches) - 1} more weights differ" if len(mismatches) > 1 else ""
        return (f"its weight `{name}` has shape {saved} in its file, {here} on this base{more}. It was trained on "
                "another base model (one its emotune.json or config.yaml does not name), or its adapter_config.json "
                "comes from another adapter: serve it from a server started with the base it was trained on, or "
                "export the adapter again from its run.")
    if isinstance(err, ValueError) and "not found in the base model" in text:  # PEFT's NoMatchingPeftModuleError
        named = re.search(r"\{([^}]*)\}", text)
        modules = sorted(m.strip(" '\"") for m in named.group(1).split(",")) if named else []
        which = f" (`{modules[0]}`{f' and {len(modules) - 1} more' if len(modules) > 1 else ''})" if modules else ""
        return (f"the layers it adapts{which} are not in this base model. It was trained on a model of another "
                "architecture: serve it from a server started with the base it was trained on.")
    if isinstance(err, ValueError) and "different peft types" in text:
        return (f"PEFT cannot hold it beside the adapters loaded already ({first_line(err)}). Serve it from a server "
                "of its own.")
    return None


def _tokenizer_fingerprint(folder: Path) -> str:
    digest = hashlib.sha1()
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            digest.update(name.encode() + b"\0" + (folder / name).read_bytes() + b"\0")
    return digest.hexdigest()


def check_base(artifact: Artifact, engine_source: str) -> None:
    """An adapter only fits the base it was trained on."""
    source = artifact.model_cfg.source
    same = source == engine_source or (Path(source).expanduser().exists() and Path(engine_source).expanduser().exists()
                                       and Path(source).expanduser().resolve() == Path(engine_source).expanduser().resolve())
    if not same:
        raise UserError(f"Adapter `{artifact.name}` was trained on base model `{source}`, but this server's base is "
                        f"`{engine_source}`. Serve it from a server started with that base.")


def build_engine(cfg: RunConfig, targets: list[str], fallback: Fallback | None = None) -> tuple[Engine, list[Artifact]]:
    artifacts = [find_artifact(t, fallback=fallback) for t in targets]
    names = [a.name for a in artifacts]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise UserError(f"Two adapters would both be named {duplicates}; the name is the run folder's name. "
                        "Serve one of them, or copy it to a folder with another name.")
    merged = [a for a in artifacts if a.merged]
    if merged and len(artifacts) > 1:
        raise UserError(f"{[a.name for a in merged]} {'is a merged model' if len(merged) == 1 else 'are merged models'}: "
                        "a whole model of its own, which adapters trained on the original base do not fit. Serve a "
                        "merged model alone (`emotune serve RUN/export/merged`), or the run folders' adapters together "
                        "over their base.")
    if merged:
        print(f"Loading merged model {merged[0].name} from {merged[0].path} ...", flush=True)
        engine = Engine(cfg.model, cfg.device, merged=merged[0])
        engine.check_finite(merged[0].name)
        print(f"Serving merged model {merged[0].name} ({describe(merged[0])})", flush=True)
        return engine, artifacts
    model_cfg = base_config(artifacts, cfg.model, cfg.device)
    for artifact in artifacts:
        check_base(artifact, model_cfg.source)
    print(f"Loading base model {model_cfg.source} ...", flush=True)
    engine = Engine(model_cfg, cfg.device)
    engine.check_finite(BASE_MODEL)
    for artifact in artifacts:
        engine.add_adapter(artifact)
        print(f"Loaded adapter {artifact.name} ({describe(artifact)}) from {artifact.path}", flush=True)
    return engine, artifacts


def base_config(artifacts: list[Artifact], default: ModelConfig, device: str) -> ModelConfig:
    """How to load the base of these adapters: the first one's `model` settings, and, when `model.dtype` is `auto` and
    every adapter was measured in one dtype, that dtype where this device computes in it (as `emotune predict` does)."""
    model_cfg = artifacts[0].model_cfg if artifacts else default
    measured = {a.measured_dtype for a in artifacts}
    if artifacts and model_cfg.dtype == "auto" and len(measured) == 1 and None not in measured:
        dtype = serving_dtype(model_cfg, device_mod.resolve_device(device), measured.pop())
        model_cfg = model_cfg.model_copy(update={"dtype": device_mod.dtype_name(dtype)})
    return model_cfg


def describe(artifact: Artifact) -> str:
    if artifact.has_head:
        return f"classification head, {len(artifact.labels)} labels"
    return f"{artifact.task}, free-text chat" if artifact.answers_freely else f"{len(artifact.labels)} labels"
