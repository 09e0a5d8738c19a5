"""Checkpoint files: atomic writes, a `latest` marker written last, keep-last-k, and loading that refuses
anything but tensors and plain types (torch.load(weights_only=True)).

Layout of a job's checkpoints/: step-00000120.pt ... (the last k), last.pt (a hard link to the newest),
`latest` (the newest file's name) and best.pt (the best evaluation's, never rotated). A kill at any moment leaves
the previous checkpoint loadable.
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
    for old in step_files(ckpt_dir)[:-keep_last]:
        os.remove(old)
    return path


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
    try:
        os.remove(os.path.join(ckpt_dir, BEST))
    except FileNotFoundError:
        pass


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

    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path}: no such file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # unpickling arbitrary bytes fails in many ways (KeyError, IndexError, struct.error...)
        raise CheckpointError(f"checkpoint {path}: refused, not a plain tensor checkpoint ({_why(e)})") from None
    if not isinstance(state, dict) or not {"model", "step", "config"} <= set(state):
        raise CheckpointError(f"checkpoint {path}: refused, not a ddpexp checkpoint (no model/step/config)")
    return state


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
