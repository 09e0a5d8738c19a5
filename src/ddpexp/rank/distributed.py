"""The process group and the collectives the loop needs: start and teardown, the per-step agreement of the
ranks (stop signals, the end of uneven epochs, how many items a step trains on), gathers and replica checks.
Every helper works with one process too."""

from __future__ import annotations

import resource
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ddpexp.rank.signals import REQUEUE, STOP


def init(device: torch.device, timeout_s: float) -> Any:
    """Join the job's process group (env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); NCCL on a GPU, gloo on
    the CPU. Returns a gloo group for the per-step agreement, which stays on the CPU, off the GPU's stream."""
    timeout = timedelta(seconds=timeout_s)
    cuda = device.type == "cuda"
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method="env://", timeout=timeout, device_id=device if cuda else None
    )
    return dist.new_group(backend="gloo", timeout=timeout)  # new_group's default timeout is 30 min


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class StepAgreement:
    """Before each optimizer step every rank learns whether any rank was asked to stop (then all checkpoint after
    the same step) and, when shards may be uneven, whether any rank ran out of batches (then all end the epoch)
    and how many samples the step trains on over all ranks: one tiny CPU all-reduce per step. Without it, a rank
    that stops alone leaves the others in a collective.

    With equal shards (every rank's loader has the same length: DistributedSampler pads), nobody runs dry alone
    and each step's micro-batches have the same sizes on every rank, so the stop flags are all-reduced in the
    background during the step and read after it: the same decision, without a second rendezvous per step (a
    blocking one cost 2-4 % of a 2-rank CPU step here)."""

    def __init__(self, group: Any, n_batches: int | None):
        self.group = group
        n = -1 if n_batches is None else n_batches
        lengths = torch.tensor([n, -n], dtype=torch.int64)
        dist.all_reduce(lengths, op=dist.ReduceOp.MAX, group=group)  # [max, -min] over the ranks
        self.even = n_batches is not None and int(lengths[0]) == -int(lengths[1])
        self.flags, self.work, self.reason = torch.zeros(4, dtype=torch.int64), None, 0

    def before_step(self, reason: int, micro_batches: int, samples: int) -> tuple[bool, int | None]:
        """Post this rank's flags and its step's micro-batch and sample counts (no micro-batch: it ran dry).
        Returns whether the epoch ends here for every rank, and the samples of the step over all ranks (None when
        the shards are even: then it is the world size times this rank's)."""
        if self.even:
            if not micro_batches:
                return True, None  # every rank ran dry at this same batch
            self.flags.copy_(torch.tensor([reason == STOP, reason == REQUEUE, 0, 0]))
            self.work = dist.all_reduce(self.flags, group=self.group, async_op=True)
            return False, None
        self.flags.copy_(torch.tensor([reason == STOP, reason == REQUEUE, not micro_batches, samples]))
        dist.all_reduce(self.flags, group=self.group)
        self.reason = self._reason()
        return bool(self.flags[2]), int(self.flags[3])

    def after_step(self) -> int:
        """The stop reason agreed for the step just taken (0: go on)."""
        if self.work is not None:
            self.work.wait()
            self.reason, self.work = self._reason(), None
        return self.reason

    def _reason(self) -> int:
        return REQUEUE if self.flags[1] else STOP if self.flags[0] else 0


def rank() -> int:
    return dist.get_rank()


def barrier() -> None:
    """Every rank here before any goes on (a tiny all-reduce: gloo's and NCCL's alike)."""
    dist.all_reduce(torch.zeros(1, device="cuda" if dist.get_backend() == "nccl" else "cpu"))


def all_gather(obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj: Any) -> Any:
    """Rank 0's `obj` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_buffers(model: torch.nn.Module) -> None:
    """Rank 0's buffers (BatchNorm's running stats) on every rank, as DDP's next forward would do."""
    for buffer in model.buffers():
        dist.broadcast(buffer, 0)


def compare_replicas(model: torch.nn.Module) -> dict[str, Any]:
    """All-gather every rank's flattened parameters and compare them with rank 0's."""
    flat = torch.cat([p.detach().flatten().float() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    diff = max((g - gathered[0]).abs().max().item() for g in gathered)
    return {"identical": diff == 0.0, "max_abs_diff": diff, "numel": flat.numel()}


def peak_rss_mb() -> list[float]:
    """Every rank's peak resident memory (MB), gathered to all."""
    mine = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return all_gather(round(mine, 1))
