"""`emotune push RUN --to hf:ORG/NAME | modelscope:ORG/NAME [--merged] [--private] [--dry-run DIR]`.

The folder uploaded is the adapter (PEFT files, tokenizer, emotune.json) or, with --merged, the merged model
(`emotune export --merge`'s merged/, made here when the run has none), plus README.md (the model card,
emotune.deploy.model_card) and emotune_config.yaml (the run's resolved config). The token comes from HF_TOKEN or
the hub's stored login (`hf auth login`), or from MODELSCOPE_API_TOKEN; it is handed to the client and never
printed or written. `hub_client` is the one place a real HfApi / ModelScope HubApi is made.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from emotune.core.errors import UserError, first_line

HUBS = {"hf": "the Hugging Face hub", "modelscope": "ModelScope"}


def parse_destination(to: str) -> tuple[str, str]:
    """(hub, repo id) of `--to`, the repo id checked as the hubs check it (also for a dry run, which never asks them):
    letters, digits, `-`, `_` and `.`, not starting or ending with `-` or `.`, no `--` or `..`, at most 96 a part."""
    hub, _, repo_id = to.partition(":")
    if hub not in HUBS or repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise UserError(f"--to `{to}` is not a destination. Write hf:ORG/NAME (Hugging Face) or modelscope:ORG/NAME.")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise UserError(f"--to `{to}`: `{repo_id}` is not a repository name {HUBS[hub]} accepts. ORG and NAME may hold "
                        "ASCII letters, digits, `-`, `_` and `.`, must not start or end with `-` or `.`, must not hold "
                        "`--` or `..`, and have at most 96 characters each; e.g. hf:my-org/gemma3-emotion.") from None
    return hub, repo_id


def hub_token(hub: str) -> str | None:
    if hub == "modelscope":
        return os.environ.get("MODELSCOPE_API_TOKEN") or None
    if os.environ.get("HF_TOKEN"):
        return os.environ["HF_TOKEN"]
    from huggingface_hub import get_token

    return get_token()


class _ModelScopeClient:
    """ModelScope's HubApi behind the two calls push makes."""

    def __init__(self, token: str):
        try:
            from modelscope.hub.api import HubApi
        except ImportError:
            raise UserError("Pushing to ModelScope needs the `modelscope` package: pip install 'emotune[modelscope]'.") from None
        self.api = HubApi()
        self.api.login(token)

    def create_repo(self, repo_id: str, private: bool, exist_ok: bool = True) -> None:
        self.api.create_repo(repo_id, visibility="private" if private else "public", exist_ok=exist_ok)

    def upload_folder(self, folder_path: str, repo_id: str, commit_message: str) -> None:
        self.api.upload_folder(repo_id=repo_id, folder_path=folder_path, commit_message=commit_message)


class _HfClient:
    def __init__(self, token: str):
        from huggingface_hub import HfApi

        self.api = HfApi(token=token)

    def create_repo(self, repo_id: str, private: bool, exist_ok: bool = True) -> None:
        self.api.create_repo(repo_id, private=private, exist_ok=exist_ok, repo_type="model")
        # the hub ignores `private` for a repository that exists: --private must not upload into a public one
        if private and not self.api.repo_info(repo_id, repo_type="model").private:
            raise UserError(f"--private: the repository {repo_id} already exists on the Hugging Face hub and is public "
                            "(the hub keeps an existing repository's visibility). Nothing was uploaded. Make it private "
                            f"in its settings (https://huggingface.co/{repo_id}/settings), or push to a new name.")

    def upload_folder(self, folder_path: str, repo_id: str, commit_message: str) -> None:
        self.api.upload_folder(folder_path=folder_path, repo_id=repo_id, commit_message=commit_message, repo_type="model")


def hub_client(hub: str, token: str):
    """The client that uploads: create_repo(repo_id, private, exist_ok) and upload_folder(folder_path, repo_id,
    commit_message). Tests replace this function with a fake."""
    return _ModelScopeClient(token) if hub == "modelscope" else _HfClient(token)


