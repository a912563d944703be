"""Image classification (issue 19): the same config, loop, records and compare as text, for images.

builtin:digits (scikit-learn's 8x8 digits) with the tiny-vit preset, a model directory saved from a tiny random
ViT / ConvNeXt config with its image processor, an image folder of PNGs, full / LoRA / QLoRA, the accumulation
and fairness invariants, the memory estimate, the AutoTrain export and the errors bad input gets."""

from __future__ import annotations

import re
import time

import pytest
import torch

import nbtrain as nbt
from nbtrain.config import ConfigError
from nbtrain.data import DataError
from nbtrain.models import ModelError

IMG = "image-classification"


@pytest.fixture
def vit_cfg():
    """A fast image config: 64 digits, fp32, 3 steps, a quarter held out."""
    return nbt.TrainConfig(model="tiny-vit", task=IMG, data="builtin:digits", subset=64, eval_fraction=0.25,
                           max_steps=3, precision="fp32", micro_batch_size=8)


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- data ---------------------------------------------------------------------------------------------------------
def test_digits_bundle(vit_cfg):
    from nbtrain.data import load_data
    from nbtrain.models import load_tokenizer

    proc = load_tokenizer(vit_cfg)            # an image task's "tokenizer" is its image processor
    data = load_data(vit_cfg.replace(subset=None, eval_fraction=0.05), proc)
    assert (len(data.train) + len(data.eval), data.num_labels) == (1797, 10)
    assert data.label_names == [str(d) for d in range(10)]
    ex = data.train[0]
    assert ex["pixel_values"].shape == (3, 8, 8) and ex["pixel_values"].dtype == torch.float32
    assert -1.0 <= float(ex["pixel_values"].min()) and float(ex["pixel_values"].max()) <= 1.0   # mean/std 0.5
    assert data.stats["image_shape"] == (3, 8, 8) and "plain torch" in data.stats["processor"]
    # the eval split depends on the seed only, as for text
    again = load_data(vit_cfg.replace(subset=None, eval_fraction=0.05, micro_batch_size=2), proc)
    assert all(torch.equal(a["pixel_values"], b["pixel_values"]) for a, b in zip(data.eval, again.eval))


def test_image_batch_protocol(vit_cfg):
    from nbtrain.data import ImageBatch, iter_steps, load_data
    from nbtrain.models import load_tokenizer

    data = load_data(vit_cfg, load_tokenizer(vit_cfg))
    _, micro = next(iter_steps(data.train, 2, 4, 0, data.pad_token_id, data.task))
    assert len(micro) == 4 and all(isinstance(mb, ImageBatch) for mb in micro)
    mb = micro[0]
    assert (mb.n_targets, mb.n_tokens, len(mb)) == (2, 2, 2)        # an example is the unit: one target per image
    assert set(mb.forward_inputs()) == {"pixel_values"} and set(mb.model_inputs()) == {"pixel_values", "labels"}
    assert mb.to("cpu").pixel_values.shape == (2, 3, 8, 8)


def test_image_folder_of_pngs(tmp_path):
    pytest.importorskip("PIL", reason="reading image files needs Pillow")
    from PIL import Image

    from nbtrain.data import load_data
    from nbtrain.data.images import digits_images

    images, labels = digits_images()
    root = tmp_path / "digits"
    for i, (img, lab) in enumerate(zip(images[:40], labels[:40])):
        if lab > 2:
            continue
        d = root / ["zero", "one", "two"][lab]
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img.numpy(), mode="L").resize((12, 12)).save(d / f"{i}.png")
    cfg = nbt.TrainConfig(model="tiny-vit", task=IMG, data=str(root), eval_fraction=0.25, max_steps=2,
                          precision="fp32", micro_batch_size=4)
    data = load_data(cfg, nbt.models.load_tokenizer(cfg))
    assert data.label_names == ["one", "two", "zero"]               # the subfolders, in sorted order
    assert data.train[0]["pixel_values"].shape == (3, 8, 8)        # 12x12 PNGs resized to the preset's 8x8
    r = nbt.train(cfg)
    assert r.summary["steps"] == 2 and r.summary["eval_accuracy"] is not None


