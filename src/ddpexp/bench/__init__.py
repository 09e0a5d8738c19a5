"""`python -m ddpexp.bench`: ddpexp against hand-written PyTorch DDP loops on the same model, data and steps.

A is the tutorial's loop (torchvision dataset + per-sample transforms + DataLoader), B a tight loop over tensors
built once, C `python -m ddpexp`; `python -m ddpexp.bench.ddp_cost` takes a 2-rank CPU step apart. See README.md,
"Performance"."""
