"""report_to: runs logged to TensorBoard, Trackio, MLflow and W&B, each read back offline from its local store."""

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

import nbtrain as nbt
from nbtrain.config import TRACKERS, ConfigError, parse_override
from nbtrain.integrations import trackers as tr

from .helpers import Collect, inject_inf

PIP = {"tensorboard": "tensorboard", "trackio": "trackio", "mlflow": "mlflow", "wandb": "wandb"}


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


needs = {name: pytest.mark.skipif(not _installed(name), reason=f"{name} is not installed (pip install {name}; "
                                                                 "it is in the dev extra)")
         for name in ("tensorboard", "trackio", "mlflow", "wandb")}


def _same(a, b) -> bool:
    """Equal as float32 (TensorBoard keeps float32), nan equal to nan."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == pytest.approx(b, rel=1e-6, abs=0)


def _info(**kw):
    base = dict(config=nbt.TrainConfig(max_steps=3), precision_used="fp16", device="cpu", device_name="cpu",
                device_total_gib=1.0, scaler_enabled=True, total_steps=3, train_examples=10, eval_examples=2,
                trainable_params=100, total_params=100, max_grad_norm=1.0, variant=None)
    base.update(kw)
    return SimpleNamespace(**base)


def _record(step, loss, scale, skipped=False):
    return SimpleNamespace(step=step, epoch=step / 10, micro_steps=1, tokens=12, loss=loss, lr=1e-3 * step,
                           grad_norm=0.5, clipped=False, scale=scale, skipped=skipped, nonfinite=math.isnan(loss),
                           vram_allocated_gib=None, vram_reserved_gib=None, vram_peak_gib=None, host_rss_gib=1.5,
                           step_time_s=0.1, tokens_per_s=120.0, elapsed_s=0.1 * step, variant=None)


def _end(steps=3, reason="max_steps"):
    return SimpleNamespace(summary={"steps": steps, "final_loss": 2.0, "stopped_reason": reason, "device": "cpu",
                                    "peak_vram_gib": None})


def _events(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    return ea


# -----------------------------------------------------------------------------------------------------------
# The config field
# -----------------------------------------------------------------------------------------------------------
def test_report_to_field():
    assert nbt.TrainConfig().report_to == []
    assert TRACKERS == ("tensorboard", "trackio", "mlflow", "wandb")
    assert nbt.TrainConfig(report_to=("tensorboard", "trackio", "mlflow", "wandb")).report_to == list(TRACKERS)
    assert nbt.TrainConfig(report_to="tensorboard, MLflow").report_to == ["tensorboard", "mlflow"]
    assert nbt.TrainConfig(report_to="none").report_to == [] == nbt.TrainConfig(report_to=None).report_to
    assert nbt.TrainConfig(report_to=["wandb", "wandb"]).report_to == ["wandb"]
    for bad in ("tensorbord", ["wandb", "comet_ml"], [1], 3, True):
        with pytest.raises(ConfigError) as e:
            nbt.TrainConfig(report_to=bad)
        assert e.value.field == "report_to"
        assert "report_to" in str(e.value) and "tensorboard, trackio, mlflow, wandb" in str(e.value)
    cfg = nbt.TrainConfig(report_to=["mlflow", "tensorboard"])
    assert "report_to=['mlflow', 'tensorboard']" in repr(cfg)
    assert nbt.TrainConfig(**cfg.to_dict()) == cfg
    assert parse_override("report_to=[tensorboard,wandb]") == ("report_to", ["tensorboard", "wandb"])
    assert nbt.TrainConfig(report_to=parse_override("report_to=tensorboard,trackio")[1]).report_to == \
        ["tensorboard", "trackio"]
    assert "output_dir/tensorboard" in nbt.TrainConfig.model_fields["report_to"].description


def test_yaml_round_trip(tmp_path):
    cfg = nbt.TrainConfig(report_to=["trackio", "wandb"])
    cfg.to_yaml(tmp_path / "c.yaml")
    assert nbt.TrainConfig.from_yaml(tmp_path / "c.yaml") == cfg


def test_nothing_imports_a_tracker_until_asked():
    """import nbtrain, a TrainConfig naming every tracker, its YAML and the trackers module load none of them."""
    code = textwrap.dedent("""
        import json, sys
        import nbtrain as nbt
        cfg = nbt.TrainConfig(report_to=("tensorboard", "trackio", "mlflow", "wandb"))
        nbt.TrainConfig.from_yaml(cfg.to_yaml(sys.argv[1]) and sys.argv[1])
        import nbtrain.integrations.trackers
        nbt.integrations.trackers.TensorBoardCallback   # the public spelling resolves without loading tensorboard
        heavy = ("tensorboard", "torch.utils.tensorboard", "trackio", "mlflow", "wandb")
        print(json.dumps(sorted(m for m in sys.modules if m in heavy or m.split(".")[0] in heavy)))
    """)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run([sys.executable, "-c", code, os.path.join(d, "c.yaml")], capture_output=True, text=True,
                           timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == []


@pytest.mark.parametrize("name", TRACKERS)
def test_missing_package_fails_before_training_with_pip_advice(monkeypatch, name, tiny_cfg):
    import nbtrain.engine.prepare as prepare

    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, name, None)   # `import name` now raises ImportError, as when not installed
    if name == "tensorboard":
        monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)

    def no_data(*a, **k):
        raise AssertionError("data loaded: the missing tracker should have failed first")

    monkeypatch.setattr(prepare, "load_data", no_data)
    col = Collect()
    with pytest.raises(tr.TrackerUnavailable, match=rf"report_to: '{name}'.*pip install {PIP[name]}"):
        nbt.train(tiny_cfg.replace(report_to=[name]), callbacks=[col])
    assert col.info is None and col.records == []
    with pytest.raises(ImportError, match="nbtrain\\[trackers\\]"):
        tr.make_tracker(name)


def test_several_missing_packages_are_named_together(monkeypatch):
    for name in ("trackio", "wandb"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(tr.TrackerUnavailable, match="pip install trackio wandb"):
        tr.tracker_callbacks(nbt.TrainConfig(report_to=["trackio", "wandb"]))
    assert tr.tracker_callbacks(nbt.TrainConfig()) == []


def test_metrics_of_records():
    m = tr.step_metrics(_record(3, float("nan"), None, skipped=True))
    assert "train/step" not in m and "train/scale" not in m and "train/vram_peak_gib" not in m
    assert math.isnan(m["train/loss"]) and m["train/skipped"] == 1.0 and m["train/clipped"] == 0.0
    assert m["train/lr"] == pytest.approx(3e-3) and m["train/tokens_per_s"] == 120.0
    assert "train/variant" not in m
    ev = tr.eval_metrics(SimpleNamespace(step=4, eval_loss=1.5, eval_tokens=10, eval_accuracy=None,
                                         eval_perplexity=4.48, variant=None))
    assert ev == {"eval/loss": 1.5, "eval/tokens": 10.0, "eval/perplexity": 4.48}
    p = tr.run_params(_info())
    assert p["precision"] == "auto" and p["precision_used"] == "fp16" and p["trainable_params"] == 100


# -----------------------------------------------------------------------------------------------------------
# TensorBoard
# -----------------------------------------------------------------------------------------------------------
@needs["tensorboard"]
def test_tensorboard_fp16_run_reads_back_every_step(tmp_path, monkeypatch):
    """The acceptance: a TensorBoard log of a short fp16 tiny run (GradScaler) reads back every step's loss and
    scale; step 2's forward is made inf, so the scaler skips it and the scale halves there."""
    inject_inf(monkeypatch, {2})
    cfg = nbt.TrainConfig(model="tiny", data="builtin:python-docs", subset=24, max_seq_len=24, micro_batch_size=2,
                          max_steps=4, eval_fraction=0.1, precision="fp16", lr=1e-3, output_dir=str(tmp_path / "out"),
                          report_to=["tensorboard"])
    col = Collect()
    res = nbt.train(cfg, callbacks=[col])
    assert len(col.records) == 4 and col.info.scaler_enabled
    assert [r.skipped for r in col.records] == [False, True, False, False]

    ea = _events(tmp_path / "out" / "tensorboard")
    tags = ea.Tags()["scalars"]
    for field in ("loss", "scale", "skipped", "grad_norm", "lr", "tokens_per_s", "host_rss_gib", "step_time_s"):
        assert f"train/{field}" in tags, field
    assert not any(t.startswith("train/vram") for t in tags) or col.records[0].vram_allocated_gib is not None
    for field in ("loss", "scale", "skipped", "grad_norm", "lr", "tokens_per_s"):
        got = [(e.step, e.value) for e in ea.Scalars(f"train/{field}")]
        want = [(r.step, float(getattr(r, field))) for r in col.records]
        assert [s for s, _ in got] == [1, 2, 3, 4], field
        assert all(_same(g, w) for (_, g), (_, w) in zip(got, want)), (field, got, want)
    scales = [e.value for e in ea.Scalars("train/scale")]
    assert scales[1] == scales[0] / 2   # the skipped step is there, with its lower scale
    assert [(e.step, e.value) for e in ea.Scalars("eval/loss")] == \
        [(4, pytest.approx(res.summary["eval_loss"], rel=1e-6))]
    # the config: as text and as the HParams plugin's session
    text = ea.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "precision: fp16" in text and "precision_used: fp16" in text and "micro_batch_size: 2" in text
    assert ea.PluginTagToContent("hparams")   # the HParams dashboard's session of this run


