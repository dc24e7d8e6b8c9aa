"""DDP communication hooks that reduce each gradient bucket with lightcc's compressors.

Usage, on DDP over the ``lightcc`` backend or over gloo (lightcc is then started beside it,
under ``lccrun``/``mpirun``)::

    from lightcc.torch import ddp_hooks
    state = ddp_hooks.HookState(ddp_hooks.Compression.topk(0.01))
    model.register_comm_hook(state, ddp_hooks.topk_hook)

or ``ddp_hooks.register(model, "topk")``. Each hook hands the bucket to lightcc's compressed
allreduce (the engine's two-phase fp16/bf16/fp8 scheme, TopK's sparse allgather, PowerSGD's
factor allreduces) on its background thread and returns a future that completes with the
averaged bucket, identical bit for bit on every rank. fp16/bf16 (element-wise) submit the
bucket as one tensor; auto, fp8, TopK and PowerSGD submit each parameter's gradient as a
tensor of its own (a view of the bucket), so each parameter gets its own format (auto), its
own scales, its own k and its own factors, exactly as under ``DistributedOptimizer`` (and parameters under
``LCC_MIN_COMPRESS_BYTES`` travel uncompressed). Buckets go on the process set's ordered stream
(DDP runs the hooks in bucket order on every rank) under names built from ``HookState.name``
and the parameter (``name:param``: its name in the model when the hook was registered with
:func:`register`, else ``p0``, ``p1``, ... in the order the hook first saw the parameters, the
same on every rank), never from its place in a bucket: DDP rebuilds its buckets after the first
step, and a residual keyed by position would then be added to another parameter. The names key
the error-feedback residuals (and PowerSGD factors): :meth:`HookState.state_dict` returns them
for checkpoints.

Wire cost per rank for a bucket of ``N`` float32 elements over ``n`` ranks (uncompressed ring:
``8 N (n-1)/n`` bytes): fp16/bf16 ``4 N (n-1)/n``; fp8 ``2 N (n-1)/n`` plus 4-byte scales;
TopK ``8 (n-1) sum(k)`` with ``k = ratio N_p`` per parameter (indices and values to every
other rank); PowerSGD ``8 r (rows + cols) (n-1)/n`` per weight matrix plus the uncompressed
biases. :meth:`HookState.wire_bytes` computes it for one tensor.
"""
# no ``from __future__ import annotations``: DDP compares the hooks' annotations with
# dist.GradBucket and torch.futures.Future[torch.Tensor] as objects
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..common import api
from ..common import compression as compression_mod
from ..common.compression.api import Compression, CompressionSpec, spec_of
from ..common.exceptions import InvalidArgumentError, LightCCError
from .c10d.backend import DEFAULT_TIMEOUT_S
from .c10d.futures import LightCCFuture
from ._tensor import host_stage
from .c10d.work import LightCCWork

FutureTensor = torch.futures.Future[torch.Tensor]   # what DDP checks the annotation against
_FAMILIES = {"auto": "auto", "fp16": "fp16", "bf16": "bf16", "fp8": "fp8", "fp8_e5m2": "fp8", "topk": "topk",
             "powersgd": "powersgd"}
_names_lock = threading.Lock()
_used_names: dict[str, int] = {}


