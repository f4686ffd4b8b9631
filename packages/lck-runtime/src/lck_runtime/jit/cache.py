"""The JIT cache: keys, entry layout, checksums, the cross-process lock and atomic publication.

Layout under the cache root (created 0700)::

    <root>/<name>-<key[:16]>/        one published entry (never modified after publication)
        <payload file>              the cubin, or the host module's .so
        <name>.cu / .cpp            the source it was built from (for debugging)
        meta.json                   format, name, full key, sha256 of the payload, argv, nvcc, time
    <root>/.locks/<entry>.lock      flock'ed while one process builds the entry
    <root>/.tmp/<entry>.<random>/   an entry being built (same file system as the root)
    <root>/.trash/                  unusable entries moved aside before deletion

An entry is used only if its meta.json parses, names the same full key and format, and the payload's
sha256 matches; anything else (torn write, foreign copy, bit rot) is moved aside and rebuilt. Builds
happen in ``.tmp`` and are published with one ``os.rename`` of the directory, so readers see either no
entry or a complete one. One process builds (``flock`` on the entry's lock file, bounded wait); the
others wait, then find the entry. Where locks are not honoured across hosts (some NFS set-ups), two
builders can race: the loser's rename fails because the winner's directory exists, and the loser
uses the winner's entry once it verifies (retrying a few times: an NFS client may not see the new
directory's files at once, DeepEP issue 683).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import stat
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lck_runtime.jit.errors import JitConfigError, JitError

FORMAT = 1
META = "meta.json"
_AUX_DIRS = (".locks", ".tmp", ".trash")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def compute_key(fields: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of ``fields`` (sorted keys, no whitespace)."""
    blob = json.dumps({"format": FORMAT, **fields}, sort_keys=True, separators=(",", ":"))
    return sha256_bytes(blob.encode())


def entry_name(name: str, key: str) -> str:
    return f"{name}-{key[:16]}"


def ensure_root(root: Path, what: str) -> Path:
    """Create the cache root private (0700) if missing; refuse a root others can write into.

    ``what`` names the setting the root came from (for the error message). A root writable by other
    users would let them plant code that we load and run, so it is refused, not silently used. A root
    owned by another user is accepted only if it is not group/world writable.
    """
    root = Path(root).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise JitConfigError(f"{what}: cannot create the JIT cache directory {root}: {exc}") from exc
    st = root.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise JitConfigError(f"{what}: {root} is not a directory")
    mine = st.st_uid == os.getuid()
    if st.st_mode & stat.S_IWOTH or (not mine and st.st_mode & stat.S_IWGRP):
        raise JitConfigError(
            f"{what}: the JIT cache directory {root} is writable by other users (mode "
            f"{stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}); use a private directory (chmod 700)"
        )
    for aux in _AUX_DIRS:
        (root / aux).mkdir(exist_ok=True, mode=0o700)
    return root


@dataclass(frozen=True)
class Entry:
    """A verified cache entry. ``payload`` holds the checked bytes, so loading never re-reads the file."""

    path: Path
    meta: dict[str, Any]
    payload: bytes
    from_cache: bool

    @property
    def payload_path(self) -> Path:
        return self.path / self.meta["file"]


def read_entry(path: Path, key: str) -> tuple[Entry | None, str | None]:
    """(entry, None) if ``path`` holds a valid entry for ``key``; (None, None) if absent; (None, reason)
    if present but unusable."""
    try:
        raw = (path / META).read_bytes()
    except FileNotFoundError:
        return None, ("no meta.json (torn entry)" if path.exists() else None)
    except NotADirectoryError:
        return None, "not a directory"
    except OSError as exc:
        return None, f"unreadable meta.json: {exc}"
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None, "meta.json is not valid JSON (torn or corrupted)"
    if not isinstance(meta, dict):
        return None, "meta.json is not an object"
    if meta.get("format") != FORMAT:
        return None, f"format {meta.get('format')!r}, expected {FORMAT}"
    if meta.get("key") != key:
        return None, "meta.json names another key (foreign entry)"
    file = meta.get("file")
    if not isinstance(file, str) or not file or "/" in file or file in (".", "..", META):
        return None, f"bad payload name {file!r}"
    try:
        payload = (path / file).read_bytes()
    except OSError as exc:
        return None, f"payload {file} unreadable: {exc}"
    if sha256_bytes(payload) != meta.get("sha256"):
        return None, f"checksum mismatch on {file} (corrupted)"
    return Entry(path=path, meta=meta, payload=payload, from_cache=True), None


