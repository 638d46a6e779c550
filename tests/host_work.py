"""What a pass asks of the host, counted on the CPU: the aten ops it dispatches outside the regions the
GPU workers compile, and the points where a GPU run would make the host wait for the device.

On a GPU each eager op is a Python call, a dispatch and a kernel launch; each sync (`.item()`,
`float(t)`, `bool(t)`, `.cpu()`, `.tolist()`, an op whose output shape depends on the data such as
`nonzero` or boolean indexing) drains the device's queue, so the host can no longer run ahead of it.
The CPU has no device queue, so which tensors are "on the device" is tracked: the model's parameters,
what `host_to_device` returns, and everything computed from them. A sync on the host's own tensors
(the batch, packing indices) costs the GPU nothing and is not counted as one.

The compiled regions are those of `ModelForwards` on CUDA: the packed decoder layers
(`compile_decoder_layers`) and the log-softmax chunks (`use_compiled_chunks`). Their forward ops, and
the backward of the autograd nodes they created, count as inside.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

import fulcrum.batch
from fulcrum.models import linear_logprob
from fulcrum.models.packed import LAYERS_PER_REGION, run_decoder_layers, take_over_checkpointing

aten = torch.ops.aten
# Ops whose output size is read back from the device before they return.
DATA_DEPENDENT = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.unique_dim.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.equal.default,
    aten.is_nonzero.default,
    aten.repeat_interleave.Tensor,
}
# Indexing by a boolean mask counts the selected elements first (a `nonzero`).
INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default}
# Tensor methods that copy a device tensor to the host (not dispatched when the device is the CPU).
TO_HOST = {"cpu", "tolist", "numpy"}


@dataclass
class Counts:
    """Ops dispatched on device data outside the compiled regions, ops on host data, and syncs; each
    sync's op and the innermost fulcrum function that made it."""

    device_ops: int = 0
    host_ops: int = 0
    syncs: int = 0
    sync_sites: Counter[str] = field(default_factory=Counter)
    op_sites: Counter[str] = field(default_factory=Counter)

    def __sub__(self, other: Counts) -> Counts:
        return Counts(
            self.device_ops - other.device_ops,
            self.host_ops - other.host_ops,
            self.syncs - other.syncs,
            self.sync_sites - other.sync_sites,
            self.op_sites - other.op_sites,
        )


