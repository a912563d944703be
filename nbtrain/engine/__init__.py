"""The loop, its records and callbacks, and train()/start()."""

from .callbacks import Callback, CallbackError, StopTraining
from .checkpoint import CheckpointError
from .doctor import Finding, diagnose, scan_fp16_overflow
from .evaluate import evaluate
from .finish import RunSummary, TrainResult
from .fingerprint import weights_hash
from .losses import loss_sum
from .loop import Run, start, train
from .prepare import RunState
from ..precision import PRECISION_TABLE, PrecisionSpec
from .records import SAMPLE_FIELDS, STEP_FIELDS, EvalRecord, RunInfo, SampleRecord, StepRecord

__all__ = ["CheckpointError", "Finding", "diagnose", "scan_fp16_overflow", "Callback", "CallbackError", "StopTraining", "Run", "RunState", "RunSummary", "TrainResult", "evaluate", "loss_sum", "start",
           "train", "weights_hash", "PRECISION_TABLE", "PrecisionSpec", "STEP_FIELDS", "EvalRecord", "RunInfo",
           "SAMPLE_FIELDS", "SampleRecord", "StepRecord"]
