"""Run under torchrun by tests/test_fsdp.py: several runs in one process group (one start-up for all of them).

Each scenario trains with ``nbt.train`` in the group this script creates; rank 0 writes what the tests compare
(losses, grad norms, skips, scales, notes, final weights) to OUT/<scenario>.pt. Usage:
    torchrun --nproc_per_node 2 tests/fsdp_worker.py OUT
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import nbtrain as nbt
import nbtrain.engine.distributed as nbdist

BASE = dict(model="tiny", subset=64, max_seq_len=48, max_steps=4, eval_fraction=0.0, precision="fp32", lr=1e-3,
            micro_batch_size=4, sharding="fsdp")
RANK = int(os.environ.get("RANK", "0"))
# packed rows are all max_seq_len long: each rank's micro-batches have the shape the memory estimate assumes
MEMORY_RUN = dict(max_steps=3, packing=True)


class Inspect:
    """On rank 0 at the start: how FSDP holds the model (the policy, the shards)."""

    def __init__(self):
        self.seen = {}

    def on_run_start(self, info):
        model = info.model
        state = model._get_fsdp_state()
        policy = state._mp_policy
        p = next(p for p in model.parameters() if p.requires_grad)
        self.seen = {"param_dtype": str(policy.param_dtype), "reduce_dtype": str(policy.reduce_dtype),
                     "param_is_dtensor": type(p).__name__ == "DTensor" or hasattr(p, "_local_tensor"),
                     "local_numel": p._local_tensor.numel(), "numel": p.numel(), "master_dtype": str(p.dtype)}


def inf_on_rank1(make):
    """FSDPContext.make_scaler, but on rank 1 its ShardedGradScaler puts an inf into that rank's shard of one
    gradient at step 2: the inf is on one rank only, so the step is skipped on all only if the check is
    all-reduced."""

    def make_scaler(ctx, spec, device):
        scaler = make(ctx, spec, device)
        if not spec.scaler or ctx.rank != 1:
            return scaler
        original, calls = scaler.unscale_, [0]

        def unscale_(optimizer):
            calls[0] += 1
            if calls[0] == 2:
                nbdist.local(optimizer.param_groups[0]["params"][0].grad).view(-1)[0] = float("inf")
            return original(optimizer)

        scaler.unscale_ = unscale_
        return scaler

    return make_scaler


def run(name, out, callbacks=(), **changes):
    result = nbt.train(nbt.TrainConfig(**{**BASE, **changes}), callbacks=list(callbacks))
    h = result.history
    rec = {"loss": h["loss"].tolist(), "grad_norm": h["grad_norm"].tolist(), "skipped": h["skipped"].tolist(),
           "scale": h["scale"].tolist(), "tokens": h["tokens"].tolist(), "notes": list(result.summary["notes"]),
           "host_tensors_gib": h["host_tensors_gib"].tolist(), "summary": dict(result.summary)}
    # every rank's own view of the skips (a skip must be on all of them)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rec["skipped"])
    rec["skipped_by_rank"] = gathered
    if RANK == 0:
        rec["weights"] = {k: v.detach().cpu().clone() for k, v in result.model.state_dict().items()}
        torch.save(rec, out / f"{name}.pt")
    return rec


SMOLLM2_RUN = dict(model="smollm2-135m-instruct", subset=8, max_seq_len=32, micro_batch_size=2, max_steps=2,
                  method="lora", lora_dropout=0.0)


def smollm2_lora(out: Path):
    from nbtrain.models import ModelError, resolve_source

    try:
        resolve_source(SMOLLM2_RUN["model"])
    except ModelError:   # the wheel is not installed: test_real_model skips, saying so
        return
    run("smollm2_fsdp_lora", out, **SMOLLM2_RUN)


def scenarios(out: Path) -> dict:
    """name -> what it runs (in this order)."""
    seen = Inspect()

    def bf16():
        run("fsdp_bf16", out, callbacks=[seen], precision="bf16")
        if RANK == 0:
            torch.save(seen.seen, out / "fsdp_bf16_inspect.pt")

    def fp16_inf():
        make = nbdist.FSDPContext.make_scaler
        nbdist.FSDPContext.make_scaler = inf_on_rank1(make)
        try:
            run("fsdp_fp16_inf", out, precision="fp16", max_steps=3)
        finally:
            nbdist.FSDPContext.make_scaler = make

    ck = out / "ck"
    return {
        "fsdp_full": lambda: run("fsdp_full", out),
        "ddp_full": lambda: run("ddp_full", out, sharding="none"),
        # no LoRA dropout: each rank draws masks for its own rows, so with dropout N processes match one process
        # only in distribution
        "fsdp_lora": lambda: run("fsdp_lora", out, method="lora", lora_dropout=0.0),
        "ddp_lora": lambda: run("ddp_lora", out, method="lora", lora_dropout=0.0, sharding="none"),
        "fsdp_accum": lambda: run("fsdp_accum", out, micro_batch_size=2, grad_accum_steps=2),
        "fsdp_bf16": bf16,
        "fsdp_fp16_inf": fp16_inf,
        # the every-tensor precisions that compose with sharding: bf16 weights sharded as they are; fp8's float8
        # linears (emulated on a CPU) under FSDP's bf16 gather
        "fsdp_bf16_pure": lambda: run("fsdp_bf16_pure", out, precision="bf16-pure", max_steps=3),
        "fsdp_fp8": lambda: run("fsdp_fp8", out, precision="fp8", max_steps=3),
        "fsdp_ckpt": lambda: run("fsdp_ckpt", out, output_dir=str(ck), save_every=2),
        "fsdp_resume": lambda: run("fsdp_resume", out, output_dir=str(out / "ck_resumed"),
                                   resume_from=str(ck / "checkpoints" / "step-000002")),
        # tests/test_memory_fsdp.py: rank 0's traced tensors vs the per-rank estimate (its MEMORY_RUN config)
        "mem_full": lambda: run("mem_full", out, **MEMORY_RUN),
        "mem_lora": lambda: run("mem_lora", out, **MEMORY_RUN, method="lora"),
        # tests/test_real_model.py: the pretrained SmolLM2 (when its wheel is installed), LoRA without dropout
        "smollm2_fsdp_lora": lambda: smollm2_lora(out),
    }


def main(out: Path, names: list[str]):
    dist.init_process_group("gloo")
    out.mkdir(parents=True, exist_ok=True)
    todo = scenarios(out)
    for name in names or list(todo):
        todo[name]()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
