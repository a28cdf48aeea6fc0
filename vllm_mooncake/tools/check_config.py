"""``check-config``: validate a guard ``kv_transfer_config`` before deploying it.

::

    python -m vllm_mooncake.tools.check_config FILE_OR_JSON
    vllm-mooncake-check-config FILE_OR_JSON

The argument is a JSON file or a JSON string: either the
``kv_transfer_config`` itself, or an object with a ``kv_transfer_config``
key and optionally ``scheduler_cls`` (as in vLLM's engine arguments). It runs
the checks vLLM start-up runs through the plugin -- the installed vLLM is a
supported release, the ``wedge_guard`` section, the child connectors (listed,
distinct, known to vLLM's connector factory or importable), the
``scheduler_cls`` -- and then vLLM's own ``KVTransferConfig`` validation,
without building an engine. Prints ``OK: ...`` and exits 0, or prints the
error (naming the field and the fix) and exits 1.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_mooncake import CONNECTOR_NAME, names_guard_connector


class ConfigCheckError(ValueError):
    """The input is not a guard configuration at all."""


def load(arg: str) -> Any:
    """The JSON in file ``arg``, or ``arg`` itself parsed as JSON."""
    path = Path(arg)
    try:
        is_file = path.is_file()
    except OSError:  # e.g. a JSON string too long for a file name
        is_file = False
    text = path.read_text() if is_file else arg
    where = str(path) if is_file else "the argument"
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        hint = "" if is_file or text.lstrip()[:1] in "{[" else " (no such file)"
        raise ConfigCheckError(f"{where} is not valid JSON{hint}: {exc}") from exc


def check(raw: Any) -> str:
    """Validate; return a one-line summary or raise with the message."""
    from vllm_mooncake.compat.versions import check_vllm_version
    from vllm_mooncake.guard.config import GuardConfig, validate_children
    from vllm_mooncake.plugin import check_scheduler_cls, register

    if not isinstance(raw, Mapping):
        raise ConfigCheckError(
            f"expected a JSON object (the kv_transfer_config), got {raw!r}"
        )
    scheduler_cls = raw.get("scheduler_cls")
    ktc = raw.get("kv_transfer_config", raw)
    if not isinstance(ktc, Mapping):
        raise ConfigCheckError(
            f"kv_transfer_config: expected a JSON object, got {ktc!r}"
        )
    name = ktc.get("kv_connector")
    if not names_guard_connector(name, ktc.get("kv_connector_module_path")):
        raise ConfigCheckError(
            f"kv_transfer_config.kv_connector: {name!r} is not the guard; set it to "
            f"{CONNECTOR_NAME!r} (this command checks guard configurations)"
        )
    series = check_vllm_version()
    register()
    extra = ktc.get("kv_connector_extra_config")
    if extra is not None and not isinstance(extra, Mapping):
        raise ConfigCheckError(
            "kv_transfer_config.kv_connector_extra_config: expected a JSON object "
            f"with 'connectors' and 'wedge_guard', got {extra!r}"
        )
    guard = GuardConfig.from_extra_config(extra)
    children = validate_children(extra)
    check_scheduler_cls(scheduler_cls)
    _vllm_validates(ktc)
    names = ", ".join(str(c["kv_connector"]) for c in children)
    return (
        f"policy={guard.policy.value} max_attempts={guard.max_attempts} "
        f"max_failed_loads={guard.max_failed_loads} "
        f"stall_alarm_s={guard.stall_alarm_s:g} "
        f"children=[{names}] on vLLM {series}.x"
    )


def check_kv_transfer_config(raw: Any) -> str | None:
    """The error for ``raw`` (parsed JSON, as for :func:`check`), or None if OK.

    For callers that collect problems (e.g. ``deploy_check``) instead of
    stopping at the first.
    """
    try:
        check(raw)
    except (ValueError, RuntimeError) as exc:
        return str(exc)
    return None


def _vllm_validates(ktc: Mapping[str, Any]) -> None:
    """vLLM's own checks of the top-level fields (roles, failure policy...)."""
    from pydantic import ValidationError
    from vllm.config import KVTransferConfig

    try:
        KVTransferConfig(**ktc)
    except (ValidationError, TypeError) as exc:
        raise ConfigCheckError(f"kv_transfer_config: {exc}") from exc


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print(__doc__.strip().splitlines()[0])
        print("usage: vllm-mooncake-check-config FILE_OR_JSON")
        return 0 if args[:1] in (["-h"], ["--help"]) else 1
    try:
        summary = check(load(args[0]))
    except (ValueError, RuntimeError) as exc:  # config errors, unsupported vLLM
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"OK: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "ConfigCheckError",
    "check",
    "check_kv_transfer_config",
    "load",
    "main",
]
