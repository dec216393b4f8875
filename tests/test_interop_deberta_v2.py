"""DeBERTa-v2/v3 and disentangled attention: the log buckets equal transformers'
``make_log_bucket_position`` (and the paper's delta unbucketed); the attention module's
scores equal a per-query loop; transformers ``DebertaV2ForMaskedLM`` / ``DebertaV2Model``
models from tiny random configs (v2-like: separate position projections, absolute positions;
v3-like: shared projections, log buckets, normed relative embeddings; legacy and new
masked-LM heads), loaded with ``load_hf``, give the same hidden states and logits on
padded batches, the same loss and gradients; attnlab models saved with ``save_hf`` load in
transformers with the same outputs and load back exactly; what neither side holds is
refused by name; the published presets' sizes are transformers'.

Shapes: b batch, h heads, t length, d_h head dim, V vocabulary.
"""

from __future__ import annotations

import json

import pytest
import torch
from hf_cases import transformers
from oracle import deberta_row_paper, disentangled_scores, randomize_weights

from attnlab.config import ConfigError, PositionConfig
from attnlab.functional.buckets import log_bucket_positions
from attnlab.interop import HFCheckpointError, config_from_hf, hf_model_type, load_hf, save_hf
from attnlab.models.encoder import EncoderModel, mask_tokens
from attnlab.nn.disentangled import relative_rows
from attnlab.presets import get_preset

V = 61
# float32, the two libraries' operations in other orders (observed up to 8.5e-6 on logits ~7)
TOL = 1e-5
_BASE = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             relative_attention=True, hidden_dropout_prob=0.0,
             attention_probs_dropout_prob=0.0)  # fmt: skip
CASES = {
    # DeBERTa-v2's base layout: separate position projections, absolute positions on the
    # embeddings, relative positions unbucketed within 12, two token types
    "v2": dict(_BASE, pos_att_type=["c2p", "p2c"], position_biased_input=True,
               type_vocab_size=2, max_position_embeddings=40, max_relative_positions=12),
    # DeBERTa-v3's: shared projections, "p2c|c2p", log buckets (8 per side up to 20),
    # LayerNormed relative embeddings, no absolute positions, three layers
    "v3": dict(_BASE, num_hidden_layers=3, pos_att_type="p2c|c2p", share_att_key=True,
               position_buckets=8, max_relative_positions=20, norm_rel_ebd="layer_norm",
               position_biased_input=False, max_position_embeddings=40),
    # one term (c2p only), its own projection, the new masked-LM head (legacy=false), eps
    # large enough to matter
    "c2p-new-head": dict(_BASE, pos_att_type=["c2p"], position_buckets=6,
                         max_relative_positions=16, norm_rel_ebd="layer_norm",
                         position_biased_input=False, legacy=False, layer_norm_eps=0.05,
                         max_position_embeddings=40),
}  # fmt: skip


def _hf_model(case: str, name: str = "DebertaV2ForMaskedLM", seed: int = 0, **changes):
    torch.manual_seed(seed)
    cfg = transformers.DebertaV2Config(vocab_size=V, **{**CASES[case], **changes})
    model = getattr(transformers, name)(cfg)
    randomize_weights(model, seed, std=0.3, norms=(0.5, 1.5),
                      is_norm=lambda n, p: "LayerNorm.weight" in n)  # fmt: skip
    return model.eval()


