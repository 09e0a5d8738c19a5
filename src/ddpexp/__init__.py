"""ddpexp: Hydra-configured PyTorch DistributedDataParallel experiments with pluggable launchers."""

__version__ = "0.1.0"
