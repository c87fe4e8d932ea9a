"""A model built on the meta device, sharded, then materialised rank by rank with the weights a
whole model built in one process would have for the same seed.

`fully_shard` on a model that exists whole on every rank costs every rank the whole model first
(GPT-2 XL: 6.2 GB of fp32 before sharding). Built on the meta device it costs nothing; but its
initialisation then draws no random numbers, and torch's own `reset_parameters` or a sharded
`normal_` would draw different ones. So the build is recorded (`record`): every initialising
operation the constructor runs, in order, with the tensor it writes. `materialize` replays that
record on the CPU generator, one whole tensor at a time, as the one-process build draws it (the
same operations on the same shapes consume the same random numbers), and copies this rank's part
of each into its shard. The draws go in flat chunks of CHUNK elements: CPU normal_ and uniform_
draw the same numbers for a tensor in chunks of a multiple of 16 elements (the last at least 16)
as for the whole (normal_ transforms its uniforms in groups of 16), so a rank holds its shards
plus one chunk, never a whole embedding. The generator ends where the one-process build leaves
it. tests/test_meta_init.py compares every weight, bit for bit, and the generator's next draw.

What the record takes: in-place initialisers that overwrite the whole tensor (normal_, uniform_,
fill_, zero_: nn.init's) and factory functions (zeros, full, randn: buffers, and tensors drawn and
dropped, whose random numbers count too). nn.init's trunc_normal_, orthogonal_, sparse_, dirac_
and eye_ are recorded by call (WHOLE_INITS): on a meta tensor torch returns from the first four
before any operation the dispatcher would see (eye_ writes through out=), so the record takes the
call itself, seen by a profile hook on their code objects (the same function however it was
imported), and the replay calls the function on the whole tensor, the random numbers an eager
build draws. What cannot be replayed is refused, never built differently: a constructor that
mutates a tensor any other way (a mul_ after an init; an error names the operation), an init with
a generator of its own (its state is not the replay's), and any parameter or buffer that no
recorded operation writes: values computed from other tensors (`nn.Parameter(torch.randn(n) *
0.02)`, a rotary inv_freq, a tril mask) or never initialised. One error names all of them.
"""
import sys

import torch
from torch.nn import init as nn_init
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
OVERWRITING = {aten.normal_.default, aten.uniform_.default, aten.fill_.Scalar, aten.zero_.default}
# allocations with nothing to replay: their values are written by what follows, or never read
UNINITIALISED = {aten.empty.memory_format, aten.empty_strided.default}


# nn.init functions replayed by call, whole: {code object: function}. trunc_normal_ delegates to
# _no_grad_trunc_normal_ (where torch returns on meta); either may be called, the outer is recorded.
WHOLE_INITS = {f.__code__: f for f in (getattr(nn_init, name, None) for name in (
    "trunc_normal_", "_no_grad_trunc_normal_", "orthogonal_", "sparse_", "dirac_", "eye_")) if f is not None}


class ReplayRefused(NotImplementedError):
    """A constructor the meta-device build cannot replay (module docstring)."""


class InitRecorder(TorchDispatchMode):
    """The initialising operations run while it is active, in order (module docstring)."""

    def __init__(self):
        super().__init__()
        self.ops = []  # (func, target meta tensor or None, args, kwargs, output)
        self.refused = []  # what cannot be replayed, in words
        self.inside = None  # the frame of the WHOLE_INITS call being recorded: its own ops are its

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.inside is not None:
            return out
        if kwargs.get("generator") is not None:
            self.refused.append(f"{func} with a generator of its own (the replay draws from the global generator)")
        elif func in OVERWRITING:
            self.ops.append((func, args[0], args[1:], kwargs, None))
        elif func._schema.is_mutable:
            raise ReplayRefused(f"meta-device build: the constructor runs {func}, which the replay does not "
                                f"handle (only whole-tensor initialisers and factories)")
        elif func not in UNINITIALISED and isinstance(out, torch.Tensor) and \
                not any(isinstance(a, torch.Tensor) for a in torch.utils._pytree.tree_leaves((args, kwargs))):
            self.ops.append((func, None, args, kwargs, out))
        return out

    def profile(self, frame, event, arg):
        """sys.setprofile hook: a call of a WHOLE_INITS function on a meta tensor is one recorded op."""
        if event == "call" and self.inside is None and frame.f_code in WHOLE_INITS:
            code = frame.f_code
            names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
            values = {name: frame.f_locals[name] for name in names if name in frame.f_locals}
            tensor = values.pop(names[0], None)
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                self.inside = frame
                function = WHOLE_INITS[code]
                if values.get("generator") is not None:
                    self.refused.append(f"nn.init.{function.__name__.replace('_no_grad_', '')} with a generator "
                                        f"of its own (the replay draws from the global generator)")
                else:
                    self.ops.append((function, tensor, (), values, None))
        elif event == "return" and frame is self.inside:
            self.inside = None


