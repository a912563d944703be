"""What the micro-benchmarks (chunked_loss.py, lean_layers.py) share: the run's metadata and writing its results."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import torch

from nbtrain.hardware import capabilities


def meta(device: str, shape: dict, repeats: int) -> dict:
    """Date, device, torch version and threads, with the benchmark's shape and repeat count."""
    name = torch.cuda.get_device_name() if device == "cuda" else capabilities("cpu").name
    return {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "device": device,
            "device_name": name, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "shape": shape, "repeats": repeats}


def write(out: str | None, stem: str, res: dict, md: str) -> None:
    """Print the markdown; with ``out``, write ``stem``.json and ``stem``.md there."""
    print(md)
    if out:
        d = Path(out)
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{stem}.json").write_text(json.dumps(res, indent=2))
        (d / f"{stem}.md").write_text(md)
        print(f"wrote {d / stem}.json (+ .md)")
