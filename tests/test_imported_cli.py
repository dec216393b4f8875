"""Imported checkpoints through the commands that run them: Hugging Face Marian, ViT and
BERT folders from tiny random transformers models, converted with ``attnlab import-hf``,
then ``translate`` (text through a tokenizer.json, or token ids), ``classify`` (class
names from id2label), ``attention-map`` and ``eval``, compared with transformers' own
outputs where there is one."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hf_cases import transformers

from attnlab.cli.main import main

PAD, EOS = 1, 2
LETTERS = "abcdefghijklmnopqrstuvwxyz0123456789.,!?"  # 40 + <unk>, <pad>, </s>: 43 tokens


def _sharpen(model) -> None:
    """Random weights larger than the init, so outputs differ clearly between inputs."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 and "embed_positions" not in name:
                p.mul_(10.0)


def _word_tokenizer(path) -> None:
    """A tokenizer.json (BPE without merges: one token per character) for 43 ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<pad>": PAD, "</s>": EOS} | {c: 3 + i for i, c in enumerate(LETTERS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


def _marian(path, **vocab) -> transformers.MarianMTModel:
    cfg = transformers.MarianConfig(
        d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48,
        max_position_embeddings=64, pad_token_id=PAD, decoder_start_token_id=PAD,
        eos_token_id=EOS, forced_eos_token_id=None, scale_embedding=True, **vocab,
    )  # fmt: skip
    model = transformers.MarianMTModel(cfg).eval()
    _sharpen(model)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """HF folders and their attnlab imports: name -> (transformers model, hf dir, ckpt dir)."""
    torch.manual_seed(0)
    out = {}
    root = tmp_path_factory.mktemp("imported")
    hf = {name: root / f"hf-{name}" for name in ("marian", "marian-sep", "vit", "bert")}
    models = {
        "marian": _marian(hf["marian"], vocab_size=43, decoder_vocab_size=43),
        "marian-sep": _marian(
            hf["marian-sep"],
            vocab_size=43,
            decoder_vocab_size=29,
            share_encoder_decoder_embeddings=False,
        ),  # fmt: skip
    }
    _word_tokenizer(hf["marian"])
    vit = transformers.ViTConfig(
        image_size=8, patch_size=2, num_channels=1, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=48,
        id2label={0: "cat", 1: "dog", 2: "owl"}, label2id={"cat": 0, "dog": 1, "owl": 2},
    )  # fmt: skip
    models["vit"] = transformers.ViTForImageClassification(vit).eval()
    bert = transformers.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=16,
    )  # fmt: skip
    models["bert"] = transformers.BertForMaskedLM(bert).eval()
    for name in ("vit", "bert"):
        _sharpen(models[name])
        models[name].save_pretrained(hf[name])
    # the pixels the ViT was "trained" on: (pixel / 255 - 0.3) / 0.2
    transformers.ViTImageProcessor(
        size={"height": 8, "width": 8}, image_mean=[0.3], image_std=[0.2]
    ).save_pretrained(hf["vit"])
    for name, model in models.items():
        ckpt = root / f"ckpt-{name}"
        assert main(["import-hf", str(hf[name]), str(ckpt)]) == 0
        out[name] = (model, hf[name], ckpt)
    return out


def test_import_records_the_task_each_model_runs(folders):
    task = {name: json.loads((c / "config.json").read_text())["task"]
            for name, (_, _, c) in folders.items()}  # fmt: skip
    assert task == {"marian": "seq2seq", "marian-sep": "seq2seq", "vit": "image-classification",
                    "bert": "mlm"}  # fmt: skip


def _greedy(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    tokens = out[0, 1:].tolist()  # drop the decoder start token
    return tokens[: tokens.index(EOS)] if EOS in tokens else tokens


def test_translate_text_with_the_imported_tokenizer(folders, capsys):
    from attnlab.tokenizers import load_tokenizer

    ref, hf, ckpt = folders["marian"]
    tokenizer = load_tokenizer(ckpt / "tokenizer.json")  # carried over by import-hf
    texts = ["hello world", "attention"]
    assert main(["translate", "--ckpt", str(ckpt), "--json", "--max-new-tokens", "8", *texts]) == 0
    got = json.loads(capsys.readouterr().out)
    for text in texts:  # Marian's convention: the source ends with </s>
        want = _greedy(ref, tokenizer.encode(text) + [EOS], 8)
        assert got[text] == tokenizer.decode(want)
    # ids in, ids out; beams run too
    assert main(["translate", "--ckpt", str(ckpt), "--source-ids", "5,6,7,2", "--max-new-tokens",
                 "8"]) == 0  # fmt: skip
    line = capsys.readouterr().out.strip()
    assert line == f"5,6,7,2\t{tokenizer.decode(_greedy(ref, [5, 6, 7, 2], 8))}"
    assert main(["translate", "--ckpt", str(ckpt), "--num-beams", "3", "abc"]) == 0
    assert capsys.readouterr().out.startswith("abc\t")


def test_translate_defaults_and_beam_options_reach_the_model(folders, capsys, monkeypatch):
    """Without --max-new-tokens a translation may fill the context (max_seq_len - 1 new
    tokens); --num-beams, --length-penalty (default 0.6), --beam-style (default gnmt) and
    --early-stopping (with transformers' style) reach the model's beam search, and the
    output is what it gives for them."""
    from attnlab.models.seq2seq import Seq2SeqModel
    from attnlab.tokenizers import load_tokenizer
    from attnlab.training.checkpoint import load_checkpoint

    seen = []
    generate = Seq2SeqModel.generate

    def spy(self, *args, **kwargs):
        seen.append(kwargs)
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(Seq2SeqModel, "generate", spy)
    ref, _, ckpt = folders["marian"]
    tokenizer = load_tokenizer(ckpt / "tokenizer.json")
    model = load_checkpoint(ckpt).model
    text = "hello world"
    ids = tokenizer.encode(text) + [EOS]
    n = model.cfg.max_seq_len - 1
    assert main(["translate", "--ckpt", str(ckpt), "--json", text]) == 0
    assert json.loads(capsys.readouterr().out)[text] == tokenizer.decode(_greedy(ref, ids, n))
    src = torch.tensor([ids])
    for options, kwargs in [
        ([], dict(length_penalty=0.6, style="gnmt", early_stopping=True)),
        (["--length-penalty", "-2", "--beam-style", "transformers"],
         dict(length_penalty=-2.0, style="transformers", early_stopping=True)),
        (["--length-penalty", "3"], dict(length_penalty=3.0, style="gnmt")),
        (["--beam-style", "transformers", "--early-stopping", "false"],
         dict(length_penalty=0.6, style="transformers", early_stopping=False)),
        (["--beam-style", "transformers", "--early-stopping", "never"],
         dict(length_penalty=0.6, style="transformers", early_stopping="never")),
    ]:  # fmt: skip
        assert main(["translate", "--ckpt", str(ckpt), "--json", "--num-beams", "3", *options,
                     text]) == 0  # fmt: skip
        assert {k: seen[-1][k] for k in ("num_beams", *kwargs)} == {"num_beams": 3, **kwargs}
        (want,) = model.generate(src, n, num_beams=3, **kwargs)
        assert json.loads(capsys.readouterr().out)[text] == tokenizer.decode(want)


def test_translate_ids_without_a_tokenizer(folders, capsys):
    ref, _, ckpt = folders["marian-sep"]  # separate vocabularies, no tokenizer.json
    assert main(["translate", "--ckpt", str(ckpt), "hello"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("attnlab: error:") and "--source-ids" in err
    args = ["translate", "--ckpt", str(ckpt), "--json", "--max-new-tokens", "8"]
    assert main([*args, "--source-ids", "40,41,3,2", "--source-ids", "9 8 2"]) == 0
    got = json.loads(capsys.readouterr().out)
    for source, ids in (("40,41,3,2", [40, 41, 3, 2]), ("9,8,2", [9, 8, 2])):
        assert got[source] == ",".join(map(str, _greedy(ref, ids, 8)))
    assert main([*args, "--source-ids", "43"]) == 1  # the source vocabulary has 43 ids
    assert "outside the model's vocabulary [0, 43)" in capsys.readouterr().err


def test_translate_with_a_source_only_tokenizer(folders, tmp_path, capsys):
    """Separate vocabularies: the 43-token tokenizer encodes the source; the output, in
    the 29-token target vocabulary, is token ids."""
    from attnlab.tokenizers import load_tokenizer

    ref, hf, _ = folders["marian-sep"]
    tokenizer_file = folders["marian"][1] / "tokenizer.json"
    ckpt = tmp_path / "ckpt"
    assert main(["import-hf", str(hf), str(ckpt), "--tokenizer", str(tokenizer_file)]) == 0
    assert main(["translate", "--ckpt", str(ckpt), "--max-new-tokens", "8", "hi there"]) == 0
    ids = load_tokenizer(tokenizer_file).encode("hi there") + [EOS]
    want = ",".join(map(str, _greedy(ref, ids, 8)))
    assert capsys.readouterr().out.splitlines()[-1] == f"hi there\t{want}"


def _image(path, seed: int = 0):
    """An 8 x 8 grayscale PNG at ``path``; returns the PIL image."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8), "L")
    image.save(path)
    return image


@pytest.mark.parametrize("which", ["ckpt", "hf"])
def test_classify_names_classes_from_id2label(folders, tmp_path, capsys, which):
    """Classes, names and probabilities as transformers gives them for the folder's own
    image processor (its normalisation: without it the pixels were off by -0.3 / 0.2)."""
    ref, hf, ckpt = folders["vit"]
    folder = ckpt if which == "ckpt" else hf  # the imported checkpoint, or the HF folder
    paths = [tmp_path / f"{i}.png" for i in range(3)]
    images = [_image(p, seed=i) for i, p in enumerate(paths)]
    processor = transformers.AutoImageProcessor.from_pretrained(hf)
    with torch.no_grad():
        probs = ref(**processor(images, return_tensors="pt")).logits.softmax(-1)
    want = probs.argmax(-1).tolist()
    assert main(["classify", "--ckpt", str(folder), "--json", *map(str, paths)]) == 0
    report = json.loads(capsys.readouterr().out)
    names = ["cat", "dog", "owl"]
    for path, cls, row in zip(paths, want, probs):
        assert report[str(path)]["class"] == cls and report[str(path)]["label"] == names[cls]
        assert report[str(path)]["top"][0][1] == pytest.approx(float(row.max()), abs=1e-3)
    assert main(["classify", "--ckpt", str(folder), str(paths[0])]) == 0
    assert capsys.readouterr().out.split("\t")[1] == names[want[0]]


def test_classify_invert_reads_one_minus_each_pixel(folders, tmp_path, capsys):
    from PIL import ImageOps

    _, _, ckpt = folders["vit"]
    path = str(tmp_path / "x.png")
    ImageOps.invert(_image(path, seed=3)).save(tmp_path / "inverted.png")
    reports = []
    for argv in ([path, "--invert"], [str(tmp_path / "inverted.png")]):
        assert main(["classify", "--ckpt", str(ckpt), "--json", "--top", "3", *argv]) == 0
        (report,) = json.loads(capsys.readouterr().out).values()
        reports.append(report)
    assert reports[0] == reports[1]
    assert main(["classify", "--ckpt", str(ckpt), "--json", "--top", "3", path]) == 0
    (plain,) = json.loads(capsys.readouterr().out).values()
    assert plain["top"] != reports[0]["top"]  # inverting changes what the model sees


def test_attention_map_of_imported_models(folders, tmp_path, capsys):
    from PIL import Image

    image = tmp_path / "x.png"
    _image(image)
    runs = {
        "vit": ["--image", str(image)],
        "marian": ["--text", "abc", "--target", "xy"],
        "marian-sep": ["--ids", "40,41,2", "--target-ids", "27,28"],
        "bert": ["--ids", "2,7,9,3"],
    }
    for name, extra in runs.items():
        out = tmp_path / f"{name}.png"
        assert main(["attention-map", "--ckpt", str(folders[name][2]), "--out", str(out),
                     "--heads", "0", *extra]) == 0, capsys.readouterr().err  # fmt: skip
        with Image.open(out) as png:
            assert png.format == "PNG"
    capsys.readouterr()
    bad = {
        "vit": (["--text", "abc"], "give the image with --image FILE"),
        "bert": (["--text", "abc"], "has no tokenizer.json"),
        "marian-sep": (["--text", "abc"], "--ids"),
    }
    for name, (extra, message) in bad.items():
        args = ["attention-map", "--ckpt", str(folders[name][2]), "--out", str(tmp_path / "b.png")]
        assert main([*args, *extra]) == 1
        err = capsys.readouterr().err
        assert err.startswith("attnlab: error:") and message in err


def test_eval_refuses_data_an_imported_model_never_saw(folders, capsys):
    assert main(["eval", "--ckpt", str(folders["vit"][2])]) == 1
    err = capsys.readouterr().err
    assert "n_classes=3" in err and "image-classification" in err and err.count("\n") == 1


def test_eval_of_an_imported_digits_vit(tmp_path, capsys):
    """A ViT shaped for the digits task (an attnlab export, re-imported) evaluates on the
    digits as the task itself measures it."""
    from attnlab.config import RunConfig
    from attnlab.interop import save_hf
    from attnlab.models.vit import VisionTransformer, vit_digits
    from attnlab.tasks import get_task

    model = VisionTransformer(vit_digits()).eval()
    save_hf(model, tmp_path / "hf")
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    assert main(["eval", "--ckpt", str(tmp_path / "ckpt"), "--max-batches", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    cfg = RunConfig(model=model.cfg, task="image-classification")
    want = get_task(cfg.task)(cfg).evaluate(model, batch_size=cfg.train.batch_size, max_batches=1)
    assert report["task"] == "image-classification"
    assert report["accuracy"] == pytest.approx(want["accuracy"])
    assert report["loss"] == pytest.approx(want["loss"], rel=1e-5)


@pytest.mark.parametrize("mode, channels", [("L", 1), ("LA", 2), ("RGB", 3), ("RGBA", 4)])
def test_8_bit_images_of_every_mode_scale_to_0_1(tmp_path, mode, channels):
    """Pixels are divided by 255 for every 8-bit mode (with or without alpha), not clamped."""
    from PIL import Image

    from attnlab.cli.classify import load_image

    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (8, 8, channels), dtype=np.uint8)
    Image.fromarray(raw[..., 0] if channels == 1 else raw, mode).save(tmp_path / "x.png")
    x = load_image(str(tmp_path / "x.png"), channels, 8, 8)
    want = torch.from_numpy(raw.astype(np.float32) / 255).permute(2, 0, 1)
    torch.testing.assert_close(x, want)


@pytest.mark.parametrize("resample", ["nearest", "bilinear", "bicubic", "lanczos"])
@pytest.mark.parametrize("mode, size", [("RGB", (9, 7)), ("RGB", (40, 30)), ("L", (13, 21))])
def test_images_of_another_size_are_resized_as_the_image_processor_does(
    tmp_path, resample, mode, size
):
    """Resized with the config's PIL filter on the 8-bit pixels, then scaled and normalised:
    the pixel values transformers' ViTImageProcessor gives with that ``resample``."""
    from PIL import Image
    from transformers import ViTImageProcessor

    from attnlab.cli.classify import load_image
    from attnlab.models.vit import RESAMPLE_FILTERS

    channels = 3 if mode == "RGB" else 1
    raw = np.random.default_rng(1).integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    image = Image.fromarray(raw[..., 0] if channels == 1 else raw, mode)
    image.save(tmp_path / "x.png")
    processor = ViTImageProcessor(
        size={"height": 16, "width": 12},
        resample=RESAMPLE_FILTERS[resample],
        image_mean=[0.5] * channels,
        image_std=[0.25] * channels,
    )
    want = processor(image, return_tensors="pt", input_data_format="channels_last")
    x = load_image(str(tmp_path / "x.png"), channels, 16, 12, resample)
    torch.testing.assert_close((x - 0.5) / 0.25, want["pixel_values"][0], rtol=0, atol=1e-6)


def test_a_folder_given_as_an_image_is_named_as_one(tmp_path):
    from attnlab.cli.classify import load_image
    from attnlab.cli.common import CLIError

    with pytest.raises(CLIError, match="a folder; give image files"):
        load_image(str(tmp_path), 3, 8, 8)
    with pytest.raises(CLIError, match="no such file"):
        load_image(str(tmp_path / "x.png"), 3, 8, 8)
    # it is there: was "/dev/null: no such file"
    with pytest.raises(CLIError, match="^/dev/null: a character device, not an image file"):
        load_image("/dev/null", 3, 8, 8)


def test_one_bit_and_16_bit_images_resize_to_0_1(tmp_path):
    from PIL import Image

    from attnlab.cli.classify import load_image

    bits = np.random.default_rng(2).integers(0, 2, (10, 6)).astype(bool)
    Image.fromarray(bits).save(tmp_path / "b.png")
    same = load_image(str(tmp_path / "b.png"), 1, 10, 6)
    torch.testing.assert_close(same, torch.from_numpy(bits.astype(np.float32))[None])
    nearest = load_image(str(tmp_path / "b.png"), 1, 20, 12, "nearest")
    want = torch.from_numpy(bits.astype(np.float32)).repeat_interleave(2, 0).repeat_interleave(2, 1)
    torch.testing.assert_close(nearest, want[None])
    deep = np.random.default_rng(3).integers(0, 65536, (10, 6)).astype(np.uint16)
    Image.fromarray(deep).save(tmp_path / "d.png")
    x = load_image(str(tmp_path / "d.png"), 1, 20, 12, "nearest")
    want = torch.from_numpy(deep.astype(np.float32) / 65535).repeat_interleave(2, 0)
    torch.testing.assert_close(x, want.repeat_interleave(2, 1)[None])


@pytest.mark.parametrize("mode, channels", [("RGBA", 3), ("L", 3), ("RGB", 1), ("RGBA", 2)])
def test_wrong_channel_count_names_the_conversion_that_fits(tmp_path, mode, channels):
    """The error's advice works: the image converted as it says loads (it said
    convert('L') whatever the model took, which an RGB model refuses in turn)."""
    import re

    from PIL import Image

    from attnlab.cli.classify import load_image
    from attnlab.cli.common import CLIError

    Image.new(mode, (8, 8)).save(tmp_path / "x.png")
    with pytest.raises(CLIError, match="Convert it") as info:
        load_image(str(tmp_path / "x.png"), channels, 8, 8)
    have = {"RGBA": "4 channels", "RGB": "3 channels", "L": "1 channel"}[mode]
    assert f"an image of mode {mode} ({have}); the model takes" in str(info.value)
    to = re.search(r"image\.convert\('(\w+)'\)", str(info.value)).group(1)
    Image.open(tmp_path / "x.png").convert(to).save(tmp_path / "y.png")
    assert load_image(str(tmp_path / "y.png"), channels, 8, 8).shape == (channels, 8, 8)


@pytest.mark.parametrize("case", ["exif-rotated", "ycbcr"])
def test_images_read_as_transformers_pipeline_reads_them(tmp_path, case):
    """As transformers' image-classification pipeline (image_utils.load_image): a photo's
    EXIF orientation is applied (it was classified on its side) and a YCbCr file's pixels
    become R, G, B (they were fed as luma and chroma)."""
    import PIL
    from PIL import Image
    from transformers.image_utils import load_image as hf_load_image

    from attnlab.cli.classify import load_image

    raw = np.random.default_rng(0).integers(0, 256, (8, 12, 3), dtype=np.uint8)
    image = Image.fromarray(raw, "RGB")
    if case == "exif-rotated":
        path, exif = tmp_path / "x.png", Image.Exif()
        exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to view
        image.save(path, exif=exif)
    else:
        path = tmp_path / "x.tiff"
        image.convert("YCbCr").save(path)
        try:  # Pillow before 13 (the last for Python 3.10 is 12.3) cannot read this file back
            Image.open(path).load()
        except OSError as e:
            pytest.skip(f"this Pillow {PIL.__version__} cannot read the YCbCr TIFF it wrote ({e})")
    want = np.asarray(hf_load_image(str(path)), dtype=np.float32) / 255  # (H, W, 3)
    h, w = want.shape[:2]
    assert (h, w) == ((12, 8) if case == "exif-rotated" else (8, 12))
    x = load_image(str(path), 3, h, w)
    torch.testing.assert_close(x, torch.from_numpy(want).permute(2, 0, 1))