def record(build):
    """(model on the meta device, its recorded initialisation) of `build()`. A ReplayRefused names
    everything in it the replay cannot reproduce (module docstring)."""
    recorder = InitRecorder()
    previous = sys.getprofile()
    sys.setprofile(recorder.profile)
    try:
        with torch.device("meta"), recorder:
            model = build()
    finally:
        sys.setprofile(previous)
    names = {}
    for name, tensor in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()):
        names.setdefault(storage_key(tensor), name)
    # by name: the meta tensors are replaced when the model is sharded
    steps, written = [], set()
    for func, target, args, kwargs, out in recorder.ops:
        tensor = target if target is not None else out
        name = names.get(storage_key(tensor))
        if name is not None and tensor.numel() * tensor.element_size() != tensor.untyped_storage().nbytes():
            raise ReplayRefused(f"meta-device build: the constructor initialises part of {name} ({func}); "
                                f"the replay writes whole tensors")
        written.add(name)
        kwargs = {k: v for k, v in kwargs.items() if k != "device"}
        steps.append((func, name, tuple(tensor.shape), tensor.dtype, target is None, args, kwargs))
    unwritten = [name for name in dict.fromkeys(names.values()) if name not in written]
    if unwritten:
        recorder.refused.append(
            f"{', '.join(unwritten)} written by no initialiser the replay records (values computed from other "
            f"tensors, e.g. torch.randn(n) * 0.02, a tril mask or a rotary inv_freq, or never initialised): "
            f"initialise them in place with nn.init (normal_, uniform_, constant_, trunc_normal_, ...) or a "
            f"factory (torch.zeros, torch.arange, ...)")
    if recorder.refused:
        raise ReplayRefused("meta-device build cannot replay this constructor: " + "; ".join(recorder.refused))
    return model, steps


def storage_key(tensor):
    """What identifies a tensor across the dispatcher (whose Python objects are not the module's):
    its storage. The recorder keeps every recorded tensor alive, so no key is reused."""
    return tensor.untyped_storage()._cdata


CHUNK = 1 << 20  # elements drawn at a time (a multiple of 16)


@torch.no_grad()
def materialize(model, steps, device, seed):
    """Allocate `model`'s (sharded) tensors on `device` and fill them by replaying `steps` from
    `torch.manual_seed(seed)` (module docstring)."""
    from manifolds.sharded import is_sharded, local, local_part
    tied = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(p), []).append(name)
    # to_empty allocates a shared parameter once per module that holds it (a transient copy of the
    # tied embedding's shard, more than a block of GPT-2 large): each is held by its first module
    # alone while allocated, then tied again
    others = [(name, names[0]) for names in tied.values() for name in names[1:]]
    for name, _ in others:
        module, attr = owner_of(model, name)
        module._parameters[attr] = None
    model.to_empty(device=device)
    for name, first in others:
        module, attr = owner_of(model, name)
        first_module, first_attr = owner_of(model, first)
        module._parameters[attr] = first_module._parameters[first_attr]
    tensors = dict(model.named_parameters(remove_duplicate=False))
    for names in tied.values():
        if len({id(tensors[name]) for name in names}) > 1:
            raise RuntimeError(f"meta-device build: to_empty untied {names} (tie them again after materializing)")
    tensors.update(model.named_buffers())
    torch.manual_seed(seed)
    for func, name, shape, dtype, factory, args, kwargs in steps:
        target = tensors.get(name)
        if not isinstance(func, torch._ops.OpOverload):  # a WHOLE_INITS call: on the whole tensor
            whole = torch.empty(shape, dtype=dtype)
            func(whole, **kwargs)  # drawn and dropped where it wrote no parameter or buffer: its draws count
            if target is not None:
                local(target).copy_(local_part(whole, target).to_local() if is_sharded(target) else whole)
            continue
        flat = rows_of(target, shape) if not factory else None
        if flat is not None:  # drawn chunk by chunk: this rank's rows are one flat range
            draw_in_chunks(func, args, kwargs, shape, dtype, flat, None if target is None else local(target))
            continue
        whole = func(*args, **kwargs, device="cpu") if factory else func(torch.empty(shape, dtype=dtype), *args, **kwargs)
        if target is not None:
            local(target).copy_(local_part(whole, target).to_local() if is_sharded(target) else whole)
    return model


def owner_of(model, name):
    """(module, attribute) of a parameter's dotted name."""
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr


def rows_of(target, shape):
    """(lo, hi) flat elements of `shape` that this rank holds of `target`, or None where its part is
    not one flat range (split on another dimension): (0, 0) for a tensor drawn and dropped."""
    from manifolds.sharded import chunk_range, is_sharded
    numel = 1
    for n in shape:
        numel *= n
    if target is None:
        return 0, 0
    if not is_sharded(target):
        return 0, numel
    lo, hi, width = 0, shape[0], numel // max(shape[0], 1)
    for mesh_dim, placement in enumerate(target.placements):
        if placement.is_shard():
            if placement.dim % len(shape) != 0:
                return None
            lo, hi = chunk_range(shape[0], target.device_mesh.size(mesh_dim), target.device_mesh.get_local_rank(mesh_dim))
    return lo * width, hi * width


def draw_in_chunks(func, args, kwargs, shape, dtype, flat, local_tensor):
    """Run the overwriting `func` over a tensor of `shape` in flat chunks (CHUNK elements; the last
    at least 16), copying the elements in [flat) into `local_tensor` (this rank's part, or None)."""
    numel = 1
    for n in shape:
        numel *= n
    starts = list(range(0, numel, CHUNK))
    if len(starts) > 1 and numel - starts[-1] < 16:
        starts.pop()  # a chunk under 16 elements draws differently (normal_'s scalar path)
    out = local_tensor.view(-1) if local_tensor is not None else None
    for index, start in enumerate(starts):
        stop = starts[index + 1] if index + 1 < len(starts) else numel
        chunk = func(torch.empty(stop - start, dtype=dtype), *args, **kwargs)
        lo, hi = max(start, flat[0]), min(stop, flat[1])
        if out is not None and lo < hi:
            out[lo - flat[0]:hi - flat[0]].copy_(chunk[lo - start:hi - start])
