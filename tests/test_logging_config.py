"""The guard's log lines follow a user's VLLM_LOGGING_CONFIG_PATH.

vLLM configures the ``vllm`` logger when a process starts serving
(``configure_logging_from_args``, in the API server and the engine core) from
its default dict config, or from the JSON file ``VLLM_LOGGING_CONFIG_PATH``
names. The guard's loggers
sit under ``vllm`` (``vllm_mooncake.LOGGER_ROOT``), so a user's config --
its format, handlers and levels -- applies to them too. A fresh process with
vLLM's real logging set-up; the e2e tier reads the default format from real
servers' logs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

MARK = "GUARDTEST"


def _config(log_file: Path, level: str) -> dict[str, object]:
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "mine": {"format": f"{MARK} %(levelname)s %(name)s | %(message)s"}
        },
        "handlers": {
            "file": {
                "class": "logging.FileHandler",
                "formatter": "mine",
                "filename": str(log_file),
            }
        },
        "loggers": {"vllm": {"handlers": ["file"], "level": level, "propagate": False}},
    }


def _log_through_guard(tmp_path: Path, level: str) -> list[str]:
    log_file = tmp_path / "vllm.log"
    config = tmp_path / "logging.json"
    config.write_text(json.dumps(_config(log_file, level)))
    code = (
        "import argparse\n"
        "from vllm.logger import configure_logging_from_args\n"
        "configure_logging_from_args(argparse.Namespace())  # as vLLM's server\n"
        "from vllm_mooncake import logger_for\n"
        "log = logger_for('vllm_mooncake.guard.scheduler_side')\n"
        "log.info('wedge guard active: %s', 'info line')\n"
        "log.warning('wedge guard: %s', 'warning line')\n"
    )
    env = {**os.environ, "VLLM_LOGGING_CONFIG_PATH": str(config)}
    env.pop("VLLM_CONFIGURE_LOGGING", None)
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    # nothing of the guard's escapes the user's handlers to stderr
    assert "wedge guard" not in out.stderr
    return log_file.read_text().splitlines()


def test_a_users_format_and_file_get_the_guards_lines(tmp_path: Path) -> None:
    lines = _log_through_guard(tmp_path, "INFO")
    name = "vllm.vllm_mooncake.guard.scheduler_side"
    assert f"{MARK} INFO {name} | wedge guard active: info line" in lines
    assert f"{MARK} WARNING {name} | wedge guard: warning line" in lines


def test_a_users_level_applies_to_the_guard(tmp_path: Path) -> None:
    lines = _log_through_guard(tmp_path, "WARNING")
    assert not [ln for ln in lines if "info line" in ln]
    assert [ln for ln in lines if "warning line" in ln]