@needs["tensorboard"]
def test_tensorboard_callback_dirs_and_values(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # no output_dir: runs/<time>_<name> in the working folder, one folder per run
    cb = nbt.integrations.trackers.TensorBoardCallback()
    cb.on_run_start(_info())
    cb.on_step_end(_record(1, 2.5, 1024.0))
    cb.on_step_end(_record(2, float("nan"), None, skipped=True))
    cb.on_eval(SimpleNamespace(step=2, eval_loss=2.25, eval_tokens=8, eval_accuracy=0.5, eval_perplexity=None))
    cb.on_run_end(_end(2))
    first = Path(cb.log_dir)
    assert first.parent == Path("runs") and first.name[:8].isdigit() and "_fp16_" in first.name
    ea = _events(first)
    loss = ea.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2] and loss[0].value == 2.5 and math.isnan(loss[1].value)
    assert [(e.step, e.value) for e in ea.Scalars("train/scale")] == [(1, 1024.0)]   # None is left out
    assert [(e.step, e.value) for e in ea.Scalars("eval/accuracy")] == [(2, 0.5)]
    assert "eval/perplexity" not in ea.Tags()["scalars"]
    assert "final_loss" in ea.Tensors("summary/text_summary")[0].tensor_proto.string_val[0].decode()
    cb.on_run_start(_info())
    cb.on_run_end(_end(0))
    assert Path(cb.log_dir) != first   # the same callback, a second run: its own folder
    # an output_dir: output_dir/tensorboard; a log_dir under compare(): log_dir/<variant>
    cb = tr.TensorBoardCallback()
    cb.on_run_start(_info(config=nbt.TrainConfig(output_dir=str(tmp_path / "o"))))
    cb.on_run_end(_end(0))
    assert Path(cb.log_dir) == tmp_path / "o" / "tensorboard"
    cb = tr.TensorBoardCallback(tmp_path / "tb")
    cb.on_run_start(_info(variant="bs2x4"))
    cb.on_step_end(_record(1, 1.0, None))
    cb.on_run_end(_end(1))
    assert Path(cb.log_dir) == tmp_path / "tb" / "bs2x4" and _events(cb.log_dir).Scalars("train/loss")


