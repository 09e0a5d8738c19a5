"""The parent's side of the ranks' processes, for the launchers that start them here: ranks never outlive the
command that started them, leave the terminal's process group, and get the user's first Ctrl-C/SIGTERM once, from
the command (forward_signals). The ranks' side of a stop (a flag read at a step boundary) is rank/signals.py."""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import select
import signal
import sys
import threading
from collections.abc import Callable, Iterator


def die_with_parent(through_forkserver: bool = False) -> None:
    """A rank started by this command (spawn, torchrun) gets SIGKILL when the command dies, even by SIGKILL.

    Linux's PR_SET_PDEATHSIG; elsewhere ranks rely on the launcher's own cleanup. A rank forked by the command's
    forkserver has the server as its parent, and the server lives as long as any process it forked: such a rank
    also watches the command itself (a pidfd, in a thread that sleeps until the command ends)."""
    parent = multiprocessing.parent_process()
    if parent is None or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if through_forkserver:
        try:
            watched = os.pidfd_open(parent.pid)
        except ProcessLookupError:  # the command ended before this rank started
            os._exit(1)
        threading.Thread(
            target=_killed_when_readable, args=(watched,), name="ddpexp-command-watch", daemon=True
        ).start()
    elif os.getppid() != parent.pid:  # the parent died before prctl took effect
        os._exit(1)


def has_pidfd() -> bool:
    """Whether this system can watch a process through a pidfd (Linux 5.3 and later)."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    return True


def _killed_when_readable(fd: int) -> None:
    select.select([fd], [], [])  # a pidfd turns readable when its process ends
    os.kill(os.getpid(), signal.SIGKILL)


def detach_from_terminal() -> None:
    """A rank started by this command leaves the terminal's process group: Ctrl-C reaches only the command,
    which hands it on to the ranks once (forward_signals). Otherwise each rank would see the terminal's signal and
    the forwarded one, i.e. two signals, which means "exit at once"."""
    if multiprocessing.parent_process() is not None:
        try:
            os.setpgid(0, 0)
        except OSError:  # already a group leader, or not allowed: keep the terminal's group
            pass


STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Processes started in here inherit SIGINT/SIGTERM blocked (not ignored): one that comes while a rank starts
    up, still in the terminal's group and without its handler, waits in the rank until StopSignals takes it, once
    (the terminal's and the forwarded one are the same pending signal). Ignored, it would be lost; unblocked, it
    would kill the rank (SIGTERM) or raise in its start-up (SIGINT)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class forward_signals:  # noqa: N801 - used as a context manager
    """In a parent whose ranks run elsewhere (child processes, a Slurm job): the first SIGINT/SIGTERM is handed on
    once, by `forward(signum)` (the ranks checkpoint and stop); a second one raises KeyboardInterrupt here.

    `forward` may come later (`to`), once the ranks exist: a signal received before is handed on then."""

    def __init__(self, forward: Callable[[int], None] | None = None):
        self.forward, self.received, self.signum, self.sent = forward, "", 0, False

    def _handle(self, signum: int, frame: object) -> None:
        if self.received:
            self.__exit__()
            raise KeyboardInterrupt
        self.received, self.signum = signal.Signals(signum).name, signum
        print(f"ddpexp: {self.received}: stopping at the next step boundary (again to exit at once)", file=sys.stderr)
        self._send()

    def to(self, forward: Callable[[int], None]) -> None:
        self.forward = forward
        self._send()

    def _send(self) -> None:
        # Also called from the handler: whichever of the two runs second sees `sent` and does nothing.
        if self.received and self.forward is not None and not self.sent:
            self.sent = True
            self.forward(self.signum)

    def __enter__(self) -> forward_signals:
        self.previous = {}
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}


def terminate(pids: list[int], signum: int = signal.SIGTERM) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
