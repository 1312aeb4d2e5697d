"""Checkpoints named by a Hugging Face repo id (`moonshotai/Kimi-K2.6`, `org/name@revision`).

A published Kimi checkpoint is ~555 GB, of which the vision tower and projector are ~0.9 GB. Resolving a repo id
fetches (or, offline, finds in the local Hugging Face cache) only `config.json`, `preprocessor_config.json`,
`model.safetensors.index.json` and the shards that the index says hold `vision_tower.*` / `mm_projector.*`
tensors, and returns the snapshot folder they sit in; `bivit.checkpoint` then reads it like any local
directory. `HF_HUB_OFFLINE=1`, `HF_HUB_CACHE`, `HF_TOKEN` and the other `huggingface_hub` settings apply as
usual. A file that is neither cached nor downloadable raises CheckpointError with the command that fetches it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

from .checkpoint import INDEX, vision_weight_map
from .errors import CheckpointError, ConfigError
from .preprocess_config import PREPROCESSOR_CONFIG

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def parse_repo_ref(model: str | os.PathLike, revision: Optional[str] = None) -> Optional[tuple[str, Optional[str]]]:
    """`org/name` or `org/name@rev` -> (repo id, revision); None when `model` is a local path or not a repo id.

    An existing local directory always wins over a repo id of the same spelling.
    """
    text = os.fspath(model)
    if Path(text).exists():
        return None
    repo, _, rev = text.partition("@")
    if not _REPO_ID.fullmatch(repo) or ".." in repo:
        return None
    if rev and revision and rev != revision:
        raise ConfigError(f"model {text!r} names revision {rev!r} but option 'revision' = {revision!r}")
    return repo, (rev or revision or None)


def _hub():
    try:
        import huggingface_hub
    except ImportError:
        raise ConfigError('a hub repo id needs huggingface_hub: pip install "bivit[hub]"') from None
    return huggingface_hub


class _Fetcher:
    def __init__(self, repo: str, revision: Optional[str], cache_dir: Optional[str]) -> None:
        self.hub = _hub()
        self.repo, self.revision, self.cache_dir = repo, revision, cache_dir
        self.label = repo + (f"@{revision}" if revision else "")

    def command(self, files: list[str]) -> str:
        rev = f" --revision {self.revision}" if self.revision else ""
        return f"hf download {self.repo} {' '.join(files)}{rev}"

    def cached_absent(self, filename: str) -> bool:
        """True when the cache records that the repo has no such file (a 404 seen online earlier)."""
        found = self.hub.try_to_load_from_cache(self.repo, filename, cache_dir=self.cache_dir,
                                                revision=self.revision)
        return found is self.hub._CACHED_NO_EXIST

    def get(self, filename: str, optional: bool = False) -> Optional[Path]:
        """Local path of `filename` (downloaded if needed and allowed); None if the repo has no such optional file."""
        from huggingface_hub import errors

        try:
            return Path(self.hub.hf_hub_download(self.repo, filename, revision=self.revision,
                                                 cache_dir=self.cache_dir))
        except (errors.RepositoryNotFoundError, errors.GatedRepoError) as e:
            raise CheckpointError(f"{self.label}: no local directory of that name, and no accessible hub "
                                  f"repository ({type(e).__name__}); check the path, the repo id and HF_TOKEN") from None
        except errors.RevisionNotFoundError:
            raise CheckpointError(f"{self.label}: revision {self.revision!r} not found") from None
        except errors.LocalEntryNotFoundError:  # (a subclass of EntryNotFoundError: caught first)
            if optional and self.cached_absent(filename):
                return None
            raise _Missing([filename]) from None
        except errors.EntryNotFoundError:
            if optional:
                return None
            raise CheckpointError(f"{self.label}: the repository has no {filename}") from None
        except (errors.HfHubHTTPError, OSError, ValueError) as e:
            raise CheckpointError(f"{self.label}: fetching {filename} failed ({e})") from None


class _Missing(Exception):
    def __init__(self, files: list[str]) -> None:
        self.files = files


def resolve(model: str, revision: Optional[str] = None, *, cache_dir: Optional[str] = None) -> Path:
    """A repo id -> the local snapshot folder holding what the vision encoder needs (see the module doc)."""
    ref = parse_repo_ref(model, revision)
    if ref is None:
        raise ConfigError(f"{model!r} is neither a local checkpoint directory nor a hub repo id (org/name[@rev])")
    f = _Fetcher(*ref, cache_dir)
    missing: list[str] = []

    def get(filename: str, optional: bool = False) -> Optional[Path]:
        try:
            return f.get(filename, optional)
        except _Missing as m:
            missing.extend(m.files)
            return None

    config = get("config.json")
    get(PREPROCESSOR_CONFIG, optional=True)
    index = get(INDEX, optional=True)
    if index is not None:
        shards = sorted(set(vision_weight_map(index).values()))
        if not shards:
            raise CheckpointError(f"{f.label}: {INDEX} lists no vision_tower.* / mm_projector.* tensors")
    elif INDEX in missing:
        shards = []  # which shards are needed is known only from the index
    else:
        shards = ["model.safetensors"]  # an unsharded checkpoint
    for shard in shards:
        get(shard)
    if missing:
        raise CheckpointError(
            f"{f.label}: {', '.join(missing)} not in the local Hugging Face cache and not downloadable here "
            f"(offline or no connection); fetch {'them' if len(missing) > 1 else 'it'} with: {f.command(missing)}"
            + ("" if shards or INDEX not in missing else ", then the vision shards the index names"))
    return config.parent
