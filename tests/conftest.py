"""Test setup: offline hubs, the Triton interpreter on CPU, threads (pytest.ini puts the repository
root on sys.path).

TRITON_INTERPRET must be set before any @triton.jit function is decorated, so it is set
here, at collection, and only when there is no CUDA device (library code never sets it).
"""
import os

import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# pytest-xdist (pytest.ini) runs the tests in several worker processes: the cores are shared out
# among them (most long tests wait on subprocesses, which set their own OMP_NUM_THREADS)
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // WORKERS)))
