"""Library log lines and warnings that are about nbtrain's own use of a library, not for its users."""

from __future__ import annotations

import logging

# bitsandbytes' CPU backend logs, at import, that an optional kernel from the Hub could not be loaded (on CPUs
# with AVX512-BF16). It falls back to its own kernel; a tutorial that uses no QLoRA at all showed it in red.
_BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"
_BNB_CPU_MESSAGE = "kernels-community"
# torchao (precision="fp8") logs, at import, each of its CUDA kernel libraries it cannot load on a machine without
# them (a CPU, another CUDA), and torch logs that one of its enums registers itself the deprecated way. Its float8
# training needs neither kernel library (it falls back to torch's scaled matmul, or emulates it).
_QUIET = ((_BNB_CPU_LOGGER, _BNB_CPU_MESSAGE), ("torchao", "Failed to load"),
          ("torch.utils._pytree", "register_constant"))


class _DropMessage(logging.Filter):
    def __init__(self, needle: str):
        super().__init__()
        self.needle = needle

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return self.needle not in record.getMessage()
        except Exception:  # a record whose arguments do not format is not ours to hide
            return True


def quiet_library_logs() -> None:
    """Drop the known, harmless import-time log lines of optional libraries (idempotent; imports nothing)."""
    for name, needle in _QUIET:
        log = logging.getLogger(name)   # configurable before the library is ever imported
        if not any(isinstance(f, _DropMessage) and f.needle == needle for f in log.filters):
            log.addFilter(_DropMessage(needle))


quiet_library_logs()   # on import: nbtrain/__init__ imports this module before anything else