# -- the acceptance -------------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_tiny_vit_learns_digits_on_cpu_within_a_minute():
    """Issue 19: default settings, 200 steps: eval accuracy >= 0.8 (chance: 0.1) in under 60 s on this CPU.

    On one thread: the ops of a model this small are too small to gain from two, and on a shared 2-core box
    (tests in parallel) two OpenMP threads wait for each other at every op: 100 steps took 40 s there on two
    threads and 1.6 s on one (the same losses)."""
    cfg = nbt.TrainConfig(model="tiny-vit", task=IMG, data="builtin:digits", max_steps=200)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        r = nbt.train(cfg)
        took = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    assert r.summary["eval_accuracy"] >= 0.8, r.summary
    assert took < 60, f"{took:.1f} s"
    assert r.summary["tokens"] == 200 * 8                           # examples, for a classifier
    assert r.history["loss"].iloc[-20:].mean() < 0.5 * r.history["loss"].iloc[:5].mean()


# -- the loop's invariants ------------------------------------------------------------------------------------------
def test_accumulation_8x1_equals_2x4_and_1x8(vit_cfg):
    cfg = vit_cfg.replace(lr=1e-4, eval_fraction=0.0)
    runs = {key: nbt.train(cfg.replace(micro_batch_size=key[0], grad_accum_steps=key[1]))
            for key in [(8, 1), (2, 4), (1, 8)]}
    ref = runs[(8, 1)]
    ref_w = _weights(ref.model)
    for key, r in runs.items():
        assert list(r.history["micro_steps"]) == [key[1]] * cfg.max_steps
        assert list(r.history["tokens"]) == [8] * cfg.max_steps     # per example
        for a, b in zip(r.history["loss"], ref.history["loss"]):
            assert abs(a - b) <= 1e-5 * abs(b), (key, a, b)
        assert r.summary["data_hash"] == ref.summary["data_hash"]   # the same pixels and labels in every step
        w = _weights(r.model)
        for k in ref_w:
            torch.testing.assert_close(w[k], ref_w[k], rtol=1e-5, atol=1e-5)


def test_step_loss_is_the_mean_over_the_steps_examples(vit_cfg):
    """Per-example normalisation: a 2x4 step's loss is the sum over its 8 images / 8, not a mean of means."""
    from nbtrain.data import iter_steps, load_data
    from nbtrain.engine import loss_sum
    from nbtrain.models import build_model, load_tokenizer

    cfg = vit_cfg.replace(subset=61, eval_fraction=0.0, micro_batch_size=3, grad_accum_steps=3, max_steps=1)
    proc = load_tokenizer(cfg)
    data = load_data(cfg, proc)
    torch.manual_seed(cfg.seed)
    from nbtrain.engine.rng import RunRng

    with RunRng(cfg.seed, "cpu").active():
        model = build_model(cfg, proc, data.num_labels, "fp32", "cpu", label_names=data.label_names)
    steps = iter_steps(data.train, 3, 3, cfg.seed, data.pad_token_id, data.task)
    _, micro = next(steps)
    with torch.no_grad():
        total = sum(loss_sum(model(**m.forward_inputs()).logits, m.labels, data.task) for m in micro)
    r = nbt.train(cfg)
    assert r.history["tokens"][0] == 9
    assert r.history["loss"][0] == pytest.approx(total.item() / 9, rel=1e-5)


def test_compare_fp32_bf16_is_fair_by_hash(vit_cfg):
    cmp = nbt.compare(vit_cfg, precisions=("fp32", "bf16"), max_steps=3)
    t = cmp.table
    assert cmp.fair, t
    assert t["init_hash"].nunique() == 1 and t["data_hash"].nunique() == 1
    assert set(cmp.results) == {"fp32", "bf16"}
    assert all(r.summary["eval_accuracy"] is not None for r in cmp.results.values())
    assert cmp.results["bf16"].summary["precision_used"] == "bf16"


