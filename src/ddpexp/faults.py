"""Ranks never outlive the command that started them."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys


def die_with_parent() -> None:
    """A rank started by this command (spawn, torchrun) gets SIGKILL when the command dies, even by SIGKILL.

    Linux's PR_SET_PDEATHSIG; elsewhere ranks rely on the launcher's own cleanup."""
    parent = multiprocessing.parent_process()
    if parent is None or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent.pid:  # the parent died before prctl took effect
        os._exit(1)
