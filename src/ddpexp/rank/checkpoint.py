"""Checkpoint files: atomic writes, a `latest` marker written last, keep-last-k, and loading that refuses
anything but tensors and plain types (torch.load(weights_only=True)).

Layout of a job's checkpoints/: step-00000120.pt ... (the last k), last.pt (a hard link to the newest),
`latest` (the newest file's name) and best.pt (the best evaluation's, never rotated). A kill at any moment leaves
the previous checkpoint loadable.

A sharded run's (strategy=fsdp2) checkpoints have the same names, each a folder: every rank's shards of the model
and optimizer in DCP's format (`torch.distributed.checkpoint`: *.distcp, .metadata), and STATE, rank 0's file of
the rest (position, RNG streams, schedule, config), loaded with weights_only=True. The folder is written under a
temporary name and renamed once whole; last.pt is then a symlink to it.
"""

from __future__ import annotations

import glob
import os
import random
from collections.abc import Callable
from typing import Any

from ddpexp.exceptions import CheckpointError

MARKER = "latest"
BEST = "best.pt"
STATE = "state.pt"  # in a sharded checkpoint's folder: rank 0's plain state


def rng_state() -> dict[str, Any]:
    """Every RNG the loop touches, as tensors and plain types (no pickled objects)."""
    import numpy as np
    import torch

    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(mt), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_initialized():  # a CUDA run: its own GPU's stream (a CPU run never touches CUDA)
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_initialized():
        cuda = state["cuda"]
        if isinstance(cuda, list):  # an older checkpoint: every visible GPU's state
            cuda = cuda[torch.cuda.current_device()] if torch.cuda.current_device() < len(cuda) else None
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)


def _write_atomic(path: str, write: Any, midway: Callable[[], None] | None = None) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"  # a writer killed before the rename leaves this: job.remove_partial
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    if midway is not None:
        midway()
    os.replace(tmp, path)


def save(
    state: dict[str, Any], ckpt_dir: str, step: int, keep_last: int, midway: Callable[[], None] | None = None
) -> str:
    """Write step-N.pt (temp file, fsync, rename), point last.pt and the marker at it, drop the oldest. `midway`
    runs between the write and the rename (a test's fault)."""
    import torch

    os.makedirs(ckpt_dir, exist_ok=True)
    name = f"step-{step:08d}.pt"
    path = os.path.join(ckpt_dir, name)
    _write_atomic(path, lambda f: torch.save(state, f), midway)
    tmp_link = os.path.join(ckpt_dir, f"last.pt.tmp.{os.getpid()}")
    if os.path.lexists(tmp_link):
        os.remove(tmp_link)
    os.link(path, tmp_link)  # last.pt: the same bytes under a fixed name, no copy
    os.replace(tmp_link, os.path.join(ckpt_dir, "last.pt"))
    _write_atomic(os.path.join(ckpt_dir, MARKER), lambda f: f.write(name.encode()))
    _fsync_dir(ckpt_dir)
    _rotate(ckpt_dir, keep_last)
    return path


def _rotate(ckpt_dir: str, keep_last: int) -> None:
    import shutil

    for old in step_files(ckpt_dir)[:-keep_last]:
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old)
        else:
            os.remove(old)


def save_sharded(
    state: dict[str, Any] | None, shards: dict[str, Any], ckpt_dir: str, step: int | None, keep_last: int,
    tmp_suffix: str, midway: Callable[[], None] | None = None,
) -> str:  # fmt: skip
    """Every rank: its shards into NAME.tmp.SUFFIX/ (DCP; rank 0 writes the metadata once all are written), then
    rank 0 (`state` given) writes STATE there and renames the folder to step-N.pt (step None: best.pt), points
    last.pt and the marker at it, drops the oldest. A kill before the rename leaves the previous checkpoint the
    newest whole one; `tmp_suffix` is rank 0's pid (job.remove_partial clears a dead writer's folder)."""
    import shutil

    import torch
    import torch.distributed.checkpoint as dcp

    os.makedirs(ckpt_dir, exist_ok=True)
    name = BEST if step is None else f"step-{step:08d}.pt"
    path = os.path.join(ckpt_dir, name)
    tmp = f"{path}.tmp.{tmp_suffix}"
    dcp.save(shards, checkpoint_id=tmp)  # collective: returns on every rank once the metadata is written
    if state is None:
        return ""
    _write_atomic(os.path.join(tmp, STATE), lambda f: torch.save({**state, "sharded": True}, f))
    _fsync_dir(tmp)
    if midway is not None:
        midway()
    _replace_folder(tmp, path)
    if step is not None:
        tmp_link = os.path.join(ckpt_dir, f"last.pt.tmp.{os.getpid()}")
        if os.path.lexists(tmp_link):
            os.remove(tmp_link)
        os.symlink(name, tmp_link)
        last = os.path.join(ckpt_dir, "last.pt")
        if os.path.isdir(last) and not os.path.islink(last):  # a copy of the run dir that followed the link
            shutil.rmtree(last)
        os.replace(tmp_link, last)
        _write_atomic(os.path.join(ckpt_dir, MARKER), lambda f: f.write(name.encode()))
    _fsync_dir(ckpt_dir)
    if step is not None:
        _rotate(ckpt_dir, keep_last)
    return path


