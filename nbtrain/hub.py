"""Reaching the Hugging Face Hub: one cheap probe, shared by data and model loading.

Offline, ``datasets`` and ``transformers`` retry each request for ~25-45 s before they fail. A
3 s connection probe first lets both go straight to their local caches and fail with a clear error.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlparse

PROBE_TIMEOUT_S = 3.0
_REMEMBER_S = 60.0   # a run asks several times (tokenizer, config, weights); one probe answers them all
_last: tuple[float, bool] | None = None


def _endpoint() -> tuple[str, int]:
    try:
        from huggingface_hub import constants

        url = urlparse(constants.ENDPOINT)
        return url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    except Exception:  # noqa: BLE001 - a malformed HF_ENDPOINT: fall back to the public Hub
        return "huggingface.co", 443


def hub_reachable(timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the Hub opens within ``timeout`` seconds (remembered for a minute)."""
    global _last
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # a direct connection says nothing about a proxy; let the libraries try
    if _last is not None and time.monotonic() - _last[0] < _REMEMBER_S:
        return _last[1]
    host, port = _endpoint()
    ok = threading.Event()

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            ok.set()
        except OSError:
            pass

    # in a thread: the socket timeout does not bound the DNS lookup, which can hang far longer
    t = threading.Thread(target=probe, name="nbtrain-hub-probe", daemon=True)
    t.start()
    t.join(timeout)
    _last = (time.monotonic(), ok.is_set())
    return ok.is_set()


def hub_offline() -> bool:
    """True when the Hub must not be asked: ``HF_HUB_OFFLINE`` is set, or it is not reachable."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or not hub_reachable()


@contextlib.contextmanager
def offline_mode(on: bool) -> Iterator[None]:
    """Make datasets/huggingface_hub use only their caches for one call (no-op when ``on`` is False)."""
    if not on:
        yield
        return
    import datasets
    from huggingface_hub import constants

    saved = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved
