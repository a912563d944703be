"""Issue 28: sharded training with FSDP2 (gloo on CPU) gives the numbers of one process and of DDP.

One torchrun start-up runs every 2-process scenario (tests/fsdp_worker.py); the single-process references run
here. Launchers (torchrun CLI, two nodes on loopback, nbt.launch + Stop) have their own tests below.
"""

import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
import torch

import nbtrain as nbt
from nbtrain.engine.checkpoint import CheckpointError

from .helpers import communicate, retry_port, run_process

pytestmark = pytest.mark.slow   # each start-up of 2 processes is ~15 s on 2 cores

BASE = dict(model="tiny", subset=64, max_seq_len=48, max_steps=4, eval_fraction=0.0, precision="fp32", lr=1e-3)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def torchrun(*args, nproc=2, timeout=600, **popen):
    def start(port):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", str(port), *map(str, args)]
        proc = run_process(cmd, timeout, env=ENV, **popen)
        return proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:], proc

    ok, output, proc = retry_port(start)
    assert ok, output
    return proc


@pytest.fixture(scope="module")
def worker(fsdp_worker_runs):
    return fsdp_worker_runs


@pytest.fixture(scope="module")
def single():
    """1 process x micro 8: full, LoRA and bf16 references, with their final weights."""
    out = {}
    # LoRA without dropout: each rank draws dropout masks for its own rows (as fsdp_worker.py says)
    for name, extra in {"full": {}, "lora": {"method": "lora", "lora_dropout": 0.0},
                        "bf16": {"precision": "bf16"}}.items():
        r = nbt.train(nbt.TrainConfig(**{**BASE, **extra}, micro_batch_size=8))
        out[name] = {"loss": r.history["loss"].tolist(), "grad_norm": r.history["grad_norm"].tolist(),
                     "tokens": r.history["tokens"].tolist(),
                     "weights": {k: v.detach().clone() for k, v in r.model.state_dict().items()}}
    return out


def close(a, b, rel=1e-5):
    assert len(a) == len(b) and len(a) > 0
    for x, y in zip(a, b):
        assert abs(x - y) <= rel * abs(y), (x, y, a, b)


def same_weights(a: dict, b: dict, rel=1e-5, whole=False):
    """Each tensor within ``rel`` (relative L2); ``whole``: the trainable ones as one vector."""
    assert a.keys() == b.keys()
    if whole:
        keys = [k for k in a if "lora_" in k]
        d = sum(float((a[k].double() - b[k].double()).norm()) ** 2 for k in keys) ** 0.5
        assert d <= rel * sum(float(b[k].double().norm()) ** 2 for k in keys) ** 0.5, d
        return
    for k in a:
        d = (a[k].double() - b[k].double()).norm()
        assert d <= rel * max(b[k].double().norm(), 1e-12), (k, float(d))


@pytest.mark.parametrize("method", ["full", "lora"])
def test_fsdp_equals_one_process_and_ddp(worker, single, method):
    """2 processes x micro 4 under FSDP = 1 x micro 8 = DDP, step for step and in the final weights."""
    fsdp, ddp, ref = worker[f"fsdp_{method}"], worker[f"ddp_{method}"], single[method]
    close(fsdp["loss"], ref["loss"])
    close(fsdp["loss"], ddp["loss"])
    close(fsdp["grad_norm"], ref["grad_norm"])   # the global pre-clip norm over both ranks' shards
    assert fsdp["tokens"] == ref["tokens"]
    # LoRA's B matrices start at zero and Adam's first, normalised steps turn summation-order rounding into
    # ~6e-5 of their small norm (measured; DDP's the same): per tensor for full, the adapters as one vector
    same_weights(fsdp["weights"], ref["weights"], whole=method == "lora")
    same_weights(ddp["weights"], ref["weights"], whole=method == "lora")
    same_weights(fsdp["weights"], ddp["weights"])   # FSDP and DDP: per tensor
    assert any("FSDP2 over 2 process(es)" in n for n in fsdp["notes"])
    assert not any("FSDP2" in n for n in ddp["notes"])
    assert fsdp["loss"][-1] < fsdp["loss"][0]   # it trains