def _batch(seed: int = 0, t: int = 30):
    """(3, t) ids (never the padding id 0) and their mask: row 1 right-padded to 20 real
    tokens, row 2 left-padded to 23 (longer than the buckets' exact range)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(1, V, (3, t), generator=g)
    mask = torch.ones_like(idx)
    mask[1, 20:] = 0
    mask[2, :7] = 0
    return idx.masked_fill(mask == 0, 0), mask


@pytest.fixture(scope="module", params=list(CASES))
def imported(request, tmp_path_factory):
    case = request.param
    ref = _hf_model(case, seed=len(case))
    path = tmp_path_factory.mktemp(case)
    ref.save_pretrained(path)
    return case, ref, load_hf(path)


# --------------------------------------------------------------------------- the mechanism


def test_log_buckets_equal_transformers_and_the_paper():
    make = transformers.models.deberta_v2.modeling_deberta_v2.make_log_bucket_position
    relative = torch.arange(-2000, 2001)
    for buckets, max_distance in ((256, 512), (8, 20), (6, 16), (16, 128), (2, 5)):
        want = make(relative, buckets, max_distance).long()
        got = log_bucket_positions(relative, buckets=buckets, max_distance=max_distance)
        assert torch.equal(got, want)
        mid = buckets // 2
        near = relative.abs() <= mid  # exact within mid; odd; |r| = max - 1 on 2 mid - 1
        assert torch.equal(got[near], relative[near])
        assert torch.equal(got, -got.flip(0))
        assert log_bucket_positions(torch.tensor([max_distance - 1]), buckets=buckets,
                                    max_distance=max_distance).item() == 2 * mid - 1  # fmt: skip
    # unbucketed: the paper's delta(i, j) = clamp(i - j + k, 0, 2k - 1)
    cfg = PositionConfig(kind="disentangled", disentangled_buckets=0, disentangled_max_distance=5)
    pos = torch.arange(14)[None]
    rows = relative_rows(pos, pos, cfg)[0]
    want = [[deberta_row_paper(i - j, 5) for j in range(14)] for i in range(14)]
    assert rows.tolist() == want


@pytest.mark.parametrize("case", list(CASES))
def test_scores_equal_a_loop_over_queries(case):
    """The module's attention output equals softmax over the per-pair loop's scores."""
    cfg = config_from_hf(_hf_model(case).config.to_dict())
    torch.manual_seed(0)
    model = EncoderModel(cfg).eval()
    randomize_weights(model, 1, std=0.3, norms=(0.5, 1.5))
    attn = model.blocks[0].attn
    x = torch.randn(2, 11, cfg.d_model)
    pos = torch.arange(11)[None]
    rel = model.pos_bias(pos, pos)
    q, k, v = (t.view(2, 11, 4, -1).transpose(1, 2) for t in attn.qkv(x).split(32, dim=-1))
    terms = cfg.position.disentangled_terms
    pk = attn._position_heads(rel.embeddings, "key") if "c2p" in terms else None
    pq = attn._position_heads(rel.embeddings, "query") if "p2c" in terms else None
    scores = disentangled_scores(q, k, pk, pq, rel.rows[0])
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, 8:] = False
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    want = attn.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 11, 32))
    with torch.no_grad():
        got = attn(x, mask=mask[:, None, None, :], bias=rel)
    assert (got - want).abs().max() <= TOL


# --------------------------------------------------------------------------- import


def test_import_config(imported):
    case, ref, model = imported
    cfg, hf = model.cfg, ref.config
    assert model.num_parameters() == ref.num_parameters()
    assert config_from_hf(hf.to_dict()) == cfg
    assert hf_model_type(cfg) == "deberta-v2"
    pos = cfg.position
    assert pos.kind == "disentangled" and pos.disentangled_absolute == hf.position_biased_input
    assert pos.disentangled_share_key == getattr(hf, "share_att_key", False)
    assert sorted(pos.disentangled_terms) == sorted(hf.pos_att_type)


@pytest.mark.parametrize("head", ["DebertaV2ForMaskedLM", "DebertaV2Model"])
def test_import_outputs_with_padding(imported, head, tmp_path):
    """Masked-LM logits (and, from the base model, hidden states) at the real tokens of a
    right- and left-padded batch (token types where the model has two)."""
    case, ref, model = imported
    if head == "DebertaV2Model":
        ref.deberta.save_pretrained(tmp_path)
        ref, model = ref.deberta, load_hf(tmp_path)
    idx, mask = _batch()
    kw = {}
    if ref.config.type_vocab_size > 1:
        kw["token_type_ids"] = torch.randint(0, 2, idx.shape, generator=torch.Generator())
    with torch.no_grad():
        out = ref(input_ids=idx, attention_mask=mask, **kw)
        theirs = out.logits if head.endswith("MaskedLM") else out.last_hidden_state
        ours = model(idx, attention_mask=mask, **kw).logits
    real = mask.bool()
    assert theirs.abs().max() > 1.0
    assert (ours[real] - theirs[real]).abs().max() <= TOL
    # a padded row's real tokens as the row alone (relative positions from its first token)
    with torch.no_grad():
        alone = model(idx[1:2, :20], **{k: v[1:2, :20] for k, v in kw.items()}).logits
    assert (ours[1:2, :20] - alone).abs().max() <= TOL


def test_loss_and_gradients_match_transformers(tmp_path):
    """A masked-LM loss backward in training mode (dropout off) on a padded batch: the loss
    and the gradients of the embeddings, the relative table and its norm, a block's
    projections (position ones included), the head's."""
    ref = _hf_model("v2", seed=3).train()
    ref.save_pretrained(tmp_path)
    model = load_hf(tmp_path).train()
    idx, mask = _batch(seed=2)
    g = torch.Generator().manual_seed(7)
    targets = torch.where(torch.rand(idx.shape, generator=g) < 0.4, idx, -100)
    targets = targets.masked_fill(mask == 0, -100)
    ours = model(idx, attention_mask=mask, targets=targets).loss
    theirs = ref(input_ids=idx, attention_mask=mask, labels=targets).loss
    ours.backward()
    theirs.backward()
    assert abs(ours.item() - theirs.item()) <= TOL
    d, enc = ref.deberta, ref.deberta.encoder
    layer, block = enc.layer[1].attention, model.blocks[1]
    pairs = [
        (model.tok_emb.weight.grad, d.embeddings.word_embeddings.weight.grad),
        (model.pos_emb.weight.grad, d.embeddings.position_embeddings.weight.grad),
        (model.pos_bias.embeddings.weight.grad, enc.rel_embeddings.weight.grad),
        (block.attn.qkv.weight.grad[32:64], layer.self.key_proj.weight.grad),
        (block.attn.pos_key.weight.grad, layer.self.pos_key_proj.weight.grad),
        (block.attn.pos_query.weight.grad, layer.self.pos_query_proj.weight.grad),
        (block.attn.out.weight.grad, layer.output.dense.weight.grad),
        (model.head.transform.weight.grad, ref.cls.predictions.transform.dense.weight.grad),
    ]
    for got, want in pairs:
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


