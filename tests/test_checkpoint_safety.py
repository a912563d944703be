"""Issue 16: checkpoints load without running code, say what they skipped, and writers never collide."""

import hashlib
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import nbtrain as nbt
from nbtrain.engine import checkpoint as ckpt
from nbtrain.engine.checkpoint import CheckpointError, check_resumable, load_checkpoint, save_checkpoint


def _state(step: int = 2) -> dict:
    """A state shaped like the loop's, from a real AdamW, LambdaLR (closure) and enabled GradScaler."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    warm = 2
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / (warm + 1)))
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    for _ in range(step):
        scaler.scale(model(torch.randn(5, 4)).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad()
    return {"step": step, "model": ckpt.trainable_state(model), "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(), "scaler": scaler.state_dict(),
            "rng": {"torch": torch.get_rng_state()}, "prev_scale": scaler.get_scale(),
            "data_hash": "00ff00ff00ff00ff", "first_nonfinite": None,
            "records": [{"step": 1, "loss": 1.5, "scale": None, "skipped": False, "variant": "a"}],
            "evals": [], "config": nbt.TrainConfig(precision="fp32").to_dict()}


def _save(root, step=2, **kw):
    return save_checkpoint(root, step, {**_state(), "step": step}, "model: tiny\n", **kw)


def _forge(directory, payload, fmt=ckpt.FORMAT):
    """What an attacker writes: any state.pt, and a meta.json whose checksum matches it."""
    directory.mkdir(parents=True)
    torch.save(payload, directory / "state.pt")
    sha = hashlib.sha256((directory / "state.pt").read_bytes()).hexdigest()
    (directory / "meta.json").write_text(json.dumps({"step": 2, "sha256": sha, "format": fmt}))


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))   # unpickling creates the marker file


# -- item 4: no code execution -----------------------------------------------------------------------------------
def test_real_optimizer_scheduler_scaler_states_round_trip(tmp_path):
    state = _state()
    path = _save(tmp_path / "c", run_id="r1")
    ck = load_checkpoint(path)   # weights_only=True inside
    assert ck["notes"] == [] and ck["path"] == str(path) and ck["step"] == 2
    assert ck["scaler"] == state["scaler"] and ck["scheduler"] == state["scheduler"]
    assert ck["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    for k, v in state["optimizer"]["state"][0].items():
        assert torch.equal(ck["optimizer"]["state"][0][k], v)
    # the saved states restore real objects
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    opt.load_state_dict(ck["optimizer"])
    sched.load_state_dict(ck["scheduler"])
    torch.amp.GradScaler("cpu").load_state_dict(ck["scaler"])
    assert sched.last_epoch == 2


def test_callable_object_lr_lambda_is_dropped_not_pickled(tmp_path):
    class Factor:   # LambdaLR keeps a callable object's __dict__, which may hold anything
        def __init__(self):
            self.fn = lambda s: 1.0

        def __call__(self, s):
            return self.fn(s)

    opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    state = _state()
    state["scheduler"] = torch.optim.lr_scheduler.LambdaLR(opt, Factor()).state_dict()
    assert state["scheduler"]["lr_lambdas"][0]   # holds the lambda today
    ck = load_checkpoint(save_checkpoint(tmp_path, 2, state, ""))
    assert ck["scheduler"]["lr_lambdas"] == [None]


def test_numpy_scalars_are_stored_as_plain_numbers(tmp_path):
    state = _state()
    state["records"][0]["loss"] = np.float32(1.5)
    ck = load_checkpoint(save_checkpoint(tmp_path, 2, state, ""))
    assert type(ck["records"][0]["loss"]) is float


def test_state_that_would_need_code_is_refused_at_save(tmp_path):
    state = _state()
    state["config"] = nbt.TrainConfig()   # an object, not its dict
    with pytest.raises(CheckpointError, match=r"state\['config'\].*TrainConfig"):
        save_checkpoint(tmp_path, 2, state, "")
    assert not list(tmp_path.iterdir()) or not list(tmp_path.glob("step-*"))


def test_crafted_checkpoint_runs_no_code(tmp_path):
    # the payload is real: with weights_only=False it runs
    probe = tmp_path / "probe"
    _forge(probe, {"x": _Payload(tmp_path / "probe-ran")})
    torch.load(probe / "state.pt", weights_only=False)
    assert (tmp_path / "probe-ran").exists()

    marker = tmp_path / "pwned"
    evil = tmp_path / "run" / "checkpoints" / "step-000002"
    _forge(evil, {**_state(), "rng": {"torch": _Payload(marker)}})
    ckpt.verify(evil)   # the checksum matches: it proves nothing about origin
    for target in (evil, tmp_path / "run"):
        with pytest.raises(CheckpointError, match="refusing to unpickle code") as e:
            load_checkpoint(target)
        assert str(evil) in str(e.value)
    assert not marker.exists()


def test_old_format_checkpoint_fails_clearly(tmp_path):
    old = {**_state(), "data_hash": b"\x00\x01",
           "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state()}}
    _forge(tmp_path / "v1", old, fmt=1)
    with pytest.raises(CheckpointError, match="format 1") as e:
        load_checkpoint(tmp_path / "v1")
    assert str(tmp_path / "v1") in str(e.value)
    _forge(tmp_path / "v1-relabelled", old)   # meta claims the new format: still never unpickled
    with pytest.raises(CheckpointError, match="refusing to unpickle code.*numpy"):
        load_checkpoint(tmp_path / "v1-relabelled")


def test_state_missing_keys_is_named(tmp_path):
    state = _state()
    del state["config"], state["rng"]
    _forge(tmp_path / "s", state)
    with pytest.raises(CheckpointError, match="lacks rng, config"):
        load_checkpoint(tmp_path / "s")
    _forge(tmp_path / "u", {**_state(), "data_hash": b"\x00", "rng": {"cuda": []}})
    with pytest.raises(CheckpointError, match=r"wrong type for data_hash \(bytes\), rng\['torch'\]"):
        load_checkpoint(tmp_path / "u")
    _forge(tmp_path / "t", [1, 2])
    with pytest.raises(CheckpointError, match="not a state dict"):
        load_checkpoint(tmp_path / "t")


# -- item 8: corrupt newest, leftovers, concurrent writers ---------------------------------------------------------
def test_corrupt_newest_falls_back_and_says_so(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, 2)
    newest = _save(root, 4)
    state = newest / "state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    ck = load_checkpoint(tmp_path)   # the output_dir: its checkpoints/ folder
    assert ck["step"] == 2 and ck["path"].endswith("step-000002")
    (note,) = ck["notes"]
    assert note.startswith("checkpoint step-000004 is corrupt (") and note.endswith("resumed from step-000002 instead")
    with pytest.raises(CheckpointError, match="truncated or corrupt"):   # named directly: no silent fallback
        load_checkpoint(newest)


def test_newest_is_chosen_by_number_not_name(tmp_path):
    _save(tmp_path, 999_999)
    _save(tmp_path, 1_000_000)
    assert ckpt.latest_checkpoint(tmp_path).name == "step-1000000"


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_leftover_temp_dirs_of_dead_writers_are_removed(tmp_path):
    dead = tmp_path / f".tmp-step-000002-{_dead_pid()}-abc"
    old_style = tmp_path / f".tmp-step-000002-{_dead_pid()}"          # format 1 name
    own_stale = tmp_path / f".tmp-step-000001-{os.getpid()}-gone"     # this process, no write owns it
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        alive = tmp_path / f".tmp-step-000002-{sleeper.pid}-xyz"      # another process still writing
        for d in (dead, old_style, own_stale, alive):
            d.mkdir()
            (d / "state.pt").write_bytes(b"partial")
        _save(tmp_path, 4, run_id="me")
        assert not dead.exists() and not old_style.exists() and not own_stale.exists()
        assert alive.exists()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")] == [alive.name]


def test_failed_write_leaves_no_temp_dir(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, 2, run_id="r")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("run_ids", [("a", "b"), (None, None), ("same", "same")])
def test_concurrent_writers_of_one_step_do_not_collide(tmp_path, monkeypatch, run_ids):
    states = {rid: _state() for rid in ("x", "y")}
    real_save = torch.save
    inside = threading.Barrier(2, timeout=20)

    def save_together(obj, f, *a, **k):   # both writers are mid-write at once, every time
        inside.wait()
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save_together)
    errors = []

    def write(name, rid):
        try:
            save_checkpoint(tmp_path, 2, states[name], "", run_id=rid)
        except BaseException as e:   # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(n, r)) for n, r in zip(("x", "y"), run_ids)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002"]
    assert load_checkpoint(tmp_path)["step"] == 2


def test_temp_dir_name_carries_pid_and_run_id(tmp_path, monkeypatch):
    seen = []
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: (seen.append(os.path.basename(os.path.dirname(f))),
                                                                 real_save(obj, f, *a, **k)))
    _save(tmp_path, 7, run_id="run42")
    assert seen == [f".tmp-step-000007-{os.getpid()}-run42"]


# -- item 8: resuming with a different run is refused --------------------------------------------------------------
@pytest.mark.parametrize("field, value", [("precision", "bf16"), ("max_grad_norm", 0.5), ("weight_decay", 0.01),
                                          ("lr", 1e-3), ("seed", 3)])
def test_check_resumable_names_the_differing_field(field, value):
    saved = nbt.TrainConfig(precision="fp32").to_dict()
    cfg = nbt.TrainConfig(precision="fp32").replace(**{field: value})
    with pytest.raises(CheckpointError, match=rf"{field}: checkpoint .* vs config {value!r}") as e:
        check_resumable(saved, cfg, "/ck/step-000002")
    assert "/ck/step-000002" in str(e.value)


def test_check_resumable_accepts_the_same_run():
    cfg = nbt.TrainConfig(precision="fp32", max_grad_norm=None)
    check_resumable(cfg.to_dict(), cfg.replace(max_steps=500, resume_from="x"), "p")   # longer is fine
    check_resumable(cfg.to_dict(), cfg.replace(max_grad_norm=0.0), "p")                # both: no clipping