def _replace_folder(tmp: str, path: str) -> None:
    """Rename the whole folder `tmp` to `path`; an existing `path` (best.pt, or the same step saved again) is
    moved aside first and removed after, so a kill in between leaves one of the two whole."""
    import shutil

    if not os.path.lexists(path):
        os.rename(tmp, path)
        return
    aside = f"{path}.old.tmp.{os.getpid()}"
    os.rename(path, aside)
    os.rename(tmp, path)
    if os.path.isdir(aside):
        shutil.rmtree(aside)
    else:
        os.remove(aside)


def save_best(state: dict[str, Any], ckpt_dir: str) -> str:
    """Write best.pt (temp file, fsync, rename): the previous best stays whole until the new one is."""
    import torch

    os.makedirs(ckpt_dir, exist_ok=True)
    path = os.path.join(ckpt_dir, BEST)
    _write_atomic(path, lambda f: torch.save(state, f))
    _fsync_dir(ckpt_dir)
    return path


def drop_best(ckpt_dir: str) -> None:
    """A fresh start's: best.pt of an earlier attempt that left no step checkpoint is no evaluation of this run."""
    import shutil

    path = os.path.join(ckpt_dir, BEST)
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _fsync_dir(ckpt_dir: str) -> None:
    dir_fd = os.open(ckpt_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the renames themselves survive a power cut
    finally:
        os.close(dir_fd)


def step_files(ckpt_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(ckpt_dir, "step-*.pt")))


def load(path: str) -> dict[str, Any]:
    """Load with weights_only=True: a file holding pickled code is refused before anything runs."""
    import torch

    if os.path.isdir(path):
        return _load_sharded(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path}: no such file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # unpickling arbitrary bytes fails in many ways (KeyError, IndexError, struct.error...)
        raise CheckpointError(f"checkpoint {path}: refused, not a plain tensor checkpoint ({_why(e)})") from None
    if not isinstance(state, dict) or not {"model", "step", "config"} <= set(state):
        raise CheckpointError(f"checkpoint {path}: refused, not a ddpexp checkpoint (no model/step/config)")
    return state


def _load_sharded(path: str) -> dict[str, Any]:
    """A sharded checkpoint's STATE (weights_only), once its folder is whole (DCP's metadata and STATE there); the
    shards stay on disk until the strategy loads them (rank/fsdp2.py) or `model_weights` does."""
    import torch

    state_path = os.path.join(path, STATE)
    if not (os.path.isfile(state_path) and os.path.isfile(os.path.join(path, ".metadata"))):
        raise CheckpointError(f"checkpoint {path}: refused, not a whole sharded checkpoint (no {STATE} or .metadata)")
    try:
        state = torch.load(state_path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path}: refused, not a plain tensor checkpoint ({_why(e)})") from None
    if not isinstance(state, dict) or not {"step", "config"} <= set(state):
        raise CheckpointError(f"checkpoint {path}: refused, not a ddpexp checkpoint (no step/config)")
    return state


def model_weights(path: str, state: dict[str, Any], model: Any) -> None:
    """Load a checkpoint's weights into the whole, plain `model`: a file's `model`, or a sharded folder's model
    shards read and put together by DCP in this one process (no process group)."""
    if not state.get("sharded"):
        model.load_state_dict(state["model"])
        return
    import warnings

    import torch.distributed.checkpoint as dcp

    weights = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(weights, checkpoint_id=path, no_dist=True)
    model.load_state_dict(weights["model"])


def _why(error: Exception) -> str:
    """torch's reason in one line, without its advice to load with weights_only=False (which would run the code
    in the file): for a refused pickle the line naming what it holds, else the error's type and first line."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    named = [line for line in lines if "GLOBAL" in line or "Unsupported" in line]
    if named:
        return named[0].rstrip(".")
    if lines and "weights_only" not in lines[0]:
        return f"{type(error).__name__}: {lines[0]}"
    return type(error).__name__


def resolve(path: str) -> str:
    """`resume=PATH`: a checkpoint file, a checkpoints/ folder or a job dir (its newest valid checkpoint)."""
    if os.path.isdir(path):
        folder = os.path.join(path, "checkpoints") if os.path.isdir(os.path.join(path, "checkpoints")) else path
        found = find_latest(folder)
        if found is None:
            raise CheckpointError(f"resume={path}: no valid checkpoint in {folder}")
        return found
    load(path)  # refuses a missing, truncated or unsafe file with a message naming it
    return path


def newest(ckpt_dir: str) -> str | None:
    """The file the `latest` marker names (not loaded: for messages), None when there is none."""
    try:
        with open(os.path.join(ckpt_dir, MARKER)) as f:
            return os.path.join(ckpt_dir, f.read().strip())
    except FileNotFoundError:
        return None


def find_latest(ckpt_dir: str) -> str | None:
    """The newest checkpoint that loads: the marker's file, else older step files (a kill mid-save)."""
    candidates = list(reversed(step_files(ckpt_dir)))
    try:
        with open(os.path.join(ckpt_dir, MARKER)) as f:
            candidates.insert(0, os.path.join(ckpt_dir, f.read().strip()))
    except FileNotFoundError:
        pass
    for path in candidates:
        try:
            load(path)
            return path
        except CheckpointError:
            continue
    return None
