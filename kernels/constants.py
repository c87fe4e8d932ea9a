"""Constant tensors the solver reads every step (identities, 0 and 1 for torch.where, fixed sign
patterns), made once per shape, dtype and device and kept: built every step, each is one or more
launches a step (torch.eye, a Python scalar in torch.where: a scalar_tensor fill on CUDA)."""
import torch

_KEPT = {}  # (name, shape, dtype, device, id(fake mode)) -> (fake mode, tensor)
LIMIT = 64              # tensors kept at most; past it (or past LIMIT_BYTES) all are dropped and made again
LIMIT_BYTES = 1 << 28   # 256 MiB: a stand-in pattern of GPT-2 XL's 6400 x 1600 is 41 MB


def kept(name, shape, like, make):
    """make() (a constant tensor of `like`'s dtype and device) made once per name, shape, dtype
    and device and kept. While a CUDA graph is captured or under inference mode a kept one is
    read but none is stored (its memory would belong to the graph; an inference tensor); the
    eager warm-up steps before a capture (manifolds/step_graph.py) have made them. A fake tensor is
    kept for its own fake mode (bench.cost_model counts the step as a GPU runs it: built on the
    first step only). Callers must not write to it."""
    mode = getattr(like, "fake_mode", None)
    key = (name, tuple(shape), like.dtype, like.device, id(mode))
    hit = _KEPT.get(key)
    if hit is not None:
        return hit[1]
    if torch.is_inference_mode_enabled() or (like.is_cuda and torch.cuda.is_current_stream_capturing()):
        return make()
    made = make()
    size = made.numel() * made.element_size()
    if size > LIMIT_BYTES:
        return made
    if len(_KEPT) >= LIMIT or size + sum(t.numel() * t.element_size() for _, t in _KEPT.values()) > LIMIT_BYTES:
        _KEPT.clear()
    _KEPT[key] = (mode, made)  # the mode kept alive with it: its id is not reused
    return made


def eye(q, like):
    """The q x q identity in like's dtype and device."""
    return kept("eye", (q,), like, lambda: torch.eye(q, dtype=like.dtype, device=like.device))


def scalar(value, like):
    """A 0-dim tensor of `value` in like's dtype and device, for torch.where."""
    return kept(("scalar", value), (), like, lambda: torch.full((), value, dtype=like.dtype, device=like.device))