def test_fp16_uses_the_grad_scaler(vit_cfg):
    r = nbt.train(vit_cfg.replace(precision="fp16", max_steps=2))
    assert r.history["scale"].notna().all() and r.summary["precision_used"] == "fp16"


def test_dashboard_follows_an_image_run(vit_cfg):
    dash = nbt.LiveDashboard()
    r = nbt.train(vit_cfg.replace(max_steps=2), callbacks=[dash])
    assert r.summary["steps"] == 2
    assert r.figure() is not None


# -- methods --------------------------------------------------------------------------------------------------------
def test_lora_on_tiny_vit_trains_adapters_and_the_whole_head(vit_cfg):
    r = nbt.train(vit_cfg.replace(method="lora", lora_targets=["q_proj", "v_proj"]))
    names = [n for n, p in r.model.named_parameters() if p.requires_grad]
    assert any("q_proj.lora_A" in n for n in names) and any("v_proj.lora_B" in n for n in names)
    assert not any("k_proj.lora" in n or "fc1.lora" in n for n in names)
    assert any("classifier.modules_to_save" in n for n in names)     # the new head trains whole
    assert r.summary["trainable_params"] < 0.2 * r.summary["total_params"]


def test_qlora_keeps_the_head_unquantised(vit_cfg):
    why = nbt.capabilities().why_not("qlora")
    if why:
        pytest.skip(f"QLoRA cannot run here: {why}")
    from bitsandbytes.nn import Linear4bit

    r = nbt.train(vit_cfg.replace(method="qlora"))
    base = r.model.get_base_model()
    quantised = [n for n, m in base.named_modules() if isinstance(m, Linear4bit)]
    assert quantised and not any(n.startswith("classifier") for n in quantised)
    assert any(".q_proj" in n for n in quantised)
    assert all(r.history["loss"].notna())


def _save_tiny(kind: str, path):
    from transformers import (ConvNextConfig, ConvNextForImageClassification, ConvNextImageProcessor, ViTConfig,
                              ViTForImageClassification, ViTImageProcessor)

    torch.manual_seed(0)
    if kind == "vit":
        model = ViTForImageClassification(ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                                                    num_hidden_layers=2, num_attention_heads=2,
                                                    intermediate_size=64, num_labels=3))
        proc = ViTImageProcessor(size={"height": 16, "width": 16})
    else:
        model = ConvNextForImageClassification(ConvNextConfig(num_channels=3, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1],
                                                              image_size=32, num_labels=3))
        proc = ConvNextImageProcessor(size={"shortest_edge": 32})
    model.save_pretrained(path)
    proc.save_pretrained(path)
    return path


@pytest.mark.parametrize("kind,method", [("vit", "full"), ("vit", "lora"), ("convnext", "lora")])
def test_a_local_checkpoint_directory(tmp_path, kind, method):
    pytest.importorskip("PIL", reason="transformers' image processors need Pillow without torchvision")
    d = _save_tiny(kind, tmp_path / kind)
    cfg = nbt.TrainConfig(model=str(d), task=IMG, data="builtin:digits", subset=40, eval_fraction=0.25,
                          max_steps=2, precision="fp32", micro_batch_size=4, method=method)
    from nbtrain.models import load_tokenizer

    proc = load_tokenizer(cfg)
    assert type(proc).__name__.startswith(("ViTImageProcessor", "ConvNextImageProcessor")), type(proc)
    r = nbt.train(cfg)
    assert r.summary["steps"] == 2 and r.summary["eval_accuracy"] is not None
    assert r.model.config.num_labels == 10 if method == "full" else r.model.get_base_model().config.num_labels == 10
    if method == "lora":
        names = [n for n, p in r.model.named_parameters() if p.requires_grad]
        assert any(".lora_A." in n for n in names) and any("classifier.modules_to_save" in n for n in names)
    out = r.save(tmp_path / "saved")
    assert (out / "preprocessor_config.json").is_file()


