"""The example configs ship inside the package: a notebook opened alone, or a pip install, finds them by name
(TrainConfig.example, `nbtrain train tiny`); the README's command lines run as written."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

import nbtrain as nbt
from nbtrain import cli
from nbtrain.config import EXAMPLES_DIR, example_configs

ROOT = Path(__file__).resolve().parents[1]


def test_every_example_loads_by_name_from_inside_the_package():
    assert EXAMPLES_DIR.parent == Path(nbt.__file__).resolve().parent
    assert set(example_configs()) == {"tiny", "minilm-lora", "qwen2.5-0.5b-qlora"}
    for name, path in example_configs().items():
        assert nbt.TrainConfig.example(name) == nbt.TrainConfig.from_yaml(path)


def test_an_unknown_example_lists_the_ones_there_are():
    with pytest.raises(ValueError, match=r"no example config 'tinny'.*tiny, minilm-lora|minilm-lora.*tiny"):
        nbt.TrainConfig.example("tinny")


def test_the_command_line_takes_a_file_or_an_example_name(tmp_path, capsys):
    assert cli._load_config("tiny", []) == nbt.TrainConfig.example("tiny")
    own = tmp_path / "tiny"            # a file of that name wins over the example
    nbt.TrainConfig(model="tiny", max_steps=3).to_yaml(own)
    assert cli._load_config(str(own), []).max_steps == 3
    assert cli.main(["estimate", "nosuch.yaml"]) == 2
    err = capsys.readouterr().err
    assert "'nosuch.yaml' does not exist" in err and "tiny" in err and "example config" in err


def test_the_readme_command_lines_name_configs_that_load():
    readme = (ROOT / "README.md").read_text()
    lines = re.findall(r"^nbtrain (train|compare|estimate|export) (\S+)", readme, flags=re.M)
    assert len(lines) >= 4
    for command, config in lines:
        assert cli._load_config(shlex.split(config)[0], []).model, (command, config)


def test_the_wheel_ships_the_examples():
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'\[tool\.setuptools\.package-data\]\s*\nnbtrain = \["configs/\*\.yaml"\]', text)
