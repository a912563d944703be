"""Test helpers shared by several test files."""

import math


class Collect:
    """A callback that keeps everything it is given."""

    def __init__(self):
        self.info = None
        self.records = []
        self.evals = []
        self.result = None

    def on_run_start(self, info):
        self.info = info

    def on_step_end(self, rec):
        self.records.append(rec)

    def on_eval(self, rec):
        self.evals.append(rec)

    def on_run_end(self, result):
        self.result = result


def after_build(monkeypatch, modify):
    """Patch the engine's build_model so ``modify(model)`` runs on every model a run builds."""
    import nbtrain.engine.prepare as prepare

    original = prepare.build_model

    def build(*args, **kwargs):
        model = original(*args, **kwargs)
        modify(model)
        return model

    monkeypatch.setattr(prepare, "build_model", build)


def inject_inf(monkeypatch, on_forward_calls):
    """Make the model's logits inf on the given (1-based) forward calls of training."""
    calls = {"n": 0}

    def hook(module, inputs, output):
        if not module.training:
            return output
        calls["n"] += 1
        if calls["n"] in on_forward_calls:
            output.logits = output.logits * math.inf
        return output

    after_build(monkeypatch, lambda model: model.register_forward_hook(hook))
    return calls


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a tied weight counts once)."""
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def frozen_heap():
    """Body of a fixture (``yield from frozen_heap()``): a full collection, then all the process holds moves to the
    collector's permanent generation until the fixture ends. The benchmark suite runs a full ``gc.collect()``
    between rows (fair peak memory); in a test worker each would walk every earlier test's imports and objects.
    (compare() freezes what is older than the comparison itself.)"""
    import gc

    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# -- bounded waits that say what they waited for -------------------------------------------------------------------
def _tail(text, n=4000) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return (text or "")[-n:]


def run_process(cmd, timeout: float, **kw):
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)``; on a timeout the test
    fails with the command and the tails of what it printed (stdout and stderr), not a bare TimeoutExpired."""
    import subprocess

    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{' '.join(map(str, cmd))[:300]} did not end within {timeout:.0f} s\n"
                             f"--- stdout tail ---\n{_tail(e.stdout)}\n--- stderr tail ---\n{_tail(e.stderr)}") from None


def communicate(proc, timeout: float) -> str:
    """``proc.communicate(timeout)``'s stdout; on a timeout the process is killed and the test fails with the
    tail of what it printed."""
    import subprocess

    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        out = proc.communicate()[0]
        raise AssertionError(f"{' '.join(map(str, proc.args))[:300]} did not end within {timeout:.0f} s\n"
                             f"--- output tail ---\n{_tail(out)}") from None


def execute_notebook(nb, cwd, timeout: float, env=None) -> None:
    """Execute ``nb`` headless (nbclient, the python3 kernel = this interpreter, in ``cwd``), each cell within
    ``timeout`` s. A cell that hangs fails the test with the kernel's Python stacks (every thread: faulthandler,
    registered on SIGUSR1 by an IPython start-up file, dumped when the cell times out) and the cell's source,
    instead of a bare CellTimeoutError."""
    import asyncio
    import os
    import signal
    import tempfile
    from pathlib import Path

    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError

    class Client(NotebookClient):
        stacks = ""

        async def _async_handle_timeout(self, timeout, cell=None):
            pid = getattr(getattr(self.km, "provisioner", None), "pid", None)
            if pid:
                os.kill(pid, signal.SIGUSR1)
                await asyncio.sleep(3)
                self.stacks = dump.read_text(errors="replace")
            return await super()._async_handle_timeout(timeout, cell)

    with tempfile.TemporaryDirectory(prefix="nbt-kernel-") as tmp:
        startup = Path(tmp, "ipython", "profile_default", "startup")
        startup.mkdir(parents=True)
        dump = Path(tmp, "stacks.txt")
        (startup / "00-stacks.py").write_text(
            "import faulthandler, signal\n"
            f"faulthandler.register(signal.SIGUSR1, file=open({str(dump)!r}, 'w'), all_threads=True)\n")
        kernel_env = {**(env if env is not None else os.environ), "IPYTHONDIR": str(Path(tmp, "ipython"))}
        client = Client(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(cwd)}})
        try:
            client.execute(env=kernel_env)
        except CellTimeoutError as e:
            raise AssertionError(f"{e}\n--- the kernel's Python stacks when it timed out ---\n"
                                 f"{client.stacks[-6000:] or '(none dumped)'}") from None


# -- the one transient failure a start-up is retried for: a port taken between choosing it and binding it --------
PORT_IN_USE = ("address already in use", "eaddrinuse", "errno 98", "is already in use")
START_ATTEMPTS = 3


def free_port() -> int:
    """A port on 127.0.0.1 free now (another process may still take it before it is bound: see retry_port)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(text: str) -> bool:
    """Whether a process's output says it could not bind its port."""
    text = (text or "").lower()
    return any(p in text for p in PORT_IN_USE)


def retry_port(start, attempts: int = START_ATTEMPTS):
    """``start(port)`` -> (ok, output, value) with a fresh free port, again (up to ``attempts`` times) only when it
    failed because that port was taken; returns the last (ok, output, value). Nothing else is retried."""
    for i in range(attempts):
        ok, output, value = start(free_port())
        if ok or not port_in_use(output) or i == attempts - 1:
            return ok, output, value
    raise AssertionError("unreachable")


def load_benchmark(name: str):
    """The module benchmarks/<name>.py (benchmarks/ is no package), registered under ``name``."""
    import importlib.util
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent.parent / "benchmarks"
                                                  / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
