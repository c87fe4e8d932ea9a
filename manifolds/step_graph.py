"""The optimizer step replayed from one CUDA graph (`StepGraph`), and that replay emulated on
any device (`Recorded`), so that a CPU can check what a GPU would replay.

A CUDA graph records the kernels of one call and replays them on the same memory: every
later replay reads the tensors that were the inputs at capture (at their current values) and
writes its results to the addresses of the capture. A step is replayable when all it reads
from outside (parameters, gradients, optimizer state, learning rates) lives in those same
tensors, updated in place, and nothing it does depends on Python values that change between
steps (a float lr is baked in as a constant; a state tensor replaced by a new one is never
read again; a host read of a device value cannot be recorded at all).

`Recorded` emulates that on any device with torch's dispatcher: while recording, every aten
op runs and is kept with its argument tensors (by identity) and its outputs; `replay()` runs
the same ops again on the same argument tensors and copies each fresh output into the
recorded one (the graph's fixed addresses). Ops of the same tensor objects, not re-traced
Python: exactly what a graph replays. Two differences from a real graph: kernels outside
torch's dispatcher (Triton launches) are not recorded, so use the torch backend, and the
recorded intermediates stay allocated (as a graph's memory pool does).

    with Recorded() as step:
        opt.step()          # runs, and is recorded
    ...                     # write new gradients / lr into the same tensors
    step.replay()           # the optimizer step of those, as a graph replay would compute it
"""
import contextlib
import functools
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# aten ops that read a device value on the host: a graph cannot record them
HOST_READS = ("_local_scalar_dense", "is_nonzero", "item")
# Tensor methods that bring device data to the host without one of those ops: on a CPU tensor
# they dispatch nothing (or a detach), on CUDA `.cpu()` / `.to("cpu")` is a device-to-host copy
# that waits for the stream and `.tolist()` / `.numpy()` read host memory. They are counted on
# any device, since the code that calls them reads a device value wherever it runs on a GPU.
HOST_READ_METHODS = ("tolist", "numpy", "cpu", "to")

_watchers = []  # (thread id, on_read) of the open `watching_host_reads` contexts
_unpatched = {}  # Tensor method name -> torch.Tensor's own entry (None: inherited), while watched
_watchers_lock = threading.Lock()


def _is_host_read(name, args, kwargs):
    """Whether `tensor.<name>(*args, **kwargs)` copies to the host. A `.to` reads when it targets
    the CPU and blocks: a non-blocking copy does not wait for the stream (per_matrix's copy of a
    pinned host tensor to W's device is one), and `.to(other_tensor)` follows that tensor's
    device, which on a GPU run is the device's."""
    if name != "to":
        return True
    if args and torch.is_tensor(args[0]):
        return False
    device, _, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
    return device is not None and device.type == "cpu" and not non_blocking


def _watched(name, method):
    @functools.wraps(method)
    def watched(self, *args, **kwargs):
        me = threading.get_ident()
        for thread, on_read in list(_watchers):
            if thread == me and _is_host_read(name, args, kwargs):
                on_read(name)
        return method(self, *args, **kwargs)
    return watched


@contextlib.contextmanager
def watching_host_reads(on_read):
    """While inside, each host read through a Tensor method of HOST_READ_METHODS on this thread
    calls `on_read(method name)` before it runs (it may raise to refuse the read). The aten ops
    of HOST_READS are a dispatch mode's to see: pair this with one. Other threads (a trainer's
    prefetch thread) are not watched: a dispatch mode does not see them either."""
    entry = (threading.get_ident(), on_read)
    with _watchers_lock:
        if not _watchers:
            for name in HOST_READ_METHODS:
                _unpatched[name] = vars(torch.Tensor).get(name)
                setattr(torch.Tensor, name, _watched(name, getattr(torch.Tensor, name)))
        _watchers.append(entry)
    try:
        yield
    finally:
        with _watchers_lock:
            _watchers.remove(entry)
            if not _watchers:
                for name, method in _unpatched.items():
                    if method is None:
                        delattr(torch.Tensor, name)  # back to the C method it inherits
                    else:
                        setattr(torch.Tensor, name, method)
                _unpatched.clear()


