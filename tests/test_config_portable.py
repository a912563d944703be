"""A config written for another machine (tf32 on an Ampere GPU, QLoRA with bitsandbytes) loads, edits, estimates
and exports on this one; only a run says that this device cannot run it, with the reason."""

import json
import sys

import pytest
import yaml

import nbtrain as nbt
from nbtrain.cli import main

from .helpers import run_process

TF32_YAML = """\
model: tiny
data: builtin:python-docs
max_seq_len: 32
subset: 32
precision: tf32
micro_batch_size: 4
max_steps: 2
eval_fraction: 0.0
"""

QLORA_YAML = """\
model: tiny
data: builtin:python-docs
max_seq_len: 32
subset: 32
precision: bf16
method: qlora
quant_bits: 4
lora_targets: [q_proj, v_proj]
micro_batch_size: 4
max_steps: 2
eval_fraction: 0.0
"""


@pytest.fixture
def tf32_yaml(tmp_path):
    path = tmp_path / "tf32.yaml"
    path.write_text(TF32_YAML)
    return path


@pytest.fixture
def qlora_yaml(tmp_path):
    path = tmp_path / "qlora.yaml"
    path.write_text(QLORA_YAML)
    return path


def test_tf32_and_qlora_yaml_load_and_edit_here(tf32_yaml, qlora_yaml, tmp_path):
    cfg = nbt.TrainConfig.from_yaml(tf32_yaml)
    assert cfg.precision == "tf32" and cfg.micro_batch_size == 4
    q = nbt.TrainConfig.from_yaml(qlora_yaml)
    assert (q.method, q.quant_bits, q.lora_targets) == ("qlora", 4, ["q_proj", "v_proj"])
    edited = cfg.replace(micro_batch_size=2, grad_accum_steps=2)
    assert edited.precision == "tf32" and edited.effective_batch_size == 4
    edited.to_yaml(tmp_path / "back.yaml")
    assert nbt.TrainConfig.from_yaml(tmp_path / "back.yaml") == edited


def test_first_config_does_not_import_bitsandbytes():
    """Constructing a config asks no device question, so it never pays for importing bitsandbytes."""
    code = ("import sys, nbtrain.config as c\n"
            "c.TrainConfig(); c.TrainConfig(method='qlora', precision='tf32')\n"
            "print('bitsandbytes' in sys.modules, 'nbtrain.hardware' in sys.modules)\n")
    out = run_process([sys.executable, "-c", code], 120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "False"


@pytest.mark.parametrize("which", ["tf32", "qlora"])
def test_cli_export_of_a_config_for_another_machine(which, tf32_yaml, qlora_yaml, capsys):
    path = tf32_yaml if which == "tf32" else qlora_yaml
    assert main(["export", str(path), "--to", "llamafactory"]) == 0
    lf = yaml.safe_load(capsys.readouterr().out)
    assert main(["export", str(path), "--to", "autotrain"]) == 0
    at = yaml.safe_load(capsys.readouterr().out)
    assert main(["export", str(path), "--to", "training-args"]) == 0
    args = json.loads(capsys.readouterr().out)
    assert main(["export", str(path), "--to", "accelerate-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["mixed_precision"] == "no"
    if which == "tf32":
        assert lf["tf32"] is True and args["training_arguments"]["tf32"] is True
        assert at["params"]["mixed_precision"] == "none"
    else:
        assert lf["quantization_bit"] == 4 and lf["bf16"] is True
        assert at["params"]["quantization"] == "int4"
        assert args["quantization_config"]["load_in_4bit"] is True
        assert set(args["peft_config"]["target_modules"]) == {"q_proj", "v_proj"}


@pytest.mark.parametrize("which", ["tf32", "qlora"])
def test_cli_estimate_of_a_config_for_another_machine(which, tf32_yaml, qlora_yaml, capsys):
    path = tf32_yaml if which == "tf32" else qlora_yaml
    assert main(["estimate", str(path)]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.strip()


def test_cli_train_of_a_tf32_config_names_the_reason(tf32_yaml, tmp_path, capsys):
    caps = nbt.capabilities()
    if "tf32" not in caps.reasons:
        pytest.skip("this device runs tf32")
    assert main(["train", str(tf32_yaml), "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"precision: 'tf32' cannot run on this {caps.device} ({caps.name})" in err
    assert caps.reasons["tf32"] in err
    assert not (tmp_path / "run" / "history.csv").exists()
