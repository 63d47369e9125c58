"""A Hugging Face Hub id (ORG/NAME) as a model: its config.json, from the local cache first.

The cache is huggingface_hub's (huggingface_hub/constants.py): HF_HUB_CACHE, else the older
HUGGINGFACE_HUB_CACHE, else HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub;
a model's files live under models--ORG--NAME/snapshots/<commit>/, the commit a revision names in
refs/<revision>. Reading the cache needs nothing installed. Only where the cache lacks the file, and
HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is not set, is config.json downloaded, alone (never the weights),
through huggingface_hub (`pip install 'memcalc[hub]'`), which keeps it in the same cache.
"""

from __future__ import annotations

import logging
import os
import re
from contextlib import contextmanager
from pathlib import Path

from memcalc.errors import InputError

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # ORG/NAME as the Hub spells repo ids
TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's ENV_VARS_TRUE_VALUES


def is_hub_id(text: str) -> bool:
    """ORG/NAME, and not a file or folder here (a path with one slash is read as the path, as is a .json)."""
    return (bool(HUB_ID.fullmatch(text)) and ".." not in text and not text.lower().endswith(".json")
            and not Path(text).exists())  # fmt: skip


def cache_dir() -> Path:
    """huggingface_hub's cache folder, from the same variables in the same order."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.path.expandvars(os.environ["HF_HUB_CACHE"])).expanduser()
    if os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(os.environ["HUGGINGFACE_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.path.expandvars(os.environ["HF_HOME"])).expanduser() / "hub"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "huggingface" / "hub"


def offline() -> bool:
    return any((os.environ.get(v) or "").upper() in TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def cached_repos() -> list[str]:
    """The model ids (ORG/NAME) whose main revision's config.json is in the cache, sorted."""
    try:
        folders = sorted(p.name for p in cache_dir().iterdir() if p.name.startswith("models--"))
    except OSError:
        return []
    ids = [name.removeprefix("models--").replace("--", "/", 1) for name in folders]
    return [i for i in ids if HUB_ID.fullmatch(i) and cached_config(i) is not None]


def cached_config(repo_id: str, revision: str = "main") -> Path | None:
    """config.json of the snapshot refs/<revision> names (or the snapshot <revision> is), if cached."""
    repo = cache_dir() / ("models--" + repo_id.replace("/", "--"))
    ref = repo / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    path = repo / "snapshots" / commit / "config.json"
    return path if re.fullmatch(r"[\w.-]+", commit) and path.is_file() else None


def hub_config(repo_id: str) -> Path:
    """The path of the Hub model's config.json: cached, or downloaded now; else one line saying what to do."""
    path = cached_config(repo_id)
    if path is not None:
        return path
    if offline():
        raise InputError(f"{repo_id}: no config.json in the Hugging Face cache ({cache_dir()}) and HF_HUB_OFFLINE "
                         "is set: download it once online, or pass --config PATH")  # fmt: skip
    return downloaded(repo_id)


def downloaded(repo_id: str) -> Path:
    """config.json alone, through huggingface_hub into its cache; asked once, without retries (answered)."""
    try:
        from huggingface_hub import constants, hf_hub_download
        from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError:
        raise InputError(f"{repo_id} is not in the Hugging Face cache ({cache_dir()}); to download its config.json: "
                         "pip install 'memcalc[hub]', or pass --config PATH") from None  # fmt: skip
    unreachable = (f"{repo_id}: the Hugging Face Hub ({constants.ENDPOINT}) could not be reached ({{}}) and the cache "
                   f"({cache_dir()}) has no config.json for it: retry online, or pass --config PATH")  # fmt: skip
    try:
        answered(repo_id)
        with quiet("huggingface_hub"):
            return Path(hf_hub_download(repo_id, "config.json", etag_timeout=TIMEOUT_S))
    except NoAnswer as e:
        raise InputError(unreachable.format(e)) from None
    except GatedRepoError:
        raise InputError(f"{repo_id} is gated on the Hub: accept its licence on its page and log in "
                         "(`hf auth login`), or pass --config PATH") from None  # fmt: skip
    except RepositoryNotFoundError:
        raise InputError(f"{repo_id}: no such model on the Hugging Face Hub (or it is private: log in with "
                         "`hf auth login`)") from None  # fmt: skip
    except LocalEntryNotFoundError:  # what hf_hub_download raises when the Hub cannot be reached
        raise InputError(unreachable.format("no answer")) from None
    except Exception as e:  # a proxy, a repo without config.json: whatever else huggingface_hub raises
        reason = type(e).__name__ + (f": {str(e).split('. ')[0][:120]}" if str(e).strip() else "")
        raise InputError(f"{repo_id}: could not fetch config.json from the Hub ({reason}); pass --config PATH") from None


TIMEOUT_S = 5  # seconds for the Hub to answer; huggingface_hub's default is 10 (constants.DEFAULT_ETAG_TIMEOUT)


class NoAnswer(Exception):
    """The Hub did not answer at all (no connection, no name, a timeout); its text is the reason."""


def answered(repo_id: str) -> None:
    """One HEAD of the config's URL, with no retry, as hf_hub_download's first is: where it gets no answer,
    hf_hub_download asks again with back-off (1, 2, 4, 8, 8 s: huggingface_hub utils/_http.py http_backoff,
    called with retry_on_errors=True by file_download._hf_hub_download_to_cache_dir), logging each try.
    An answer that refuses (gated, missing: an HTTP error) is raised as it is, for downloaded to word."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, HFValidationError

    try:
        get_hf_file_metadata(hf_hub_url(repo_id, "config.json"), timeout=TIMEOUT_S)
    except (HfHubHTTPError, EntryNotFoundError, HFValidationError):
        raise
    except Exception as e:  # the HTTP client's connection and timeout errors, whichever client this version uses
        text = re.sub(r"^\[Errno -?\d+\] ", "", str(e).strip()).split(". ")[0][:120]
        raise NoAnswer(text or type(e).__name__) from None


@contextmanager
def quiet(logger: str):
    """The library's warnings held back while it runs: its failures reach the user as one line, ours."""
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def snapshot_of(path: Path) -> str:
    """The commit a cached file's snapshot folder is named by, shortened."""
    return path.parent.name[:12] if path.parent.parent.name == "snapshots" else ""