def push(run_dir: str | Path, to: str, merged: bool = False, private: bool = False, dry_run: str | None = None) -> Path | None:
    from emotune.model.artifacts import find_artifact

    hub, repo_id = parse_destination(to)
    artifact = find_artifact(run_dir)
    from emotune.core.rundir import RunDir

    # a train.finetuning full / freeze run: its model/ is the merged model, uploaded as such (there is no adapter)
    whole = artifact.merged and artifact.path.resolve() == RunDir(run_dir).model.resolve()
    merged = merged or whole
    if artifact.merged and not whole:
        raise UserError(f"`{run_dir}` is a merged model folder; push reads the run folder (its adapter, config and "
                        "comparison.json). Point at runs/<name> and add --merged to upload the merged model.")
    token = None
    if dry_run is None:
        token = hub_token(hub)
        if not token:
            where = "MODELSCOPE_API_TOKEN" if hub == "modelscope" else "HF_TOKEN, or log in with `hf auth login`"
            raise UserError(f"No token for {HUBS[hub]}: set {where}. Nothing was uploaded. `--dry-run DIR` writes the "
                            "folder that would be uploaded without a token.")
    if dry_run is not None:
        target = Path(dry_run).expanduser()
        if target.resolve().is_relative_to(artifact.path.resolve()):
            raise UserError(f"--dry-run folder `{target}` is inside the folder being uploaded ({artifact.path}), which "
                            "would then hold a copy of itself. Give a new folder outside it.")
        if target.exists() and (not target.is_dir() or any(target.iterdir())):
            raise UserError(f"--dry-run folder `{target}` is {'not empty' if target.is_dir() else 'a file'}. Give a new "
                            "or empty folder.")
        from emotune.core.rundir import check_folder_path

        check_folder_path(target, "the --dry-run folder", "Give --dry-run a new folder where you can write.")
        _assemble(artifact, Path(run_dir), target, hub, repo_id, merged)
        print(f"Dry run: the folder that would be uploaded to {HUBS[hub]} as {repo_id} is {target}", flush=True)
        return target
    with tempfile.TemporaryDirectory(prefix="emotune-push-") as staging:
        folder = _assemble(artifact, Path(run_dir), Path(staging) / "upload", hub, repo_id, merged)
        what = "merged model" if merged else "LoRA adapter"
        created = False
        try:
            client = hub_client(hub, token)  # ModelScope's client logs in here: a refused token fails at once
            client.create_repo(repo_id, private=private, exist_ok=True)
            created = True
            client.upload_folder(folder_path=str(folder), repo_id=repo_id, commit_message=f"emotune: {artifact.name} ({what})")
        except UserError:
            raise
        except Exception as err:  # the hub's answer (auth, permission, rate limit) or no answer (network, offline)
            raise UserError(upload_failure(hub, repo_id, err, created, token)) from None
    print(f"Uploaded {artifact.name} ({'merged model' if merged else 'adapter'}) to {HUBS[hub]}: {repo_id}", flush=True)
    return None


def upload_failure(hub: str, repo_id: str, err: Exception, created: bool, token: str | None) -> str:
    """Why an upload to `repo_id` failed and what to do, from the client's exception (an HTTP status where the hub
    answered); the token is never part of it. Nothing in the run folder was changed."""
    status = getattr(getattr(err, "response", None), "status_code", None)
    owner = repo_id.split("/")[0]
    login = "MODELSCOPE_API_TOKEN" if hub == "modelscope" else "HF_TOKEN (or log in again with `hf auth login`)"
    if status == 401:
        fix = f"The hub refused the token (401: wrong, revoked or expired). Set a valid token with write access in {login}."
    elif status == 403:
        fix = (f"The token may not create or write `{repo_id}` (403): a read-only token, or `{owner}` is an organization "
               f"it has no write role in. Use a token with write access to `{owner}` ({login}), or push to your own "
               "name (--to ...:YOURNAME/NAME).")
    elif status == 404:
        fix = f"The hub has no user or organization `{owner}` this token may use (404). Check ORG in --to."
    elif status == 429:
        fix = "The hub is limiting this account's requests (429: rate limit). Wait a few minutes and run the same command."
    elif isinstance(status, int) and status >= 500:
        fix = f"The hub failed to answer ({status}). Try again later."
    elif isinstance(status, int):
        fix = f"The hub refused the request ({status}). Check --to and the token."
    else:
        offline = ", or HF_HUB_OFFLINE set" if hub == "hf" else ""  # huggingface_hub's switch; ModelScope has none
        fix = (f"{HUBS[hub]} could not be reached (no network, a proxy, a timeout{offline}). Check the connection and "
               "run the same command again.")
    detail = first_line(err).replace(token, "***") if token else first_line(err)
    where = (f"The repository {repo_id} exists, but the upload did not finish; running the same command again uploads "
             "the whole folder." if created else "Nothing was uploaded.")
    return (f"Could not upload to {HUBS[hub]} as {repo_id} ({type(err).__name__}: {detail}). {fix} {where} The run "
            "folder is unchanged.")


def _assemble(artifact, run_dir: Path, target: Path, hub: str, repo_id: str, merged: bool) -> Path:
    from emotune.core.rundir import RunDir
    from emotune.deploy.model_card import model_card

    run = RunDir(run_dir)
    if artifact.merged:  # a full / freeze run's model/, already the whole model
        shutil.copytree(artifact.path, target, dirs_exist_ok=True)
    elif merged:
        source = run.export / "merged"
        if (source / "config.json").is_file():
            shutil.copytree(source, target, dirs_exist_ok=True)
        else:
            from emotune.deploy.export import merge_adapter

            print("No merged model in the run's export/; merging the adapter into the base (once) ...", flush=True)
            merge_adapter(artifact, target)
    else:
        shutil.copytree(artifact.path, target, dirs_exist_ok=True)
    config_text = run.config.read_text(encoding="utf-8") if run.config.is_file() else None
    if config_text:
        (target / "emotune_config.yaml").write_text(config_text, encoding="utf-8")
    card = model_card(artifact, run, hub, repo_id, merged, config_text)
    (target / "README.md").write_text(card, encoding="utf-8")
    return target