@contextlib.contextmanager
def file_lock(path: Path, timeout: float) -> Iterator[None]:
    """Exclusive ``flock`` on ``path``, polled so the wait is bounded by ``timeout`` seconds.

    The kernel drops the lock when its holder exits, even by a crash, so a dead builder never blocks
    the others.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + timeout
        delay = 0.005
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise JitError(
                        f"waited {timeout:g} s for the JIT cache lock {path}: another process is still "
                        "building this entry (a hung nvcc?). Kill it or raise lock_timeout"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.1)
        yield
    finally:
        os.close(fd)  # releases the lock


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def quarantine(root: Path, path: Path) -> None:
    """Move an unusable entry out of the way atomically, then delete it."""
    dest = root / ".trash" / f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        os.rename(path, dest)
    except FileNotFoundError:
        return
    _remove(dest)


def _read_settled(path: Path, key: str, attempts: int = 5) -> tuple[Entry | None, str | None]:
    """read_entry, retried with back-off while the entry looks torn (an NFS client may show another
    host's freshly renamed directory before its files)."""
    delay = 0.05
    entry, why = read_entry(path, key)
    for _ in range(attempts - 1):
        if entry is not None or why is None:
            break
        time.sleep(delay)
        delay *= 2
        entry, why = read_entry(path, key)
    return entry, why


STALE_BUILD_SECONDS = 3600.0


def _sweep_stale_builds(root: Path, entry: str) -> None:
    """Delete this entry's build folders left by builders that died (killed nvcc, lost node).

    Called with the entry's lock held, so no live local builder owns them; the age threshold also
    spares a builder on another host whose lock we cannot see.
    """
    now = time.time()
    for d in (root / ".tmp").glob(f"{entry}.*"):
        with contextlib.suppress(OSError):
            if now - d.stat().st_mtime > STALE_BUILD_SECONDS:
                _remove(d)


def get_or_create(
    root: Path,
    name: str,
    key: str,
    produce: Callable[[Path], dict[str, Any]],
    *,
    lock_timeout: float,
) -> Entry:
    """Return the verified entry for ``key``, building it with ``produce`` if needed.

    ``produce(tmpdir)`` writes the payload (and anything else) into ``tmpdir`` and returns metadata
    that must include ``"file"``, the payload's file name. At most one process runs ``produce`` for a
    key at a time; the rest wait for the lock and then load what it published.
    """
    final = root / entry_name(name, key)
    entry, _ = read_entry(final, key)
    if entry is not None:
        return entry
    with file_lock(root / ".locks" / f"{final.name}.lock", lock_timeout):
        entry, why = _read_settled(final, key)
        if entry is not None:
            return entry
        if why is not None:
            warnings.warn(
                f"JIT cache entry {final} is unusable ({why}); rebuilding it", RuntimeWarning, stacklevel=3
            )
            quarantine(root, final)
        _sweep_stale_builds(root, final.name)
        tmp = Path(tempfile.mkdtemp(prefix=f"{final.name}.", dir=root / ".tmp"))
        try:
            fields = produce(tmp)
            file = fields["file"]
            payload = (tmp / file).read_bytes()
            meta = {
                "format": FORMAT,
                "name": name,
                "key": key,
                "sha256": sha256_bytes(payload),
                "created": time.time(),
                "created_iso": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "host": socket.gethostname(),
                "pid": os.getpid(),
                **fields,
            }
            (tmp / META).write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
            for f in tmp.iterdir():
                if f.is_file():
                    _fsync_path(f)
            _fsync_path(tmp, directory=True)
            os.chmod(tmp, 0o700)
            try:
                os.rename(tmp, final)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                # Someone published without holding our lock (a lock that is not shared across hosts).
                existing, why = _read_settled(final, key)
                if existing is not None:
                    _remove(tmp)
                    return existing
                quarantine(root, final)
                os.rename(tmp, final)
            with contextlib.suppress(OSError):
                _fsync_path(root, directory=True)
        except BaseException:
            _remove(tmp)
            raise
    return Entry(path=final, meta=meta, payload=payload, from_cache=False)


def summarize(root: Path, host_entry: str) -> dict[str, Any]:
    """What a cache root holds, for ``lck doctor``: whether it exists and is private (0700), its published
    entries (a folder with a ``meta.json``) and their total size, and whether an entry named ``host_entry``
    (the host module's, :data:`lck_runtime.jit.host.ENTRY_NAME`) is built there.
    Reads only; unreadable parts count as absent."""
    root = Path(root).expanduser()
    out: dict[str, Any] = {"path": str(root), "exists": root.is_dir()}
    if not out["exists"]:
        return out
    out["private"] = stat.S_IMODE(root.stat().st_mode) & 0o077 == 0
    entries, size, host = 0, 0, False
    for d in root.iterdir():
        if d.name.startswith(".") or not (d / META).is_file():
            continue
        entries += 1
        host |= d.name.startswith(host_entry + "-")
        for f in d.iterdir():
            with contextlib.suppress(OSError):
                size += f.stat().st_size
    out.update(entries=entries, bytes=size, host_module=host)
    return out
