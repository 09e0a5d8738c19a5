"""The in-memory data path against torchvision's own classes and the DataLoader path: same values, same order,
same resume position; its cache; per-batch augmentation; the GPU speed defaults' choices."""

from __future__ import annotations

import math
import os
from functools import partial
from pathlib import Path

import pytest
import torch
from torchvision import datasets, transforms

from conftest import load_weights, read_summary, run_ddpexp
from ddpexp.parts import data, loaders
from ddpexp.parts.inmemory import CACHE_DIR, augment, batchable
from ddpexp.parts.loaders import InMemoryLoader, eval_batches
from test_e2e import write_mnist_idx

CPU = torch.device("cpu")


@pytest.fixture
def mnist_root(tmp_path: Path) -> Path:
    write_mnist_idx(tmp_path, n_train=300, n_test=101)
    return tmp_path


def test_in_memory_values_equal_torchvision_transforms(mnist_root: Path) -> None:
    splits = data.torchvision_dataset("MNIST", str(mnist_root), in_memory=True)
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    reference = datasets.MNIST(str(mnist_root), train=True, transform=tf)
    idx = torch.tensor([0, 7, 299, 7])
    x, y = splits.train.batch(idx)
    assert x.shape == (4, 1, 28, 28) and x.dtype == torch.float32
    for row, i in enumerate(idx.tolist()):
        assert torch.equal(x[row], reference[i][0]) and int(y[row]) == reference[i][1]
    assert torch.equal(splits.val[100][0], datasets.MNIST(str(mnist_root), train=False, transform=tf)[100][0])
    assert (splits.in_channels, splits.image_size, len(splits.train), len(splits.val)) == (1, 28, 300, 101)


@pytest.mark.parametrize("world_size,batch", [(1, 64), (2, 32), (3, 50)])
def test_in_memory_batches_equal_dataloader_path_and_resume_slices(mnist_root, world_size, batch) -> None:
    memory = data.torchvision_dataset("MNIST", str(mnist_root), in_memory=True)
    loader_path = data.torchvision_dataset("MNIST", str(mnist_root), in_memory=False)
    for rank in range(world_size):
        fast = InMemoryLoader(batchable(memory.train), batch, rank, world_size, seed=5, device=CPU)
        plain = loaders.TrainLoader(loader_path.train, batch, rank, world_size, seed=5)
        assert len(fast) == len(plain) == math.ceil(math.ceil(300 / world_size) / batch)
        for epoch, start in ((0, 0), (1, 0), (1, 2)):
            fast.set_epoch(epoch, start)
            plain.set_epoch(epoch, start)
            got, want = list(fast), list(plain)
            assert len(got) == len(want) == len(fast) - start
            for ((xf, yf), own_f, all_f), ((xp, yp), own_p, all_p) in zip(got, want):
                assert torch.equal(xf, xp) and torch.equal(yf, yp) and (own_f, all_f) == (own_p, all_p)
                assert own_f == len(yf)
            assert sum(total for _, _, total in got) == 300 - start * batch * world_size  # the global order's rest
    # different epochs give different orders (set_epoch reaches the permutation)
    fast.set_epoch(0)
    first = next(iter(fast))[0][1]
    fast.set_epoch(1)
    assert not torch.equal(first, next(iter(fast))[0][1])


