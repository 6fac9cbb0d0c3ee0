"""The on-disk protocol: temporary directory, manifest, atomic rename, finding the latest.

[Note: atomic checkpoints]
Every rank writes into ``<path>.tmp-<id>`` (a name rank 0 picks and broadcasts). When all data
files exist, each rank reports its own files' sha256, computed while writing them
(``digest_writer.py``); rank 0 writes ``flatshard.json``, then
``MANIFEST.json`` (sizes and sha256 of every file) last, fsyncs, and renames the directory to
``<path>``. A save killed at any point leaves either nothing at ``<path>`` or the previous
complete checkpoint; the partial directory keeps its ``.tmp-`` name (and usually lacks the
manifest), so ``latest_checkpoint`` and ``load`` ignore it, and the next save to the same path
deletes it. Overwriting an existing checkpoint renames it to ``<path>.old-<id>`` first (a
directory cannot be atomically replaced by another on POSIX) and deletes it after the new one is
in place: a crash between those two renames leaves no ``<path>`` but both complete copies;
``latest_checkpoint`` then returns the set-aside previous one, and the next commit to ``<path>``
deletes it.
All ranks must see one shared filesystem (as DCP itself needs for resharding loads).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from flatshard.checkpoint.safety import describe_file

MANIFEST = "MANIFEST.json"
DESCRIPTION = "flatshard.json"
DCP_METADATA = ".metadata"
FORMAT = "flatshard-checkpoint"
VERSION = 2  # 2: parameters and their optimizer state stored with their full shapes
READABLE_VERSIONS = (1, 2)  # 1: the same, each parameter as a 1-D tensor of its numel
TMP_MARK, OLD_MARK = ".tmp-", ".old-"
# Test hook: seconds to sleep after the data files are written, before the manifest, so a
# test can SIGKILL a save at its most delicate point.


def new_tmp_dir(path: Path) -> Path:
    """Create ``<path>.tmp-<id>`` (removing earlier partial saves to the same path)."""
    for stale in path.parent.glob(f"{glob.escape(path.name)}{TMP_MARK}*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = path.with_name(f"{path.name}{TMP_MARK}{uuid.uuid4().hex[:12]}")
    tmp.mkdir(parents=True)
    return tmp


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(
    tmp: Path,
    path: Path,
    data_files: dict[str, dict],
    description: dict,
    before_commit: Callable[[], None] | None = None,
) -> None:
    """Rank 0: write the description and the manifest into ``tmp``, then move it to ``path``
    (``before_commit()`` first, when given: see ``fs.save``)."""
    _write_durably(tmp / DESCRIPTION, json.dumps(description, indent=1))
    files = dict(data_files)
    for name in (DESCRIPTION, DCP_METADATA):
        files[name] = describe_file(tmp / name)
    if before_commit is not None:
        before_commit()
    manifest = {"format": FORMAT, "version": VERSION, "created_ns": time.time_ns(), "files": files}
    _write_durably(tmp / MANIFEST, json.dumps(manifest, indent=1))
    _fsync_dir(tmp)
    old = None
    if path.exists():
        old = path.with_name(f"{path.name}{OLD_MARK}{uuid.uuid4().hex[:12]}")
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    # ours, and any left by an overwrite that was killed between its two renames
    for stale in path.parent.glob(f"{glob.escape(path.name)}{OLD_MARK}*"):
        shutil.rmtree(stale, ignore_errors=True)


def read_manifest(path: Path) -> dict:
    """The manifest of a complete checkpoint; ``ValueError`` saying why ``path`` is not one."""
    if not path.is_dir():
        raise ValueError(f"checkpoint {path} does not exist (or is not a directory)")
    if TMP_MARK in path.name or not (path / MANIFEST).is_file():
        raise ValueError(
            f"{path} is not a complete flatshard checkpoint (no {MANIFEST}: a save that did not "
            "finish); use fs.latest_checkpoint(dir) to find the newest complete one"
        )
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path / MANIFEST} is unreadable ({err}); damaged checkpoint") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path / MANIFEST} is not a flatshard manifest")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ValueError(f"{path / MANIFEST} lists no files; the checkpoint is damaged")
    if manifest.get("version") not in READABLE_VERSIONS:
        raise ValueError(
            f"{path} has checkpoint format version {manifest.get('version')}; this flatshard "
            f"reads versions {', '.join(map(str, READABLE_VERSIONS))}"
        )
    for name in files:
        if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", ".."):
            raise ValueError(f"{path / MANIFEST} lists the file {name!r} outside the checkpoint")
    return manifest


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint directly under ``directory`` (by commit time), or
    ``None``. Partial saves (``*.tmp-*``) and damaged ones are ignored, and so are set-aside old
    copies (``<name>.old-*``) unless ``<name>`` is missing: an overwrite killed between its two
    renames, whose previous checkpoint is then the one to use."""
    root = Path(directory)
    if not root.is_dir():
        return None
    best: tuple[int, str] | None = None
    for child in root.iterdir():
        if TMP_MARK in child.name:
            continue
        if OLD_MARK in child.name and (root / child.name.split(OLD_MARK)[0]).exists():
            continue
        try:
            created = int(read_manifest(child)["created_ns"])
        except (ValueError, KeyError, TypeError):
            continue
        if best is None or (created, child.name) > best:
            best = (created, child.name)
    return root / best[1] if best else None