def test_tiny_vit_saves_and_reloads_with_auto_classes(vit_cfg, tmp_path):
    pytest.importorskip("PIL", reason="AutoImageProcessor needs Pillow without torchvision")
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    r = nbt.train(vit_cfg)
    out = r.save(tmp_path / "vit")
    model = AutoModelForImageClassification.from_pretrained(out)
    proc = AutoImageProcessor.from_pretrained(out)
    assert model.config.id2label[3] == "3"
    x = torch.linspace(-1, 1, 2 * 3 * 8 * 8).reshape(2, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(pixel_values=x).logits, r.model.eval()(pixel_values=x).logits)
    assert proc.size == {"height": 8, "width": 8}


# -- estimate and exports -------------------------------------------------------------------------------------------
def test_memory_estimate_counts_patches_times_hidden(vit_cfg):
    est = nbt.estimate_memory(vit_cfg, device_total_gib=8)
    assert est.fits and est.activations_gib > 0
    real = sum(p.numel() for p in nbt.train(vit_cfg.replace(max_steps=1)).model.parameters())
    assert est.trainable_params == est.total_params
    assert abs(est.total_params - real) <= 8 * 97    # the estimate's head has 2 labels, digits have 10
    bigger = nbt.estimate_memory(vit_cfg.replace(micro_batch_size=64), device_total_gib=8)
    assert bigger.activations_gib > 4 * est.activations_gib            # activations grow with the images
    assert any("patch" in n for n in est.notes)
    lora = nbt.estimate_memory(vit_cfg.replace(method="lora"), device_total_gib=8)
    assert lora.trainable_params < est.trainable_params


def test_autotrain_export_is_image_classification(tmp_path):
    from nbtrain.integrations.exports import from_autotrain_yaml, to_autotrain_yaml

    cfg = nbt.TrainConfig(model="google/vit-base-patch16-224", task=IMG, data="some/cats-vs-dogs",
                          image_column="img", label_column="labels", precision="fp16", micro_batch_size=4,
                          grad_accum_steps=2, epochs=2, max_steps=None)
    text = to_autotrain_yaml(cfg, tmp_path / "at.yaml")
    import yaml

    doc = yaml.safe_load(text)
    assert doc["task"] == "image_classification"
    assert doc["data"]["column_mapping"] == {"image_column": "img", "target_column": "labels"}
    assert doc["params"]["mixed_precision"] == "fp16" and doc["params"]["gradient_accumulation"] == 2
    assert "max_seq_length" not in doc["params"]
    back = from_autotrain_yaml(tmp_path / "at.yaml")
    for f in ("model", "task", "data", "image_column", "label_column", "precision", "micro_batch_size",
              "grad_accum_steps", "epochs"):
        assert getattr(back, f) == getattr(cfg, f), f


def test_autotrain_export_of_an_image_folder(tmp_path):
    from nbtrain.integrations.exports import autotrain_config, from_autotrain_yaml, to_autotrain_yaml

    folder = tmp_path / "data" / "pets"
    (folder / "cat").mkdir(parents=True)
    cfg = nbt.TrainConfig(model="tiny-vit", task=IMG, data=str(folder), max_steps=None, epochs=1)
    doc, notes = autotrain_config(cfg)
    assert doc["data"]["path"] == str(tmp_path / "data") and doc["data"]["train_split"] == "pets"
    assert doc["data"]["column_mapping"] == {"image_column": "image", "target_column": "label"}
    to_autotrain_yaml(cfg, tmp_path / "at.yaml")
    assert from_autotrain_yaml(tmp_path / "at.yaml").data == str(folder)


def test_autotrain_export_refuses_lora_for_images():
    from nbtrain.integrations.exports import to_autotrain_yaml

    with pytest.raises(ConfigError, match="method"):
        to_autotrain_yaml(nbt.TrainConfig(model="tiny-vit", task=IMG, data="builtin:digits", method="lora"))


