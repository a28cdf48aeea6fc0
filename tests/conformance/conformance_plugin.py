"""pytest plugin (``-p conformance_plugin``) for running vLLM's own tests.

Loaded into every run of the conformance tier; ``CONFORMANCE_MODE`` picks the
run:

* ``stock``   -- vLLM's tests as they are (this project's vLLM plugin is kept
  out with ``VLLM_PLUGINS=""`` by the runner);
* ``guard``   -- the guard swapped in (:mod:`conformance_swap`);
* ``control`` -- vLLM's MultiConnector swapped in, without the guard.

In every mode it

1. skips the tests named in ``skips.toml``, each with its reason;
2. marks every test ``skip_global_cleanup`` (vLLM's own marker: its
   after-test cleanup releases accelerator memory, costs ~0.7 s a test on a
   CPU and nothing these unit tests need);
3. writes each test's outcome to the JSON file ``CONFORMANCE_OUT``.

In ``guard`` and ``control`` mode it also replaces the scheduler classes at
the construction sites listed in :data:`SWAP_SITES` -- every place vLLM's
tests in scope build a Scheduler or AsyncScheduler -- and records any test
that still built an unswapped scheduler (a site this table misses).
"""

from __future__ import annotations

import fnmatch
import functools
import json
import os
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent

# module -> the scheduler class names it looks up when it builds a scheduler.
SWAP_SITES: dict[str, tuple[str, ...]] = {
    # The two helpers almost every test uses: create_scheduler().
    "tests.v1.core.utils": ("Scheduler", "AsyncScheduler"),
    "tests.v1.kv_connector.unit.utils": ("Scheduler", "AsyncScheduler"),
    # Tests that call Scheduler(...) themselves.
    "tests.v1.core.test_scheduler": ("Scheduler",),
    "tests.v1.core.test_priority_preemption_bug": ("Scheduler",),
    "tests.v1.core.test_prefix_replay": ("Scheduler",),
}


def load_skips(path: Path) -> list[dict[str, str]]:
    """``[[skip]]`` entries of ``skips.toml``: ``test`` (a pattern), ``reason``."""
    with path.open("rb") as f:
        entries: list[dict[str, str]] = tomllib.load(f).get("skip", [])
    for entry in entries:
        if not entry.get("test") or not entry.get("reason"):
            raise pytest.UsageError(f"{path}: each [[skip]] needs test and reason")
    return entries


class Recorder:
    """Outcomes per test id, plus the unswapped schedulers each test built."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.started = time.monotonic()
        self.tests: dict[str, dict[str, Any]] = {}
        self.current: str | None = None
        self.unused_skips: list[str] = []

    def entry(self, nodeid: str) -> dict[str, Any]:
        return self.tests.setdefault(nodeid, {"outcome": "passed"})

    def note_unswapped(self, cls_name: str) -> None:
        if self.current is not None:
            unswapped = self.entry(self.current).setdefault("unswapped", [])
            if cls_name not in unswapped:
                unswapped.append(cls_name)

    def record(self, report: pytest.TestReport) -> None:
        entry = self.entry(report.nodeid)
        outcome = _outcome(report)
        if outcome is None:
            return
        if entry["outcome"] == "passed" or report.when == "setup":
            entry["outcome"] = outcome
            message = _message(report)
            if message:
                entry["message"] = message

    def write(self, path: Path) -> None:
        data = {
            "mode": self.mode,
            "seconds": round(time.monotonic() - self.started, 1),
            "unused_skips": self.unused_skips,
            "tests": self.tests,
        }
        path.write_text(json.dumps(data, indent=1, sort_keys=True))


def _outcome(report: pytest.TestReport) -> str | None:
    """The outcome this phase contributes (None: nothing to change)."""
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed"
    if report.skipped:
        return "skipped"
    if report.failed:
        return "failed" if report.when == "call" else "error"
    return None


def _message(report: pytest.TestReport) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    crash = getattr(report.longrepr, "reprcrash", None)
    text = getattr(crash, "message", "") or ""
    return text.strip().splitlines()[0][:300] if text.strip() else ""


def _install_swaps(mode: str) -> None:
    """Replace the scheduler classes at :data:`SWAP_SITES` (imported modules)."""
    from conformance_swap import swapped_classes
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    stock = {"Scheduler": Scheduler, "AsyncScheduler": AsyncScheduler}
    classes = swapped_classes(mode)
    for module_name, names in SWAP_SITES.items():
        module = sys.modules.get(module_name)
        if module is None:
            continue  # not collected in this run
        for name in names:
            if getattr(module, name, None) is not stock[name]:
                raise pytest.UsageError(
                    f"swap site {module_name}.{name} is not vLLM's {name}: "
                    "vLLM's tests changed; update SWAP_SITES"
                )
            setattr(module, name, classes[name])


def _watch_unswapped(recorder: Recorder) -> None:
    """Record a test that builds a scheduler none of the swaps produced."""
    import conformance_swap
    from vllm.v1.core.sched.scheduler import Scheduler

    stock_init = Scheduler.__init__

    # functools.wraps keeps the original's source reachable: the guard reads
    # Scheduler.__init__'s source to check the vLLM internals it relies on.
    @functools.wraps(stock_init)
    def __init__(self: Scheduler, *args: Any, **kwargs: Any) -> None:
        if type(self).__module__ != conformance_swap.__name__:
            recorder.note_unswapped(type(self).__name__)
        stock_init(self, *args, **kwargs)

    Scheduler.__init__ = __init__


class ConformancePlugin:
    def __init__(self, mode: str, out: Path, skips: list[dict[str, str]]) -> None:
        self.recorder = Recorder(mode)
        self.out = out
        self.skips = skips

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        used: set[str] = set()
        for item in items:
            item.add_marker(pytest.mark.skip_global_cleanup)
            for entry in self.skips:
                if fnmatch.fnmatchcase(item.nodeid, entry["test"]):
                    item.add_marker(pytest.mark.skip(reason=entry["reason"]))
                    used.add(entry["test"])
                    break
        self.recorder.unused_skips = [
            e["test"] for e in self.skips if e["test"] not in used
        ]
        if self.recorder.mode != "stock":
            _install_swaps(self.recorder.mode)

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        self.recorder.current = item.nodeid

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.recorder.record(report)

    def pytest_sessionfinish(self) -> None:
        self.recorder.write(self.out)


def pytest_configure(config: pytest.Config) -> None:
    mode = os.environ.get("CONFORMANCE_MODE", "stock")
    if mode not in ("stock", "guard", "control"):
        raise pytest.UsageError(f"CONFORMANCE_MODE={mode!r}: stock, guard or control")
    out = Path(os.environ.get("CONFORMANCE_OUT", f"conformance-{mode}.json"))
    skips = load_skips(Path(os.environ.get("CONFORMANCE_SKIPS", HERE / "skips.toml")))
    plugin = ConformancePlugin(mode, out, skips)
    if mode != "stock":
        from conformance_swap import register_null_connector

        register_null_connector()
        if mode == "guard":
            from vllm_mooncake.plugin import register

            register()
        _watch_unswapped(plugin.recorder)
    config.pluginmanager.register(plugin, "conformance")
