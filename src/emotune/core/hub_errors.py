"""What a hub's refusal to download means for the user: a gated model, a token the hub refused, a name or revision it
does not have, a name it cannot hold. The hub clients' exceptions are read by class name and HTTP status (no hub
package is imported here); where this returns None the failure is the network's (offline, a timeout, a proxy) and
the caller says how to download elsewhere."""

from __future__ import annotations

import re

LOGIN = {"hf": "`hf auth login` or HF_TOKEN", "modelscope": "MODELSCOPE_API_TOKEN or `modelscope login`"}
SITE = {"hf": "https://huggingface.co/", "modelscope": "https://modelscope.cn/models/"}


HUB_PAGE = re.compile(r"(?:https?://)?(?:www\.)?(?:huggingface\.co|hf\.co|modelscope\.cn/models)/([^/@\s]+/[^/@\s]+)")


def hub_id_hint(source: str, field: str = "model.source") -> str:
    """How to write a source given as a hub page's address or as `ORG/NAME@REVISION`: the id, with the revision in
    its own field; "" for anything else."""
    page = HUB_PAGE.match(source)
    if page:
        hub = "modelscope:" if "modelscope" in source.split("/")[2 if "://" in source else 0] else ""
        return (f" It is a web address: write the id alone, {field}: {hub}{page.group(1)} (a branch, tag or commit goes "
                f"in {field.split('.')[0]}.revision).")
    if "@" in source and source.count("/") == 1:
        name, _, revision = source.rpartition("@")
        return f" Write {field}: {name} and {field.split('.')[0]}.revision: {revision}."
    parts = source.split("/")
    if len(parts) > 2 and all(parts) and not source.startswith((".", "~", "/")) and ":" not in source:
        repo, sub = "/".join(parts[:2]), "/".join(parts[2:])
        return (f" If `{repo}` is a hub repository and `{sub}` a folder in it: a source is a whole repository, so "
                f"download it (`hf download {repo} --local-dir models/{parts[1]}`) and set {field} to "
                f"models/{parts[1]}/{sub}.")
    return ""


def refused_download(err: Exception, hub: str, repo_id: str, field: str, revision: str | None) -> str | None:
    """The cause and the fix of a download of `repo_id` (read from config field `field`, e.g. `model.source`; its
    revision from the sibling `revision` field) the hub refused, or None where the hub was not reached or the cause
    is not known."""
    names = {cls.__name__ for cls in type(err).__mro__}
    status = getattr(getattr(err, "response", None), "status_code", None)
    section = field.split(".")[0]
    login = LOGIN.get(hub, LOGIN["hf"])
    site = SITE.get(hub, SITE["hf"]) + repo_id
    if "HFValidationError" in names:
        url = f" (write {hub}:{repo_id.lstrip('/')}, without `//`)" if repo_id.startswith("/") else ""
        return (f"`{repo_id}` is not a hub id the hub accepts (ORG/NAME of ASCII letters, digits, `-`, `_` and `.`, "
                f"without `--` or `..`){url}, and no such folder exists here. Fix {field}: a hub id such as "
                f"{'dair-ai/emotion' if field.startswith('data') else 'google/gemma-3-270m'}, or the path of a local "
                f"folder.{hub_id_hint(repo_id, field)}")
    if isinstance(err, ImportError) and getattr(err, "name", None) == "modelscope":
        return f"{field} `modelscope:{repo_id}` needs the `modelscope` package: pip install modelscope."
    if "GatedRepoError" in names:
        return (f"`{repo_id}` is a gated repository: its terms must be accepted once with your account on {site}, and "
                f"this machine logged in with that account ({login}). Then run the same command.")
    if "RevisionNotFoundError" in names:
        return (f"`{repo_id}` has no revision `{revision}`. Fix {section}.revision (a branch, tag or commit hash of it), "
                "or remove it for the default branch.")
    if status == 401 and "RepositoryNotFoundError" not in names:
        return f"The hub refused the token this machine is logged in with (401). Log in again ({login}), then run again."
    if "RepositoryNotFoundError" in names or status == 404:
        return (f"The hub has no repository `{repo_id}` this machine may read: check the spelling in {field}, or, if "
                f"it is private or gated, log in with an account that has access ({login}).")
    if status == 403:
        return f"The hub refused access to `{repo_id}` (403). Log in with an account that may read it ({login})."
    if status == 429:
        return ("The hub is limiting this machine's requests (429: rate limit). Wait a few minutes and run again; "
                f"logged in ({login}) the limit is higher.")
    return None