class HookState:
    """What a lightcc DDP hook keeps: the compressor, the lightcc process set, the bucket names.

    ``compression``: a ``Compression`` value or spec string (``"fp8:e5m2:block:256"``).
    ``process_group``: DDP's group when it is not the default one (a lightcc group maps to its
    process set; any other group must span every rank). ``name``: prefix of the bucket names,
    the same on every rank (default: ``ddp``, ``ddp.1``, ... in creation order).
    """

    def __init__(self, compression: CompressionSpec | str = Compression.fp16,
                 process_group: Any = None, name: str | None = None) -> None:
        self.spec = spec_of(compression)
        comp = compression_mod.make(self.spec)        # validates the spec now
        if comp is None:
            raise InvalidArgumentError("HookState: compression 'none' is not a compressor; use "
                                       "torch's allreduce_hook (or no hook)")
        self.family = _FAMILIES[self.spec.split(":")[0]]
        self._wire = comp.wire_bytes
        self.name = name or _default_name()
        self.process_group = process_group
        self._ps: "api.ProcessSet | None" = None
        self.steps = 0                               # buckets reduced so far
        self._params: dict[int, str] = {}            # id(parameter) -> its label

    def name_parameters(self, named_parameters: Any) -> None:
        """Label the residuals of these ``(name, parameter)`` pairs by name (:func:`register`
        passes the model's); others get ``p0``, ``p1``, ... when first seen."""
        for pname, param in named_parameters:
            self._params[id(param)] = f"{self.name}:{pname}"

    def label(self, param: Any) -> str:
        """The name a parameter's gradient is reduced under (keys its residual)."""
        key = id(param)
        found = self._params.get(key)
        if found is None:
            found = self._params[key] = f"{self.name}:p{len(self._params)}"
        return found

    def process_set(self) -> api.ProcessSet:
        """The lightcc process set the buckets are reduced over (lightcc started if needed)."""
        if self._ps is not None:
            return self._ps
        pg = self.process_group
        if pg is None and dist.is_initialized():
            pg = dist.group.WORLD
        ps = getattr(pg, "process_set", None) if pg is not None else None
        if ps is None:
            if not api.is_initialized():
                api.init()
            if pg is not None and dist.get_world_size(pg) != api.size():
                raise LightCCError(f"lightcc DDP hook: DDP's group has "
                                   f"{dist.get_world_size(pg)} ranks but is not a lightcc "
                                   f"group; only a group of all {api.size()} ranks can be "
                                   f"reduced by lightcc beside it")
            ps = api.global_process_set
        self._ps = ps
        return ps

    def wire_bytes(self, numel: int, nranks: int | None = None) -> int:
        """Bytes one rank sends to reduce a bucket of ``numel`` float32 gradients."""
        n = nranks if nranks is not None else self.process_set().size()
        return int(self._wire(numel, n))

    def _engine_compressor(self) -> Any:
        """The engine's compressor of this hook's process set (it holds the residuals)."""
        return api.compressor(self.process_set(), self.spec, create=True)

    def state_dict(self) -> dict[str, Any]:
        """Error-feedback residuals (and PowerSGD factors) of this hook's buckets."""
        full = self._engine_compressor().state_dict()
        return {"spec": self.spec, "name": self.name,
                "state": {part: {k: v for k, v in entries.items() if _mine(k, self.name)}
                          for part, entries in full.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (same spec); other hooks' entries are kept."""
        if state.get("spec") != self.spec:
            raise InvalidArgumentError(f"HookState.load_state_dict: state is for "
                                       f"{state.get('spec')!r}, this hook uses {self.spec!r}")
        comp = self._engine_compressor()
        full = comp.state_dict()
        for part, entries in state.get("state", {}).items():
            kept = {k: v for k, v in full.get(part, {}).items() if not _mine(k, self.name)}
            full[part] = {**kept, **entries}
        comp.load_state_dict(full)


def _mine(key: str, prefix: str) -> bool:
    return key.startswith(prefix + ":")


def _default_name() -> str:
    with _names_lock:
        n = _used_names.get("ddp", 0)
        _used_names["ddp"] = n + 1
    return "ddp" if n == 0 else f"ddp.{n}"


def _reduce(state: HookState, bucket: dist.GradBucket, family: str,
            per_tensor: bool) -> FutureTensor:
    if state.family != family:
        raise InvalidArgumentError(f"{family}_hook was registered with a HookState for "
                                   f"{state.spec!r}; use the matching hook or state")
    ps = state.process_set()
    buf = bucket.buffer()
    what = f"DDP hook '{state.name}' bucket {bucket.index()}"
    st = host_stage(buf, what)
    flat = st.array.reshape(-1)
    base = f"{state.name}:b{bucket.index()}"
    if per_tensor:     # each parameter its own scales / k / factors (PowerSGD needs shapes)
        parts, offset = [], 0
        for p in bucket.parameters():
            view = flat[offset:offset + p.numel()].reshape(tuple(p.shape) or (1,))
            parts.append((state.label(p), view))
            offset += p.numel()
    else:
        parts = [(base, flat)]
    # on the process set's ordered stream: DDP runs the hooks in bucket order on every rank;
    # the name labels the call and keys its error-feedback state
    handles = [api.allreduce_async(arr, api.Average, name=name, process_set=ps,
                                   compression=state.spec, out=arr, ordered=True)
               for name, arr in parts]
    state.steps += 1

    def finish(_results: list) -> torch.Tensor:
        return st.finish()

    work = LightCCWork(handles, finish, what, base, DEFAULT_TIMEOUT_S,
                       [buf.device] if buf.is_cuda else None)
    return work.get_future()


def auto_hook(state: HookState | None, bucket: dist.GradBucket) -> FutureTensor:
    """Average each parameter's gradient in the format ``compression=auto`` chose for it
    (none, fp16 or bf16; fp8 too with ``Compression.auto(accuracy="lossy")``) from
    measurements of the link and the codecs (docs/compression.md)."""
    return _reduce(state or _default("auto"), bucket, "auto", True)


def fp16_hook(state: HookState | None, bucket: dist.GradBucket) -> FutureTensor:
    """Average the bucket as fp16 over lightcc's two-phase scheme (half the bytes of fp32)."""
    return _reduce(state or _default("fp16"), bucket, "fp16", False)


def bf16_hook(state: HookState | None, bucket: dist.GradBucket) -> FutureTensor:
    """Average the bucket as bfloat16 (fp32's range, half the bytes)."""
    return _reduce(state or _default("bf16"), bucket, "bf16", False)


def fp8_hook(state: HookState | None, bucket: dist.GradBucket) -> FutureTensor:
    """Average the bucket as scaled fp8 (E4M3 by default, ``Compression.fp8("e5m2", ...)``
    for E5M2; power-of-two scales per parameter or per block of one): a quarter of the
    bytes."""
    return _reduce(state or _default("fp8"), bucket, "fp8", True)


def topk_hook(state: HookState | None, bucket: dist.GradBucket) -> FutureTensor:
    """Send the largest ``ratio`` of each parameter's gradient (1 % by default) with error
    feedback: what is not sent is added to its next gradient (Seide et al. 2014; Stich et
    al. 2018)."""
    return _reduce(state or _default("topk"), bucket, "topk", True)


def powersgd_hook(state: HookState | None, bucket: dist.GradBucket) -> FutureTensor:
    """Rank-r PowerSGD (Vogels et al. 2019) per weight matrix, error feedback and warm start;
    biases and other vectors go uncompressed."""
    return _reduce(state or _default("powersgd"), bucket, "powersgd", True)


HOOKS: dict[str, Callable[[Any, dist.GradBucket], FutureTensor]] = {
    "auto": auto_hook, "fp16": fp16_hook, "bf16": bf16_hook, "fp8": fp8_hook, "fp8_e5m2": fp8_hook,
    "topk": topk_hook, "powersgd": powersgd_hook,
}
_DEFAULT_SPECS = {"auto": Compression.auto, "fp16": Compression.fp16, "bf16": Compression.bf16,
                  "fp8": Compression.fp8(), "fp8_e5m2": Compression.fp8("e5m2"),
                  "topk": Compression.topk(0.01), "powersgd": Compression.powersgd(2)}
_defaults: dict[str, HookState] = {}


def _default(kind: str) -> HookState:
    """The shared state used when a hook is registered with ``state=None``."""
    with _names_lock:
        state = _defaults.get(kind)
    if state is None:
        state = HookState(_DEFAULT_SPECS[kind], name=f"ddp.{kind}")
        with _names_lock:
            state = _defaults.setdefault(kind, state)
    return state


def register(model: torch.nn.parallel.DistributedDataParallel, kind: str,
             compression: CompressionSpec | str | None = None, **state_kw: Any) -> HookState:
    """Register the ``kind`` hook (auto, fp16, bf16, fp8, fp8_e5m2, topk, powersgd) on a DDP
    model.

    ``compression`` overrides the default of that kind (e.g. ``Compression.topk(0.001)``).
    Returns the hook's state (for ``state_dict``).
    """
    if kind not in HOOKS:
        raise InvalidArgumentError(f"unknown lightcc DDP hook {kind!r}; known: "
                                   f"{', '.join(HOOKS)}")
    state = HookState(compression or _DEFAULT_SPECS[kind], **state_kw)
    state.name_parameters(getattr(model, "module", model).named_parameters())
    model.register_comm_hook(state, HOOKS[kind])
    return state


__all__ = ["Compression", "HOOKS", "HookState", "LightCCFuture", "auto_hook", "bf16_hook",
           "fp16_hook", "fp8_hook", "powersgd_hook", "register", "topk_hook"]