# -- errors ---------------------------------------------------------------------------------------------------------
def test_text_task_with_digits_fails_at_construction():
    with pytest.raises(ConfigError, match="image-classification") as e:
        nbt.TrainConfig(data="builtin:digits")
    assert e.value.field == "data"


def test_image_task_with_builtin_text_fails_at_construction():
    with pytest.raises(ConfigError, match="holds text") as e:
        nbt.TrainConfig(model="tiny-vit", task=IMG, data="builtin:python-docs")
    assert e.value.field == "data"


def test_preset_and_task_must_agree(vit_cfg):
    with pytest.raises(ModelError, match="tiny-vit"):
        nbt.train(nbt.TrainConfig(model="tiny-vit", data="builtin:python-docs", max_steps=1))
    with pytest.raises(ModelError, match="'tiny'.*image-classification"):
        nbt.train(vit_cfg.replace(model="tiny"))


def test_image_folder_without_class_subfolders(tmp_path, vit_cfg):
    pytest.importorskip("PIL")
    from PIL import Image

    for i in range(3):
        Image.new("L", (8, 8)).save(tmp_path / f"{i}.png")
    with pytest.raises(DataError, match="no class subfolders") as e:
        nbt.train(vit_cfg.replace(data=str(tmp_path)))
    assert str(tmp_path) in str(e.value)


def test_folder_without_images_and_one_class(tmp_path, vit_cfg):
    (tmp_path / "a.txt").write_text("hello\n")
    with pytest.raises(DataError, match="no image files"):
        nbt.train(vit_cfg.replace(data=str(tmp_path)))
    one = tmp_path / "only" / "cat"
    one.mkdir(parents=True)
    (one / "1.png").write_bytes(b"")
    with pytest.raises(DataError, match="only one class"):
        nbt.train(vit_cfg.replace(data=str(tmp_path / "only")))


def _folder_with_a_corrupt_png(root):
    from PIL import Image

    for c in ("cat", "dog"):
        (root / c).mkdir(parents=True)
        for i in range(4):
            Image.new("L", (8, 8), color=30 * i).save(root / c / f"{i}.png")
    bad = root / "dog" / "x.png"     # sorts after dog/0..3.png: the last file read
    bad.write_bytes(b"these are not the bytes of a PNG file\n" * 4)
    return bad


class _Steps:
    def __init__(self):
        self.steps = []

    def on_step_end(self, record):
        self.steps.append(record.step)


def test_a_corrupt_image_in_a_folder_is_a_data_error_before_step_1(tmp_path, vit_cfg):
    """issue 25: one file of garbage bytes named x.png raised PIL's UnidentifiedImageError, during preprocessing."""
    pytest.importorskip("PIL")
    bad = _folder_with_a_corrupt_png(tmp_path / "pets")
    cfg = vit_cfg.replace(data=str(tmp_path / "pets"), subset=None, eval_fraction=0.25)
    seen = _Steps()
    with pytest.raises(DataError) as e:
        nbt.train(cfg, callbacks=[seen])
    msg = str(e.value)
    assert type(e.value) is DataError and e.value.__cause__ is None                  # no raw PIL error
    assert str(bad) in msg and "UnidentifiedImageError" in msg and ".png" in msg and ".jpg" in msg
    assert seen.steps == []                                                          # raised before step 1
    from nbtrain.engine.prepare import prepare

    with pytest.raises(DataError, match=re.escape(str(bad))):
        prepare(cfg)
    # every file is read before training, not only the subset's: x.png is the 8th image, subset=2 keeps 2
    with pytest.raises(DataError, match=re.escape(str(bad))):
        nbt.train(cfg.replace(subset=2, eval_fraction=0.0), callbacks=[seen])
    assert seen.steps == []
    bad.unlink()                                                                     # without it, the folder trains
    assert nbt.train(cfg.replace(max_steps=1)).summary["steps"] == 1