class HostReadMode(TorchDispatchMode):
    """A dispatch mode that sees every host read on its thread: while it is entered, the Tensor
    methods of HOST_READ_METHODS call `self.host_read(method name)`, and a subclass's
    __torch_dispatch__ calls `self.host_read(func)` for the ops where `reads_host(func)`."""

    def host_read(self, what):
        raise NotImplementedError

    @staticmethod
    def reads_host(func):
        return func.overloadpacket.__name__ in HOST_READS

    def __enter__(self):
        self._host_reads = contextlib.ExitStack()
        self._host_reads.enter_context(watching_host_reads(self.host_read))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._host_reads.close()


class NotCapturable(RuntimeError):
    pass


class Recorded(HostReadMode):
    def __init__(self):
        super().__init__()
        self.ops = []  # (func, args, kwargs, recorded outputs)

    def host_read(self, what):
        raise NotCapturable(f"{what} reads a device value on the host (a sync): a CUDA graph cannot record it")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.reads_host(func):
            self.host_read(func)
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out

    def replay(self):
        """Run the recorded ops again on the same tensors (see the module docstring)."""
        with torch.no_grad():
            for func, args, kwargs, recorded in self.ops:
                fresh = func(*args, **kwargs)
                for new in tree_flatten(fresh)[0]:
                    if hasattr(new, "wait") and not isinstance(new, torch.Tensor):
                        # an async collective's handle: the eager code waited on it outside the
                        # dispatcher, where a recording cannot see it; a graph orders it on its stream
                        new.wait()
                for old, new in zip(tree_flatten(recorded)[0], tree_flatten(fresh)[0]):
                    if not isinstance(old, torch.Tensor) or old is new or _same_memory(old, new):
                        continue  # in-place ops return their argument, views alias it
                    old.copy_(new)

    def __len__(self):
        return len(self.ops)


def _same_memory(a, b):
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


def lr_in_device_tensors(optimizer, device):
    """Each group's lr as a 0-dim tensor on `device`: a captured float would be a constant, a
    tensor is read by every replay (write the schedule into it with fill_)."""
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(float(group["lr"]), device=device)


class StepGraph:
    """`step()` run eagerly for its first `warmup` calls (a cold step, then a warm one that
    creates the warm starts; on CUDA on a side stream, as torch.cuda.graph's recipe asks, so
    that allocations and Triton's autotuning happen outside the capture), then captured once
    and replayed on every later call: on CUDA as a torch.cuda.CUDAGraph, elsewhere by
    `Recorded` (the same replay semantics, for checking; no faster).

    The caller keeps what the step reads in the capture's tensors: the lr in device tensors
    written with fill_, the gradients accumulated into the same .grad (zero_grad(set_to_none=
    False)); and the step must be sync-free (ManifoldMuon(capturable=True))."""

    def __init__(self, step, device, warmup=2):
        self.step, self.device, self.warmup = step, torch.device(device), warmup
        self.calls, self.replay, self.graph = 0, None, None

    def __call__(self):
        self.calls += 1
        cuda = self.device.type == "cuda"
        if self.calls <= self.warmup:
            if not cuda:
                return self.step()
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self.step()
            torch.cuda.current_stream(self.device).wait_stream(side)
        elif self.replay is None:
            if cuda:
                self.graph = torch.cuda.CUDAGraph()
                # thread_local: the trainer's prefetch thread pins the next batch meanwhile (a CUDA
                # host allocation), which the default "global" mode would refuse during a capture
                with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                    self.step()
                self.replay = self.graph.replay
                self.replay()  # a capture records the kernels without running them
            else:
                with Recorded() as recorded:
                    self.step()  # records and runs
                self.replay = recorded.replay
        else:
            self.replay()
