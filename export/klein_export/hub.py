"""Checkpoints named by their Hugging Face Hub id (`black-forest-labs/FLUX.2-klein-4B`), downloaded
with `huggingface_hub`: its cache (shared with diffusers and transformers), resumed downloads,
`HF_TOKEN` / `hf auth login`, `HF_HUB_OFFLINE` and `HF_ENDPOINT`. Only the files an export reads
are fetched: the configs, the tokenizer and the weights of the four components, not the variants
(`*.fp16.safetensors`) or other formats a repository may also hold."""

import json
import re
import sys
from pathlib import Path

from .errors import CheckpointError

#: `ORG/NAME`, as the Hub spells repository ids.
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")

#: What `Checkpoint` reads (checkpoint.py): model_index.json, every component's config and
#: weights (sharded ones with their index), the scheduler and the tokenizer; for FLUX.3
#: (flux3.py), the modular pipeline's index and the processor's files in `tokenizer/`.
ALLOW_PATTERNS = [
    "model_index.json",
    "modular_model_index.json",
    "scheduler/*.json",
    "tokenizer/*",
    *(f"{component}/*.json" for component in ("text_encoder", "transformer", "vae")),
    *(f"{component}/*.safetensors" for component in ("text_encoder", "transformer", "vae")),
]
#: Weight variants (`model.fp16.safetensors`) that diffusers loads only when asked.
IGNORE_PATTERNS = ["*/*.*.safetensors"]


def is_hub_id(text: str) -> bool:
    """A Hub id rather than a local path: `ORG/NAME` where no such file or folder exists."""
    return bool(HUB_ID.match(text)) and not Path(text).exists()


def resolve_checkpoint(text: str, revision: str | None = None, log=None) -> Path:
    """The local directory of checkpoint `text`: itself when it is a path; for a Hub id, its
    snapshot in the Hugging Face cache, downloaded first where needed. Errors say what to do."""
    if not is_hub_id(text):
        if revision is not None:
            raise CheckpointError(f"--revision {revision}: it goes with a Hub id (ORG/NAME), not a local checkpoint")
        return Path(text)
    log = log or _stderr
    at = f"{text}@{revision}" if revision else text
    log(f"klein-export: fetching {at} from the Hugging Face Hub (only the files the export reads)")
    folder = download(text, revision, ALLOW_PATTERNS, IGNORE_PATTERNS)
    log(f"klein-export: {at} is in {folder}")
    return folder


def _stderr(message):  # stderr: stdout is the bundle's path, which scripts read
    print(message, file=sys.stderr)


def download(text: str, revision: str | None, allow_patterns, ignore_patterns=None) -> Path:
    """`snapshot_download` of these files of the Hub repository `text`; the Hub's errors as
    CheckpointErrors that say what to do."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f"{text}@{revision}" if revision else text
    page = f"https://huggingface.co/{text}"
    try:
        return Path(
            snapshot_download(
                repo_id=text, revision=revision, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns
            )
        )
    except GatedRepoError:
        raise CheckpointError(
            f"{text} is a gated repository: accept its terms on {page} with your account, then log in "
            "(`hf auth login`) or set HF_TOKEN to a token of that account"
        ) from None
    except RevisionNotFoundError:
        raise CheckpointError(f"{text}: no revision {revision!r} (give a branch, tag or commit of {page})") from None
    except RepositoryNotFoundError:
        raise CheckpointError(
            f"{text}: no such local directory, and no such model repository on the Hub (or a private one: "
            "check the id, or log in with `hf auth login` or set HF_TOKEN)"
        ) from None
    except LocalEntryNotFoundError as error:
        raise CheckpointError(
            f"{at} is not in the Hugging Face cache, and the Hub cannot be reached (HF_HUB_OFFLINE, or no "
            f"connection): download it where the Hub is reachable, or give a local checkpoint directory ({error})"
        ) from None
    except HfHubHTTPError as error:
        raise CheckpointError(f"{at}: the Hub answered {error}") from None


def fetch_bundle(text: str, revision: str | None = None, log=None) -> Path | None:
    """For a Hub repository that holds a klein bundle (a `manifest.json` and no `model_index.json`
    at its root): its snapshot, every file the manifest lists downloaded and checked against the
    manifest's size and sha256. None for a repository that holds a checkpoint."""
    log = log or _stderr
    at = f"{text}@{revision}" if revision else text
    indexes = ["model_index.json", "modular_model_index.json"]
    probe = download(text, revision, ["manifest.json", *indexes])
    if not (probe / "manifest.json").is_file() or any((probe / index).is_file() for index in indexes):
        return None
    try:
        files = json.loads((probe / "manifest.json").read_text())["files"]
        names = [str(name) for name in files]
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{at}: its manifest.json is not a klein manifest with `files` ({error})") from None
    if any(name.startswith(("/", "..")) or "/" in name or "\\" in name for name in names):
        raise CheckpointError(f"{at}: its manifest lists a file outside the bundle's folder")
    log(f"klein-export: {at} holds a klein bundle: fetching its {len(names)} files")
    folder = download(text, revision, ["manifest.json", *names])
    from .manifest import file_entry

    for name in names:
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{at}: {name}, listed in its manifest, is not in the repository")
        got, want = file_entry(path), files[name]
        if (got["bytes"], got["sha256"]) != (want.get("bytes"), want.get("sha256")):
            raise CheckpointError(
                f"{at}: {name} does not match the manifest (sha256 {got['sha256']}, {got['bytes']} bytes; the "
                f"manifest says {want.get('sha256')}, {want.get('bytes')} bytes): the download is damaged or the "
                "repository is inconsistent; nothing was installed"
            )
    log(f"klein-export: {at}: every file matches its manifest's sha256")
    return folder