def test_fsdp_accumulation_equals_one_micro_batch(worker, single):
    """2 processes x micro 2 x accum 2 = 1 x micro 8."""
    close(worker["fsdp_accum"]["loss"], single["full"]["loss"])
    same_weights(worker["fsdp_accum"]["weights"], single["full"]["weights"])


def test_bf16_policy_gathers_bf16_reduces_fp32(worker, single):
    seen = worker["fsdp_bf16_inspect"]
    assert seen["param_dtype"] == "torch.bfloat16" and seen["reduce_dtype"] == "torch.float32"
    assert seen["param_is_dtensor"] and seen["master_dtype"] == "torch.float32"   # sharded fp32 masters
    assert seen["local_numel"] * 2 == seen["numel"]                                  # half on each rank
    run = worker["fsdp_bf16"]
    close(run["loss"], single["bf16"]["loss"], rel=2e-3)   # bf16 compute: not bitwise, same run
    assert all(w.dtype == torch.float32 for w in run["weights"].values())
    assert any("gathered in bfloat16, gradients reduced in float32" in n for n in run["notes"])


def test_fp16_overflow_on_one_rank_skips_on_all(worker):
    """An inf in rank 1's gradient shard only: both ranks skip step 2 and the scale halves once."""
    run = worker["fsdp_fp16_inf"]
    assert run["skipped_by_rank"] == [[False, True, False], [False, True, False]]
    assert run["scale"][1] == run["scale"][0] / 2 and run["scale"][2] == run["scale"][1]
    assert run["summary"]["skipped_steps"] == 1


@pytest.mark.parametrize("precision, weights", [("bf16-pure", torch.bfloat16), ("fp8", torch.float32)])
def test_every_tensor_precisions_compose_with_sharding(worker, precision, weights):
    """bf16-pure (bf16 weights sharded, no fp32 master) and fp8 (float8 linears, fp32 masters) train under FSDP."""
    run = worker[f"fsdp_{precision.replace('-', '_')}"]
    assert all(math.isfinite(x) for x in run["loss"] + run["grad_norm"]) and run["loss"][-1] < run["loss"][0]
    assert run["summary"]["precision_used"] == precision
    floats = {w.dtype for k, w in run["weights"].items() if w.is_floating_point() and "rotary" not in k}
    assert floats == {weights}, floats


def test_sharded_checkpoint_resumes_bitwise(worker):
    ck = worker["_dir"] / "ck" / "checkpoints" / "step-000002"
    meta = json.loads((ck / "meta.json").read_text())
    assert meta["world_size"] == 2 and {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(meta["shards"])
    full, resumed = worker["fsdp_ckpt"], worker["fsdp_resume"]
    assert resumed["loss"] == full["loss"] and resumed["grad_norm"] == full["grad_norm"]   # bitwise
    for k, v in full["weights"].items():
        assert torch.equal(v, resumed["weights"][k]), k
    assert any("written by 2 processes, read by 2" in n for n in resumed["notes"])


def test_sharded_checkpoint_resumes_in_one_process(worker, single):
    """Another world size: one plain process (micro 8 = 2 x 4) continues the 2-process run."""
    ck = worker["_dir"] / "ck" / "checkpoints" / "step-000002"
    r = nbt.train(nbt.TrainConfig(**BASE, micro_batch_size=8, sharding="fsdp", resume_from=str(ck)))
    close(r.history["loss"].tolist(), single["full"]["loss"])
    same_weights({k: v for k, v in r.model.state_dict().items()}, single["full"]["weights"])
    assert any("written by 2 processes, read by 1" in n for n in r.summary["notes"])
    with pytest.raises(CheckpointError, match="micro_batch_size 4 x 2 processes.*micro_batch_size=8"):
        nbt.train(nbt.TrainConfig(**BASE, micro_batch_size=4, resume_from=str(ck)))


def test_corrupt_shard_is_refused(worker, tmp_path):
    import shutil

    src = worker["_dir"] / "ck" / "checkpoints" / "step-000002"
    bad = tmp_path / "step-000002"
    shutil.copytree(src, bad)
    shard = bad / "shards" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="shards/__1_0.distcp is missing, truncated or corrupt"):
        nbt.train(nbt.TrainConfig(**BASE, micro_batch_size=8, resume_from=str(bad)))


