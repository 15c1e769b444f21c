"""Hugging Face Hub ids for :func:`slotinfer.load`: ``"org/name"``, ``"org/name:file.gguf"``, ``revision=``.

A string that names no local path but has the shape of a repo id is resolved by
``huggingface_hub`` into its standard cache (``$HF_HOME/hub``, or ``HF_HUB_CACHE``), and
``load`` goes on with the local snapshot folder (or file).  Only the files slotinfer
reads are fetched: the Hugging Face layout (config, safetensors, tokenizer and
generation files), or the repo's one GGUF file.  Offline (``HF_HUB_OFFLINE=1``, or no
network) the cached snapshot of the revision loads as it is; an id that has none is a
:class:`ModelNotFoundError` that says how to get the files.

    >>> slotinfer.load("HuggingFaceTB/SmolLM2-135M-Instruct")
    >>> slotinfer.load("HuggingFaceTB/SmolLM2-135M-Instruct", revision="main")
    >>> slotinfer.load("bartowski/SmolLM2-135M-Instruct-GGUF:SmolLM2-135M-Instruct-Q8_0.gguf")
"""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

from ._files import where_missing
from .errors import InvalidRequestError, ModelNotFoundError

# The Hub's own rule for a name: letters, digits, "-", "_", ".", 1 to 96 characters, neither
# starting nor ending with "-" or ".", and no "--" or "..".  A part that breaks it is a path.
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_SPEC = re.compile(rf"(?P<repo>{_PART}/{_PART})(?::(?P<file>[^:\\]+))?")

# The Hugging Face layout as the loader and the tokenizer read it: everything but the weights.
LAYOUT_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json")
_INDEX = "model.safetensors.index.json"


def split_id(text) -> tuple[str, str | None] | None:
    """``(repo_id, file or None)`` when ``text`` has the shape of a repo id, else None.

        >>> split_id("HuggingFaceTB/SmolLM2-135M-Instruct:model.gguf")
        ('HuggingFaceTB/SmolLM2-135M-Instruct', 'model.gguf')
        >>> split_id("./models/qwen3") is None
        True
    """
    if not isinstance(text, str):  # a Path object is always a local path
        return None
    m = _SPEC.fullmatch(text)
    if m is None or "--" in m["repo"] or ".." in m["repo"]:
        return None
    file = m["file"]
    if file is not None and (file.startswith("/") or ".." in file.split("/")):
        return None
    return m["repo"], file


def local_path(path, revision: str | None = None):
    """``path`` itself when it exists or is not a repo id; else the cached (or fetched) snapshot of the id."""
    parts = None if Path(path).expanduser().exists() else split_id(path)
    if parts is not None and parts[1] is None and parts[0].lower().endswith(".gguf"):
        parts = None  # dir/name.gguf is a GGUF file's path (a repo's GGUF file is named as org/name:file.gguf)
    if parts is not None and parts[1] is None:
        _check_not_a_local_typo(parts[0])
    if parts is None:
        if revision is not None:
            raise InvalidRequestError(
                f"revision={revision!r} applies to Hugging Face repo ids (org/name), but {str(path)!r} is a local "
                "path; drop revision=, or pass the repo id")
        return path
    if revision is not None and (not isinstance(revision, str) or not revision):
        raise InvalidRequestError(f"revision must be a branch, tag or commit hash (a non-empty str), got {revision!r}")
    return resolve(*parts, revision=revision)


def _check_not_a_local_typo(repo_id: str):
    """``models/x`` where ``models`` is a folder here reads as a local path whose entry is missing (a
    typo), not as a repo the hub would be asked for."""
    org, name = repo_id.split("/")
    if not Path(org).is_dir():
        return
    try:
        entries = sorted(p.name for p in Path(org).iterdir() if not p.name.startswith("."))
    except OSError:
        entries = []
    shown = ", ".join(entries[:8]) + (f" and {len(entries) - 8} more" if len(entries) > 8 else "")
    raise ModelNotFoundError(
        f"{repo_id!r} does not exist: {org}/ is a folder here, so {repo_id!r} is read as a local path, not a "
        f"Hugging Face repo id; {org}/ holds: {shown or 'nothing'} (to load the repo of that name, run from a folder "
        f"without a {org}/)")


