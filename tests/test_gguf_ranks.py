"""Issue "the conversion is right on any rank and heals": two torchrun ranks start with an empty cache and rank 1
converts the GGUF file first. transformers' save_pretrained writes nothing on a distributed rank other than 0, so
the cached folder once held only the tokenizer under a marker, and every later load failed; now it is complete.

The file converted is SmolLM2's own GGUF cut to its first two layers (its tokenizer, metadata, embedding and those
layers' quantized blocks copied byte for byte): the same conversion without a second full one (the whole model
converts once per run in the session fixture, tests/conftest.py); the test took 53 s in a full run, 72-98 s before."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from .conftest import SMOLLM2, smollm2_ready
from .helpers import retry_port, run_process


LAYERS = 2


def two_layer_gguf(source: Path, target: Path) -> Path:
    """GGUF file ``source`` (a llama) cut to its first LAYERS layers: every key but the layer count, and the kept
    tensors in their own quantized types, copied as they are."""
    import gguf as g

    reader = g.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = g.GGUFWriter(target, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue   # the writer's own
        value = LAYERS if key == f"{arch}.block_count" else field.contents()
        sub = field.types[1] if field.types[0] == g.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub)
    for t in reader.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= LAYERS:
            continue
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


@pytest.mark.slow   # ~50 s in the full suite on 2 cores: two ranks start, one converts, both load
def test_a_conversion_by_rank_1_of_two_is_complete_and_loads_everywhere(tmp_path, monkeypatch):
    why = smollm2_ready()
    if why:
        pytest.skip(why)
    import torch
    from transformers import AutoModelForCausalLM

    from nbtrain.models import gguf, resolve_source

    (tmp_path / "model").mkdir()
    path = two_layer_gguf(Path(resolve_source(SMOLLM2).name), tmp_path / "model" / "SmolLM2-2-layers.gguf")
    cache, out = tmp_path / "cache", tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "NBTRAIN_CACHE": str(cache)}

    def start(port):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(port), str(Path(__file__).with_name("gguf_rank_worker.py")), str(out),
               str(path)]
        proc = run_process(cmd, 300, env=env)
        return proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:], proc

    ok, output, _ = retry_port(start)
    assert ok, output
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["converted"] for r in ranks] == [False, True]   # rank 1 converted; rank 0 found its folder
    folder = Path(ranks[1]["folder"])
    assert ranks[0]["folder"] == str(folder) and folder.parent == cache / "gguf"
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", gguf.MARKER):
        assert (folder / name).is_file(), f"{name} missing: {sorted(p.name for p in folder.iterdir())}"
    assert ranks[0]["checksum"] == ranks[1]["checksum"]
    for r in ranks:
        assert r["tied"] and not any(r["loading"].values()), r   # embeddings tied, no missing or unexpected keys

    # and in a fresh process (this one): the cache says complete, and the weights are the ranks'
    monkeypatch.setenv("NBTRAIN_CACHE", str(cache))
    assert gguf.is_converted(path) and gguf._missing(folder) == [] and gguf.cached_dir(path) == folder
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    assert model.config.num_hidden_layers == LAYERS and model.config.vocab_size == 49152
    assert sum(p.detach().double().sum().item() for p in model.parameters()) == ranks[0]["checksum"]