def test_consolidated_save_reloads_with_from_pretrained(worker, single):
    """The final model of a sharded run, saved by rank 0 in Hugging Face format: full weights, and for LoRA the
    adapter (with the preset's base beside it)."""
    from transformers import AutoModelForCausalLM

    full_dir = worker["_dir"] / "ck" / "model"
    model = AutoModelForCausalLM.from_pretrained(full_dir)
    same_weights({k: v for k, v in model.state_dict().items()},
                 {k: v for k, v in single["full"]["weights"].items() if k in model.state_dict()})
    assert "final model:" in " ".join(worker["fsdp_ckpt"]["notes"])


def test_two_nodes_on_loopback_save_a_reloadable_adapter(tmp_path, single):
    """torchrun --nnodes 2 running `nbtrain train`: two "nodes" of one process each on this machine (static
    rendezvous on 127.0.0.1), LoRA under FSDP. Rank 0 writes the run and the consolidated adapter, which peft
    loads onto its base and which computes what the 1-process run's model computes."""
    import pandas as pd
    from peft import AutoPeftModelForCausalLM

    cfg = tmp_path / "c.yaml"
    nbt.TrainConfig(**BASE, micro_batch_size=4, method="lora", lora_dropout=0.0, sharding="fsdp").to_yaml(cfg)
    def start(port):
        procs = []
        for node in (0, 1):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
                   "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
                   "-m", "nbtrain", "train", str(cfg), "--output-dir", str(tmp_path / f"out{node}")]
            procs.append(subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
        outs = [communicate(p, 600) for p in procs]
        return [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs), None

    ok, output, _ = retry_port(start)
    assert ok, output
    out = tmp_path / "out0"
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2
    close(pd.read_csv(out / "history.csv")["loss"].tolist(), single["lora"]["loss"])
    assert not (tmp_path / "out1" / "summary.json").exists()   # rank 0 alone writes

    saved = out / "model"
    assert (saved / "adapter_config.json").is_file() and not (saved / "model.safetensors").exists()
    model = AutoPeftModelForCausalLM.from_pretrained(saved).eval()
    ids = torch.arange(1, 17).unsqueeze(0)
    ref = nbt.train(nbt.TrainConfig(**BASE, micro_batch_size=8, method="lora", lora_dropout=0.0)).model.eval()
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, ref(input_ids=ids).logits
    assert (a - b).abs().max() <= 1e-4 * b.abs().max()


def test_accelerate_launch_with_its_fsdp_config_streams_and_stops():
    """nbt.launch(launcher="accelerate") on a sharded config: accelerate launch --config_file with the exported
    FSDP config (distributed_type FSDP, fsdp_version 2) runs `nbtrain train` on 2 ranks; rank 0's records reach
    the callbacks, and Stop ends every rank cleanly, the model kept."""
    import yaml

    gate = threading.Event()
    seen = []

    class Gate:
        def on_step_end(self, rec):
            seen.append(rec)
            if rec.step >= 2:
                gate.set()

    cfg = nbt.TrainConfig(**{**BASE, "max_steps": 100000}, micro_batch_size=4, sharding="fsdp")
    run = nbt.launch(cfg, num_processes=2, launcher="accelerate", callbacks=[Gate()])
    conf = yaml.safe_load(Path(run.command[run.command.index("--config_file") + 1]).read_text())
    assert conf["distributed_type"] == "FSDP" and conf["fsdp_config"]["fsdp_version"] == 2
    assert gate.wait(400), "\n".join(run.log[-30:])
    children = psutil.Process(run.process.pid).children(recursive=True)
    run.stop()
    result = run.wait(300)
    assert result is not None, "\n".join(run.log[-30:])
    assert result.summary["stopped_reason"] == "stopped" and result.summary["world_size"] == 2
    assert any("FSDP2 over 2" in n for n in result.summary["notes"])
    assert 2 <= len(result.history) == len(seen) < 100000
    assert run.process.returncode == 0   # a clean end, not the grace period's SIGTERM
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert (Path(run.output_dir) / "model" / "model.safetensors").is_file()   # a stopped run keeps its model
