"""The two hand-written DDP loops ddpexp is measured against; plain PyTorch, nothing imported from ddpexp.

    python -m ddpexp.bench.loops {tutorial,tight} --root R --world-size N --batch B --steps S --warmup W --out DIR

tutorial (A): the tutorial's recipe as written: mp.spawn, torchvision's MNIST with ToTensor + Normalize per sample,
    DataLoader + DistributedSampler + set_epoch, DDP; no thread settings.
tight (B): the same model, seed and data order (DistributedSampler's), over tensors normalized once; batches by
    index slicing; threads per rank = cores // ranks, one inter-op thread. What a careful engineer writes by hand.

Both write DIR/result.json (first_step_at, steady samples/s over the steps after `warmup`, peak RSS per rank) and
DIR/weights.pt (rank 0's final state_dict). --device cuda: one GPU per rank, NCCL, data moved to the GPU (the
tutorial's per-batch copy for A, the whole set once for B)."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import resource
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

MEAN, STD = 0.1307, 0.3081


def build_model(name: str) -> nn.Module:
    if name == "cnn":  # ddpexp's model=cnn, layer for layer (so the same seed gives the same weights)
        return nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Flatten(),
            nn.Linear(64 * 14 * 14, 128), nn.ReLU(),
            nn.Linear(128, 10),
        )  # fmt: skip
    if name == "resnet18":  # ddpexp's model=resnet18 on 28 px: 3x3 stem, no max-pool
        import torchvision

        net = torchvision.models.resnet18(weights=None, num_classes=10)
        net.conv1 = nn.Conv2d(1, 64, 3, 1, 1, bias=False)
        net.maxpool = nn.Identity()
        return net
    raise SystemExit(f"bench: model={name!r}: must be cnn or resnet18")


def _batches_tutorial(args: argparse.Namespace, rank: int, world_size: int, device: torch.device):  # type: ignore[no-untyped-def]
    from torchvision import datasets, transforms

    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((MEAN,), (STD,))])
    dataset = datasets.MNIST(args.root, train=True, transform=tf)
    sampler = DistributedSampler(dataset, world_size, rank, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler)
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        for x, y in loader:
            yield x.to(device), y.to(device)


def _batches_tight(args: argparse.Namespace, rank: int, world_size: int, device: torch.device):  # type: ignore[no-untyped-def]
    from torchvision import datasets

    raw = datasets.MNIST(args.root, train=True)
    x = raw.data.unsqueeze(1).float().div(255).sub(torch.tensor(MEAN)).div(torch.tensor(STD)).to(device)
    y = raw.targets.to(device)
    sampler = DistributedSampler(range(len(y)), world_size, rank, shuffle=True, seed=args.seed)
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler), device=device)
        for start in range(0, len(order), args.batch):
            idx = order[start : start + args.batch]
            yield x[idx], y[idx]


def _rank(rank: int, args: argparse.Namespace) -> None:
    world_size = args.world_size
    if args.loop == "tight":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        torch.set_num_interop_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # the store main() hosts: rank 0 joins it as a client
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else lambda: None  # CUDA runs ahead of the host: time what it finished
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world_size)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    model = build_model(args.model).to(device)
    ddp = DDP(model, device_ids=[rank] if cuda else None)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.01)
    batches = (_batches_tight if args.loop == "tight" else _batches_tutorial)(args, rank, world_size, device)
    first_step_at = steady_from = None
    for step in range(1, args.steps + 1):
        x, y = next(batches)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 1:
            sync()
            first_step_at = time.time()
        if step == args.warmup:
            sync()
            steady_from = time.perf_counter()
    sync()
    elapsed = time.perf_counter() - steady_from  # type: ignore[operator]
    rss: list = [None] * world_size
    dist.all_gather_object(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save(model.state_dict(), os.path.join(args.out, "weights.pt"))
        result = {
            "loop": args.loop,
            "first_step_at": first_step_at,
            "samples_per_s": (args.steps - args.warmup) * args.batch * world_size / elapsed,
            "peak_rss_mb": [round(r, 1) for r in rss],
            "threads_per_rank": torch.get_num_threads(),
        }
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()


def parse_args(prog: str, description: str, loops: list[str] | None = None) -> argparse.Namespace:
    """The arguments every benchmark loop takes (A and B here, D in lightning_loop)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    if loops:
        p.add_argument("loop", choices=loops)
    p.add_argument("--root", required=True)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--model", default="cnn")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=0, help="the rendezvous store's port (0: a free one, bound here)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if not 1 <= args.warmup < args.steps:
        raise SystemExit(f"bench: --warmup={args.warmup}: must be >= 1 and < --steps={args.steps}")
    return args


def main() -> None:
    args = parse_args("python -m ddpexp.bench.loops", __doc__.split("\n\n")[0], ["tutorial", "tight"])
    # The store bound here before the ranks start: a port picked free and bound later by rank 0 can be taken
    # meanwhile (another job's ephemeral connection), which failed a run with EADDRINUSE.
    store = dist.TCPStore("127.0.0.1", args.port, is_master=True, wait_for_workers=False)
    args.port = store.port
    mp.spawn(_rank, args=(args,), nprocs=args.world_size)


if __name__ == "__main__":
    main()
