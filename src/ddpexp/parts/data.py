"""Datasets behind `data=`: each factory returns Splits (train, val and the facts a model needs to fit them):
images (digits, MNIST, FashionMNIST, CIFAR-10, FakeData), tabular regression (diabetes) and character-level text
(stdlib_text), all real and offline except the torchvision sets, which download once when asked.

The parent calls `prepare()` once before any rank starts: it downloads when asked and otherwise checks that the
files are there, so a missing dataset is one clear error instead of N rank tracebacks.
"""

from __future__ import annotations

import inspect
import os
import pydoc
from collections.abc import Callable
from typing import Any

from ddpexp.exceptions import ConfigError

# torchvision dataset class name -> (folder under root, files whose presence means "downloaded")
_IDX = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
_TORCHVISION = {
    "MNIST": ("MNIST/raw", _IDX),
    "FashionMNIST": ("FashionMNIST/raw", _IDX),
    "CIFAR10": ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]),
}
_STATS = {"MNIST": ((0.1307,), (0.3081,)), "FashionMNIST": ((0.2860,), (0.3530,)),
          "CIFAR10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))}  # fmt: skip
_SHAPES = {"MNIST": (1, 28, 10), "FashionMNIST": (1, 28, 10), "CIFAR10": (3, 32, 10)}
DIGITS, DIABETES = 1797, 442  # samples in scikit-learn's load_digits(), load_diabetes()


class Splits:
    """What a data factory returns; a user factory (`data._target_`) returns one of these too: the train and val
    datasets (map-style or iterable, yielding any batch shape the task reads), optionally a test set that training
    never touches (scored only by `ddpexp eval --split test`), and the facts a model needs to fit
    them, passed to `model._target_` by name when it takes them: num_classes, in_channels and image_size for
    images; in_features and out_features for tabular data; vocab_size and block_size for text; any other names
    a user's model takes (`Splits(train, val, n_mels=80)`)."""

    def __init__(
        self,
        train: Any,
        val: Any,
        test: Any = None,
        num_classes: int | None = None,
        in_channels: int | None = None,
        image_size: int | None = None,
        **facts: Any,
    ):
        self.train, self.val, self.test = train, val, test
        images = {"num_classes": num_classes, "in_channels": in_channels, "image_size": image_size}
        self.facts: dict[str, Any] = {k: v for k, v in images.items() if v is not None} | facts

    def __getattr__(self, name: str) -> Any:  # splits.num_classes, splits.vocab_size, ...
        facts = self.__dict__.get("facts", {})
        if name in facts:
            return facts[name]
        raise AttributeError(f"Splits has no {name!r} (its facts: {', '.join(facts) or 'none'})")


def digits(val_fraction: float = 0.2, seed: int = 0, test_fraction: float | None = None) -> Splits:
    """scikit-learn's real 8x8 handwritten digits (1797 images): the offline default. test_fraction > 0 carves a
    test split too (see _carve); None or 0: none."""
    import torch

    images, target = _digits_arrays()
    x = (torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0 - 0.5) / 0.5
    y = torch.tensor(target, dtype=torch.long)
    train, val, test = _carve(len(y), val_fraction, test_fraction, seed)
    tds = torch.utils.data.TensorDataset
    return Splits(tds(x[train], y[train]), tds(x[val], y[val]), tds(x[test], y[test]) if len(test) else None,
                  num_classes=10, in_channels=1, image_size=8)  # fmt: skip


def _carve(n: int, val_fraction: float, test_fraction: float | None, seed: int) -> tuple[Any, Any, Any]:
    """Disjoint (train, val, test) indices of one seeded permutation: val its first round(n * val_fraction), test
    the next round(n * test_fraction), train the rest. With test_fraction None or 0 train and val are exactly those of
    the versions before test splits existed, so earlier runs resume and compare unchanged."""
    import torch

    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val, n_test = round(n * val_fraction), round(n * (test_fraction or 0))
    return perm[n_val + n_test :], perm[:n_val], perm[n_val : n_val + n_test]


def _digits_arrays() -> tuple[Any, Any]:
    """load_digits()'s images and targets, read from the file scikit-learn ships without importing scikit-learn
    (about 0.7 s in every rank's process); through load_digits where that file is not where 1.x keeps it."""
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sklearn")  # finds the package, runs none of it
    path = os.path.join(os.path.dirname(spec.origin or ""), "datasets", "data", "digits.csv.gz") if spec else ""
    if os.path.isfile(path):
        data = np.loadtxt(path, delimiter=",")  # what load_digits reads: 64 pixels, then the digit
        return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.images, d.target


def torchvision_dataset(
    name: str,
    root: str = "data",
    download: bool = False,
    in_memory: bool | None = None,
    in_memory_max_mb: float = 4096,
    crop_padding: int = 0,
    hflip: bool = False,
) -> Splits:
    """MNIST, FashionMNIST or CIFAR10. In memory (in_memory=null: when the files take <= in_memory_max_mb): decoded
    once to uint8 tensors, cached under root, normalized and augmented per batch. Otherwise torchvision's own
    classes with per-sample transforms (RandomCrop/RandomHorizontalFlip, ToTensor, Normalize) for a DataLoader."""
    mean, std = _STATS[name]
    in_channels, image_size, num_classes = _SHAPES[name]
    if fits_in_memory(name, root, in_memory, in_memory_max_mb):  # from the cache: no torchvision import (~4 s)
        from ddpexp.parts.inmemory import TensorImages

        train, val = (tensors(name, root, split) for split in (True, False))
        return Splits(
            TensorImages(*train, mean, std, crop_padding, hflip), TensorImages(*val, mean, std),
            num_classes=num_classes, in_channels=in_channels, image_size=image_size,
        )  # fmt: skip
    import torchvision
    from torchvision import transforms

    tf = [transforms.ToTensor(), transforms.Normalize(mean, std)]
    augment = [transforms.RandomCrop(image_size, padding=crop_padding)] if crop_padding else []
    augment += [transforms.RandomHorizontalFlip()] if hflip else []
    cls = getattr(torchvision.datasets, name)
    train = cls(root, train=True, transform=transforms.Compose(augment + tf), download=download)
    val = cls(root, train=False, transform=transforms.Compose(tf), download=download)
    return Splits(train, val, num_classes=num_classes, in_channels=in_channels, image_size=image_size)


def _sources(name: str, root: str) -> list[str]:
    folder, files = _TORCHVISION[name]
    return [os.path.join(root, folder, f) for f in files]


def fits_in_memory(name: str, root: str, in_memory: bool | None, max_mb: float) -> bool:
    if in_memory is not None:
        return in_memory
    return sum(os.path.getsize(p) for p in _sources(name, root) if os.path.exists(p)) <= max_mb * 2**20


def tensors(name: str, root: str, train: bool) -> tuple[Any, Any]:
    """(uint8 images [N, C, H, W], int64 labels) of one split, decoded by torchvision's class once, then cached."""
    from ddpexp.parts.inmemory import cached

    def decode() -> tuple[Any, Any]:
        import torch
        import torchvision

        ds = getattr(torchvision.datasets, name)(root, train=train)
        images = torch.as_tensor(ds.data)
        images = images.unsqueeze(1) if images.dim() == 3 else images.permute(0, 3, 1, 2)  # CIFAR: N, H, W, C
        return images.contiguous(), torch.as_tensor(ds.targets, dtype=torch.long)

    return cached(name, root, "train" if train else "test", decode, _sources(name, root))


def fake(
    train_size: int = 1000,
    val_size: int = 200,
    image_size: int = 28,
    in_channels: int = 1,
    num_classes: int = 10,
    crop_padding: int = 0,
    hflip: bool = False,
) -> Splits:
    """torchvision FakeData: random images, for smoke tests and throughput checks (augmentation keys as above)."""
    from torchvision import datasets, transforms

    shape = (in_channels, image_size, image_size)
    augment = [transforms.RandomCrop(image_size, padding=crop_padding)] if crop_padding else []
    augment += [transforms.RandomHorizontalFlip()] if hflip else []
    tf = transforms.ToTensor()
    train = datasets.FakeData(train_size, shape, num_classes, transforms.Compose([*augment, tf]), random_offset=0)
    val = datasets.FakeData(val_size, shape, num_classes, transform=tf, random_offset=train_size)
    return Splits(train, val, num_classes=num_classes, in_channels=in_channels, image_size=image_size)


def diabetes(val_fraction: float = 0.2, seed: int = 0, test_fraction: float | None = None) -> Splits:
    """scikit-learn's diabetes data: 442 patients, 10 features, a measure of disease progression one year later.
    Real regression data, offline. Features and target are standardized with the train split's mean and std, so
    predicting the mean scores val/mse of about 1 and val/r2 of about 0. test_fraction > 0: a test split (_carve)."""
    import torch
    from sklearn.datasets import load_diabetes

    d = load_diabetes()
    x = torch.tensor(d.data, dtype=torch.float32)
    y = torch.tensor(d.target, dtype=torch.float32).unsqueeze(1)
    train, val, test = _carve(len(y), val_fraction, test_fraction, seed)
    (mx, sx), (my, sy) = ((t[train].mean(0), t[train].std(0)) for t in (x, y))
    x, y = (x - mx) / sx, (y - my) / sy
    tds = torch.utils.data.TensorDataset
    test_set = tds(x[test], y[test]) if len(test) else None
    return Splits(tds(x[train], y[train]), tds(x[val], y[val]), test_set, in_features=10, out_features=1)


# Characters of stdlib_text: tab, newline and printable ASCII; every other character is one more id.
VOCAB = "\t\n" + "".join(chr(c) for c in range(32, 127))


def stdlib_text(
    block_size: int = 64, max_chars: int = 300_000, val_fraction: float = 0.1, test_fraction: float | None = None
) -> Splits:
    """Character-level text that every Python install has: the standard library's own source (the .py files
    beside the `os` module, by name, up to max_chars characters; so it depends on the Python version). Samples
    are non-overlapping windows of block_size characters, targets the same windows shifted by one character;
    the last val_fraction of the windows (the end of the text) is the val set; test_fraction > 0 takes that many
    windows from the very end as a test set, after the val set (None or 0: no test set)."""
    import numpy as np
    import torch

    folder, parts, size = os.path.dirname(os.__file__), [], 0
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py") and size < max_chars:
            with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
                parts.append(f.read())
            size += len(parts[-1])
    codes = np.frombuffer("".join(parts)[:max_chars].encode("utf-32-le"), dtype=np.uint32)
    table = np.full(128, len(VOCAB), dtype=np.int64)
    table[[ord(c) for c in VOCAB]] = np.arange(len(VOCAB))
    ids = torch.from_numpy(np.where(codes < 128, table[np.minimum(codes, 127)], len(VOCAB)))
    windows = (len(ids) - 1) // block_size
    x, y = (ids[o : o + windows * block_size].view(windows, block_size) for o in (0, 1))
    n_val, n_test = round(windows * val_fraction), round(windows * (test_fraction or 0))
    if not (0 < n_val and n_val + n_test < windows):
        raise ConfigError(
            f"data: {len(ids)} characters make {windows} windows of block_size={block_size}; val_fraction="
            f"{val_fraction} and test_fraction={test_fraction} must leave >= 1 to each split (raise data.max_chars)"
        )
    tds, end = torch.utils.data.TensorDataset, windows - n_test
    train, val = tds(x[: end - n_val], y[: end - n_val]), tds(x[end - n_val : end], y[end - n_val : end])
    test = tds(x[end:], y[end:]) if n_test else None
    return Splits(train, val, test, vocab_size=len(VOCAB) + 1, block_size=block_size)


def prepare(data_cfg: dict) -> None:
    """In the parent, before ranks start: download a torchvision dataset if asked, else check its files; then
    build the in-memory cache if that path applies."""
    target = data_cfg.get("_target_")
    if not isinstance(target, str) or pydoc.locate(target) is not torchvision_dataset:  # by the object it names
        return
    example(data_cfg)
    name, root = data_cfg["name"], os.path.abspath(data_cfg.get("root", "data"))
    max_mb = data_cfg.get("in_memory_max_mb", 4096)
    if not isinstance(max_mb, (int, float)) or max_mb <= 0:
        raise ConfigError(f"data.in_memory_max_mb={max_mb!r}: must be > 0")
    folder, files = _TORCHVISION[name]
    missing = [f for f in files if not os.path.exists(os.path.join(root, folder, f))]
    if missing and not data_cfg.get("download", False):
        raise ConfigError(
            f"data.root={root}: {name} not found (missing {os.path.join(folder, missing[0])}); "
            f"set data.download=true, or put the files there"
        )
    if missing:
        try:
            torchvision_dataset(name, root, download=True, in_memory=False)
        except Exception as e:  # torchvision raises URLError, HTTPError or RuntimeError depending on the mirror
            raise ConfigError(f"data.download=true: could not download {name} to {root} ({e}); no network?") from None
    if fits_in_memory(name, root, data_cfg.get("in_memory"), max_mb):
        for train in (True, False):  # decoded and cached once here, not by every rank at once
            tensors(name, root, train)


def example(data_cfg: dict) -> tuple[dict[str, Any], Callable[[int], Any]] | None:
    """The facts of a built-in `data=` and a function making a batch of n samples of its shapes and dtypes (under
    `torch.device("meta")` nothing is allocated), from its config alone, once the keys that size it are checked
    (nothing is read); None for a user's factory, known only once it is built, in the ranks.

    One training sample is enough for a step on every rank: DistributedSampler pads, and the last batch is kept."""
    import torch

    factory = pydoc.locate(data_cfg["_target_"])  # by what the path names: ddpexp.data.digits is this module's
    if factory not in (digits, torchvision_dataset, fake, diabetes, stdlib_text):
        return None
    kwargs = {k: p.default for k, p in inspect.signature(factory).parameters.items()} | data_cfg
    if "crop_padding" in kwargs:
        _check_int(kwargs, "crop_padding", 0, "(0: no random crop)")
    if factory in (digits, diabetes):
        total, what = (DIGITS, "digits") if factory is digits else (DIABETES, "patients")
        fraction, test = kwargs["val_fraction"], kwargs["test_fraction"] or 0  # null: no test split
        n_val = round(total * fraction) if isinstance(fraction, (int, float)) else 0
        if not 0 < n_val < total:
            raise ConfigError(f"data.val_fraction={fraction!r}: must leave >= 1 of the {total} {what} to each split")
        if not isinstance(test, (int, float)) or test < 0 or n_val + round(total * test) >= total:
            raise ConfigError(f"data.test_fraction={test!r}: must be >= 0 and leave >= 1 of the {total} {what} to train")  # fmt: skip
    if factory is diabetes:
        return {"in_features": 10, "out_features": 1}, lambda n: (torch.empty(n, 10), torch.empty(n, 1))
    if factory is stdlib_text:
        _check_int(kwargs, "block_size", 1)
        _check_int(kwargs, "max_chars", 2)
        fraction = kwargs["val_fraction"]
        if not (isinstance(fraction, (int, float)) and 0 < fraction < 1):
            raise ConfigError(f"data.val_fraction={fraction!r}: must be > 0 and < 1")
        test = kwargs["test_fraction"] or 0  # null: no test split
        if not (isinstance(test, (int, float)) and 0 <= test < 1 - fraction):
            raise ConfigError(f"data.test_fraction={test!r}: must be >= 0 and < 1 - val_fraction")
        t = kwargs["block_size"]
        tokens = lambda n: (torch.zeros(n, t, dtype=torch.long), torch.zeros(n, t, dtype=torch.long))  # noqa: E731
        return {"vocab_size": len(VOCAB) + 1, "block_size": t}, tokens
    if factory is digits:
        c, size, classes = 1, 8, 10
    elif factory is torchvision_dataset:
        if data_cfg.get("name") not in _SHAPES:
            raise ConfigError(f"data.name={data_cfg.get('name')!r}: must be one of {', '.join(_SHAPES)}")
        c, size, classes = _SHAPES[kwargs["name"]]
    else:
        for key in ("train_size", "val_size", "image_size", "in_channels", "num_classes"):
            _check_int(kwargs, key, 1)
        c, size, classes = kwargs["in_channels"], kwargs["image_size"], kwargs["num_classes"]
    images = lambda n: (torch.empty(n, c, size, size), torch.zeros(n, dtype=torch.long))  # noqa: E731
    return {"num_classes": classes, "in_channels": c, "image_size": size}, images


def _check_int(kwargs: dict, key: str, low: int, why: str = "") -> None:
    value = kwargs[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"data.{key}={value!r}: must be an int >= {low} {why}".rstrip())
