"""vllm_mooncake: a wedge guard for prefill/decode disaggregated vLLM serving.

Reading path (``docs/architecture.md`` follows one request through it):

1. ``guard/``               -- the product: the ledger, the connector facade,
                               the scheduler side's rooms, the guarded
                               schedulers (its ``__init__.py`` lists them in
                               reading order).
2. ``compat/``              -- what differs between vLLM releases; every
                               private vLLM name we touch (``internals.py``).
3. ``plugin.py``            -- the ``vllm.general_plugins`` entry point.
4. ``testing/``             -- the real-scheduler driver, the scripted
                               connector and the invariant checker that tests
                               and the simulator share.
5. ``tools/``               -- the simulator, the local cluster, the checks.
"""

from typing import Any

__version__ = "0.1.0"

CONNECTOR_NAME = "WedgeGuardConnector"
"""The name users put in ``kv_transfer_config["kv_connector"]``."""
CONNECTOR_MODULE = "vllm_mooncake.guard.connector"


def names_guard_connector(kv_connector: object, module_path: object) -> bool:
    """Whether a ``kv_transfer_config`` (or a child entry) names the guard:
    by its registered name, or by ``kv_connector_module_path``."""
    return kv_connector == CONNECTOR_NAME or module_path == CONNECTOR_MODULE


LOGGER_ROOT = "vllm.vllm_mooncake"
"""The project's loggers live under vLLM's ``vllm`` logger, so that vLLM's
logging configuration (its format and level, ``VLLM_LOGGING_LEVEL``,
``VLLM_LOGGING_CONFIG_PATH``) applies to them as to vLLM's own lines: vLLM
configures the ``vllm`` logger only, and a logger outside it prints its
warnings unformatted and its INFO lines not at all."""


def logger_for(module_name: str) -> Any:
    """The logger of ``module_name`` (a ``vllm_mooncake...`` module), under
    :data:`LOGGER_ROOT`, with vLLM's ``*_once`` methods."""
    from vllm.logger import init_logger

    suffix = module_name.removeprefix("vllm_mooncake")
    return init_logger(LOGGER_ROOT + suffix)


__all__ = [
    "CONNECTOR_MODULE",
    "CONNECTOR_NAME",
    "LOGGER_ROOT",
    "__version__",
    "logger_for",
    "names_guard_connector",
]