def resolve(repo_id: str, file: str | None = None, *, revision: str | None = None) -> Path:
    """The local path of ``repo_id`` (its snapshot folder, or ``file`` in it) at ``revision``, from
    the cache or fetched into it."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    if file is not None and not file.endswith(".gguf"):
        raise InvalidRequestError(
            f"{repo_id}:{file}: the name after ':' picks one GGUF file of the repo (a .gguf); "
            f"for a safetensors model pass the repo id alone ({repo_id!r})")
    unreachable, listing = None, None  # why the hub did not answer, when it did not; the repo's files
    try:
        try:  # model_info asks once, where a download or listing call retries for ~20 s without network
            info = HfApi().model_info(repo_id, revision=revision)
            listing = [s.rfilename for s in info.siblings or []]
        except Exception as e:
            if _refused(e):
                raise
            # No answer from the hub: the cache alone decides, and says why if it cannot.
            unreachable = e
        if file is not None:
            if listing is not None and file not in listing:
                ggufs = ", ".join(sorted(f for f in listing if f.endswith(".gguf"))) or "none"
                raise ModelNotFoundError(f"the Hugging Face repo {repo_id!r} has no file {file!r}; "
                                         f"its GGUF files: {ggufs}")
            return Path(hf_hub_download(repo_id, file, revision=revision, local_files_only=unreachable is not None))
        if unreachable is not None:
            listing = _cached_listing(repo_id, revision)
        # The snapshot holds what an earlier load fetched, a part of the repo's listing: ask for that part,
        # or huggingface_hub would call a snapshot without the repo's other files incomplete.
        wanted = None if listing is None else _wanted_files(repo_id, revision, listing, unreachable is not None)
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=wanted,
                                        local_files_only=unreachable is not None))
        return folder / wanted[0] if wanted and wanted[0].endswith(".gguf") else folder
    except Exception as e:
        # slotinfer's own errors, and a cache that cannot be written (permissions, a full disk), say it themselves
        if isinstance(e, (ModelNotFoundError, InvalidRequestError, PermissionError)) or \
                getattr(e, "errno", None) == errno.ENOSPC:
            raise
        raise _not_found(repo_id, file, revision, e, unreachable or e.__cause__ or e) from None


def _wanted_files(repo_id: str, revision: str | None, listing: list[str], cached: bool) -> list[str]:
    """The files of the repo's listing that ``load`` reads: the HF layout's, or its only GGUF (then
    ``load`` gets that file's path, wherever in the repo it lies)."""
    root = [f for f in listing if "/" not in f]
    weights = [f for f in root if f.endswith(".safetensors")]
    if _INDEX in root:  # read only the shards the index names, not every copy a repo keeps
        from huggingface_hub import hf_hub_download

        with open(hf_hub_download(repo_id, _INDEX, revision=revision, local_files_only=cached), encoding="utf-8") as fh:
            weight_map = json.load(fh).get("weight_map") or {}
        weights = sorted({f for f in weight_map.values() if isinstance(f, str)})
    if "config.json" in root and weights:
        return [f for f in LAYOUT_FILES if f in root] + weights
    ggufs = sorted(f for f in listing if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return ggufs
    where = f"{repo_id}" + (f" (revision {revision})" if revision else "")
    if ggufs:
        shown = ", ".join(ggufs[:8]) + (f" (and {len(ggufs) - 8} more)" if len(ggufs) > 8 else "")
        raise ModelNotFoundError(
            f"{where} holds {len(ggufs)} GGUF files and no safetensors model: {shown}; pick one as "
            f"'{repo_id}:{ggufs[0]}'")
    raise ModelNotFoundError(
        f"{where} holds neither config.json with *.safetensors weights nor a .gguf file, so slotinfer has "
        "nothing to load from it; pick a repo that publishes one of these (see docs/models.md)")


def _cached_listing(repo_id: str, revision: str | None) -> list[str] | None:
    """The repo's file listing as an earlier download cached it (recent huggingface_hub releases keep one), or None."""
    import huggingface_hub

    try:
        return [f.path for f in huggingface_hub.get_cached_repo_tree(repo_id, revision=revision)]
    except Exception:  # no listing cached (or a release without one): the snapshot folder alone decides
        return None


def _refused(e: Exception) -> bool:
    """The hub answered and said no (no such repo or revision, or no access): no cache may stand in."""
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    return isinstance(e, (RepositoryNotFoundError, RevisionNotFoundError))


def _not_found(repo_id: str, file: str | None, revision: str | None, e: Exception,
               reason: BaseException) -> ModelNotFoundError:
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    spec = repo_id + (f":{file}" if file else "")
    at = f" at revision {revision!r}" if revision else ""
    get = f"`hf download {repo_id}{' ' + file if file else ''}{' --revision ' + revision if revision else ''}`"
    if isinstance(e, GatedRepoError):
        return ModelNotFoundError(
            f"{spec!r} is a gated or private repo on the Hugging Face Hub: accept its terms on its page and log "
            "in (`hf auth login`, or set HF_TOKEN), then load it again")
    local = f"{spec!r} names no local file or folder ({where_missing(spec)})"
    if isinstance(e, RepositoryNotFoundError):
        return ModelNotFoundError(
            f"{local}, nor a model repo on the Hugging Face Hub (or the repo is private: log in with "
            "`hf auth login`); check the spelling of the folder or the repo id")
    if isinstance(e, RevisionNotFoundError):
        return ModelNotFoundError(f"the Hugging Face repo {repo_id!r} has no revision {revision!r}; "
                                  "pass an existing branch, tag or commit hash")
    why = ("HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE
           else f"{type(reason).__name__}: {str(reason).splitlines()[0] if str(reason) else 'no answer'}")
    cache = os.path.join(constants.HF_HUB_CACHE, "models--" + repo_id.replace("/", "--"))
    return ModelNotFoundError(
        f"{local}; read as a Hugging Face repo id{at}, it could not be loaded: the hub "
        f"could not be reached ({why}) and the cache holds no complete copy of it ({cache}). Get the files "
        f"where the hub is reachable with {get} (into the same cache, or copy that folder here), or download "
        "them anywhere and pass the local folder")
