#!/usr/bin/env bash
# The GPU checks of the Performance section, for a GPU machine that has PyTorch but not ddpexp's pure-Python
# dependencies and no network (the device image: torch, torchvision, lightning, scikit-learn; no Hydra).
#
#   bash bench/gpu.sh pack   # here, where .venv is installed: copy hydra, omegaconf, antlr4 into .gpu-deps/ (~4 MB)
#   bash bench/gpu.sh run    # there, from the repository root, with .gpu-deps/ carried along; writes to $OUT
#
# run: the CUDA environment, then `python -m ddpexp.bench --device cuda --world-sizes 1` (A, B, C, and D when
# Lightning is there), then a single-GPU ddpexp run with its GPU defaults (bf16, channels_last, fused AdamW).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
pack)
    site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    rm -rf .gpu-deps && mkdir -p .gpu-deps
    for pkg in hydra omegaconf antlr4; do cp -r "$site/$pkg" .gpu-deps/; done
    find .gpu-deps -name __pycache__ -prune -exec rm -rf {} +
    du -sh .gpu-deps
    ;;
run)
    out=${OUT:-bench/results/gpu}
    mkdir -p "$out"
    export PYTHONPATH="$PWD/src:$PWD/.gpu-deps${PYTHONPATH:+:$PYTHONPATH}"
    py=${PYTHON:-python3}
    "$py" -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__,
'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" | tee "$out/env.txt"
    lightning=$("$py" -c "import lightning" 2>/dev/null && echo --lightning || true)
    "$py" -m ddpexp.bench --device cuda --world-sizes 1 --repeats "${REPEATS:-3}" $lightning --out "$out" 2>&1 | tee "$out/bench.txt"
    "$py" -m ddpexp gpus=1 device=cuda data=digits epochs=3 wandb.mode=disabled progress_bar=false \
        hydra.run.dir="$out/run" 2>&1 | tail -3 | tee "$out/run.txt"
    ;;
*)
    echo "usage: bash bench/gpu.sh pack|run" >&2
    exit 2
    ;;
esac