HEADS = {
    "DebertaV2ForSequenceClassification": lambda o: o.logits,
    "DebertaV2ForTokenClassification": lambda o: o.logits,
    "DebertaV2ForQuestionAnswering": lambda o: torch.stack((o.start_logits, o.end_logits), -1),
}


@pytest.mark.parametrize("name", list(HEADS))
@pytest.mark.parametrize("case", ["v2", "v3"])
def test_classifier_heads_match_transformers(case, name, tmp_path):
    """Sequence (ContextPooler: dense -> pooler_hidden_act, here ReLU where the layers run
    GELU), token and QA logits on a padded batch; the sequence head's loss and its pooler's
    gradient in training mode (dropout off); export -> from_pretrained -> the same logits."""
    labels = 2 if name.endswith("QuestionAnswering") else 3
    ref = _hf_model(case, name, seed=5, num_labels=labels, pooler_hidden_act="relu")
    ref.save_pretrained(tmp_path / "hf")
    model = load_hf(tmp_path / "hf")
    head = model.cfg.head
    assert (head == "sequence") == (model.cfg.head_activation == "relu")
    idx, mask = _batch(seed=4)
    real = mask.bool()
    with torch.no_grad():
        theirs = HEADS[name](ref(input_ids=idx, attention_mask=mask))
        ours = model(idx, attention_mask=mask).logits
    assert theirs.abs().max() > 0.5
    # the sequence head pools the first token: compare the rows where it is real (a
    # left-padded row pools a padding token, whose state DeBERTa gives by masking its
    # query row and zeroing its embedding, where attnlab masks padding as keys only)
    first_real = mask[:, 0].bool()
    pick = (lambda t: t[first_real]) if head == "sequence" else (lambda t: t[real])
    assert (pick(ours) - pick(theirs)).abs().max() <= TOL
    if head == "sequence":
        rows, targets = (idx[first_real], mask[first_real]), torch.tensor([0, 2])
        ref.train(), model.train()
        want = ref(input_ids=rows[0], attention_mask=rows[1], labels=targets).loss
        got = model(rows[0], attention_mask=rows[1], targets=targets).loss
        want.backward(), got.backward()
        assert abs(got.item() - want.item()) <= TOL
        torch.testing.assert_close(
            model.head.pooler.weight.grad, ref.pooler.dense.weight.grad, atol=1e-4, rtol=1e-4
        )
        model.eval()
    save_hf(model, tmp_path / "out")
    again = getattr(transformers, name).from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        exported = HEADS[name](again(input_ids=idx, attention_mask=mask))
    assert (pick(exported) - pick(theirs)).abs().max() <= TOL
    assert load_hf(tmp_path / "out").cfg == model.cfg


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"relative_attention": False}, "relative_attention=false"),
        ({"pos_att_type": ["p2p", "c2p"]}, "pos_att_type=['p2p', 'c2p']"),
        ({"conv_kernel_size": 3}, "conv_kernel_size=3"),
        ({"embedding_size": 16}, "embedding_size=16"),
        ({"norm_rel_ebd": "other"}, "norm_rel_ebd='other'"),
        ({"architectures": ["DebertaV2ForMultipleChoice"]}, "DebertaV2ForMultipleChoice"),
        ({"pooler_hidden_size": 16}, "pooler_hidden_size=16"),
    ],
)  # fmt: skip
def test_import_refuses_what_attnlab_cannot_hold_by_name(changes, named):
    hf = {"model_type": "deberta-v2", "vocab_size": V, **CASES["v3"], **changes}
    with pytest.raises(HFCheckpointError, match=__import__("re").escape(named)):
        config_from_hf(hf)