def test_a_samples_augmentation_and_slices_are_the_same_at_any_world_size() -> None:
    """Random augmentation is keyed by (seed, epoch, sample index): a sample is cropped and flipped alike at 1 and 3
    ranks (in memory), and a DataLoader dataset's own torch RNG draws are too, the main process's RNG untouched."""
    from ddpexp.parts.inmemory import TensorImages

    images = TensorImages(torch.randint(0, 256, (40, 1, 8, 8), dtype=torch.uint8), torch.arange(40), (0.5,), (0.5,),
                          crop_padding=2, hflip=True)  # fmt: skip

    def in_memory(world_size: int, epoch: int) -> dict[int, torch.Tensor]:
        seen = {}
        for rank in range(world_size):
            loader = InMemoryLoader(images, 5, rank, world_size, seed=7, device=CPU)
            loader.set_epoch(epoch)
            for (x, y), own, _ in loader:
                seen.update({int(i): xi for i, xi in zip(y[:own], x[:own])})
        return seen

    one, three = in_memory(1, 1), in_memory(3, 1)
    assert sorted(one) == sorted(three) == list(range(40)) and all(torch.equal(one[i], three[i]) for i in one)
    assert any(not torch.equal(one[i], in_memory(1, 2)[i]) for i in one)  # another epoch, other draws

    class Noisy(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 30

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            return torch.rand(3), i  # a user's random transform, on torch's RNG

    def through_dataloader(world_size: int) -> dict[int, torch.Tensor]:
        seen = {}
        for rank in range(world_size):
            loader = loaders.TrainLoader(Noisy(), 4, rank, world_size, seed=7)
            loader.set_epoch(1)
            for (x, y), _, _ in loader:
                seen.update({int(i): xi for i, xi in zip(y, x)})
        return seen

    torch.manual_seed(11)
    a = through_dataloader(1)
    after = torch.rand(1)
    torch.manual_seed(11)
    torch.empty((), dtype=torch.int64).random_()  # the DataLoader's own draw of its base seed, as ever
    assert torch.equal(after, torch.rand(1))  # and nothing else: the per-sample seeds left the RNG as it was
    b = through_dataloader(2)
    assert sorted(a) == sorted(b) == list(range(30)) and all(torch.equal(a[i], b[i]) for i in a)


def test_the_global_order_repeats_and_drops_nothing_at_any_world_size() -> None:
    """1,438 digits at 3 ranks of 21: no padding (DistributedSampler repeats 2), slices differing by one at most,
    a rank with an empty slice loads rank 0's and trains on none; drop_last leaves out the short last one."""
    for world_size, batch in ((1, 63), (3, 21), (4, 500), (3, 1)):
        got = []
        for rank in range(world_size):
            order = loaders.GlobalOrder(1438, batch, rank, world_size, seed=3)
            order.set_epoch(2, start=100)
            got.append([(m.tolist(), own, total) for m, own, total in order])
        trained = sorted(i for blocks in got for m, own, _ in blocks for i in m[:own])
        g = torch.Generator().manual_seed(3 + 2)
        assert trained == sorted(torch.randperm(1438, generator=g)[100:].tolist())  # each of the rest once
        for step in zip(*got):  # the ranks' slices of one global micro-batch
            owns = [own for _, own, _ in step]
            assert max(owns) - min(owns) <= 1 and sum(owns) == step[0][2]
    tiny = [list(loaders.GlobalOrder(2, 4, rank, 3, seed=0)) for rank in range(3)]
    assert [t[0][1:] for t in tiny] == [(1, 2), (1, 2), (0, 2)] and torch.equal(tiny[2][0][0], tiny[0][0][0])
    dropped = loaders.GlobalOrder(1438, 21, 0, 3, seed=0, drop_last=True)
    assert len(dropped) == 1438 // 63 and all(total == 63 for _, _, total in dropped)


def test_digits_tensor_dataset_goes_through_the_in_memory_loader() -> None:
    class Cfg:
        batch_size, seed, num_workers = 100, 0, 0

    splits = data.digits()
    loader = loaders.train_loader(splits, Cfg, 0, 2, CPU)
    assert isinstance(loader, InMemoryLoader) and len(loader) == 8  # 1438 / (2 x 100)
    (x, y), own, total = next(iter(loader))
    assert x.shape == (100, 1, 8, 8) and y.dtype == torch.long and (own, total) == (100, 200)


def test_eval_batches_score_every_sample_once(mnist_root: Path) -> None:
    val = data.torchvision_dataset("MNIST", str(mnist_root), in_memory=True).val
    plain = data.torchvision_dataset("MNIST", str(mnist_root), in_memory=False).val
    for source in (val, plain):
        labels = []
        for rank in range(3):
            labels += [y for _, ys in eval_batches(source, rank, 3, 16, CPU) for y in ys.tolist()]
        assert sorted(labels) == sorted(int(y) for y in plain.targets)


def test_cache_is_written_reused_and_rebuilt_when_the_source_changes(mnist_root: Path) -> None:
    data.prepare({"_target_": "ddpexp.data.torchvision_dataset", "name": "MNIST", "root": str(mnist_root)})
    cache = mnist_root / CACHE_DIR / "MNIST-train.pt"
    assert cache.exists() and (mnist_root / CACHE_DIR / "MNIST-test.pt").exists()
    os.utime(cache, (1, 1))  # an old mtime: a rewrite would change it
    images, _ = data.tensors("MNIST", str(mnist_root), train=True)
    assert cache.stat().st_mtime == 1 and images.shape == (300, 1, 28, 28)

    raw = mnist_root / "MNIST" / "raw"
    write_mnist_idx(mnist_root / "other", n_train=120, n_test=10)  # new source files, another size
    for f in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"):
        (raw / f).write_bytes((mnist_root / "other" / "MNIST" / "raw" / f).read_bytes())
    images, labels = data.tensors("MNIST", str(mnist_root), train=True)
    assert images.shape == (120, 1, 28, 28) and len(labels) == 120 and cache.stat().st_mtime != 1

    cache.write_bytes(b"truncated")  # a broken cache is rebuilt, never trusted
    assert data.tensors("MNIST", str(mnist_root), train=True)[0].shape == (120, 1, 28, 28)


def test_in_memory_threshold(mnist_root: Path) -> None:
    small = data.torchvision_dataset("MNIST", str(mnist_root), in_memory_max_mb=1)  # the files take ~0.3 MB
    large = data.torchvision_dataset("MNIST", str(mnist_root), in_memory_max_mb=0.1)
    assert batchable(small.train) is not None and batchable(large.train) is None


def test_augment_is_a_padded_crop_and_a_flip_per_sample() -> None:
    torch.manual_seed(0)
    pixels = torch.randint(1, 256, (64, 3, 8, 8), dtype=torch.uint8)
    out = augment(pixels, crop_padding=2, hflip=True)
    assert out.shape == pixels.shape and out.dtype == torch.uint8
    padded = torch.nn.functional.pad(pixels, (2, 2, 2, 2))
    shifts, flips = set(), 0
    for i in range(64):
        found = [
            (dy, dx, f)
            for dy in range(5)
            for dx in range(5)
            for f in (False, True)
            if torch.equal(out[i], (lambda w: w.flip(2) if f else w)(padded[i, :, dy : dy + 8, dx : dx + 8]))
        ]
        assert found, f"sample {i} is not a crop of its padded image"
        shifts.add(found[0][:2])
        flips += found[0][2]
    assert len(shifts) > 5 and 10 < flips < 54  # random per sample, not one shift/flip for the batch
    assert torch.equal(augment(pixels, 0, False), pixels)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_in_memory_and_dataloader_paths_train_the_same_weights(mnist_root: Path) -> None:
    """End to end, 2 spawn ranks: the fast path changes nothing but speed."""
    common = ["gpus=2", "data=mnist", f"data.root={mnist_root}", "max_steps=6", "epochs=2", "batch_size=32"]
    jobs = {}
    for in_memory in ("true", "false"):
        jobs[in_memory] = mnist_root / f"job-{in_memory}"
        run_ddpexp(*common, f"data.in_memory={in_memory}", f"hydra.run.dir={jobs[in_memory]}", cwd=mnist_root)
    assert read_summary(jobs["true"])["data_path"] == "InMemoryLoader"
    assert read_summary(jobs["false"])["data_path"] == "TrainLoader"
    fast, plain = load_weights(jobs["true"]), load_weights(jobs["false"])
    assert fast.keys() == plain.keys() and all(torch.equal(fast[k], plain[k]) for k in fast)
    assert read_summary(jobs["true"])["final"] == read_summary(jobs["false"])["final"]


def test_speed_defaults_are_fp32_on_cpu_and_fast_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from ddpexp.config import Config
    from ddpexp.parts.models import cnn, mlp
    from ddpexp.parts.optim import fused_kwargs
    from ddpexp.rank.speed import speed_defaults

    cfg = Config(
        launcher={"_target_": "x"},
        model={"_target_": "x"},
        data={"_target_": "x"},
        task={"_target_": "x"},
        optimizer={"_target_": "x"},
    )
    conv, dense = cnn(10, 1, 28), mlp(10, 1, 28)
    assert speed_defaults(cfg, CPU, conv) == ("fp32", False)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    gpu = torch.device("cuda", 0)
    assert speed_defaults(cfg, gpu, conv) == ("bf16", True)
    assert speed_defaults(cfg, gpu, dense) == ("bf16", False)  # no convolution: nothing for channels_last to do
    cfg.precision, cfg.channels_last = "fp32", False  # an explicit choice wins
    assert speed_defaults(cfg, gpu, conv) == ("fp32", False)

    adamw = partial(torch.optim.AdamW, lr=1e-3)
    assert fused_kwargs(adamw, gpu) == {"fused": True} and fused_kwargs(adamw, CPU) == {}
    assert fused_kwargs(partial(torch.optim.AdamW, foreach=True), gpu) == {}  # the config chose


def test_digits_are_scikit_learns_load_digits() -> None:
    """The digits are read from scikit-learn's own file without importing it: the same images and labels."""
    from sklearn.datasets import load_digits

    from ddpexp.parts.data import _digits_arrays

    images, target = _digits_arrays()
    ref = load_digits()
    assert images.shape == (1797, 8, 8) and (images == ref.images).all() and (target == ref.target).all()
