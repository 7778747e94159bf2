"""A checkpoint folder and its manifest: names, the atomic commit, and the check on load.

Every rank writes into ``.tmp-step_NNNNNNNN/``; rank 0 then hashes every file, writes
``complete.json`` (temp + rename) and renames the folder to ``step_NNNNNNNN`` (``commit``). A crash
before that rename leaves only the ``.tmp-`` folder, which nothing reads. ``read_manifest`` checks
every listed file's size and sha256 before a checkpoint is used.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from parallel_lab.errors import ConfigError
from parallel_lab.hashing import file_digest

COMPLETE = "complete.json"
PREFIX = "step_"
TMP_PREFIX = ".tmp-"
FORMAT_VERSION = 1


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used; the message says which one and what to do."""


INIT_FROM_FIX = (
    "point trainer.init_from at a checkpoint folder, a DeepSpeed/DCP folder, a .safetensors or a torch.save file"
)


def init_from_error(path: Path | str, what: str) -> CheckpointError:
    """trainer.init_from's one line: what is wrong with path, then what to point it at."""
    return CheckpointError(f"trainer.init_from={path} {what}; {INIT_FROM_FIX}")


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def sha256_file(path: Path) -> str:
    return file_digest(path, "sha256")


def _files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != COMPLETE)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_of(path: Path) -> int:
    return int(path.name[len(PREFIX) :])


def read_manifest(path: Path) -> dict:
    """complete.json of a checkpoint, after checking every file it lists; CheckpointError if not."""
    path = Path(path)
    fix = (
        "point trainer.resume at another checkpoint, or start fresh "
        "(trainer.resume=never, an empty trainer.checkpoint_dir)"
    )
    if not path.is_dir():
        raise CheckpointError(f"checkpoint '{path}' does not exist; {fix}")
    manifest_path = path / COMPLETE
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        step = int(manifest["step"])
    except FileNotFoundError:
        inside = complete_checkpoints(path)
        if inside:
            raise CheckpointError(
                f"'{path}' holds checkpoints, it is not one; pass one of its step_* folders, "
                f"e.g. trainer.resume={inside[0]}"
            ) from None
        raise CheckpointError(
            f"checkpoint '{path}' is incomplete (no {COMPLETE}: its write never finished); {fix}"
        ) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint '{path}' has a corrupt {COMPLETE} ({exc}); {fix}") from None
    for rel, expected in files.items():
        file = path / rel
        if not file.is_file():
            raise CheckpointError(f"checkpoint '{path}' is missing {rel}; {fix}")
        if file.stat().st_size != expected["size"]:
            raise CheckpointError(
                f"checkpoint '{path}' is corrupt: {rel} has {file.stat().st_size} bytes, "
                f"{expected['size']} were written; {fix}"
            )
        if sha256_file(file) != expected["sha256"]:
            raise CheckpointError(f"checkpoint '{path}' is corrupt: {rel} does not match its sha256; {fix}")
    manifest["step"] = step
    return manifest


def complete_checkpoints(root: Path) -> list[Path]:
    """Finished checkpoint folders under root, newest (most steps) first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]), reverse=True)


def commit(tmp: Path, final: Path, step: int, run: dict) -> int:
    """Rank 0, after every rank wrote into tmp: record each file's size and sha256 in complete.json,
    then rename tmp to final in one step. Returns the checkpoint's bytes."""
    files = {}
    for file in _files_under(tmp):
        with open(file, "rb") as f:
            os.fsync(f.fileno())
        files[str(file.relative_to(tmp))] = {"size": file.stat().st_size, "sha256": sha256_file(file)}
    manifest = {"format": FORMAT_VERSION, "step": step, "run": run, "files": files}
    (tmp / (COMPLETE + ".tmp")).write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp / (COMPLETE + ".tmp"), tmp / COMPLETE)
    _fsync_dir(tmp)
    old = final.parent / f".old-{final.name}"
    if final.exists():  # written before a restart went back past it: move aside, then replace
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)
    return sum(f["size"] for f in files.values())
