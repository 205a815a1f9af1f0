"""Where a data-service reader may read, and opening what it may: local paths and fsspec URLs.

A worker reads only under the prefixes its operator allowed (``readable_dirs``,
``--readable-dir``), default deny. A prefix is a local directory or a URL prefix
(``s3://bucket/train``, ``gs://bucket``, ``file:///data``):

* a local path (or ``file://`` URL) is resolved against symlinks and ``..`` and must lie
  under a resolved directory prefix; once opened, the file the descriptor really names is
  checked again, so a link swapped in between the check and the open is not followed;
* any other URL is compared on its components: the protocol (``s3a`` is ``s3``, ``gcs`` is
  ``gs``), the bucket or host, then whole path segments, so ``s3://bucket-evil`` is not under
  ``s3://bucket`` nor ``s3://bucket/a2`` under ``s3://bucket/a``. ``.`` and ``..`` segments
  (also percent-encoded), empty segments, queries, fragments and chained URLs (``a::b``)
  are refused outright.

URLs are opened through fsspec with no options: credentials and endpoints come from the
worker's environment only (``AWS_*``, ``GOOGLE_APPLICATION_CREDENTIALS``, fsspec's config),
never from the dispatcher or a client. fsspec, and the package of a protocol (s3fs, gcsfs),
are imported only when a URL is opened.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import BinaryIO, NamedTuple
from urllib.parse import unquote

from clusterwire.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    UnavailableError,
)

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.DOTALL)
# fsspec's other names for the same file systems.
_ALIASES = {"s3a": "s3", "gcs": "gs", "local": "file"}
_HOW_TO_ALLOW = ("Add the directory or URL prefix to the worker's readable_dirs: "
                 "WorkerConfig(readable_dirs=[...]) (--readable-dir DIR_OR_URL).")


class _Url(NamedTuple):
    protocol: str
    netloc: str
    segments: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.protocol}://{'/'.join((self.netloc, *self.segments))}"


def is_url(path: str) -> bool:
    """Whether ``path`` is a URL (``scheme://...``) rather than a plain local path."""
    return _SCHEME.match(path) is not None


def _parse_url(url: str) -> _Url:
    """The canonical components of a non-file URL; InvalidArgumentError for what could escape."""
    match = _SCHEME.match(url)
    assert match is not None
    protocol = _ALIASES.get(match.group(1).lower(), match.group(1).lower())
    rest = match.group(2)
    for bad, why in (("::", "chained URLs"), ("?", "queries"), ("#", "fragments"),
                     ("\\", "backslashes"), ("\x00", "NUL characters")):
        if bad in rest:
            raise InvalidArgumentError(
                f"URL {url!r}: {why} are not accepted in data paths; name the object itself.")
    netloc, _, path = rest.partition("/")
    segments = tuple(path.rstrip("/").split("/")) if path.rstrip("/") else ()
    # Percent-decoded too: an HTTP server decodes %2e%2e to '..' after the comparison.
    if not netloc or any(unquote(s) in ("", ".", "..") or "/" in unquote(s)
                         or "\\" in unquote(s) for s in segments):
        raise InvalidArgumentError(
            f"URL {url!r} has an empty bucket or host, or an empty, '.' or '..' path segment "
            "(also percent-encoded): give the object's plain URL.")
    return _Url(protocol, netloc, segments)


def _local(path: str) -> str | None:
    """The local path a plain path or ``file://`` URL names; None for other URLs."""
    match = _SCHEME.match(path)
    if match is None:
        return path
    if _ALIASES.get(match.group(1).lower(), match.group(1).lower()) != "file":
        return None
    rest = match.group(2)
    if not rest.startswith("/"):  # file://host/path: only this host's files
        raise InvalidArgumentError(
            f"URL {path!r}: a file URL names a local path, as file:///absolute/path.")
    return rest


def _canonical_prefix(prefix: str) -> str | _Url:
    local = _local(prefix)
    return _parse_url(prefix) if local is None else os.path.realpath(local)


def check_prefixes(prefixes: Iterable[str]) -> tuple[str, ...]:
    """``readable_dirs`` checked and made canonical: resolved directories and URL prefixes.

    A local directory must exist (NotFoundError else); a URL prefix is checked for form only
    (the worker may hold no credentials for it yet when it starts).
    """
    canonical = []
    for prefix in prefixes:
        if not isinstance(prefix, str) or not prefix:
            raise InvalidArgumentError(
                f"readable_dirs takes directory paths and URL prefixes, got {prefix!r}.")
        resolved = _canonical_prefix(prefix)
        if isinstance(resolved, str) and not os.path.isdir(resolved):
            raise NotFoundError(f"readable_dirs names {prefix!r}, which is not a directory.")
        canonical.append(str(resolved))
    return tuple(canonical)


def _under(url: _Url, prefix: _Url) -> bool:
    return (url.protocol == prefix.protocol and url.netloc == prefix.netloc
            and url.segments[:len(prefix.segments)] == prefix.segments)


def resolve_readable(path: str | os.PathLike, readable_prefixes: Iterable[str] | None) -> str:
    """``path`` made canonical (a resolved local path or a canonical URL) if it may be read.

    ``readable_prefixes`` None means the caller's own reads (a client iterating locally),
    unchecked; a worker always passes its prefixes, and an empty list allows nothing.
    PermissionDeniedError names the path and the fix when it lies under no prefix.
    """
    try:
        path = os.fspath(path)
    except TypeError:
        raise InvalidArgumentError(f"a data path is a str or URL, got {path!r}.") from None
    if not isinstance(path, str) or not path:
        raise InvalidArgumentError(f"a data path is a non-empty str or URL, got {path!r}.")
    local = _local(path)
    target: str | _Url = _parse_url(path) if local is None else os.path.realpath(local)
    if readable_prefixes is None:
        return str(target)
    prefixes = [_canonical_prefix(p) for p in readable_prefixes]
    for prefix in prefixes:
        if isinstance(target, str) and isinstance(prefix, str):
            if os.path.commonpath((target, prefix)) == prefix:
                return target
        elif isinstance(target, _Url) and isinstance(prefix, _Url) and _under(target, prefix):
            return str(target)
    where = ", ".join(map(str, prefixes)) or "none are configured"
    raise PermissionDeniedError(
        f"This tf.data service worker does not read {path!r}: it reads only under its "
        f"readable_dirs ({where}). {_HOW_TO_ALLOW}")


def open_readable(url: str | os.PathLike, readable_prefixes: Iterable[str] | None) -> BinaryIO:
    """Opens a local path or fsspec URL for binary reading if it lies under a readable prefix.

    ``readable_prefixes`` as for ``resolve_readable``. Errors name the path: PermissionDenied
    (not under a prefix, or refused by the store), NotFound, FailedPrecondition (a directory,
    or fsspec / the protocol's package not installed), Unavailable (the store cannot be
    reached). The caller closes the file.
    """
    prefixes = None if readable_prefixes is None else tuple(readable_prefixes)
    target = resolve_readable(url, prefixes)
    name = os.fspath(url)
    try:
        if not is_url(target):
            file: BinaryIO = open(target, "rb")  # noqa: SIM115 - the caller closes it
            if prefixes is not None:
                _check_opened(file, name, prefixes)
            return file
        return _open_url(target)
    except (FileNotFoundError, NotADirectoryError):
        raise NotFoundError(f"{name!r} not found.") from None
    except PermissionError as error:
        raise PermissionDeniedError(f"Reading {name!r} was refused: {error}") from None
    except IsADirectoryError:
        raise FailedPreconditionError(f"{name!r} is a directory, not a file.") from None
    except (OSError, TimeoutError) as error:
        raise UnavailableError(f"Cannot read {name!r}: {error}") from None
    except Exception as error:  # the store's own client errors (botocore, aiohttp, google)
        if type(error).__module__.split(".")[0] in ("botocore", "aiohttp", "google", "gcsfs",
                                                    "s3fs", "requests", "urllib3"):
            raise UnavailableError(
                f"Cannot read {name!r}: {type(error).__name__}: {error}") from None
        raise


def _check_opened(file: BinaryIO, name: str, prefixes: tuple[str, ...]) -> None:
    """Checks the file a descriptor names (Linux's /proc) lies under a prefix; closes it else."""
    proc = f"/proc/self/fd/{file.fileno()}"
    if not os.path.exists(proc):
        return
    try:
        resolve_readable(os.readlink(proc), prefixes)
    except PermissionDeniedError:
        file.close()
        raise PermissionDeniedError(
            f"{name!r} was replaced by a link out of the readable_dirs while it was opened; "
            "not read.") from None


def _open_url(url: str) -> BinaryIO:
    try:
        import fsspec
    except ImportError:
        raise FailedPreconditionError(
            f"Reading {url!r} needs fsspec on this worker: pip install 'clusterwire[fsspec]'."
        ) from None
    try:
        return fsspec.open(url, "rb").open()
    except (ImportError, ValueError) as error:
        if isinstance(error, ImportError):
            raise FailedPreconditionError(
                f"Reading {url!r} needs the package of its file system on this worker: "
                f"{error}") from None
        raise InvalidArgumentError(f"Cannot open {url!r}: {error}") from None