def _site() -> str:
    """file:function of the innermost caller inside fulcrum (the stack of the op being counted)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "/fulcrum/" in name and "/tests/" not in name:
            return f"{name.rsplit('/fulcrum/', 1)[1]}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


class HostWork(TorchDispatchMode):
    """Counts into `self.counts`; `device_tensors` holds what a GPU run would hold on the device."""

    def __init__(self, sites: bool = False) -> None:
        super().__init__()
        self.counts = Counts()
        self.device_tensors: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.sites = sites
        self.inside = 0  # depth of compiled regions entered
        # Inside a factory call given an explicit device (`torch.zeros(..., device=...)`).
        self.factory_on_device = 0
        self.paused = 0
        self.compiled_nodes: list[tuple[int, int]] = []  # autograd sequence numbers made inside

    def on_device(self, t: torch.Tensor) -> torch.Tensor:
        self.device_tensors[t] = True
        return t

    def is_device(self, t: object) -> bool:
        return isinstance(t, torch.Tensor) and t in self.device_tensors

    def in_compiled_backward(self) -> bool:
        node = torch._C._current_autograd_node()
        if node is None or not self.compiled_nodes:
            return False
        seq = node._sequence_nr()
        i = bisect.bisect_right(self.compiled_nodes, (seq, float("inf"))) - 1
        return i >= 0 and self.compiled_nodes[i][0] <= seq <= self.compiled_nodes[i][1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        on_device = self.factory_on_device > 0 or any(self.is_device(t) for t in tree_leaves((args, kwargs)))
        if on_device:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.device_tensors[t] = True
        if self.inside or self.in_compiled_backward():
            return out
        site = _site() if self.sites else ""
        if on_device:
            self.counts.device_ops += 1
            self.counts.op_sites[f"{site} {func}"] += 1
            boolean_index = func in INDEXING and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in tree_leaves(args[1])
            )
            if func in DATA_DEPENDENT or boolean_index:
                self.sync(f"{site} {func}")
        else:
            self.counts.host_ops += 1
        return out

    def sync(self, what: str) -> None:
        self.counts.syncs += 1
        self.counts.sync_sites[what] += 1

    def sequence_nr(self) -> int:
        """The autograd sequence number the next node made on this thread would get."""
        self.paused += 1
        try:
            with torch.enable_grad():
                return torch.zeros((), requires_grad=True).neg().grad_fn._sequence_nr()
        finally:
            self.paused -= 1

    def compiled(self, fn: Callable[..., object]) -> Callable[..., object]:
        """`fn` as a compiled region: its ops and the backward of its autograd nodes count as inside."""

        @functools.wraps(fn)
        def region(*args: object, **kwargs: object) -> object:
            first = self.sequence_nr()
            self.inside += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside -= 1
                self.compiled_nodes.append((first, self.sequence_nr()))
                self.compiled_nodes.sort()

        return region


class DeviceBoundary(TorchFunctionMode):
    """What the CPU does not dispatch: device-to-host copies by tensor method (`.cpu()`, `.tolist()`),
    whose result lives on the host; and tensors made on the device by a factory given a `device`."""

    def __init__(self, work: HostWork) -> None:
        super().__init__()
        self.work = work

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        work, name = self.work, getattr(func, "__name__", "")
        if name in TO_HOST and args and work.is_device(args[0]) and not work.paused:
            work.sync(f"{_site() if work.sites else ''} Tensor.{name}")
            if name == "cpu":  # the CPU returns the tensor itself: a host copy instead
                work.paused += 1
                try:
                    return args[0].clone()
                finally:
                    work.paused -= 1
        if kwargs.get("device") is None or isinstance(func, torch._ops.OpOverload):
            return func(*args, **kwargs)
        work.factory_on_device += 1
        try:
            out = func(*args, **kwargs)
        finally:
            work.factory_on_device -= 1
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                work.on_device(t)
        return out


@contextlib.contextmanager
def counting(
    models: list[torch.nn.Module], optimizers: tuple[torch.optim.Optimizer, ...] = (), sites: bool = False
) -> Iterator[HostWork]:
    """Count host work inside: `models`' parameters and buffers live on the device, `host_to_device`
    returns device tensors (a copy, as on a GPU), and packed decoder layers and log-softmax chunks run
    as the GPU workers' compiled regions. An optimiser's step counts as one region: on CUDA it is
    AdamW's fused kernel (`build_optimizer`), which keeps its step counts on the device; the CPU's
    AdamW reads them per parameter."""
    work = HostWork(sites)
    for optimizer in optimizers:
        optimizer.step = work.compiled(optimizer.step)  # type: ignore[method-assign]
    for model in models:
        for t in [*model.parameters(), *model.buffers()]:
            work.on_device(t)
        base = getattr(model, "model", None)
        if base is not None and hasattr(base, "layers"):
            layers = list(base.layers[: base.config.num_hidden_layers])
            base.fulcrum_checkpoint = take_over_checkpointing(base)
            base.fulcrum_regions = [
                layers[i : i + LAYERS_PER_REGION] for i in range(0, len(layers), LAYERS_PER_REGION)
            ]
            base.fulcrum_compiled_run = work.compiled(run_decoder_layers)
    original = fulcrum.batch.host_to_device

    def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        return work.on_device(tensor.to(device, copy=True))

    patched = [
        module
        for name, module in list(sys.modules.items())
        if name.startswith("fulcrum") and getattr(module, "host_to_device", None) is original
    ]
    chunks = dict(linear_logprob._CHUNK_FNS)
    try:
        for module in patched:
            module.host_to_device = host_to_device
        linear_logprob._CHUNK_FNS.update({k: work.compiled(fn) for k, fn in chunks.items()})
        with work, DeviceBoundary(work):
            yield work
    finally:
        for optimizer in optimizers:
            del optimizer.step
        for module in patched:
            module.host_to_device = original
        linear_logprob._CHUNK_FNS.update(chunks)
        for model in models:
            base = getattr(model, "model", None)
            for attr in ("fulcrum_compiled_run", "fulcrum_regions"):
                if base is not None and hasattr(base, attr):
                    delattr(base, attr)
