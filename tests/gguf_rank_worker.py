"""Run under torchrun by tests/test_gguf_ranks.py: with an empty cache, rank 1 converts GGUF file GGUF (SmolLM2's,
cut to two layers) while rank 0 waits, then both load the converted folder; each rank writes what it saw to
OUT/rank<r>.json. Usage:
    NBTRAIN_CACHE=<empty> torchrun --nproc_per_node 2 tests/gguf_rank_worker.py OUT GGUF
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# the process group first: transformers' save_pretrained skips its writes on a rank other than 0 only once there is one
dist.init_process_group("gloo")
RANK = dist.get_rank()

from transformers import AutoModelForCausalLM  # noqa: E402

from nbtrain.models import gguf, local_source  # noqa: E402
from nbtrain.models.loading import ModelSource  # noqa: E402

converted = []
real_convert = gguf._convert


def convert(*args):
    converted.append(RANK)
    return real_convert(*args)


gguf._convert = convert
src = ModelSource("gguf", sys.argv[2])
if RANK == 1:   # the non-zero rank converts first, alone ...
    folder = local_source(src).name
dist.barrier()
if RANK == 0:   # ... and rank 0 asks only once it has finished
    folder = local_source(src).name
model, loading = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
checksum = sum(p.detach().double().sum().item() for p in model.parameters())
out = {"rank": RANK, "converted": bool(converted), "folder": folder, "checksum": checksum,
       "tied": model.lm_head.weight is model.model.embed_tokens.weight,
       "loading": {k: sorted(map(str, v)) for k, v in loading.items()}}
Path(sys.argv[1], f"rank{RANK}.json").write_text(json.dumps(out))
dist.barrier()
dist.destroy_process_group()
