"""File operations of the disk tier: atomic writes, stale temporary files, quiet deletes."""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path

from paged_kv.tiers.disk_format import TMP_PREFIX

STALE_TMP_SECONDS = 600  # a temporary file this old was left by a crashed writer
logger = logging.getLogger(__name__)


def temp_path(directory: Path) -> Path:
    """A fresh temporary name in ``directory``, unique across processes."""
    return directory / f"{TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"


def write_atomically(directory: Path, name: str, data: bytes) -> None:
    """Write ``data`` to ``directory/name`` so that the name only ever holds a complete file.

    Written under a temporary name, fsynced, renamed over ``name`` and the directory fsynced;
    on any failure the temporary file is removed and the error raised.
    """
    tmp = temp_path(directory)
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(directory)


def _fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (where the platform can open a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a directory; the rename itself is still atomic
    finally:
        os.close(fd)


def remove_if_stale(path: Path, now: float | None = None) -> bool:
    """Delete a temporary file older than ``STALE_TMP_SECONDS``; whether it was deleted."""
    now = time.time() if now is None else now
    try:
        if now - path.stat().st_mtime < STALE_TMP_SECONDS:
            return False
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as err:
        logger.warning("disk tier: cannot delete stale temporary file %s (%s)", path, err)
        return False
    return True


def delete_quietly(path: Path) -> bool:
    """Delete a file; whether it is gone (another engine deleting it first is fine)."""
    try:
        path.unlink()
    except FileNotFoundError:
        return True
    except OSError as err:
        logger.warning("disk tier: cannot delete %s (%s)", path, err)
        return False
    return True
