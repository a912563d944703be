"""The ``nbtrain`` command: train, compare, estimate, export and demo, for scripts, CI and terminals."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Optional, Sequence

from .config import ConfigError, TrainConfig, config_file, parse_override
from .engine.checkpoint import CheckpointError
from .viz.progress import ProgressBar


class JsonlEmitter:
    """Streams run events as ``@nbtrain {json}`` lines on stdout, for ``nbt.launch`` to read back."""

    PREFIX = "@nbtrain "

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout

    def _emit(self, event: str, payload: dict) -> None:
        self.stream.write(self.PREFIX + json.dumps({"event": event, **payload}, default=str) + "\n")
        self.stream.flush()

    def on_run_start(self, info):
        fields = {f.name: getattr(info, f.name) for f in dataclasses.fields(info) if f.name not in ("config", "model")}
        self._emit("run_start", {"info": fields})

    def on_step_end(self, rec):
        self._emit("step", {"record": rec.to_dict()})

    def on_eval(self, rec):
        self._emit("eval", {"record": rec.to_dict()})

    def on_run_end(self, result):
        self._emit("run_end", {"summary": dict(result.summary)})


def _load_config(path: str, sets: Sequence[str], **more) -> TrainConfig:
    cfg = TrainConfig.from_yaml(config_file(path))
    changes = {**dict(parse_override(s) for s in sets), **{k: v for k, v in more.items() if v is not None}}
    if changes:   # at once: --set save_every=2 --output-dir D is valid together, not one at a time
        cfg = cfg.replace(**changes)
    return cfg


def _print_summary(summary: dict) -> None:
    keys = ["steps", "final_loss", "eval_loss", "tokens_per_s", "peak_vram_gib", "skipped_steps",
            "nonfinite_steps", "wall_s", "stopped_reason", "precision_used", "device"]
    for k in keys:
        v = summary.get(k)
        print(f"  {k:<16} {v:.4f}" if isinstance(v, float) else f"  {k:<16} {v}")
    # what the run learned about itself (auto batch size, a resume, an out-of-memory stop) and how to fit
    for title, key in (("notes", "notes"), ("to fit in memory", "advice")):
        if summary.get(key):
            print(f"{title}:")
            for line in summary[key]:
                print(f"  - {line}")


def cmd_train(args) -> int:
    from .engine import train

    cfg = _load_config(args.config, args.set, output_dir=args.output_dir)
    if cfg.output_dir is None:
        cfg = cfg.replace(output_dir="runs/latest")
    cbs = [JsonlEmitter()] if args.jsonl else [ProgressBar(cfg.log_every)]
    result = train(cfg, callbacks=cbs)
    if int(os.environ.get("RANK", "0")) == 0 and not args.jsonl:   # one report, from rank 0
        print(f"wrote {cfg.output_dir}/ (config.yaml, history.csv, summary.json)")
        _print_summary(result.summary)
    return 0


def cmd_compare(args) -> int:
    from .compare import compare

    cfg = _load_config(args.config, args.set)
    precisions = tuple(p.strip() for p in args.precisions.split(",") if p.strip())
    cmp = compare(cfg, precisions=precisions, subset=args.subset, max_steps=args.max_steps,
                  repeats=args.repeats, callbacks=[ProgressBar(cfg.log_every, desc="compare")],
                  seeds=args.seeds, aa=args.aa, band=args.band, rounding=args.rounding)
    print(cmp.format_table())
    if args.html:
        cmp.to_html(args.html)
        print(f"wrote {args.html}")
    return 0


def _seeds(text: str) -> tuple[int, ...]:
    """``--seeds 0,1,2`` as a tuple of ints (an argparse type)."""
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 0,1,2, got {text!r}") from None


def cmd_estimate(args) -> int:
    from .memory import estimate_memory, format_estimate

    cfg = _load_config(args.config, args.set)
    print(format_estimate(estimate_memory(cfg, world_size=args.world_size)))
    return 0


def cmd_export(args) -> int:
    # imported here: the exports load transformers' TrainingArguments, which `nbtrain --help` does not need
    from .integrations.exports import export_text

    cfg = _load_config(args.config, args.set)
    text = export_text(cfg, args.to, args.out)
    if args.out:
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0


REAL_MODEL_NOTEBOOK = "notebooks/07_real_model_precisions.ipynb"


def demo_config() -> TrainConfig:
    """The embedded default the demo runs: the tiny preset on the builtin Python docs."""
    return TrainConfig(model="tiny", data="builtin:python-docs", max_seq_len=64, micro_batch_size=8,
                       max_steps=30, subset=600, eval_fraction=0.05, precision="fp32", lr=1e-3, warmup_steps=3)


def cmd_demo(args) -> int:
    from .compare import compare

    cfg = demo_config()
    if args.max_steps:
        cfg = cfg.replace(max_steps=args.max_steps)
    print("nbtrain demo: the tiny model on the builtin Python docs, fp32 vs bf16 vs fp16, same init and batches")
    cmp = compare(cfg, precisions=("fp32", "bf16", "fp16"), callbacks=[ProgressBar(desc="demo")])
    print(cmp.format_table())
    cmp.to_html(args.html)
    print(f"wrote {args.html}")
    # the demo stays on tiny (seconds); the same comparison on a real pretrained model is one notebook away
    print(f"next: the same on a real pretrained chat model, offline: {REAL_MODEL_NOTEBOOK} "
          "(model='smollm2-135m-instruct', SmolLM2-135M-Instruct; `make lab` opens it)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nbtrain", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def with_config(sp):
        sp.add_argument("config", help="a TrainConfig YAML file, or the name of a shipped example (tiny, minilm-lora, "
                                           "qwen2.5-0.5b-qlora)")
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field (repeatable), e.g. --set precision=bf16")

    t = sub.add_parser("train", help="train one config")
    with_config(t)
    t.add_argument("--output-dir", default=None, help="where to write config.yaml, history.csv, summary.json")
    t.add_argument("--jsonl", action="store_true", help="stream records as JSON lines on stdout (for nbt.launch)")
    t.set_defaults(fn=cmd_train)

    c = sub.add_parser("compare", help="train once per precision and print a side-by-side table")
    with_config(c)
    c.add_argument("--precisions", default="fp32,fp16,bf16")
    c.add_argument("--subset", type=int, default=None)
    c.add_argument("--max-steps", type=int, default=None)
    c.add_argument("--repeats", type=int, default=1,
                   help="time every precision this many times, each repeat in a rotated order: speed-ups get "
                        "their spread, and with 3 or more the reference's own spread is the noise floor")
    c.add_argument("--aa", action="store_true",
                   help="also time an identical copy of the first precision in every repeat: the noise floor "
                        "is how far it strays from the original")
    c.add_argument("--seeds", type=_seeds, default=(),
                   help="e.g. 0,1,2: run the first precision again under the other seeds; their spread is the "
                        "noise band each precision's loss difference is judged against")
    c.add_argument("--band", choices=("init", "data", "rounding"), default="init",
                   help="what the reruns vary: init (other initial weights, the same batches; default), data (other "
                        "batch orders and eval splits) or rounding (each initial weight moved by up to ±--rounding)")
    c.add_argument("--rounding", type=float, default=2.0 ** -8,
                   help="--band rounding's relative perturbation (default 2^-8, bf16's unit roundoff)")
    c.add_argument("--html", default=None, help="write a self-contained HTML report here")
    c.set_defaults(fn=cmd_compare)

    e = sub.add_parser("estimate", help="estimate the memory a config needs, with advice when it does not fit")
    with_config(e)
    e.add_argument("--world-size", type=int, default=1, metavar="N",
                   help="the processes the run will have: every number is then one process's (sharding=fsdp: "
                        "split N ways, plus the gathered layers; none: DDP, a whole copy each)")
    e.set_defaults(fn=cmd_estimate)

    x = sub.add_parser("export", help="write the config for transformers, LLaMA-Factory, AutoTrain or accelerate")
    with_config(x)
    x.add_argument("--to", required=True,
                   choices=["training-args", "trl-sft", "trl-dpo", "trl-grpo", "llamafactory", "autotrain",
                            "accelerate-config"],
                   help="training-args: JSON of TrainingArguments keywords (+ peft/bitsandbytes configs); trl-sft: "
                        "JSON of trl.SFTConfig keywords (+ peft/bitsandbytes configs, notes); trl-dpo: the same for "
                        "trl.DPOConfig (objective dpo; ORPOConfig / CPOConfig for orpo / simpo); trl-grpo: the same "
                        "for trl.GRPOConfig (objective grpo), with the rewards by name; the others: YAML for that "
                        "tool")
    x.add_argument("--out", default=None, help="write here instead of printing")
    x.set_defaults(fn=cmd_export)

    d = sub.add_parser("demo", help="compare fp32, bf16 and fp16 on the embedded default")
    d.add_argument("--html", default="demo-report.html")
    d.add_argument("--max-steps", type=int, default=None)
    d.set_defaults(fn=cmd_demo)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``nbtrain`` command."""
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ConfigError, CheckpointError, FileNotFoundError, ValueError) as e:
        print(f"nbtrain {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
