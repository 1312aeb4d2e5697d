"""Checkpoints named by a Hugging Face repo id (`moonshotai/Kimi-K2.6`, `org/name@revision`).

A published Kimi checkpoint is ~555 GB, of which the vision tower and projector are ~0.9 GB. Resolving a repo id
fetches (or, offline, finds in the local Hugging Face cache) only `config.json`, `preprocessor_config.json`,
`model.safetensors.index.json` and the shards that the index says hold `vision_tower.*` / `mm_projector.*`
tensors, and returns the snapshot folder they sit in; `bivit.checkpoint.state_dict` then reads it like any local
directory. `HF_HUB_OFFLINE=1`, `HF_HUB_CACHE`, `HF_TOKEN` and the other `huggingface_hub` settings apply as
usual. A file that is neither cached nor downloadable raises CheckpointError with the command that fetches it.

An unreachable hub is found out at once: one request with connect and read timeouts of `TIMEOUT_S` seconds and
no retries (huggingface_hub retries a refused connection with backoff, about 25 s a file) decides whether the
hub answers. If it does not, the files come from the local cache alone (said once in the log), and a file the
cache lacks is a CheckpointError naming the hub, why it is unreachable, and the fix.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Optional

from ..errors import CheckpointError, ConfigError
from .preprocess_config import PREPROCESSOR_CONFIG
from .state_dict import INDEX, vision_weight_map

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Seconds to connect to the hub, and then to wait for its answer, before it counts as unreachable.
TIMEOUT_S = 5.0
log = logging.getLogger("bivit")


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


def check_model(model: str | os.PathLike | None, revision: Optional[str] = None) -> None:
    """The cheap checks of a `model` argument, before anything is read: None (the demo model), an existing
    directory, or a repo id; ConfigError naming it otherwise (an existing file; a path that does not exist)."""
    if model is None or str(model) == "demo":
        return
    path = Path(model)
    if path.is_dir():
        return
    if path.exists():
        raise ConfigError(f"{path}: not a directory; a model is a checkpoint directory (config.json and the "
                          "safetensors shards) or a hub repo id (org/name[@rev]); without one, the demo model runs")
    if parse_repo_ref(model, revision) is None:
        raise ConfigError(f"{path}: does not exist; a model is a checkpoint directory or a hub repo id "
                          "(org/name[@rev]); without one, the demo model runs")


def _hub(model: str):
    try:
        import huggingface_hub.constants, huggingface_hub.errors  # optional: the hub extra
    except ImportError:
        raise ConfigError(f"{model}: does not exist as a local directory, and reading it as a hub repo id needs "
                          "huggingface_hub: pip install 'bivit[hub]'") from None
    return huggingface_hub


def unreachable(endpoint: str, repo: str, revision: Optional[str]) -> Optional[str]:
    """Why the hub at `endpoint` does not answer within TIMEOUT_S (connect, then read), or None when it answers
    at all (any HTTP status: a missing or gated repo is huggingface_hub's to report)."""
    import httpx  # httpx is slow to import: only a repo id pays it (bivit.checkpoint.weights imports this)

    url = f"{endpoint}/{repo}/resolve/{revision or 'main'}/config.json"
    try:
        httpx.head(url, timeout=httpx.Timeout(TIMEOUT_S), follow_redirects=False)
    except httpx.ConnectTimeout:
        return f"no connection within {TIMEOUT_S:g} s"
    except httpx.TimeoutException:
        return f"connected, but no answer within {TIMEOUT_S:g} s"
    except (httpx.HTTPError, OSError, ValueError) as e:
        return str(e) or type(e).__name__
    return None


class _Fetcher:
    def __init__(self, repo: str, revision: Optional[str], cache_dir: Optional[str]) -> None:
        self.label = repo + (f"@{revision}" if revision else "")
        self.hub = _hub(self.label)
        self.repo, self.revision, self.cache_dir = repo, revision, cache_dir
        constants = self.hub.constants
        self.endpoint = constants.ENDPOINT
        # Offline by choice (HF_HUB_OFFLINE) or because the hub does not answer: the local cache alone.
        self.why_offline = None if constants.HF_HUB_OFFLINE else unreachable(self.endpoint, repo, revision)

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
        errors = self.hub.errors
        try:
            return Path(self.hub.hf_hub_download(self.repo, filename, revision=self.revision,
                                                 cache_dir=self.cache_dir, etag_timeout=TIMEOUT_S,
                                                 local_files_only=self.why_offline is not None))
        except (errors.RepositoryNotFoundError, errors.GatedRepoError) as e:
            raise CheckpointError(f"{self.label}: does not exist as a local directory, and is no accessible hub "
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
        them = "them" if len(missing) > 1 else "it"
        why = (f"the Hugging Face hub at {f.endpoint} does not answer ({f.why_offline}), and "
               if f.why_offline else "")
        fix = (f"check the network, a proxy (HTTPS_PROXY) or HF_ENDPOINT, or fetch {them} where the hub answers "
               "with" if f.why_offline else f"fetch {them} with")
        raise CheckpointError(  # (parse_repo_ref read it as a repo id: no local directory has its name)
            f"{f.label}: no local directory of that name; {why}{', '.join(missing)} not in the local Hugging Face cache"
            + ("" if f.why_offline else " and not downloadable here (offline or no connection)")
            + f"; {fix}: {f.command(missing)}"
            + ("" if shards or INDEX not in missing else ", then the vision shards the index names"))
    if f.why_offline:
        log.warning("bivit: the Hugging Face hub at %s does not answer (%s); using the files of %s in the local "
                    "cache (HF_HUB_OFFLINE=1 skips this check)", f.endpoint, f.why_offline, f.label)
    return config.parent
