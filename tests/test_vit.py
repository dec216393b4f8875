"""Vision Transformer: transformers' ViTForImageClassification from tiny random configs is
the reference (both directions); shapes and errors for other image geometries."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_cases import transformers
from safetensors.torch import load_file

from attnlab.config import ConfigError, ModelConfig
from attnlab.interop import HFCheckpointError, load_hf, save_hf
from attnlab.models import build_model
from attnlab.models.vit import VisionTransformer, ViTConfig


def _random_hf_vit(tmp_path, image_size, channels, patch):
    """A tiny transformers ViTForImageClassification with random weights (LayerNorm scales
    near 1), saved to tmp_path / "hf"."""
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(
        image_size=image_size,
        patch_size=patch,
        num_channels=channels,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        num_labels=5,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )
    ref = transformers.ViTForImageClassification(cfg).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(
                (0.5 + torch.rand_like(p))
                if "layernorm" in name and "weight" in name
                else 0.3 * torch.randn_like(p)
            )
    ref.save_pretrained(tmp_path / "hf")
    return ref


@pytest.mark.parametrize("image_size,channels,patch", [(8, 1, 4), ((12, 8), 3, 2), (16, 2, 16)])
def test_vit_loads_and_saves_with_equal_logits(image_size, channels, patch, tmp_path):
    ref = _random_hf_vit(tmp_path, image_size, channels, patch)
    model = load_hf(tmp_path / "hf")
    h, w = (image_size, image_size) if isinstance(image_size, int) else image_size
    images = torch.randn(3, channels, h, w)
    with torch.no_grad():
        expected = ref(pixel_values=images).logits
        out = model(images).logits
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    save_hf(model, tmp_path / "ours")
    assert any(
        "attention.attention.query" in k for k in load_file(tmp_path / "ours" / "model.safetensors")
    )
    back = transformers.ViTForImageClassification.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(pixel_values=images).logits, expected, atol=1e-4, rtol=1e-4)
    # and the Hub-layout file we wrote loads again
    again = load_hf(tmp_path / "ours")
    torch.testing.assert_close(again(images).logits, out, atol=1e-6, rtol=1e-6)


def test_interpolated_position_embeddings_equal_transformers(tmp_path):
    """interpolate_pos_encoding=True takes images of other sizes (larger and smaller,
    non-square) with transformers' logits; the default refuses them, and at the model's own
    size the option changes nothing. Images must still be a whole number of patches."""
    ref = _random_hf_vit(tmp_path, 12, 3, 2)  # transformers interpolates from square grids
    model = load_hf(tmp_path / "hf").eval()
    for h, w in [(16, 20), (8, 6)]:
        images = torch.randn(2, 3, h, w)
        with torch.no_grad():
            expected = ref(pixel_values=images, interpolate_pos_encoding=True).logits
            out = model(images, interpolate_pos_encoding=True).logits
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match="12 x 12, got .*interpolate_pos_encoding=True"):
            model(images)
    images = torch.randn(2, 3, 12, 12)
    with torch.no_grad():
        same = model(images, interpolate_pos_encoding=True).logits
        assert torch.equal(same, model(images).logits)
    with pytest.raises(ValueError, match="13 x 12 is not a whole number of 2 x 2 patches"):
        model(torch.randn(1, 3, 13, 12), interpolate_pos_encoding=True)


def test_vit_settings_names_and_the_transformers_5_layout_both_ways(tmp_path):
    """What the logits test's defaults leave alone: no q/k/v biases, a layer_norm_eps large
    enough to move the logits, twelve named classes (listed in config.json in the order of
    their keys as text, "10" before "2": a JSON object's order means nothing); and a state
    dict in transformers 5's own names (vit.layers.i.attention.q_proj, ...), as a model's
    ``state_dict()`` saved directly holds it. Export writes the settings back, and a
    non-square model's image processor resizes to its height x width."""
    import json

    from PIL import Image
    from safetensors.torch import save_file

    torch.manual_seed(0)
    names = [f"class {i}" for i in range(12)]
    cfg = transformers.ViTConfig(
        image_size=[12, 8], patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=24, qkv_bias=False, layer_norm_eps=0.05,
        id2label=dict(enumerate(names)), attn_implementation="eager",
    )  # fmt: skip
    ref = transformers.ViTForImageClassification(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    ref.save_pretrained(tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    written["id2label"] = dict(sorted(written["id2label"].items()))  # "10" before "2"
    (tmp_path / "hf" / "config.json").write_text(json.dumps(written))
    images = torch.randn(2, 3, 12, 8)
    with torch.no_grad():
        expected = ref(pixel_values=images).logits
    model = load_hf(tmp_path / "hf")
    assert (model.cfg.attention.qkv_bias, model.cfg.norm.eps) == (False, 0.05)
    assert model.cfg.class_names == names
    torch.testing.assert_close(model(images).logits, expected, atol=1e-4, rtol=1e-4)
    # transformers 5's in-memory names
    (tmp_path / "v5").mkdir()
    (tmp_path / "v5" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert "vit.layers.0.attention.q_proj.weight" in state
    save_file(state, tmp_path / "v5" / "model.safetensors", metadata={"format": "pt"})
    torch.testing.assert_close(
        load_hf(tmp_path / "v5")(images).logits, expected, atol=1e-4, rtol=1e-4
    )
    save_hf(model, tmp_path / "ours")
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert (written["qkv_bias"], written["layer_norm_eps"]) == (False, 0.05)
    back = transformers.ViTForImageClassification.from_pretrained(tmp_path / "ours").eval()
    assert [back.config.id2label[i] for i in range(12)] == names
    with torch.no_grad():
        torch.testing.assert_close(back(pixel_values=images).logits, expected, atol=1e-4, rtol=1e-4)
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path / "ours")
    image = Image.fromarray(np.zeros((30, 50, 3), dtype=np.uint8), "RGB")  # 30 high, 50 wide
    assert processor(image, return_tensors="pt")["pixel_values"].shape == (1, 3, 12, 8)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_vit_in_another_dtype_takes_float32_pixels(dtype, tmp_path):
    """As transformers' ViT, the model casts the pixels to its weights' dtype: a bf16 or
    float64 model (``attnlab eval --dtype bfloat16``) takes the float32 images the task and
    ``classify`` feed it (the patch convolution refused them)."""
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16,
                                 num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=24, num_labels=3)  # fmt: skip
    transformers.ViTForImageClassification(cfg).save_pretrained(tmp_path)
    ref = transformers.ViTForImageClassification.from_pretrained(tmp_path, dtype=dtype).eval()
    model = load_hf(tmp_path, dtype=dtype)
    images = torch.rand(2, 3, 8, 8)  # float32
    with torch.no_grad():
        expected, out = ref(pixel_values=images).logits, model(images).logits
    assert out.dtype == dtype
    tol = 1e-10 if dtype == torch.float64 else 2e-2
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


def test_vit_config_errors_and_loss():
    with pytest.raises(ConfigError, match="patch_size=3 must divide"):
        ViTConfig(image_size=8, patch_size=3).validate()
    cfg = ModelConfig.from_dict(
        {
            "arch": "vit",
            "image_size": 8,
            "channels": 1,
            "patch_size": 2,
            "d_model": 16,
            "n_layers": 1,
            "n_classes": 4,
            "attention": {"n_heads": 2},
        }
    )
    model = build_model(cfg)
    assert isinstance(model, VisionTransformer) and model.pos.shape == (1, 17, 16)
    images, labels = torch.randn(5, 1, 8, 8), torch.randint(0, 4, (5,))
    out = model(images, targets=labels)
    assert out.logits.shape == (5, 4)
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(out.logits, labels))
    with pytest.raises(ValueError, match="expected images of shape"):
        model(torch.randn(2, 3, 8, 8))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int64, torch.bool])
