"""A rank's stop signals: SIGINT/SIGTERM (and a scheduler's requeue signal) set a flag that the loop reads at a step
boundary, where the ranks agree, checkpoint once and stop. The command's side (handing the signal on to the ranks)
is launchers/processes.py."""

from __future__ import annotations

import os
import signal

STOP, REQUEUE = 1, 2  # stop reasons: a requeue wins over a plain stop when ranks were told both


class StopSignals:
    """SIGINT/SIGTERM (and the scheduler's requeue signal) only set a flag, read by the loop at a step boundary,
    where the ranks agree, checkpoint once and exit. A second signal exits at once."""

    def __init__(self, requeue_signal: str | None = None):
        self.reason, self.signame = 0, ""
        self.requeue = getattr(signal, f"SIG{requeue_signal}") if requeue_signal else None
        sigs = {signal.SIGINT, signal.SIGTERM} | ({self.requeue} if self.requeue else set())
        self.previous = {}
        for sig in sigs:
            if signal.getsignal(sig) is signal.SIG_IGN and sig == signal.SIGINT:
                continue  # started with SIGINT ignored (nohup, `cmd &`): keep it so
            self.previous[sig] = signal.signal(sig, self._handle)
        # A rank started with them blocked (stop_signals_blocked) takes one that came meanwhile now.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, sigs)

    def _handle(self, signum: int, frame: object) -> None:
        if self.reason:
            os._exit(128 + signum)
        self.reason = REQUEUE if signum == self.requeue else STOP
        self.signame = signal.Signals(signum).name

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
