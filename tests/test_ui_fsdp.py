"""Issue 28, the Panel: the Processes tab (the panel's own processes box, sharding, reshard_after_forward), the
per-process memory readout, and Train / Stop on several processes through ``nbt.launch``. Widget tests without a
browser: set ``.value``, call ``.click()``, assert on the config, the readout and the run."""

import html
import re
import time

import psutil
import pytest

from nbtrain.config import TrainConfig

from .helpers import Collect

ipywidgets = pytest.importorskip("ipywidgets")

from nbtrain.ui.form import SECTIONS, reshard_unavailable  # noqa: E402 (after the importorskip)
from nbtrain.ui.panel import Panel  # noqa: E402

SMALL = {"model": "tiny", "data": "builtin:python-docs", "subset": 32, "max_seq_len": 32, "micro_batch_size": 4,
         "eval_fraction": 0.0, "precision": "fp32", "lr": 1e-3, "max_steps": 3}
TIMEOUT = 240   # two shared CPU cores, and two workers importing torch


def small(**kw) -> TrainConfig:
    return TrainConfig(**{**SMALL, **kw})


def text(value: str) -> str:
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", value)).split())


def wait_for(pred, timeout=TIMEOUT, what="condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_processes_tab_holds_the_controls_and_they_round_trip():
    assert SECTIONS["Processes"] == ("sharding", "reshard_after_forward")
    panel = Panel(small(), debounce_s=0)
    page = panel.tabs.children[panel.tabs.titles.index("Processes")]
    # the processes box comes first, then its info line, then the two config fields
    first = page.children[0]
    assert panel.processes_control in first.children
    assert page.children[1] is panel.processes_info
    assert page.children[2].children[0] is panel.controls["sharding"]
    assert page.children[3].children[0] is panel.controls["reshard_after_forward"]
    box = panel.processes_control
    assert (box.value, box.min, box.max) == (1, 1, 64) and panel.processes == 1

    panel.controls["sharding"].value = "fsdp"
    panel.controls["reshard_after_forward"].value = False
    panel.processes_control.value = 4
    cfg = panel.config
    assert (cfg.sharding, cfg.reshard_after_forward) == ("fsdp", False)
    assert panel.processes == 4 and "processes" not in cfg.to_dict()   # a launch setting, not part of the config
    assert Panel(cfg, debounce_s=0).config == cfg
    assert Panel(small(), debounce_s=0, processes=3).processes == 3
    panel.processes_control.value = 500   # out of range: held at the box's bound
    assert panel.processes == 64


def test_reshard_box_is_greyed_unless_fsdp_and_keeps_its_value():
    panel = Panel(small(), debounce_s=0)
    box = panel.controls["reshard_after_forward"]
    assert panel.config.sharding == "none"
    assert box.disabled and "unavailable" in box.tooltip
    assert html.escape(reshard_unavailable("none")) in panel.form.help["reshard_after_forward"].value
    panel.controls["sharding"].value = "fsdp"
    assert not box.disabled and "unavailable" not in box.tooltip
    assert "unavailable" not in panel.form.help["reshard_after_forward"].value
    box.value = False
    panel.controls["sharding"].value = "none"
    assert box.disabled and box.value is False   # never changed behind the user's back
    assert panel.config.reshard_after_forward is False and panel.errors == []


def test_processes_info_says_what_train_will_do():
    panel = Panel(small(sharding="fsdp"), debounce_s=0)
    info = text(panel.processes_info.value)
    assert "this kernel" in info and "nothing to shard" in info
    panel.processes = 2
    info = text(panel.processes_info.value)
    assert "launches 2 processes" in info and "FSDP2" in info and "split 2 ways" in info
    panel.controls["sharding"].value = "none"
    assert "DDP" in text(panel.processes_info.value)


def test_memory_readout_is_per_process_under_fsdp():
    memory = pytest.importorskip("nbtrain.memory")
    panel = Panel(small(sharding="fsdp", model="tiny", max_seq_len=32), debounce_s=0)
    one = panel.memory.value
    assert "per process" not in text(one)
    assert panel.memory_estimate == memory.estimate_memory(panel.config)

    panel.processes = 2
    two = text(panel.memory.value)
    assert panel.memory.value != one
    assert "per process, 2 processes, fsdp" in two
    import inspect

    if "world_size" in inspect.signature(memory.estimate_memory).parameters:
        est = memory.estimate_memory(panel.config, world_size=2)
        assert panel.memory_estimate == est
        assert memory.fmt_gib(est.total_gib) in two
        assert panel.memory_estimate.total_gib < memory.estimate_memory(panel.config).total_gib
    else:   # until estimate_memory divides: it says the numbers are one process's
        assert "takes no world_size" in two
    panel.processes = 4
    assert "per process, 4 processes, fsdp" in text(panel.memory.value)
    panel.processes = 1
    assert panel.memory.value == one


def test_compare_on_several_processes_is_refused_with_a_status_line():
    panel = Panel(small(), debounce_s=0, processes=2)
    panel.compare_button.click()
    status = text(panel.status.value)
    assert "not compared" in status and "set processes to 1" in status
    assert panel.runner.job is None and panel.runner.compare_thread is None
    assert not panel.compare_button.disabled and not panel.train_button.disabled
    assert panel.tabs.titles[panel.tabs.selected_index] == "Processes"


def _workers(launcher_pid: int) -> list:
    try:
        kids = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for p in kids:
        try:
            if "nbtrain" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:   # ended between the listing and the look
            pass
    return out


def test_train_on_two_processes_launches_streams_and_stops():
    collect = Collect()
    # max_steps far beyond what runs before the Stop: a run that ends by itself fails the "stopped" check
    panel = Panel(small(sharding="fsdp", max_steps=2000), callbacks=[collect], debounce_s=0, processes=2)
    panel.train_button.click()
    run = panel.run
    try:
        assert type(run).__name__ == "LaunchedRun", panel.status.value
        assert panel.train_button.disabled and not panel.stop_button.disabled
        wait_for(lambda: len(panel.dashboard.records) >= 2 or run.done, what="two steps on the dashboard")
        assert not run.done, "\n".join(run.log[-20:])
        workers = _workers(run.process.pid)
        assert len(workers) == 2, [w.cmdline() for w in workers]
        status = text(panel.status.value)
        assert "running" in status and "2 processes · fsdp" in status
        n_at_stop = len(panel.dashboard.records)

        panel.stop_button.click()
        assert panel.stop_button.disabled and "stopping" in text(panel.status.value)
        assert panel.wait(TIMEOUT) is not None
    finally:
        if run is not None and run.process.poll() is None:
            run.process.kill()
    res = panel.result
    assert res is run.result and res.model is None
    assert res.summary["stopped_reason"] == "stopped" and res.summary["world_size"] == 2
    assert n_at_stop <= len(res.history) < 2000
    assert list(res.history["step"]) == list(range(1, len(res.history) + 1))
    # rank 0's records reached the dashboard and the user's callback, as for a run in this kernel
    assert [r.step for r in panel.dashboard.records] == list(res.history["step"])
    assert collect.result is res and len(collect.records) == len(res.history)
    # Stop ended the launcher and both workers
    wait_for(lambda: not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers), 30,
             "the workers to end")
    assert run.process.poll() is not None
    status = text(panel.status.value)
    assert "stopped" in status and "2 processes · fsdp" in status
    assert "result.model is None" in text(panel.notes.value)
    assert not panel.train_button.disabled and panel.stop_button.disabled