def test_vit_refuses_integer_pixels(dtype):
    """Raw 8-bit pixels (0..255) cast to float as they are would give the logits of an
    image 255 times too bright, silently: the model asks for floating-point pixels."""
    cfg = ViTConfig(image_size=8, channels=1, patch_size=4, d_model=16, n_layers=1,
                    n_classes=3)  # fmt: skip
    cfg.attention.n_heads = 2
    model = VisionTransformer(cfg).eval()
    pixels = torch.randint(0, 256, (2, 1, 8, 8)).to(dtype)
    with pytest.raises(TypeError, match=r"images must be floating point .*got torch\."):
        model(pixels)
    model(pixels.float() / 255)  # the same pixels scaled to [0, 1] are taken


@pytest.mark.parametrize("changes", [{"norm.bias": False}, {"ffn.bias": False}])
def test_vit_export_refuses_missing_biases(changes, tmp_path):
    """transformers' ViT has LayerNorm and MLP biases: a model without them is refused
    with the reason, not a KeyError halfway through the export."""
    cfg = ViTConfig(image_size=8, patch_size=4, d_model=16, n_layers=1, n_classes=3)
    with pytest.raises(HFCheckpointError, match="ViT needs"):
        save_hf(build_model(cfg.override(changes)), tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_vit_sigmoid_mlp_is_exported(tmp_path):
    """hidden_act sigmoid (which the import reads) is written back, not refused."""
    cfg = ViTConfig(image_size=8, patch_size=4, d_model=16, n_layers=1, n_classes=3)
    model = build_model(cfg.override({"ffn.activation": "sigmoid"})).eval()
    save_hf(model, tmp_path)
    back = transformers.ViTForImageClassification.from_pretrained(tmp_path).eval()
    assert back.config.hidden_act == "sigmoid"
    images = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(
            back(pixel_values=images).logits, model(images).logits, atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("problem_type", ["multi_label_classification", "regression"])
def test_vit_head_that_is_no_single_label_classifier_is_refused(problem_type, tmp_path):
    """attnlab's ViT scores its classes by a softmax (its loss, classify): a multi-label or
    regression head is refused by name, not run as a softmax classifier."""
    cfg = transformers.ViTConfig(
        image_size=8,
        patch_size=4,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=24,
        num_labels=3,
        problem_type=problem_type,
    )
    transformers.ViTForImageClassification(cfg).save_pretrained(tmp_path)
    with pytest.raises(HFCheckpointError, match=f"problem_type='{problem_type}' is not supported"):
        load_hf(tmp_path)


def test_vit_with_one_label_is_refused_both_ways(tmp_path):
    """transformers reads num_labels 1 without a problem_type as regression (MSE loss, a
    sigmoid in its image-classification pipeline); attnlab's softmax over one class gave
    every image probability 1 and loss 0: refused on import and on export."""
    cfg = transformers.ViTConfig(image_size=8, patch_size=4, hidden_size=16,
                                 num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=24, num_labels=1)  # fmt: skip
    assert cfg.problem_type is None
    transformers.ViTForImageClassification(cfg).save_pretrained(tmp_path / "hf")
    with pytest.raises(HFCheckpointError, match="one label and no problem_type.*regression"):
        load_hf(tmp_path / "hf")
    ours = ViTConfig(image_size=8, patch_size=4, d_model=16, n_layers=1, n_classes=1)
    with pytest.raises(HFCheckpointError, match="n_classes=1"):
        save_hf(build_model(ours), tmp_path / "out")
    assert not (tmp_path / "out" / "config.json").exists()


@pytest.mark.parametrize(
    "settings",
    [
        {},  # ViTImageProcessor's defaults: mean and std 0.5
        {"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]},
        {"do_normalize": False},
        {"do_rescale": False, "image_mean": [100.0, 120.0, 90.0], "image_std": [50.0, 60, 70]},
        {"rescale_factor": 1 / 127.5, "image_mean": 1.0, "image_std": 1.0},  # [-1, 1]
    ],
)
def test_imported_normalisation_equals_the_image_processor(settings, tmp_path):
    """The folder's preprocessor_config.json (or ViTImageProcessor's defaults) gives the
    model's inputs that transformers' processor gives: normalize_pixels of pixels / 255,
    on an image already at the model's size (no resampling)."""
    from PIL import Image

    from attnlab.models.vit import normalize_pixels

    cfg = transformers.ViTConfig(image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=24)  # fmt: skip
    transformers.ViTForImageClassification(cfg).save_pretrained(tmp_path / "hf")
    processor = transformers.ViTImageProcessor(size={"height": 8, "width": 8}, **settings)
    if settings:
        processor.save_pretrained(tmp_path / "hf")
    model = load_hf(tmp_path / "hf")
    assert (model.cfg.image_mean is None) == (settings == {"do_normalize": False})
    raw = np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    want = processor(Image.fromarray(raw, "RGB"), return_tensors="pt")["pixel_values"]
    pixels = torch.from_numpy(raw.astype(np.float32) / 255).permute(2, 0, 1)[None]
    torch.testing.assert_close(normalize_pixels(pixels, model.cfg), want, atol=1e-5, rtol=1e-5)
    # export writes it back: transformers' processor of the exported folder agrees
    save_hf(model, tmp_path / "out")
    again = transformers.AutoImageProcessor.from_pretrained(tmp_path / "out")
    back = again(Image.fromarray(raw, "RGB"), return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(back, want, atol=1e-5, rtol=1e-5)
    assert load_hf(tmp_path / "out").cfg.image_mean == model.cfg.image_mean


@pytest.mark.parametrize("resample", [None, 0, 3])
def test_the_image_processors_resampling_filter_is_imported_and_exported(resample, tmp_path):
    """preprocessor_config.json's ``resample`` (absent: ViTImageProcessor's bilinear)
    becomes the config's filter, which ``classify`` resizes with; export writes it back, and
    a number that is no PIL filter is refused by name."""
    import json

    from attnlab.models.vit import RESAMPLE_FILTERS

    cfg = transformers.ViTConfig(image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=24)  # fmt: skip
    transformers.ViTForImageClassification(cfg).save_pretrained(tmp_path / "hf")
    if resample is not None:
        processor = transformers.ViTImageProcessor(
            size={"height": 8, "width": 8}, resample=resample
        )
        processor.save_pretrained(tmp_path / "hf")
    model = load_hf(tmp_path / "hf")
    want = 2 if resample is None else resample
    assert RESAMPLE_FILTERS[model.cfg.resample] == want
    save_hf(model, tmp_path / "out")
    assert transformers.AutoImageProcessor.from_pretrained(tmp_path / "out").resample == want
    assert load_hf(tmp_path / "out").cfg.resample == model.cfg.resample
    file = tmp_path / "hf" / "preprocessor_config.json"
    file.write_text(json.dumps({"image_processor_type": "ViTImageProcessor", "resample": 9}))
    with pytest.raises(HFCheckpointError, match=r"resample=9 is not one of PIL's filters"):
        load_hf(tmp_path / "hf")
    with pytest.raises(ConfigError, match="resample: unknown filter 'cubic'"):
        ViTConfig(resample="cubic").validate()


def test_vit_normalisation_config_errors():
    with pytest.raises(ConfigError, match="image_mean: give image_mean and image_std together"):
        ViTConfig(image_mean=[0.5, 0.5, 0.5]).validate()
    with pytest.raises(ConfigError, match="image_std: 2 values for channels=3"):
        ViTConfig(image_mean=[0.5] * 3, image_std=[0.5] * 2).validate()
    with pytest.raises(ConfigError, match="image_std: must be finite and > 0"):
        ViTConfig(image_mean=[0.5] * 3, image_std=[0.5, 0.0, 0.5]).validate()


@pytest.mark.parametrize("key", ["image_mean", "image_std", "rescale_factor"])
def test_processor_setting_that_is_not_a_number_is_one_clear_error(key, tmp_path):
    """A null (or text) mean, std or rescale factor in preprocessor_config.json, which
    transformers' processor refuses too, names the key (it was float()'s TypeError)."""
    import json

    cfg = transformers.ViTConfig(image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=24)  # fmt: skip
    transformers.ViTForImageClassification(cfg).save_pretrained(tmp_path)
    processor = transformers.ViTImageProcessor(size={"height": 8, "width": 8})
    settings = processor.to_dict() | {key: None}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError):  # transformers: at its first image
        image = np.zeros((8, 8, 3), dtype=np.uint8)
        transformers.AutoImageProcessor.from_pretrained(tmp_path)(image, return_tensors="pt")
    with pytest.raises(HFCheckpointError, match=f"preprocessor_config.json: {key} must be"):
        load_hf(tmp_path)


def test_fine_tuning_an_imported_vit_on_the_digits(tmp_path):
    """``attnlab train --init-from VIT_FOLDER --task image-classification``: a ViT folder
    has no tokenizer.json and the images need none; the model starts as transformers'
    (the digits normalised as its image processor would) and its classes are then the
    digits, no longer config.json's id2label."""
    from attnlab.config import RunConfig
    from attnlab.tasks.base import eval_mode
    from attnlab.training.trainer import Trainer, finetune_config

    names = {i: f"d{i}" for i in range(10)}
    cfg = transformers.ViTConfig(image_size=8, patch_size=4, num_channels=1, hidden_size=16,
                                 num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=32, id2label=names)  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.ViTForImageClassification(cfg).eval()
    ref.save_pretrained(tmp_path / "hf")
    run = finetune_config(RunConfig(model=load_hf(tmp_path / "hf").cfg))
    run.task = "image-classification"
    trainer = Trainer(run, tmp_path / "ft", init_from=tmp_path / "hf", progress=False)
    assert trainer.cfg.model.class_names is None
    images, _ = trainer.task.batch(torch.tensor([[0, 0, 0], [5, 1, 2]]))
    with eval_mode(trainer.model), torch.no_grad():
        torch.testing.assert_close(
            trainer.model(images).logits, ref(pixel_values=images).logits, atol=1e-5, rtol=1e-5
        )
