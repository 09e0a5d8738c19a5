"""Models behind `model=`: an MLP for images or tabular data, small CNN and torchvision ResNets with the input
stem adapted to the images, and a nanoGPT-sized causal transformer for text."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def mlp(
    num_classes: int | None = None,
    in_channels: int | None = None,
    image_size: int | None = None,
    hidden: tuple[int, ...] = (256, 256),
    dropout: float = 0.0,
    in_features: int | None = None,
    out_features: int | None = None,
) -> Any:
    """Flatten, then Linear-ReLU layers of `hidden` widths: images (in_channels x image_size^2 inputs,
    num_classes outputs) or tabular data (in_features, out_features)."""
    from torch import nn

    from ddpexp.config import check, is_number

    check(_counts(hidden), f"model.hidden={hidden!r}: must be a list of ints >= 1 (layer widths)")
    check(is_number(dropout) and 0 <= dropout < 1, f"model.dropout={dropout!r}: must be >= 0 and < 1")
    images = None not in (in_channels, image_size)
    check(
        (in_features is not None or images) and (out_features or num_classes) is not None,
        "model=mlp: the data gives neither in_features/out_features nor in_channels/image_size/num_classes",
    )
    inputs = in_features if in_features is not None else in_channels * image_size * image_size  # type: ignore[operator]
    dims = [inputs, *hidden]
    layers: list[nn.Module] = [nn.Flatten()]
    for d_in, d_out in zip(dims, dims[1:]):
        layers += [nn.Linear(d_in, d_out), nn.ReLU()] + ([nn.Dropout(dropout)] if dropout else [])
    return nn.Sequential(*layers, nn.Linear(dims[-1], out_features if out_features is not None else num_classes))


def cnn(
    num_classes: int, in_channels: int, image_size: int, channels: tuple[int, int] = (32, 64), hidden: int = 128
) -> Any:
    """conv32-conv64-maxpool-fc128: the PyTorch MNIST example's net, without dropout (DDP-reproducible)."""
    from torch import nn

    from ddpexp.config import check

    check(
        _counts(channels) and len(channels) == 2, f"model.channels={channels!r}: must be two ints >= 1 [conv1, conv2]"
    )
    check(_count(hidden), f"model.hidden={hidden!r}: must be an int >= 1")
    c1, c2 = channels
    side = image_size // 2
    return nn.Sequential(
        nn.Conv2d(in_channels, c1, 3, padding=1), nn.ReLU(),
        nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(c2 * side * side, hidden), nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )  # fmt: skip


def resnet(arch: str, num_classes: int, in_channels: int, image_size: int, stem: str = "auto") -> Any:
    """torchvision ResNet, randomly initialised. stem=small (3x3 conv, no max-pool) suits 28-32 px images;
    stem=imagenet keeps the 7x7/2 conv + max-pool (the tutorial's setup); auto picks small below 64 px."""
    import torchvision
    from torch import nn

    from ddpexp.config import check_choice

    check_choice("model.stem", stem, ("auto", "small", "imagenet"))
    net = getattr(torchvision.models, arch)(weights=None, num_classes=num_classes)
    if stem == "small" or (stem == "auto" and image_size < 64):
        net.conv1 = nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False)
        net.maxpool = nn.Identity()
    elif in_channels != 3:
        net.conv1 = nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False)
    return net


def gpt(
    vocab_size: int,
    block_size: int,
    n_layer: int = 2,
    n_head: int = 4,
    n_embd: int = 128,
    dropout: float = 0.0,
    bias: bool = True,
) -> Any:
    """A GPT-2 style causal transformer the size of nanoGPT's shakespeare_char (or smaller): token and position
    embeddings, `n_layer` pre-LayerNorm blocks of causal self-attention and a 4x GELU MLP, the output head tied
    to the token embedding. (batch, time) token ids in, (batch, time, vocab_size) logits out."""
    from ddpexp.config import check, is_number
    from ddpexp.parts.gpt import GPT

    for key, value in (("n_layer", n_layer), ("n_head", n_head), ("n_embd", n_embd), ("block_size", block_size)):
        check(_count(value), f"model.{key}={value!r}: must be an int >= 1")
    check(n_embd % n_head == 0, f"model.n_embd={n_embd}: must be a multiple of model.n_head={n_head}")
    check(is_number(dropout) and 0 <= dropout < 1, f"model.dropout={dropout!r}: must be >= 0 and < 1")
    return GPT(vocab_size, block_size, n_layer, n_head, n_embd, dropout, bias)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _counts(values: Any) -> bool:
    return isinstance(values, Sequence) and all(map(_count, values))
