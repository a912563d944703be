"""The browser tests' REST polling (issue 25: GET /api/kernels answered HTTP 500 about one fresh run in seven while
the kernel started): transient server errors are retried until the helper's deadline, anything else fails at once.
Against a tiny http.server on 127.0.0.1; no Jupyter, no browser."""

from __future__ import annotations

import http.server
import json
import threading
import time
import urllib.error

import pytest

from ..helpers import free_port
from .test_browser import JupyterServer, _transient, _wait_for_kernel

IDLE = [{"id": "k1", "execution_state": "idle", "connections": 1}]


class _Scripted(http.server.BaseHTTPRequestHandler):
    """Answers each request with the next step of the server's script: an HTTP status (with IDLE as the body
    for 200), or "reset" (the connection closed with no answer)."""

    def do_GET(self):
        srv = self.server
        srv.seen.append((self.path, self.headers.get("Authorization")))
        step = srv.script.pop(0) if srv.script else 200
        if step == "reset":
            self.close_connection = True
            return
        body = json.dumps(IDLE if step == 200 else {"message": "boom"}).encode()
        self.send_response(step)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake(tmp_path):
    """``(JupyterServer pointed at a scripted HTTP server, that server)``."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    httpd.script, httpd.seen = [], []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    srv = JupyterServer("lab", tmp_path)
    srv.base = f"http://127.0.0.1:{httpd.server_address[1]}"
    yield srv, httpd
    httpd.shutdown()
    httpd.server_close()
    thread.join(5)


def test_transient_errors_are_retried_until_the_kernel_is_idle(fake):
    srv, httpd = fake
    httpd.script = [500, "reset", 503, 200]
    _wait_for_kernel(srv, timeout=30)
    assert [p for p, _ in httpd.seen] == ["/api/kernels"] * 4
    assert all(auth == f"token {srv.token}" for _, auth in httpd.seen)


@pytest.mark.parametrize("status", [403, 404])
def test_other_http_errors_fail_at_once(fake, status):
    srv, httpd = fake
    httpd.script = [status, 200]
    t0 = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as e:
        _wait_for_kernel(srv, timeout=30)
    assert e.value.code == status and len(httpd.seen) == 1 and time.monotonic() - t0 < 5


def test_retries_end_at_the_deadline_with_the_last_error(fake):
    srv, httpd = fake
    httpd.script = [500] * 1000
    t0 = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as e:
        _wait_for_kernel(srv, timeout=1.5)
    assert e.value.code == 500 and 1.5 <= time.monotonic() - t0 < 10
    assert any("still failing at the deadline" in n for n in e.value.__notes__)
    srv.base = f"http://127.0.0.1:{free_port()}"            # nobody listening: refused, retried, then raised
    with pytest.raises(urllib.error.URLError) as e:
        srv.poll_api("GET", "/api/kernels", time.monotonic() + 1)
    assert isinstance(e.value.reason, ConnectionRefusedError)


def test_what_counts_as_transient():
    def http_error(code):
        return urllib.error.HTTPError("http://127.0.0.1/api/kernels", code, "x", None, None)

    assert all(_transient(http_error(c)) for c in (500, 502, 503, 504))
    assert not any(_transient(http_error(c)) for c in (400, 401, 403, 404, 409))
    assert _transient(urllib.error.URLError(ConnectionRefusedError(111, "refused")))
    assert _transient(ConnectionResetError()) and _transient(ConnectionAbortedError())
    import http.client

    assert _transient(http.client.RemoteDisconnected("closed"))
    assert not _transient(urllib.error.URLError(TimeoutError("timed out")))
    assert not _transient(TimeoutError()) and not _transient(json.JSONDecodeError("x", "", 0))
    assert not _transient(urllib.error.URLError(OSError(-2, "Name or service not known")))


def test_only_a_taken_port_is_retried_and_with_a_new_port():
    from ..helpers import START_ATTEMPTS, retry_port

    ports = []

    def taken_once(port):
        ports.append(port)
        return (len(ports) > 1, "OSError: [Errno 98] Address already in use" if len(ports) == 1 else "ok", port)

    ok, _, port = retry_port(taken_once)
    assert ok and len(ports) == 2 and port == ports[-1]
    other = []
    ok, out, _ = retry_port(lambda p: (other.append(p) or False, "AssertionError: losses differ", None))
    assert not ok and len(other) == 1 and "losses differ" in out      # a real failure is never retried
    always = []
    ok, out, _ = retry_port(lambda p: (always.append(p) or False, "EADDRINUSE", None))
    assert not ok and len(always) == START_ATTEMPTS                     # and a taken port only so often


# -- a frontend that never takes in the end of a run (issues 35, 36) ----------------------------------------------
class _FakeServer:
    """The two REST calls one_retry_on_stall makes, recorded; a kernel-error record file in ``root``."""

    def __init__(self, root, idle_for_s=0.0):
        import datetime as dt

        self.root, self.calls = root, []
        last = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=idle_for_s)
        self.kernels = [{"id": "k1", "execution_state": "idle", "last_activity": last.isoformat().replace("+00:00", "Z")}]

    def api(self, method, path):
        self.calls.append((method, path))
        return self.kernels if method == "GET" else None


def test_a_frontend_stall_is_told_by_an_idle_kernel_and_retried_once_from_a_restart(tmp_path):
    from .kernel_errors import RECORD_FILE
    from .test_browser import STALL_IDLE_S, FrontendStall, _kernels_idle_s, one_retry_on_stall

    assert _kernels_idle_s(_FakeServer(tmp_path, idle_for_s=STALL_IDLE_S + 5)) > STALL_IDLE_S
    busy = _FakeServer(tmp_path)
    busy.kernels[0]["execution_state"] = "busy"
    assert _kernels_idle_s(busy) is None

    srv, runs = _FakeServer(tmp_path), []
    (tmp_path / RECORD_FILE).write_text("old")

    def stalls_once():
        runs.append(1)
        if len(runs) == 1:
            raise FrontendStall("the kernel has been idle for 61 s")

    one_retry_on_stall(srv, stalls_once)
    assert len(runs) == 2 and ("POST", "/api/kernels/k1/restart") in srv.calls
    assert not (tmp_path / RECORD_FILE).exists()

    def always():
        raise FrontendStall("again")

    with pytest.raises(FrontendStall):          # a second stall fails the test
        one_retry_on_stall(_FakeServer(tmp_path), always)

    def other():
        raise AssertionError("a real failure")

    calls = _FakeServer(tmp_path)
    with pytest.raises(AssertionError, match="a real failure"):   # anything else is never retried
        one_retry_on_stall(calls, other)
    assert calls.calls == []