# -----------------------------------------------------------------------------------------------------------
# The callback objects in a real run: TensorBoard, MLflow (file store) and W&B (offline) side by side
# -----------------------------------------------------------------------------------------------------------
def _wandb_records(run_dir: Path):
    """The records of an offline run's .wandb file (a LevelDB-style log of protobuf Records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = next(run_dir.glob("run-*.wandb")).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:   # a block's tail too short for a header is padding
            pos += left
            continue
        n, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:
            break
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        buf = chunk if kind in (1, 2) else buf + chunk   # FULL / FIRST start a record, MIDDLE / LAST extend it
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
    return out


def _wandb_history(run_dir: Path) -> dict[int, dict]:
    rows: dict[int, dict] = {}
    for rec in _wandb_records(run_dir):
        if rec.WhichOneof("record_type") == "history":
            row = rows.setdefault(rec.history.step.num, {})
            for item in rec.history.item:
                row[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return rows


def _wandb_config(run_dir: Path) -> dict:
    out = {}
    for rec in _wandb_records(run_dir):
        kind = rec.WhichOneof("record_type")
        updates = rec.run.config.update if kind == "run" else rec.config.update if kind == "config" else []
        for item in updates:
            out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


@needs["tensorboard"]
@needs["mlflow"]
@needs["wandb"]
def test_callback_objects_log_a_run_to_their_local_stores(tmp_path, monkeypatch, tiny_cfg):
    import wandb
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")   # mlflow 3 keeps file stores in maintenance mode
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    uri = (tmp_path / "mlruns").as_uri()
    cfg = tiny_cfg.replace(eval_fraction=0.1, eval_every=2)
    col = Collect()
    tb = tr.TensorBoardCallback(tmp_path / "tb")
    ml = tr.MLflowCallback(tracking_uri=uri, experiment="nbtrain-test", run_name="r1")
    wb = tr.WandbCallback(dir=tmp_path / "wb", settings=wandb.Settings(console="off", silent=True))
    res = nbt.train(cfg, callbacks=[col, tb, ml, wb])
    steps = [r.step for r in col.records]
    assert steps == [1, 2, 3, 4] and [e.step for e in col.evals] == [2, 4]

    # TensorBoard
    ea = _events(tmp_path / "tb")
    assert [e.step for e in ea.Scalars("train/loss")] == steps
    assert all(_same(e.value, r.loss) for e, r in zip(ea.Scalars("train/loss"), col.records))
    assert "train/scale" not in ea.Tags()["scalars"]   # fp32: no GradScaler, scale is None

    # MLflow
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("nbtrain-test")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "r1" and run.info.status == "FINISHED"
    hist = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in sorted(hist, key=lambda m: m.step)] == [(r.step, r.loss) for r in col.records]
    gn = sorted(client.get_metric_history(run.info.run_id, "train/grad_norm"), key=lambda m: m.step)
    assert [m.value for m in gn] == [r.grad_norm for r in col.records]
    ev = sorted(client.get_metric_history(run.info.run_id, "eval/loss"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in ev] == [(e.step, e.eval_loss) for e in col.evals]
    assert not client.get_metric_history(run.info.run_id, "train/scale")
    params = run.data.params
    assert params["precision"] == "fp32" and params["micro_batch_size"] == "8" and params["lr"] == "0.001"
    assert params["precision_used"] == "fp32" and params["report_to"] == ""
    assert run.data.tags["nbtrain.stopped_reason"] == "max_steps"
    assert run.data.metrics["summary/steps"] == 4
    art = Path(client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path / "dl")))
    assert "micro_batch_size: 8" in art.read_text()

    # W&B, offline
    (run_dir,) = (tmp_path / "wb" / "wandb").glob("offline-run-*")
    rows = _wandb_history(run_dir)
    assert sorted(rows) == steps
    for r in col.records:
        assert rows[r.step]["train/loss"] == pytest.approx(r.loss, rel=1e-12)
        assert rows[r.step]["train/lr"] == pytest.approx(r.lr, rel=1e-12)
        assert "train/scale" not in rows[r.step]
    assert {s: rows[s]["eval/loss"] for s in (2, 4)} == {e.step: pytest.approx(e.eval_loss) for e in col.evals}
    config = _wandb_config(run_dir)
    assert config["precision"] == "fp32" and config["micro_batch_size"] == 8 and config["total_steps"] == 4
    assert res.summary["steps"] == 4


@needs["mlflow"]
def test_mlflow_store_that_does_not_open_fails_when_made(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "false")
    import mlflow

    if tuple(int(x) for x in mlflow.__version__.split(".")[:2]) < (3, 7):
        pytest.skip("this mlflow still opens file stores without MLFLOW_ALLOW_FILE_STORE")
    with pytest.raises(tr.TrackerUnavailable, match="MLFLOW_ALLOW_FILE_STORE"):
        tr.MLflowCallback(tracking_uri=(tmp_path / "mlruns").as_uri())


@needs["mlflow"]
def test_mlflow_status_follows_the_stop(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    cb = tr.MLflowCallback(tracking_uri=uri)
    for variant, reason in (("a", "stopped"), ("b", "out_of_memory")):
        cb.on_run_start(_info(variant=variant))
        cb.on_step_end(_record(1, 2.0, 65536.0))
        cb.on_run_end(_end(1, reason))
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("nbtrain").experiment_id])
    assert {r.info.run_name: r.info.status for r in runs} == {"a": "KILLED", "b": "FAILED"}
    assert {r.data.tags["nbtrain.variant"] for r in runs} == {"a", "b"}


# -----------------------------------------------------------------------------------------------------------
# Trackio: its store directory is fixed when trackio is imported, so it runs in a process of its own
# -----------------------------------------------------------------------------------------------------------
@needs["trackio"]
def test_trackio_local_store(tmp_path):
    code = textwrap.dedent("""
        import json, math, sys
        from types import SimpleNamespace
        import nbtrain as nbt
        from nbtrain.integrations.trackers import TrackioCallback

        info = SimpleNamespace(config=nbt.TrainConfig(max_steps=3, micro_batch_size=4), precision_used="fp16",
                               device="cpu", variant="fp16", trainable_params=7, total_params=9)
        cb = TrackioCallback(project="nbt-test")
        cb.on_run_start(info)
        for s, loss, scale in ((1, 3.0, 1024.0), (2, 2.5, 512.0), (3, 2.0, None)):
            cb.on_step_end(SimpleNamespace(step=s, loss=loss, scale=scale, skipped=s == 2, lr=0.1 * s,
                                           grad_norm=1.0, vram_peak_gib=None, tokens_per_s=100.0, variant=None))
        cb.on_eval(SimpleNamespace(step=3, eval_loss=1.75, eval_tokens=5, eval_accuracy=None))
        cb.on_run_end(SimpleNamespace(summary={"steps": 3, "stopped_reason": "max_steps"}))

        from trackio.sqlite_storage import SQLiteStorage
        logs = SQLiteStorage.get_logs("nbt-test", "fp16")
        cfg = SQLiteStorage.get_run_config("nbt-test", "fp16")
        print("RESULT " + json.dumps({"logs": logs, "config": cfg}, default=str))
    """)
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[7:])
    by_step: dict = {}
    for row in out["logs"]:
        by_step.setdefault(row["step"], {}).update(row)
    assert sorted(by_step) == [1, 2, 3]
    assert [by_step[s]["train/loss"] for s in (1, 2, 3)] == [3.0, 2.5, 2.0]
    assert [by_step[s].get("train/scale") for s in (1, 2, 3)] == [1024.0, 512.0, None]
    assert [by_step[s]["train/skipped"] for s in (1, 2, 3)] == [0.0, 1.0, 0.0]
    assert by_step[3]["eval/loss"] == 1.75
    assert out["config"]["micro_batch_size"] == 4 and out["config"]["precision_used"] == "fp16"
    assert any(p.suffix == ".db" for p in (tmp_path / "trackio").iterdir())


# -----------------------------------------------------------------------------------------------------------
# The HF export
# -----------------------------------------------------------------------------------------------------------
def test_training_arguments_report_to():
    from transformers.integrations import get_reporting_integration_callbacks

    from nbtrain.integrations.exports import to_training_arguments, training_arguments_kwargs

    cfg = nbt.TrainConfig(precision="fp32", report_to=["tensorboard", "trackio", "mlflow", "wandb"])
    kw = training_arguments_kwargs(cfg)
    assert kw["report_to"] == ["tensorboard", "trackio", "mlflow", "wandb"]
    args = to_training_arguments(cfg)
    assert [r for r in args.report_to if r != "kubeflow"] == ["tensorboard", "trackio", "mlflow", "wandb"]
    if hasattr(args, "project"):
        assert args.project == "nbtrain"   # the trackio project nbtrain's own runs use
    # the Trainer knows every name (its callbacks, not nbtrain's)
    names = [c.__name__ for c in get_reporting_integration_callbacks(list(cfg.report_to))]
    assert names == ["TensorBoardCallback", "TrackioCallback", "MLflowCallback", "WandbCallback"]
    assert training_arguments_kwargs(nbt.TrainConfig(precision="fp32"))["report_to"] == "none"
    assert to_training_arguments(nbt.TrainConfig(precision="fp32", report_to=["mlflow"])).report_to[:1] == ["mlflow"]


def test_compare_logs_one_tensorboard_run_per_variant(tmp_path, monkeypatch):
    """The warm-up and the timing repeats are not results: only each variant's first run reaches the tracker."""
    pytest.importorskip("tensorboard")
    monkeypatch.chdir(tmp_path)   # a run without output_dir would log under ./runs: counted below too
    cfg = nbt.TrainConfig(model="tiny", data="builtin:python-docs", subset=32, max_seq_len=24, micro_batch_size=4,
                          eval_fraction=0.0, max_steps=2, precision="fp32", report_to=["tensorboard"],
                          output_dir=str(tmp_path / "out"))
    cmp = nbt.compare(cfg, variants={"a": {}, "b": {"lr": 1e-3}}, repeats=2)
    assert cmp.finished == ["a", "b"]
    runs = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("events.out.tfevents.*"))
    assert [r.split("/")[:2] for r in runs] == [["out", "a"], ["out", "b"]], runs
    for variant in ("a", "b"):
        assert [e.step for e in _events(tmp_path / "out" / variant / "tensorboard").Scalars("train/loss")] == [1, 2]
