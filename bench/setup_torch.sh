#!/usr/bin/env bash
# Makes bench/.venv, a virtual environment with PyTorch for `p2ptrain bench scaling`'s DDP runs
# (bench/ddp_train.py) and `bench step`'s yardstick (bench/step_torch.py).
# A benchmark dependency only: no test needs it. PyPI's torch wheel is the CUDA build (about
# 5 GB with its libraries); it runs on CPU as well.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv
.venv/bin/pip install --quiet torch numpy
.venv/bin/python -c 'import torch, torch.distributed as d; print("torch", torch.__version__, "gloo", d.is_gloo_available())'
