"""Issue 16: runs that start safely in a fresh process, stay isolated from each other, keep what they have
when a callback fails, and end before the interpreter does."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest
import torch

import nbtrain as nbt

from .helpers import run_process

# Each case in one fresh process (10 each took 2 min of the suite). The one race seen so far (a half-built
# transformers module) is forced in compare_in_thread, so it shows in every process: more repeats add no power.
REPS = 1

# Each script is the first thing a fresh process does, in the order a notebook does it; it prints OK.
FRESH = {
    # Panel -> Train first thing, then Stop and leave: the run must start (no half-built transformers),
    # and interpreter exit must stop and join it (summary.json is written by the run's end).
    "panel_train_stop_exit": """
        import threading
        import nbtrain as nbt

        class FirstStep:
            seen = threading.Event()

            def on_step_end(self, record):
                self.seen.set()

        p = nbt.Panel(callbacks=[FirstStep()])
        p.controls["max_steps"].value = "200"
        p.controls["subset"].value = "32"
        p.controls["eval_fraction"].value = 0.0
        p.controls["output_dir"].value = OUT
        p.train_button.click()
        FirstStep.seen.wait(60)
        p.stop_button.click()
        print("OK")
    """,
    "compare_in_thread": """
        import threading
        import nbtrain as nbt
        cfg = nbt.TrainConfig(model="tiny", max_steps=1, subset=16, eval_fraction=0, max_seq_len=32)
        t = threading.Thread(target=nbt.compare, args=(cfg,), kwargs=dict(precisions=("fp32",), warmup=False))
        t.start()
        # The worst interleaving, every time: this thread's import starts once the other thread's has (at once
        # when import nbtrain completed transformers, as it must); without that, the bug showed in 2 of 3 processes.
        import sys
        import time
        deadline = time.monotonic() + 30
        while "transformers" not in sys.modules and time.monotonic() < deadline:
            time.sleep(0.0005)
        from transformers import AutoConfig  # noqa: F401
        t.join()
        print("OK")
    """,
}


# A zygote: a fresh interpreter that imports only torch and the scientific stack (no transformers, no nbtrain,
# no bitsandbytes) and forks one child per case. Each child is a fresh process as far as the race is concerned
# (transformers is first imported there, on whichever thread gets to it first), runs its script and leaves through a
# normal interpreter exit (atexit, finalisation of daemon threads); forking saves the ~3 s torch import in every
# child. A child's stdout goes to NAME.log and its stderr to NAME.err.
ZYGOTE = """
import json, os, sys
import gc, numpy, pandas, torch, yaml, pydantic, psutil  # noqa: F401  (nothing here starts a thread)
exec(sys.argv[3] if len(sys.argv) > 3 else "")   # a prelude shared by every child (it must start no thread)
gc.freeze()   # what is here stays: no child's collections (its exit's included) walk it and copy its pages
jobs, out, parallel = json.loads(sys.argv[1]), sys.argv[2], 2
live, status = {}, {}
for name, code in jobs:
    while len(live) >= parallel:
        pid, st = os.wait()
        status[live.pop(pid)] = os.waitstatus_to_exitcode(st)
    pid = os.fork()
    if pid == 0:
        fd = os.open(os.path.join(out, name + ".log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        err = os.open(os.path.join(out, name + ".err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(err, 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        exec(compile(code, name, "exec"), {"__name__": "__main__"})
        sys.exit(0)
    live[pid] = name
while live:
    pid, st = os.wait()
    status[live.pop(pid)] = os.waitstatus_to_exitcode(st)
print(json.dumps(status))
"""


def _fork_cases(jobs, tmp_path, timeout=600, prelude=""):
    """Run ``[(name, code)]`` in fresh children of one zygote (after ``prelude`` there, whose stderr must stay
    empty); {name: (exit code, stdout, stderr)}."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    p = run_process([sys.executable, "-c", ZYGOTE, json.dumps(jobs), str(tmp_path), prelude], timeout, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert not p.stderr, f"the zygote's prelude {prelude!r} wrote to stderr: {p.stderr[-2000:]!r}"
    status = json.loads(p.stdout.strip().splitlines()[-1])
    return {name: (status[name], (tmp_path / f"{name}.log").read_text(), (tmp_path / f"{name}.err").read_text())
            for name, _ in jobs}


@pytest.mark.slow
def test_fresh_process_starts_are_thread_safe_and_exit_cleanly(tmp_path):
    """REPS fresh processes per case: no import error, exit code 0, the stopped run finished before exit."""
    jobs = []
    for rep in range(REPS):
        for case, body in FRESH.items():
            name = f"{case}-{rep}"
            jobs.append((name, f"OUT = {str(tmp_path / name)!r}\n" + textwrap.dedent(body)))
    failures = []
    for name, (code, text, err) in _fork_cases(jobs, tmp_path).items():
        text += err
        ok = code == 0 and "OK" in text and "Error" not in text and "terminate called" not in text
        if ok and name.startswith("panel_train_stop_exit"):
            # Exit joined the stopped run: its end-of-run work (summary.json) happened.
            summary = tmp_path / name / "summary.json"
            ok = summary.is_file() and json.loads(summary.read_text())["stopped_reason"] == "stopped"
        if not ok:
            failures.append(f"{name}: exit {code}\n{text[-1500:]}")
    assert not failures, f"{len(failures)} of {len(jobs)} fresh processes failed:\n" + "\n---\n".join(failures[:3])


# Two runs started together, forced to overlap: while one run holds the process's RNG lock (its own random state
# in torch's global generator: building its model, its steps), the lock is kept until the other run has done all
# it can without it and waits for it. Whatever a run draws from the global generator outside its lock then takes
# numbers from the other run's stream, every time (issue: the MFU probe's GEMM inputs, drawn as a run prepared,
# changed the other run's initial weights in 2 of 3 processes). Then, in the same process, a solo run with the
# same config, and what the process wrote to stderr and imported.
OVERLAP = """
import contextlib, json, sys, threading, time
import nbtrain as nbt   # done in the zygote (its stderr checked there): each child starts from it
from nbtrain.engine import rng as rngmod

RUNS = 2
cond = threading.Condition()
waiting, runs, local = {}, set(), threading.local()


def _others_waiting(me):
    return len(runs) >= RUNS and all(waiting.get(t) or not t.is_alive() for t in runs if t is not me)


def _hold_until_others_wait(me):
    deadline = time.monotonic() + 20
    with cond:
        while not _others_waiting(me) and time.monotonic() < deadline:
            cond.wait(0.02)


orig_active, orig_init = rngmod.RunRng.active, rngmod.RunRng.__init__


@contextlib.contextmanager
def active(self):
    me = threading.current_thread()
    if me is threading.main_thread() or getattr(local, "inside", False):
        with orig_active(self):
            yield
        return
    with cond:
        runs.add(me)
        waiting[me] = True
        cond.notify_all()
    with orig_active(self):
        with cond:
            waiting[me] = False
        _hold_until_others_wait(me)
        local.inside = True
        try:
            yield
        finally:
            local.inside = False


def init(self, *args, **kwargs):
    me = threading.current_thread()
    with cond:
        if me is not threading.main_thread():
            runs.add(me)
            waiting[me] = True
        cond.notify_all()
    try:
        orig_init(self, *args, **kwargs)
    finally:
        with cond:
            waiting[me] = False


rngmod.RunRng.active, rngmod.RunRng.__init__ = active, init
cfg = nbt.TrainConfig(model="tiny", precision="fp32", seed=3, max_steps=2, subset=16, eval_fraction=0,
                      max_seq_len=32)
a, b = nbt.start(cfg), nbt.start(cfg)
together = [a.wait().history["loss"].tolist(), b.wait().history["loss"].tolist()]
rngmod.RunRng.active, rngmod.RunRng.__init__ = orig_active, orig_init
solo = nbt.train(cfg).history["loss"].tolist()
print(json.dumps({"together": together, "solo": solo, "bitsandbytes": "bitsandbytes" in sys.modules}))
"""


@pytest.mark.slow
def test_two_starts_forced_to_overlap_equal_a_solo_run_in_3_fresh_processes(tmp_path):
    """Two nbt.start(cfg) in a fresh process, forced to overlap during model construction and the first step,
    each equal a solo nbt.train(cfg) loss for loss, in 3 of 3 processes (the overlap is forced, so one would
    do; three catch what else might vary); and the process (import nbtrain, in
    the zygote, and three tiny fp32 runs, offline) wrote nothing to stderr and never imported bitsandbytes. The
    children fork from a zygote that imported nbtrain (no thread is running then): 10 x the import was ~45 s."""
    jobs = [(f"overlap-{i}", OVERLAP) for i in range(3)]
    failures = []
    for name, (code, text, err) in _fork_cases(jobs, tmp_path, prelude="import nbtrain").items():
        if code != 0 or not text.strip():
            failures.append(f"{name}: exit {code}\n{(text + err)[-1500:]}")
            continue
        out = json.loads(text.strip().splitlines()[-1])
        if out["together"] != [out["solo"], out["solo"]]:
            failures.append(f"{name}: together {out['together']} != solo {out['solo']}")
        if err:
            failures.append(f"{name}: wrote to stderr: {err[-800:]!r}")
        if out["bitsandbytes"]:
            failures.append(f"{name}: imported bitsandbytes (no QLoRA, no 8-bit optimizer)")
    assert not failures, f"{len(failures)} problem(s) in 3 processes:\n" + "\n".join(failures[:6])


QLORA_OFFLINE = """
import json, sys
import nbtrain as nbt
from nbtrain._logs import bitsandbytes_loaded
r = nbt.train(nbt.TrainConfig(model="tiny", method="qlora", precision="bf16", max_steps=2, subset=16, eval_fraction=0,
                              max_seq_len=32))
layer = type(r.model.base_model.model.model.layers[0].self_attn.q_proj.base_layer).__name__
print(json.dumps({"loss": r.history["loss"].tolist(), "layer": layer, "loaded": bitsandbytes_loaded()}))
"""


@pytest.mark.slow
def test_qlora_offline_trains_with_no_hub_lookup_on_stderr(tmp_path):
    """QLoRA offline (HF_HUB_OFFLINE=1) in a fresh process: bitsandbytes loads (its own CPU kernel where the Hub's
    is out of reach), the 4-bit layers train, and nothing about a Hub kernel or its publisher reaches stderr."""
    (code, text, err), = _fork_cases([("qlora", QLORA_OFFLINE)], tmp_path, prelude="import nbtrain").values()
    assert code == 0, text + err
    out = json.loads(text.strip().splitlines()[-1])
    assert out["layer"] == "Linear4bit" and out["loaded"]
    assert all(v == v and abs(v) < 100 for v in out["loss"]), out
    for needle in ("kernels-community", "publisher trust", "Hugging Face Hub", "gemm_4bit_forward"):
        assert needle not in err, err


SAVE = """
import json, sys, tempfile
import nbtrain as nbt
r = nbt.train(nbt.TrainConfig(model="tiny", subset=16, max_seq_len=16, max_steps=1, eval_fraction=0.0,
                              precision="fp32", micro_batch_size=4))
r.save(tempfile.mkdtemp(prefix="nbt-save-"))
from nbtrain._logs import bitsandbytes_loaded
print(json.dumps({"executed": bitsandbytes_loaded()}))
"""


def test_saving_a_model_reaches_no_hub_and_writes_no_note(tmp_path):
    """result.save() in a fresh process, offline: save_pretrained's import of bitsandbytes (through peft and
    transformers' quantizers) stays lazy, so no Hub kernel lookup and no fallback note reach stderr."""
    (code, text, err), = _fork_cases([("save", SAVE)], tmp_path, prelude="import nbtrain").values()
    assert code == 0, text + err
    for needle in ("kernels-community", "publisher trust", "gemm_4bit_forward"):
        assert needle not in err, err
    assert json.loads(text.strip().splitlines()[-1]) == {"executed": False}


def _lora(seed: int) -> nbt.TrainConfig:
    # LoRA: its init and its dropout both draw random numbers, so interleaved runs would differ.
    return nbt.TrainConfig(model="tiny", subset=48, max_seq_len=32, micro_batch_size=4, max_steps=6,
                           eval_fraction=0.0, precision="fp32", method="lora", lora_dropout=0.3, seed=seed)


def test_concurrent_runs_equal_solo_runs_and_leave_global_rng_alone():
    solo = {s: nbt.train(_lora(s)).history["loss"].tolist() for s in (0, 1)}
    assert solo[0] != solo[1]
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    runs = {s: nbt.start(_lora(s)) for s in (0, 1)}
    together = {s: r.wait().history["loss"].tolist() for s, r in runs.items()}
    assert together == solo
    assert torch.equal(torch.get_rng_state(), before), "a run changed the caller's global RNG state"


def test_train_leaves_global_rng_state_as_found(tiny_cfg):
    torch.manual_seed(7)
    before = torch.get_rng_state()
    nbt.train(tiny_cfg.replace(max_steps=2))
    assert torch.equal(torch.get_rng_state(), before)
    # ... and the run does not depend on the caller's state either.
    torch.manual_seed(99)
    a = nbt.train(tiny_cfg.replace(max_steps=2)).history["loss"].tolist()
    torch.manual_seed(5)
    b = nbt.train(tiny_cfg.replace(max_steps=2)).history["loss"].tolist()
    assert a == b


class _FailAt:
    def __init__(self, step):
        self.step = step

    def on_step_end(self, rec):
        if rec.step == self.step:
            raise ValueError("boom")


class _Ends:
    def __init__(self):
        self.results = []

    def on_run_end(self, result):
        self.results.append(result)


def test_failing_callback_keeps_the_run(tiny_cfg, tmp_path):
    ends = _Ends()
    cfg = tiny_cfg.replace(max_steps=6, output_dir=str(tmp_path / "out"))
    with pytest.raises(nbt.CallbackError, match=r"_FailAt\.on_step_end raised ValueError: boom") as info:
        nbt.train(cfg, callbacks=[_FailAt(3), ends])
    result = info.value.result
    assert result is not None and len(result.history) == 3
    assert result.summary["stopped_reason"] == "callback_error"
    assert result.model is not None
    assert ends.results == [result], "on_run_end must still reach every callback"
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["stopped_reason"] == "callback_error"


def test_failing_callback_in_start_keeps_run_result(tiny_cfg):
    run = nbt.start(tiny_cfg.replace(max_steps=5), callbacks=[_FailAt(2)])
    with pytest.raises(nbt.CallbackError):
        run.wait()
    assert run.result is not None and len(run.result.history) == 2
    assert run.result.summary["stopped_reason"] == "callback_error"


def test_failing_on_run_end_still_reaches_later_callbacks(tiny_cfg):
    class BadEnd:
        def on_run_end(self, result):
            raise RuntimeError("end")

    ends = _Ends()
    with pytest.raises(nbt.CallbackError, match="BadEnd.on_run_end") as info:
        nbt.train(tiny_cfg.replace(max_steps=2), callbacks=[BadEnd(), ends])
    assert ends.results == [info.value.result]
    assert len(info.value.result.history) == 2


def test_start_registers_its_thread_for_exit(tiny_cfg):
    from nbtrain.engine import threads

    run = nbt.start(tiny_cfg.replace(max_steps=2))
    assert run._thread in threads._live or run.done
    run.wait()
    run._thread.join()
    assert run._thread not in threads._live