# --------------------------------------------------------------------------- export


def _tiny(**changes):
    return get_preset("deberta-v3-tiny").override({"vocab_size": V, "max_seq_len": 40, **changes})


EXPORTS = {
    "deberta-v3-tiny": _tiny(),
    "v2-like": _tiny(**{"position.disentangled_share_key": False,
                        "position.disentangled_absolute": True, "position.disentangled_norm":
                        False, "position.disentangled_buckets": 0,
                        "position.disentangled_max_distance": 9, "type_vocab_size": 2}),
    "p2c-untied": _tiny(**{"position.disentangled_terms": ["p2c"], "tie_embeddings": False,
                           "position.disentangled_share_key": False}),
    "base-model": _tiny(head="none"),
    "sequence": _tiny(head="sequence", n_labels=3, label_names=["a", "b", "c"]),
}  # fmt: skip


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_round_trip(name, tmp_path):
    cfg = EXPORTS[name]
    torch.manual_seed(20)
    model = EncoderModel(cfg).eval()
    randomize_weights(model, len(name), std=0.3, norms=(0.5, 1.5))
    assert hf_model_type(cfg) == "deberta-v2"
    save_hf(model, tmp_path)
    cls = {"mlm": "DebertaV2ForMaskedLM", "sequence": "DebertaV2ForSequenceClassification"}
    ref = getattr(transformers, cls.get(cfg.head, "DebertaV2Model")).from_pretrained(tmp_path)
    idx, mask = _batch(seed=5)
    with torch.no_grad():
        ours = model(idx, attention_mask=mask).logits
        out = ref.eval()(input_ids=idx, attention_mask=mask)
    theirs = out.last_hidden_state if cfg.head == "none" else out.logits
    real = mask.bool() if cfg.head != "sequence" else mask[:, 0].bool()  # (pooled: 1st real)
    assert ours.abs().max() > 1.0
    assert (ours[real] - theirs[real]).abs().max() <= TOL
    back = load_hf(tmp_path)  # import(export(x)): the same config and weights
    assert back.cfg == cfg
    theirs_sd, ours_sd = back.state_dict(), model.state_dict()
    assert theirs_sd.keys() == ours_sd.keys()
    assert all(torch.equal(theirs_sd[k], ours_sd[k]) for k in ours_sd)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["relative_attention"] and written["conv_kernel_size"] == 0


