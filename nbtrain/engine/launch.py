"""``nbt.launch``: a multi-process run (torchrun or accelerate launch) started from a notebook.

The workers run ``nbtrain train CFG.yaml --jsonl``; rank 0 streams its events as JSON lines, and a reader
thread here turns them back into RunInfo / StepRecord / EvalRecord objects for the callbacks, so the live
dashboard and ``result.history`` work as for an in-process run. Stop writes a stop file that every rank
checks at the start of a step (they agree through an all-reduce), so the workers end cleanly; if they do not
within ``grace_s``, the process group is terminated.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Optional

from ..config import TrainConfig
from .callbacks import CallbackList
from .finish import EVAL_FIELDS, RunSummary, TrainResult, frame
from .records import STEP_FIELDS, EvalRecord, RunInfo, StepRecord
from .threads import spawn

PREFIX = "@nbtrain "


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(cfg_path: str, num_processes: int, launcher: str = "torchrun",
                   accelerate_config: Optional[str] = None) -> list[str]:
    """The command line that runs ``nbtrain train`` on ``num_processes`` processes of this machine.

    ``accelerate_config``: an ``accelerate launch --config_file`` (``nbtrain export --to accelerate-config``),
    e.g. the FSDP one a sharded config exports; the command line still sets the processes, address and port."""
    port = str(_free_port())
    if launcher == "accelerate" and accelerate_config:
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", accelerate_config,
                "--num_processes", str(num_processes), "--main_process_ip", "127.0.0.1",
                "--main_process_port", port, "-m", "nbtrain", "train", cfg_path, "--jsonl"]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(num_processes),
                "--master_addr", "127.0.0.1", "--master_port", port,
                "-m", "nbtrain", "train", cfg_path, "--jsonl"]
    if launcher == "accelerate":
        return [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(num_processes),
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_ip", "127.0.0.1", "--main_process_port", port,
                # --multi_gpu selects accelerate's torchrun-based launcher; on a CPU-only machine it starts the
                # same processes and nbtrain picks the gloo backend itself.
                *(["--multi_gpu"] if num_processes > 1 else []),
                "-m", "nbtrain", "train", cfg_path, "--jsonl"]
    raise ValueError(f"launcher={launcher!r}: choose 'torchrun' or 'accelerate'")


class LaunchedRun:
    """A multi-process run seen from the notebook: ``stop()``, ``wait()``, ``done``, ``result``."""

    def __init__(self, cfg: TrainConfig, num_processes: int, callbacks=None, launcher: str = "torchrun",
                 grace_s: float = 60.0, env: Optional[dict] = None):
        self.config = cfg
        self.grace_s = grace_s
        self._tmp = Path(tempfile.mkdtemp(prefix="nbtrain-launch-"))
        self._stop_file = self._tmp / "STOP"
        if cfg.output_dir is None:
            cfg = cfg.replace(output_dir=str(self._tmp / "output"))
        self.output_dir = cfg.output_dir
        cfg_path = self._tmp / "config.yaml"
        cfg.to_yaml(cfg_path)
        self._cbs = CallbackList(callbacks)
        self.info: Optional[RunInfo] = None
        self.records: list[StepRecord] = []
        self.evals: list[EvalRecord] = []
        self.summary: Optional[dict] = None
        self.result: Optional[TrainResult] = None
        self.error: Optional[BaseException] = None
        self.log: list[str] = []   # the workers' other output, for error messages
        full_env = {**os.environ, "NBTRAIN_STOP_FILE": str(self._stop_file), "PYTHONUNBUFFERED": "1",
                    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
        acc = None
        if launcher == "accelerate" and cfg.sharding == "fsdp":
            # accelerate's own FSDP config (distributed_type FSDP, fsdp_version 2), as `nbtrain export` writes it
            from ..integrations.exports import to_accelerate_config_yaml

            acc = str(self._tmp / "accelerate_fsdp.yaml")
            to_accelerate_config_yaml(cfg, acc, num_processes=num_processes)
        self.command = launch_command(str(cfg_path), num_processes, launcher, accelerate_config=acc)
        # A new session, so stop() can signal the launcher and every worker as one process group.
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env=full_env, start_new_session=True, bufsize=1)
        # The reader fires the callbacks; interpreter exit stops the workers and joins it.
        self._reader = spawn(self._read, "nbtrain-launch-reader", stop=self.stop, cfg=cfg)

    def _read(self) -> None:
        try:
            for line in self.process.stdout:
                if not line.startswith(PREFIX):
                    self.log.append(line.rstrip("\n"))
                    continue
                msg = json.loads(line[len(PREFIX):])
                ev = msg["event"]
                if ev == "run_start":
                    self.info = RunInfo(config=self.config, model=None, **msg["info"])
                    self._cbs.fire("on_run_start", self.info)
                elif ev == "step":
                    rec = StepRecord(**msg["record"])
                    self.records.append(rec)
                    self._cbs.fire("on_step_end", rec)
                elif ev == "eval":
                    rec = EvalRecord(**msg["record"])
                    self.evals.append(rec)
                    self._cbs.fire("on_eval", rec)
                elif ev == "run_end":
                    self.summary = msg["summary"]
            rc = self.process.wait()
            if self.summary is None:
                tail = "\n".join(self.log[-30:])
                raise RuntimeError(f"the launched run exited with code {rc} before finishing:\n{tail}")
            self.result = TrainResult(history=frame(self.records, STEP_FIELDS),
                                      eval_history=frame(self.evals, EVAL_FIELDS),
                                      summary=RunSummary.from_dict(self.summary),
                                      model=None, tokenizer=None, config=self.config, info=self.info,
                                      records=self.records)
            self._cbs.fire("on_run_end", self.result)
        except BaseException as e:  # kept for wait(); a reader thread must not die silently
            self.error = e
        finally:
            self._stop_file.unlink(missing_ok=True)   # the temp dir stays: it may hold output_dir

    def stop(self) -> None:
        """Ask every worker to stop after its current step; terminate them if they have not within grace_s."""
        self._stop_file.write_text("stop")

        def escalate():
            try:
                self.process.wait(self.grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGTERM)

        threading.Thread(target=escalate, daemon=True).start()

    @property
    def done(self) -> bool:
        return not self._reader.is_alive()

    def wait(self, timeout: Optional[float] = None) -> Optional[TrainResult]:
        """Block until the run ends; returns the TrainResult (``model`` is None: it lived in the workers; rank 0
        saved it to ``output_dir/model`` beside the run's other files)."""
        self._reader.join(timeout)
        if self._reader.is_alive():
            return None
        if self.error is not None:
            raise self.error
        return self.result


def launch(cfg: TrainConfig, num_processes: int = 2, callbacks=None, launcher: str = "torchrun",
           **kwargs) -> LaunchedRun:
    """Run ``cfg`` on ``num_processes`` processes (DDP, or FSDP2 with ``sharding="fsdp"``) under torchrun or
    accelerate launch, streaming rank 0's records back to ``callbacks`` (e.g. ``nbt.LiveDashboard()``) in this
    process; rank 0 saves the final model to ``output_dir/model``."""
    return LaunchedRun(cfg, num_processes, callbacks, launcher=launcher, **kwargs)
