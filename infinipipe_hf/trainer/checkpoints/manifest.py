"""``epp_manifest.json``: every file of a published checkpoint with its size and SHA-256.

Design: a same-size overwrite (a bad disk block, a copy that died halfway over an existing file,
a stray ``dd``) passes a size check and loads as garbage weights, so each file's checksum is
recorded when the checkpoint is published and compared before any tensor of it is used.
SHA-256 because ``hashlib`` runs it through OpenSSL's hardware-assisted code (about twice
blake2b's speed on x86 with SHA extensions) and ``sha256sum -c`` can check a checkpoint from
a shell.  A manifest written before checksums were recorded (sizes only) still verifies by size;
``Manifest.checksums`` is then ``None`` so the caller can say that contents were not checked.
Hashing many files is shared out over ranks by ``integrity.py``; this module checks one file.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

MANIFEST_NAME = "epp_manifest.json"
CHECKSUM = "sha256"
_CHUNK = 8 << 20


@dataclass(frozen=True)
class Manifest:
    """What a completed save recorded about its files."""

    files: dict[str, int]
    """Path relative to the checkpoint folder -> size in bytes."""
    checksums: dict[str, str] | None
    """Path -> hex digest (``algorithm``); ``None`` for a manifest that records sizes only."""
    algorithm: str = CHECKSUM
    """``hashlib`` name of the digest in ``checksums``."""


def file_checksum(path: str, algorithm: str = CHECKSUM) -> str:
    """Hex digest of the file at ``path``, read in 8 MiB chunks (hashlib releases the GIL)."""
    h = hashlib.new(algorithm)
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def list_files(folder: str) -> dict[str, int]:
    """Every file under ``folder`` (the manifest and its temporary copy left out) with its size."""
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            if rel not in (MANIFEST_NAME, MANIFEST_NAME + ".tmp"):
                out[rel] = os.path.getsize(path)
    return dict(sorted(out.items()))


def write_manifest(folder: str, files: dict[str, int] | None = None,
                   checksums: dict[str, str] | None = None) -> None:
    """Write ``epp_manifest.json`` (to a temporary name, then renamed) for ``folder``.

    ``files``/``checksums``: already measured (by the ranks of a save); ``None``: measured here."""
    files = list_files(folder) if files is None else dict(sorted(files.items()))
    if checksums is None:
        checksums = {name: file_checksum(os.path.join(folder, name)) for name in files}
    missing = sorted(set(files) - set(checksums))
    if missing:
        raise ValueError(f"no checksum for {missing[:3]} of {folder}; every listed file needs one")
    tmp = os.path.join(folder, MANIFEST_NAME + ".tmp")
    with open(tmp, "w") as fh:
        json.dump({"files": files, "checksum": CHECKSUM,
                   "checksums": {k: checksums[k] for k in files}}, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(folder, MANIFEST_NAME))


def read_manifest(folder: str) -> Manifest | str:
    """The manifest of ``folder``, or why there is none usable (a sentence naming the file)."""
    path = os.path.join(folder, MANIFEST_NAME)
    if not os.path.isfile(path):
        return (f"it has no {MANIFEST_NAME}, so it was not published by a completed EPPTrainer save "
                f"(interrupted, or written by another tool)")
    try:
        with open(path) as fh:
            raw = json.load(fh)
        files = {str(k): int(v) for k, v in raw["files"].items()}
        sums = raw.get("checksums")
        algorithm = str(raw.get("checksum", CHECKSUM))
        if sums is not None:
            sums = {str(k): str(v) for k, v in sums.items()}
            hashlib.new(algorithm)  # an unknown name is a damaged manifest
            if set(sums) != set(files):
                raise ValueError("its checksums do not list the same files as its sizes")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{path} is unreadable ({type(exc).__name__}: {exc})"
    return Manifest(files=files, checksums=sums, algorithm=algorithm)


def file_problem(folder: str, name: str, manifest: Manifest) -> str | None:
    """Why file ``name`` of ``folder`` differs from what ``manifest`` recorded, or ``None``."""
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return f"{path} is missing"
    size = manifest.files[name]
    got = os.path.getsize(path)
    if got != size:
        return f"{path} has {got} bytes but {size} were saved (truncated or overwritten)"
    if manifest.checksums is None:
        return None
    try:
        digest = file_checksum(path, manifest.algorithm)
    except OSError as exc:
        return f"{path} cannot be read ({type(exc).__name__}: {exc})"
    if digest != manifest.checksums[name]:
        return (f"{path} does not match its {manifest.algorithm} checksum (same size, different "
                f"bytes: damaged or overwritten after the save)")
    return None
