"""Test-only faults (`debug.*`): a rank that raises, is killed or hangs after a given step, rank 0 killed while it
writes a checkpoint; a slowed-down step."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any


class DebugFaults:
    """Test-only faults (`debug.*`), fired after an optimizer step; kill and hang only in a run not resumed."""

    def __init__(self, cfg: Any, rank: int, resumed: bool):
        self.cfg, self.mine, self.resumed = cfg, rank == cfg.fail_rank, resumed

    def in_save(self, step: int) -> Callable[[], None] | None:
        """What rank 0 runs midway through writing step `step`'s checkpoint (its bytes written, not yet renamed):
        SIGKILL with debug.kill_in_save_at_step=step."""
        if self.cfg.kill_in_save_at_step == step and not self.resumed:
            return lambda: os.kill(os.getpid(), signal.SIGKILL)
        return None

    def after_step(self, step: int) -> None:
        if self.cfg.step_delay_s:
            time.sleep(self.cfg.step_delay_s)
        if not self.mine:
            return
        if self.cfg.fail_at_step == step:
            raise RuntimeError(f"debug.fail_at_step={step}: rank {self.cfg.fail_rank} fails on purpose")
        if self.cfg.kill_at_step == step and not self.resumed:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.cfg.hang_at_step == step and not self.resumed:
            logging.getLogger("ddpexp").warning(
                "debug.hang_at_step=%d: rank %d hangs on purpose", step, self.cfg.fail_rank
            )
            while True:
                time.sleep(3600)
