"""ModernBERT (``model_type`` modernbert) <-> attnlab
:class:`~attnlab.models.encoder.EncoderModel`; the head follows config.json's
``architectures``: ``ModernBertForMaskedLM`` (mlm), ``ModernBertForSequenceClassification``
(sequence), ``ModernBertForTokenClassification`` (token), ``ModernBertForQuestionAnswering``
(qa), ``ModernBertModel`` (none). ``ModernBertForMultipleChoice`` is refused by name (attnlab
has no multiple-choice head). Labels, ``problem_type`` and the task an imported head serves
as bert.py's.

ModernBERT (Warner et al. 2024) is BERT's encoder rebuilt as a modern decoder's stack:

- pre-norm blocks (norm.placement ``pre``) with LayerNorms without bias (``norm_bias``:
  ``norm.bias``), a LayerNorm on the embeddings (``embedding_norm``) and a final one, and no
  norm before the first layer's attention (``first_attn_norm`` false: its input is the
  normed embeddings); no position embeddings and no token types;
- RoPE (split halves), base ``global_rope_theta`` on the global layers and
  ``local_rope_theta`` on the local ones (``position.local_rope_theta``; transformers 5 keeps
  both in ``rope_parameters`` by layer type), plain RoPE only;
- every ``global_attn_every_n_layers``-th layer global, from layer 0 (layer i global when
  i % n == 0: attention.layer_pattern ``G`` + ``L`` * (n - 1)), or transformers 5's
  ``layer_types``; the local layers attend to the keys within ``local_attention // 2``
  positions on either side of the query, as transformers masks them (|q - k| <=
  local_attention // 2), which is attnlab's bidirectional window of ``sliding_window`` =
  local_attention // 2 + 1 (|q - k| < sliding_window). Export writes local_attention =
  2 (sliding_window - 1): an odd local_attention reads as the even one below it, the same
  mask;
- a GeGLU feed-forward: ``Wi`` holds [input; gate] and the output is Wo(act(input) * gate),
  which is attnlab's ``glu`` with gate_up = Wi (attnlab's "gate" is the activated half);
  ``attention_bias`` and ``mlp_bias`` (none in the published models);
- every head starts with ``head.dense`` (bias ``classifier_bias``: ``head_bias``) ->
  ``classifier_activation`` (``head_activation``) -> ``head.norm``
  (``classifier_transform='dense_act_norm'``); the masked-LM decoder is tied to the token
  embedding (``tie_word_embeddings``) with a bias when ``decoder_bias``; the sequence
  classifier pools the first token or the mean of the real tokens (``classifier_pooling``:
  ``pooling``).

transformers computes unpadded batches (4.x) or masks the padding (5.x): either way the
real tokens' outputs are those of the padded computation, which attnlab does.

Dropout: ModernBERT drops inside its MLP (before Wo) and after the attention output, which
attnlab's residual dropout does not match: non-zero ``embedding_dropout``, ``mlp_dropout``
or ``attention_dropout`` are refused by name (the published models train without), and
export writes zeros (a model with dropout is refused). ``classifier_dropout`` is the heads'
``classifier_dropout``. Runtime settings that change no result are read and ignored:
``deterministic_flash_attn``, ``reference_compile``, ``repad_logits_with_grad``,
``sparse_prediction`` (logits at the masked positions only; the same loss),
``initializer_cutoff_factor`` (initialisation).

Layouts, HF (``model.`` under a head) -> attnlab:

    embeddings.tok_embeddings, embeddings.norm   -> tok_emb, emb_norm
    layers.{i}.attn_norm (i > 0)                 -> blocks.{i}.attn_norm
    layers.{i}.attn.Wqkv, attn.Wo                -> blocks.{i}.attn.qkv, attn.out
    layers.{i}.mlp_norm, mlp.Wi, mlp.Wo          -> blocks.{i}.ffn_norm, ffn.gate_up, ffn.down
    final_norm                                   -> norm
    head.dense, head.norm                        -> head.transform, head.norm
    decoder (bias)                               -> head.decoder (tied), head.bias
    classifier                                   -> head.classifier (qa: head.span)

Shapes: d d_model, V vocabulary size.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from attnlab.config import AttentionConfig, FFNConfig, ModelConfig, NormConfig, PositionConfig
from attnlab.interop.bert import shared_problems
from attnlab.interop.io import (
    LAYER_TYPES,
    NAMED_HEADS,
    TASK_OF_HEAD,
    Family,
    HFCheckpointError,
    Plan,
    Source,
    Specs,
    activation,
    dtype_entries,
    exported_label_names,
    get,
    hf_activation,
    label_entries,
    label_names,
    n_labels,
    numbered,
    periodic_layer_types,
    prefix,
    rope_settings,
    unplan,
    unrepresentable,
    windows_of_layer_types,
)
from attnlab.models.encoder import PROBLEM_TYPES, EncoderConfig

HEAD_ARCHITECTURES = {
    "ModernBertForMaskedLM": "mlm",
    "ModernBertModel": "none",
    "ModernBertForSequenceClassification": "sequence",
    "ModernBertForTokenClassification": "token",
    "ModernBertForQuestionAnswering": "qa",
}
ARCHITECTURES = {"modernbert": tuple(HEAD_ARCHITECTURES)}
ARCHITECTURE_OF_HEAD = {head: arch for arch, head in HEAD_ARCHITECTURES.items()}

# transformers' ModernBertConfig class defaults for the config.json keys read here.
DEFAULTS: dict[str, dict[str, Any]] = {
    "modernbert": {
        "vocab_size": 50368,
        "hidden_size": 768,
        "intermediate_size": 1152,
        "num_hidden_layers": 22,
        "num_attention_heads": 12,
        "hidden_activation": "gelu",
        "max_position_embeddings": 8192,
        "initializer_range": 0.02,
        "norm_eps": 1e-5,
        "norm_bias": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "local_attention": 128,
        "embedding_dropout": 0.0,
        "mlp_bias": False,
        "mlp_dropout": 0.0,
        "decoder_bias": True,
        "classifier_pooling": "cls",
        "classifier_dropout": 0.0,
        "classifier_bias": False,
        "classifier_activation": "gelu",
        "tie_word_embeddings": True,
    },
}
# ModernBertConfig's keyword-only settings (not in the table: not arguments of its class):
# without layer_types every global_attn_every_n_layers-th layer is global; the RoPE bases
# without rope_parameters (its default_theta)
GLOBAL_ATTN_EVERY_N_LAYERS = 3
DEFAULT_THETA = {"full_attention": 160_000.0, "sliding_attention": 10_000.0}
_THETA_KEYS = {"full_attention": "global_rope_theta", "sliding_attention": "local_rope_theta"}
_DROPOUTS = ("embedding_dropout", "mlp_dropout", "attention_dropout")
_SPECIAL_TOKENS = ("pad_token_id", "bos_token_id", "eos_token_id", "cls_token_id", "sep_token_id")
# transformers' rotary buffers, never saved by 5.x; recomputed, never loaded
IGNORED = re.compile(r"^(model\.)?rotary_emb\..*inv_freq$")

# --------------------------------------------------------------------------- configs


def modernbert_layer_types(n_layers: int, period: int) -> list[str]:
    """ModernBertConfig's layer_types from global_attn_every_n_layers: layer i global when
    i % period == 0 (the first layer global), else sliding."""
    return periodic_layer_types(n_layers, period, first_global=True)


def _layer_types(hf: dict[str, Any], n_layers: int) -> list[str]:
    types = hf.get("layer_types")
    if types is not None:
        return types
    period = hf.get("global_attn_every_n_layers", GLOBAL_ATTN_EVERY_N_LAYERS)
    if not isinstance(period, int) or isinstance(period, bool) or period < 1:
        raise HFCheckpointError(
            f"config.json global_attn_every_n_layers must be a positive integer, got {period!r}"
        )
    return modernbert_layer_types(n_layers, period)


def _rope_thetas(hf: dict[str, Any]) -> dict[str, float]:
    """The RoPE base of each layer type, as ModernBertConfig.convert_rope_params_to_dict
    fills them (transformers 5's rope_parameters, else 4.x's global_rope_theta and
    local_rope_theta, else default_theta); only plain RoPE (rope_type default)."""
    given = hf.get("rope_parameters")
    if given is not None and (
        not isinstance(given, dict)
        or set(given) - set(LAYER_TYPES)
        or not all(isinstance(v, dict) for v in given.values())
    ):
        raise HFCheckpointError(
            f"config.json rope_parameters must map {' and '.join(LAYER_TYPES)} to their "
            f"RoPE parameters, got {given!r}"
        )
    if hf.get("rope_scaling") is not None:
        raise HFCheckpointError(
            f"config.json rope_scaling={hf['rope_scaling']!r} is not supported: attnlab's "
            "ModernBERT takes plain RoPE (rope_type 'default') on both layer types"
        )
    thetas = {}
    for layer_type, key in _THETA_KEYS.items():
        params = dict((given or {}).get(layer_type) or {"rope_type": "default"})
        theta = hf.get(key)
        params.setdefault("rope_theta", DEFAULT_THETA[layer_type] if theta is None else theta)
        # refuses scaling, partial rotation and keys it does not read, by name
        thetas[layer_type] = rope_settings({"rope_parameters": params}, ("default",))["rope_theta"]
    return thetas


def config_from_hf(hf: dict[str, Any], model_type: str = "modernbert") -> EncoderConfig:
    arch = (hf.get("architectures") or ["ModernBertModel"])[0]
    for key in _DROPOUTS:
        if hf.get(key, 0.0) not in (0, 0.0, None):
            raise HFCheckpointError(
                f"config.json {key}={hf[key]!r} is not supported: ModernBERT drops inside its "
                "MLP and after the attention output, where attnlab's residual dropout does "
                "not; set it to 0 (the published models train without)"
            )
    labels = n_labels(hf)
    if arch == "ModernBertForQuestionAnswering" and labels != 2:
        raise HFCheckpointError(f"a QA model has 2 outputs (start, end), got num_labels={labels}")
    head = HEAD_ARCHITECTURES[arch]
    names = label_names(hf, labels) or numbered(labels) if head in NAMED_HEADS else None
    problem_type = hf.get("problem_type") if head == "sequence" else None
    if problem_type is not None and problem_type not in PROBLEM_TYPES:
        raise HFCheckpointError(
            f"config.json problem_type={problem_type!r} is not supported; supported: "
            f"{', '.join(PROBLEM_TYPES)}"
        )
    pooling = hf.get("classifier_pooling", "cls")
    if pooling not in ("cls", "mean"):
        raise HFCheckpointError(
            f"config.json classifier_pooling={pooling!r} is not supported; supported: cls, mean"
        )
    n_layers, d = get(hf, "num_hidden_layers"), get(hf, "hidden_size")
    half = get(hf, "local_attention") // 2  # transformers' sliding_window: keys within half
    types = _layer_types(hf, n_layers)
    window, layer_pattern = windows_of_layer_types({"sliding_window": half + 1}, types, n_layers)
    thetas = _rope_thetas(hf)
    local_theta = thetas["sliding_attention"]
    if window is None or local_theta == thetas["full_attention"]:
        local_theta = None  # one RoPE serves every layer
    act = activation(hf.get("hidden_activation"), "hidden_activation")
    head_act = activation(hf.get("classifier_activation"), "classifier_activation")
    attention_bias = bool(hf.get("attention_bias", False))
    return EncoderConfig(
        vocab_size=get(hf, "vocab_size"),
        max_seq_len=get(hf, "max_position_embeddings"),
        d_model=d,
        n_layers=n_layers,
        attention=AttentionConfig(
            n_heads=get(hf, "num_attention_heads"),
            qkv_bias=attention_bias,
            out_bias=attention_bias,
            sliding_window=window,
            layer_pattern=layer_pattern,
        ),
        position=PositionConfig(
            kind="rope",
            rope_theta=thetas["full_attention"],
            rope_layout="split",
            local_rope_theta=local_theta,
        ),
        ffn=FFNConfig(
            kind="glu",
            activation=act,
            hidden_dim=get(hf, "intermediate_size"),
            bias=bool(hf.get("mlp_bias", False)),
        ),
        norm=NormConfig(
            kind="layernorm",
            eps=float(hf.get("norm_eps", 1e-5)),
            bias=bool(hf.get("norm_bias", False)),
            placement="pre",
        ),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        init_std=float(hf.get("initializer_range", 0.02)),
        type_vocab_size=0,
        embedding_norm=True,
        head=head,
        n_labels=labels,
        classifier_dropout=float(hf.get("classifier_dropout") or 0.0),
        label_names=names,
        problem_type=problem_type,
        first_attn_norm=False,
        pooling=pooling,
        classifier_transform="dense_act_norm",
        head_bias=bool(hf.get("classifier_bias", False)),
        head_activation=None if head_act == act else head_act,
        decoder_bias=bool(hf.get("decoder_bias", True)),
    )


def modernbert_features(cfg: ModelConfig) -> list[str]:
    """The fields of an encoder config set to what ModernBERT has and BERT has not."""
    if not isinstance(cfg, EncoderConfig):
        return []
    found = []
    if cfg.position.kind == "rope":
        found.append("position.kind='rope'")
    if cfg.ffn.kind == "glu":
        found.append("ffn.kind='glu'")
    if cfg.norm.placement == "pre":
        found.append("norm.placement='pre'")
    if cfg.classifier_transform not in ("bert", "distilbert"):  # (DistilBERT's: its own)
        found.append(f"classifier_transform={cfg.classifier_transform!r}")
    for name, bert in (
        ("first_attn_norm", True),
        ("pooling", "cls"),
        ("head_bias", True),
        ("head_activation", None),
        ("decoder_bias", True),
    ):
        if getattr(cfg, name) != bert:
            found.append(f"{name}={getattr(cfg, name)!r}")
    if cfg.position.local_rope_theta is not None:
        found.append("position.local_rope_theta")
    return found


def exports(cfg: ModelConfig) -> bool:
    """Encoders with any of ModernBERT's pieces (BERT's layout would drop them)."""
    return cfg.arch == "encoder" and bool(modernbert_features(cfg))


def _period(cfg: EncoderConfig) -> int | None:
    """global_attn_every_n_layers of the model's local/global layers (every layer global:
    1), None where its layers are no such pattern."""
    local = [cfg.attention.window_of(i) is not None for i in range(cfg.n_layers)]
    for period in range(1, cfg.n_layers + 1):
        if local == [t == "sliding_attention" for t in modernbert_layer_types(len(local), period)]:
            return period
    return None


def export_type(cfg: ModelConfig) -> str:
    """``modernbert``, or HFCheckpointError naming the field ModernBERT has otherwise (and
    the ModernBERT piece that rules out BERT's layout)."""
    assert isinstance(cfg, EncoderConfig)
    piece = modernbert_features(cfg)[0]
    att, ffn, pos, norm = cfg.attention, cfg.ffn, cfg.position, cfg.norm

    def refuse(reason: str) -> HFCheckpointError:
        return unrepresentable(f"{reason}; {piece} exports as modernbert only")

    classifier = cfg.head in ("sequence", "token", "qa")
    for field, value, theirs in (
        ("position.kind", pos.kind, "rope"),
        ("position.rope_layout", pos.rope_layout, "split"),
        ("position.rope_scaling", pos.rope_scaling, None),
        ("norm.kind", norm.kind, "layernorm"),
        ("norm.placement", norm.placement, "pre"),
        ("first_attn_norm", cfg.first_attn_norm, False),
        ("embedding_norm", cfg.embedding_norm, True),
        ("type_vocab_size", cfg.type_vocab_size, 0),
        ("attention.kind", att.kind, "mha"),
        ("attention.n_kv_heads", att.kv_heads, att.n_heads),
        ("attention.head_dim", cfg.head_dim, cfg.d_model // att.n_heads),
        ("attention.out_bias", att.out_bias, att.qkv_bias),
        ("ffn.kind", ffn.kind, "glu"),
        ("dropout", cfg.dropout, 0.0),
        ("attention.dropout", att.dropout, 0.0),
        *(
            [("classifier_transform", cfg.classifier_transform, "dense_act_norm")]
            if classifier
            else []
        ),  # fmt: skip
    ):
        if value != theirs:
            raise refuse(f"{field}={value!r} (ModernBERT's is {theirs!r})")
    if cfg.head_dim * att.n_heads != cfg.d_model:
        raise refuse("attention.head_dim (ModernBERT's heads split d_model)")
    for problem in shared_problems(cfg, "ModernBERT"):
        raise refuse(problem)
    if _period(cfg) is None:
        raise refuse(
            f"attention.layer_pattern={att.layer_pattern!r} (ModernBERT's layer i is global "
            "when i % global_attn_every_n_layers == 0: a pattern G, GL, GLL, ...)"
        )
    hf_activation(ffn.activation)  # (refused by name if transformers has no such name)
    hf_activation(cfg.head_activation or ffn.activation)
    return "modernbert"


def config_to_hf(cfg: EncoderConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    att, pos = cfg.attention, cfg.position
    period = _period(cfg)
    types = modernbert_layer_types(cfg.n_layers, period)
    local = "sliding_attention" in types
    local_theta = pos.local_rope_theta if pos.local_rope_theta is not None else pos.rope_theta
    rope = {
        "full_attention": {"rope_type": "default", "rope_theta": pos.rope_theta},
        "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
    }
    return {
        "model_type": "modernbert",
        "architectures": [ARCHITECTURE_OF_HEAD[cfg.head]],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn.hidden_size(cfg.d_model),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": att.n_heads,
        "hidden_activation": hf_activation(cfg.ffn.activation),
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.init_std,
        "norm_eps": cfg.norm.eps,
        "norm_bias": cfg.norm.bias,
        "attention_bias": att.qkv_bias,
        "mlp_bias": cfg.ffn.bias,
        **dict.fromkeys(_DROPOUTS, 0.0),
        # transformers 5.x: layer_types and rope_parameters; 4.x: the period and two bases
        "layer_types": types,
        "global_attn_every_n_layers": period,
        # the keys within local_attention // 2 either side; unused without local layers
        "local_attention": 2 * (att.sliding_window - 1)
        if local
        else DEFAULTS[model_type]["local_attention"],
        "rope_parameters": rope,
        "global_rope_theta": pos.rope_theta,
        "local_rope_theta": local_theta,
        "tie_word_embeddings": cfg.tie_embeddings,
        "decoder_bias": cfg.decoder_bias,
        "classifier_pooling": cfg.pooling,
        "classifier_dropout": cfg.classifier_dropout or 0.0,
        "classifier_bias": cfg.head_bias,
        "classifier_activation": hf_activation(cfg.head_activation or cfg.ffn.activation),
        **dict.fromkeys(_SPECIAL_TOKENS),  # attnlab models carry no special tokens
        **label_entries(
            2 if cfg.head == "qa" else cfg.n_labels,
            exported_label_names(cfg.label_names, cfg.n_labels),
        ),
        **({"problem_type": cfg.problem_type} if cfg.problem_type else {}),
        **dtype_entries(dtype),
    }


# --------------------------------------------------------------------------- weights


def _specs(cfg: EncoderConfig, b: str) -> Specs:
    """attnlab name -> HF name; ``b`` the backbone prefix (``model.`` under a head, or none)."""
    norm = ("weight", "bias") if cfg.norm.bias else ("weight",)

    def linear(ours: str, theirs: str, bias: bool) -> Specs:
        return {
            f"{ours}.{s}": f"{theirs}.{s}" for s in (("weight", "bias") if bias else ("weight",))
        }

    def layer_norm(ours: str, theirs: str) -> Specs:
        return {f"{ours}.{s}": f"{theirs}.{s}" for s in norm}

    specs: Specs = {"tok_emb.weight": f"{b}embeddings.tok_embeddings.weight"}
    specs |= layer_norm("emb_norm", f"{b}embeddings.norm")
    att_bias, mlp_bias = cfg.attention.qkv_bias, cfg.ffn.bias
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}.", f"{b}layers.{i}."
        if i > 0:  # layer 0's is the identity (first_attn_norm false)
            specs |= layer_norm(ours + "attn_norm", theirs + "attn_norm")
        specs |= linear(ours + "attn.qkv", theirs + "attn.Wqkv", att_bias)  # rows [q; k; v]
        specs |= linear(ours + "attn.out", theirs + "attn.Wo", att_bias)
        specs |= layer_norm(ours + "ffn_norm", theirs + "mlp_norm")
        specs |= linear(ours + "ffn.gate_up", theirs + "mlp.Wi", mlp_bias)  # [act'd; gate]
        specs |= linear(ours + "ffn.down", theirs + "mlp.Wo", mlp_bias)
    specs |= layer_norm("norm", f"{b}final_norm")
    if cfg.head != "none":
        specs |= linear("head.transform", "head.dense", cfg.head_bias)
        specs |= layer_norm("head.norm", "head.norm")
    if cfg.head == "mlm":
        if cfg.decoder_bias:
            specs["head.bias"] = "decoder.bias"
        if not cfg.tie_embeddings:
            specs["head.decoder.weight"] = "decoder.weight"
    elif cfg.head in ("sequence", "token"):
        specs |= linear("head.classifier", "classifier", True)
    elif cfg.head == "qa":
        specs |= linear("head.span", "classifier", True)
    return specs


def weights_to_attnlab(src: Source, cfg: EncoderConfig) -> Plan:
    b = prefix(src, "model.", "embeddings.tok_embeddings.weight")
    plan = src.plan(_specs(cfg, b))
    if cfg.head == "mlm" and cfg.tie_embeddings:  # a stored copy of the tied decoder
        src.tied("decoder.weight", plan["tok_emb.weight"])
    return plan  # type: ignore[return-value]  # None entries only with src.missing/wrong


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: EncoderConfig, model_type: str
) -> dict[str, Tensor]:
    out = unplan(_specs(cfg, "" if cfg.head == "none" else "model."), sd)
    if cfg.head == "mlm" and cfg.tie_embeddings:
        out["decoder.weight"] = sd["tok_emb.weight"]
    return out


FAMILY = Family(
    name="modernbert",
    arch="encoder",
    architectures=ARCHITECTURES,
    config_from_hf=config_from_hf,
    defaults=DEFAULTS,
    config_to_hf=config_to_hf,  # type: ignore[arg-type]  # an EncoderConfig family
    weights_to_attnlab=weights_to_attnlab,  # type: ignore[arg-type]
    weights_from_attnlab=weights_from_attnlab,  # type: ignore[arg-type]
    exports=exports,
    export_type=export_type,
    ignored=IGNORED,
    task=lambda cfg: TASK_OF_HEAD[cfg.head],
)