def test_a_corrupt_image_in_a_dataset_is_a_data_error(monkeypatch, vit_cfg):
    pytest.importorskip("PIL")
    import datasets

    import nbtrain.data.loading as loading

    good = _png_bytes()
    ds = datasets.Dataset.from_dict({"image": [{"bytes": good, "path": None}] * 3
                                     + [{"bytes": b"garbage", "path": None}], "label": [0, 1, 0, 1]},
                                    features=datasets.Features({"image": datasets.Image(),
                                                                "label": datasets.Value("int64")}))
    monkeypatch.setattr(loading, "hub_dataset", lambda data, hint="": (ds, "train", f"dataset {data!r}"))
    with pytest.raises(DataError, match=r"dataset 'someone/pets': cannot decode image 3 \(UnidentifiedImageError"):
        nbt.train(vit_cfg.replace(data="someone/pets", subset=None, eval_fraction=0.0))


def _png_bytes() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (8, 8), color=100).save(buf, format="PNG")
    return buf.getvalue()


def test_text_task_on_an_image_folder_says_so(tmp_path):
    d = tmp_path / "imgs" / "cat"
    d.mkdir(parents=True)
    (d / "1.png").write_bytes(b"")
    with pytest.raises(DataError, match="holds images"):
        nbt.train(nbt.TrainConfig(data=str(tmp_path / "imgs"), max_steps=1))


def test_dataset_without_an_image_column(monkeypatch, vit_cfg):
    import datasets

    import nbtrain.data.loading as loading

    text = datasets.Dataset.from_dict({"text": ["a", "b"], "label": [0, 1]})
    monkeypatch.setattr(loading, "hub_dataset", lambda data, hint="": (text, "train", f"dataset {data!r}"))
    with pytest.raises(DataError, match=r"no image column 'image'.*text dataset"):
        nbt.train(vit_cfg.replace(data="someone/texts"))
    pics = datasets.Dataset.from_dict({"img": [torch.zeros(8, 8, dtype=torch.uint8).numpy()] * 2, "label": [0, 1]},
                                      features=datasets.Features({"img": datasets.Image(),
                                                                  "label": datasets.Value("int64")}))
    monkeypatch.setattr(loading, "hub_dataset", lambda data, hint="": (pics, "train", f"dataset {data!r}"))
    with pytest.raises(DataError, match="set image_column='img'"):
        nbt.train(vit_cfg.replace(data="someone/pictures"))


def test_dataset_id_with_image_and_label_columns(monkeypatch, vit_cfg):
    pytest.importorskip("PIL")
    import datasets

    import nbtrain.data.loading as loading
    from nbtrain.data.images import digits_images

    images, labels = digits_images()
    ds = datasets.Dataset.from_dict({"picture": [i.numpy() for i in images[:40]],
                                     "digit": [str(x) for x in labels[:40]]},
                                    features=datasets.Features({"picture": datasets.Image(),
                                                                "digit": datasets.Value("string")}))
    monkeypatch.setattr(loading, "hub_dataset", lambda data, hint="": (ds, "train", f"dataset {data!r}"))
    r = nbt.train(vit_cfg.replace(data="someone/digits", image_column="picture", label_column="digit",
                                  max_steps=2))
    assert r.summary["steps"] == 2
    assert r.model.config.id2label[0] == "0"


def test_lora_targets_are_checked_against_the_vit(vit_cfg):
    with pytest.raises(ConfigError, match="q_proj") as e:
        nbt.train(vit_cfg.replace(method="lora", lora_targets=["query"]))   # transformers 4's name; 5 says q_proj
    assert e.value.field == "lora_targets"


def test_panel_shows_and_returns_an_image_config(vit_cfg):
    panel = nbt.Panel()
    cfg = vit_cfg.replace(image_column="img")
    panel.config = cfg
    assert panel.config == cfg