@pytest.mark.parametrize(
    "changes, named",
    [
        (
            {"head": "sequence", "classifier_transform": "bert"},
            "classifier_transform='bert' (DeBERTa's is 'context_pooler')",
        ),
        ({"norm.placement": "pre"}, "DeBERTa uses post-norm LayerNorm"),
        ({"head_activation": "relu"}, "head_activation='relu'"),
    ],
)
def test_export_refuses_what_deberta_lacks_by_name(changes, named):
    with pytest.raises(HFCheckpointError, match=__import__("re").escape(named)):
        hf_model_type(_tiny(**changes))


def test_config_refuses_disentangled_settings_it_cannot_run():
    with pytest.raises(ConfigError, match="attention.sliding_window"):
        _tiny(**{"attention.sliding_window": 4}).validate()
    with pytest.raises(ConfigError, match="disentangled_max_distance"):
        _tiny(**{"position.disentangled_max_distance": 8}).validate()
    with pytest.raises(ConfigError, match="disentangled_absolute"):
        _tiny(**{"position.kind": "learned", "position.disentangled_absolute": True}).validate()
    with pytest.raises(ConfigError, match="attention.clip_qkv: is not implemented by "):
        _tiny(**{"attention.clip_qkv": 1e-3}).validate()  # (it would clamp nothing)
    for name, value in [("disentangled_share_key", False), ("disentangled_norm", False),
                        ("disentangled_buckets", 64), ("disentangled_terms", ["c2p"]),
                        ("disentangled_max_distance", 128)]:  # fmt: skip
        with pytest.raises(ConfigError, match=f"position.{name}: needs position.kind "):
            # (learned positions: the field would do nothing)
            get_preset("bert-tiny-qa").override({f"position.{name}": value}).validate()


@pytest.mark.parametrize(
    "name", ["deberta-v3-xsmall", "deberta-v3-small", "deberta-v3-base", "deberta-v3-large"]
)
def test_published_preset_sizes_are_transformers(name):
    from attnlab.interop import config_to_hf

    cfg = get_preset(name)
    hf = {k: v for k, v in config_to_hf(cfg).items()
          if k not in ("model_type", "architectures", "transformers_version", "dtype",
                       "torch_dtype")}  # fmt: skip
    with torch.device("meta"):
        ours = EncoderModel(cfg).num_parameters()
        theirs = transformers.DebertaV2ForMaskedLM(transformers.DebertaV2Config(**hf))
    assert ours == theirs.num_parameters()


def test_tiny_preset_learns_a_fixed_batch():
    """deberta-v3-tiny: a few AdamW steps on one masked batch lower its loss, the relative
    table and its norm receiving gradients."""
    cfg = get_preset("deberta-v3-tiny").override({"vocab_size": V, "max_seq_len": 40})
    torch.manual_seed(0)
    model = EncoderModel(cfg).train()
    idx, mask = _batch(seed=9)
    g = torch.Generator().manual_seed(9)
    inputs, targets = mask_tokens(
        idx, mask_id=V - 1, vocab_size=V, mask_prob=0.3, special=mask == 0, generator=g
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = model(inputs, attention_mask=mask, targets=targets).loss
        opt.zero_grad()
        loss.backward()
        assert model.pos_bias.embeddings.weight.grad.abs().max() > 0
        assert model.pos_bias.norm.weight.grad.abs().max() > 0
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
