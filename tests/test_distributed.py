"""Issue 9: the same loop on several processes (gloo on CPU), launched by torchrun, accelerate and nbt.launch."""

import os
import threading

import pandas as pd
import psutil
import pytest

import nbtrain as nbt
from nbtrain.engine.launch import launch_command

from .helpers import execute_notebook, run_process

BASE = dict(model="tiny", subset=64, max_seq_len=48, max_steps=4, eval_fraction=0.0, precision="fp32", lr=1e-3)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _run_cli(cmd, out_dir):
    proc = run_process(cmd + ["--output-dir", str(out_dir)], 300, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return pd.read_csv(out_dir / "history.csv")


def _assert_same_losses(a, b):
    assert len(a) == len(b)
    for x, y in zip(a["loss"], b["loss"]):
        assert abs(x - y) <= 1e-5 * abs(y), (x, y)
    assert list(a["tokens"]) == list(b["tokens"])


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """1 process x micro 8 (and micro 4 x accum 2), the references."""
    d = tmp_path_factory.mktemp("single")
    r8 = nbt.train(nbt.TrainConfig(**BASE, micro_batch_size=8))
    r4x2 = nbt.train(nbt.TrainConfig(**BASE, micro_batch_size=4, grad_accum_steps=2))
    return d, r8.history, r4x2.history


def test_two_processes_with_accumulation(single, tmp_path):
    """torchrun through the CLI: 2 ranks x micro 2 x accum 2 (no_sync on the first micro-batch) equals 1 x micro 4 x
    accum 2. (2 processes x micro 4 = 1 x micro 8, no accumulation: accelerate launch, in the notebook test below;
    torchrun is also nbt.launch's launcher in the stop test. Each launch costs two fresh workers.)"""
    import json

    _, _, ref = single
    cfg_path = tmp_path / "c.yaml"
    nbt.TrainConfig(**BASE, micro_batch_size=2, grad_accum_steps=2).to_yaml(cfg_path)
    cmd = [c for c in launch_command(str(cfg_path), 2, "torchrun") if c != "--jsonl"]
    _assert_same_losses(_run_cli(cmd, tmp_path / "out"), ref)
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["world_size"] == 2


def test_launch_stop_ends_all_workers():
    gate = threading.Event()

    class Gate:
        def on_step_end(self, rec):
            if rec.step >= 2:
                gate.set()

    cfg = nbt.TrainConfig(**{**BASE, "max_steps": 100000}, micro_batch_size=4)
    run = nbt.launch(cfg, num_processes=2, callbacks=[Gate()])
    assert gate.wait(300), "\n".join(run.log[-20:])
    children = psutil.Process(run.process.pid).children(recursive=True)
    assert len([c for c in children if "nbtrain" in " ".join(c.cmdline())]) >= 2
    run.stop()
    result = run.wait(120)
    assert result.summary["stopped_reason"] == "stopped" and 2 <= len(result.history) < 100000
    assert run.process.poll() is not None
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def test_launch_streams_records_to_callbacks_and_a_dashboard_in_a_headless_notebook(single, tmp_path):
    """nbt.launch with 2 CPU processes under accelerate launch, from a notebook executed headless (nbclient): a plain
    callback gets the run's start, its 4 records and its result, a LiveDashboard draws them, the launcher exits 0
    and the losses equal 1 process x micro 8 (one launch serves all of these: each costs two fresh workers)."""
    import json

    import nbformat

    _, ref, _ = single
    code = (
        "import json\n"
        "import nbtrain as nbt\n"
        "class Seen:\n"
        "    info, records, result = None, [], None\n"
        "    def on_run_start(self, info): Seen.info = info\n"
        "    def on_step_end(self, rec): Seen.records.append(rec)\n"
        "    def on_run_end(self, result): Seen.result = result\n"
        f"cfg = nbt.TrainConfig(**{BASE!r}, micro_batch_size=4)\n"
        "dash = nbt.LiveDashboard()\n"
        "run = nbt.launch(cfg, num_processes=2, callbacks=[Seen(), dash], launcher='accelerate')\n"
        "result = run.wait(300)\n"
        "assert result is not None and run.done and run.process.returncode == 0, run.log[-20:]\n"
        "assert Seen.info.precision_used == 'fp32' and len(Seen.records) == 4 and Seen.result is result\n"
        "assert result.summary['world_size'] == 2 and result.summary['stopped_reason'] == 'max_steps'\n"
        "assert len(dash.records) == 4, len(dash.records)\n"
        "print('LAUNCH-OK', dash.mode)\n"
        "print('HISTORY', json.dumps(result.history[['loss', 'tokens']].to_dict('list')))\n"
    )
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)])
    execute_notebook(nb, tmp_path, 400)
    outputs = nb.cells[0].outputs
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "LAUNCH-OK html" in text
    assert any("plotly" in str(o.get("data", {})) for o in outputs if o.output_type in ("display_data",
                                                                                        "update_display_data"))
    hist = json.loads(next(line for line in text.splitlines() if line.startswith("HISTORY "))[len("HISTORY "):])
    _assert_same_losses(pd.DataFrame(hist), ref)
