"""GPT-BigCode (``model_type`` gpt_bigcode: GPTBigCodeForCausalLM, GPTBigCodeModel; SantaCoder,
StarCoder, StarCoderBase): GPT-2's decoder (learned positions, pre-norm blocks with biased
LayerNorms, an MLP of ``n_inner`` or 4 d, biases on every projection, a tied head) with
``nn.Linear`` layers instead of Conv1D and, with ``multi_query`` (the default, every
published checkpoint), one key/value head shared by all query heads.

- ``c_attn`` fuses q, k and v. With ``multi_query``: rows [q (d); k (d_h); v (d_h)], which
  are attnlab's [q; k; v] rows of ``n_kv_heads=1`` as stored. Without it (one key/value head
  per query head): transformers views the output as (h, 3 d_h) and splits each head's
  slice into q, k and v, so the rows are stored head by head, (h, 3, d_h) (GPT-NeoX's and
  BLOOM's order: a ``Part`` with ``per_head``), attnlab's [q; k; v] on import.
- ``activation_function``: ``gelu_pytorch_tanh`` by default (``ffn.activation='gelu_tanh'``).
- ``attention_softmax_in_fp32`` and ``scale_attention_softmax_in_fp32``: transformers 4.x
  upcast half-precision scores to float32 for the softmax, dividing q . k by (layer + 1)
  before and multiplying it back after (overflow insurance in float16); with float32
  scores neither applies (the upcast is skipped, the factor is 1), and transformers 5.x
  reads neither (its softmax is always float32). Both are read as the same maths and
  written as true, the published checkpoints' values.
- Dropout: attnlab has one dropout for the embeddings and each sublayer's output, read
  from ``resid_pdrop``; an ``embd_pdrop`` that differs loads with a warning
  (``io.one_dropout``: training only). ``attn_pdrop`` is ``attention.dropout``.

Refused by name: ``scale_attn_weights`` false (unscaled scores, which no published
checkpoint uses) and ``add_cross_attention`` true (an encoder's cross-attention in every
block).

Export takes the learned-position pre-norm decoders with fewer key/value heads than query
heads (GPT-2's and OPT's layouts have one per query head; grouped ones are refused by name,
GPT-BigCode having one or one per query head); the multi-head ones stay GPT-2's or OPT's.

Weights, HF (``transformer.``; none in headless GPTBigCodeModel files) -> attnlab:

    wte, wpe                          (V, d), (L, d)   -> tok_emb, pos_emb
    h.{i}.ln_1, h.{i}.ln_2            (d,)             -> blocks.{i}.attn_norm, ffn_norm
    h.{i}.attn.c_attn                 (d + 2 d_kv, d)  -> blocks.{i}.attn.qkv
    h.{i}.attn.c_proj                 (d, d)           -> blocks.{i}.attn.out
    h.{i}.mlp.c_fc, mlp.c_proj        (f, d), (d, f)   -> blocks.{i}.ffn.up, ffn.down
    ln_f                              (d,)             -> norm
    lm_head.weight                    (V, d)           -> lm_head.weight (untied only)

Shapes: d d_model, h heads, d_h head dim, d_kv key/value width (d_h with ``multi_query``,
else d), f feed-forward hidden size, V vocabulary size, L max positions.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from attnlab.config import AttentionConfig, FFNConfig, ModelConfig, NormConfig, PositionConfig
from attnlab.interop.gpt_neox import heads_together
from attnlab.interop.io import (
    Family,
    HFCheckpointError,
    Part,
    Plan,
    Source,
    activation,
    common_config,
    get,
    hf_activation,
    is_plain_decoder,
    one_dropout,
    or_zeros,
    prefix,
    unrepresentable,
)

ARCHITECTURES = {"gpt_bigcode": ("GPTBigCodeForCausalLM", "GPTBigCodeModel")}

# transformers' GPTBigCodeConfig class defaults for the config.json keys read here
# (n_inner, None there, is left out: read as missing, 4 n_embd).
DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt_bigcode": {
        "vocab_size": 50257,
        "n_positions": 1024,
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "activation_function": "gelu_pytorch_tanh",
        "resid_pdrop": 0.1,
        "embd_pdrop": 0.1,
        "attn_pdrop": 0.1,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "attention_softmax_in_fp32": True,
        "scale_attention_softmax_in_fp32": True,
        "multi_query": True,
        "add_cross_attention": False,
        "tie_word_embeddings": True,
    }
}

# The causal-mask table (``transformer.bias``) older transformers versions saved.
IGNORED = re.compile(r"^(transformer\.)?bias$")
HEAD = "lm_head.weight"

# --------------------------------------------------------------------------- configs


def config_from_hf(hf: dict[str, Any], model_type: str = "gpt_bigcode") -> ModelConfig:
    if not hf.get("scale_attn_weights", True):
        raise HFCheckpointError(
            "config.json scale_attn_weights=false (unscaled attention scores) is not supported "
            "for gpt_bigcode: attnlab's GPT-BigCode scales q . k by 1/sqrt(head_dim); set it "
            "to true"
        )
    if hf.get("add_cross_attention"):
        raise HFCheckpointError(
            "config.json add_cross_attention=true (cross-attention to an encoder in every "
            "block) is not supported: attnlab's decoders attend to their own tokens; set it "
            "to false"
        )
    d, n_heads = get(hf, "n_embd"), get(hf, "n_head")
    multi_query = bool(hf.get("multi_query", True))
    return ModelConfig(
        vocab_size=get(hf, "vocab_size"),
        max_seq_len=get(hf, "n_positions"),
        d_model=d,
        n_layers=get(hf, "n_layer"),
        attention=AttentionConfig(
            n_heads=n_heads,
            n_kv_heads=1 if multi_query and n_heads > 1 else None,
            qkv_bias=True,
            out_bias=True,
            dropout=hf.get("attn_pdrop") or 0.0,
        ),
        position=PositionConfig(kind="learned"),
        ffn=FFNConfig(
            kind="mlp",
            activation=activation(
                hf.get("activation_function", "gelu_pytorch_tanh"), "activation_function"
            ),
            hidden_dim=hf.get("n_inner") or 4 * d,
            bias=True,
        ),
        norm=NormConfig(kind="layernorm", eps=get(hf, "layer_norm_epsilon"), bias=True),
        tie_embeddings=hf.get("tie_word_embeddings", True),
        dropout=one_dropout(hf, "resid_pdrop", "embd_pdrop"),
        init_std=hf.get("initializer_range", 0.02),
    )


def exports(cfg: ModelConfig) -> bool:
    """Pre-norm learned-position decoders with fewer key/value heads than query heads
    (GPT-2's and OPT's layouts have one per query head, and take the others)."""
    return (
        is_plain_decoder(cfg) and cfg.position.kind == "learned" and cfg.n_kv_heads != cfg.n_heads
    )


def export_type(cfg: ModelConfig) -> str:
    """``gpt_bigcode``, or HFCheckpointError naming what GPT-BigCode has not (absent biases
    are written as zeros). Windows, QK-norm and other families' pieces are refused by
    ``convert`` for every family that lacks them."""
    d = cfg.d_model
    problems = [
        (cfg.norm.kind != "layernorm",
         f"norm.kind={cfg.norm.kind!r} (GPT-BigCode's is 'layernorm')"),
        (cfg.ffn.kind != "mlp", f"ffn.kind={cfg.ffn.kind!r} (GPT-BigCode's is 'mlp')"),
        (cfg.n_kv_heads != 1,
         f"attention.n_kv_heads={cfg.n_kv_heads} (GPT-BigCode has one key/value head, "
         "multi_query, or one per query head)"),
        (cfg.head_dim * cfg.n_heads != d,
         f"attention.head_dim={cfg.head_dim} (GPT-BigCode's heads are d_model / n_heads wide)"),
    ]  # fmt: skip
    for found, what in problems:
        if found:
            raise unrepresentable(what)
    hf_activation(cfg.ffn.activation)  # (refused by name if transformers has no such name)
    return "gpt_bigcode"


def config_to_hf(cfg: ModelConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    att = cfg.attention
    return {
        **common_config(cfg, FAMILY, model_type, dtype),
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_positions": cfg.max_seq_len,
        "n_inner": cfg.ffn.hidden_size(cfg.d_model),
        "multi_query": cfg.n_kv_heads == 1,
        "activation_function": hf_activation(cfg.ffn.activation),
        "layer_norm_epsilon": cfg.norm.eps,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": att.dropout,
        "scale_attn_weights": True,
        # (no effect on float32 scores; the published checkpoints' values)
        "attention_softmax_in_fp32": True,
        "scale_attention_softmax_in_fp32": True,
        "add_cross_attention": False,
    }


# --------------------------------------------------------------------------- weights

NORMS = (("ln_1", "attn_norm"), ("ln_2", "ffn_norm"))


def weights_to_attnlab(src: Source, cfg: ModelConfig) -> Plan:
    d, f, V, L = cfg.d_model, cfg.ffn.hidden_size(cfg.d_model), cfg.vocab_size, cfg.max_seq_len
    h, d_kv = cfg.n_heads, cfg.n_kv_heads * cfg.head_dim
    p = prefix(src, "transformer.", "wte.weight")
    out: dict[str, tuple[Part, ...] | None] = {
        "tok_emb.weight": src.take(f"{p}wte.weight", (V, d)),
        "pos_emb.weight": src.take(f"{p}wpe.weight", (L, d)),
        "norm.weight": src.take(f"{p}ln_f.weight", (d,)),
        "norm.bias": src.take(f"{p}ln_f.bias", (d,)),
    }
    # multi_query: rows [q; k; v] as attnlab's; else (h, 3, d_h), each head's q, k, v together
    layout = {} if cfg.n_kv_heads == 1 else {"per_head": (3, h)}
    for i in range(cfg.n_layers):
        hf, a = f"{p}h.{i}.", f"blocks.{i}."
        out |= {
            a + "attn.qkv.weight": src.take(hf + "attn.c_attn.weight", (d + 2 * d_kv, d), **layout),
            a + "attn.qkv.bias": src.take(hf + "attn.c_attn.bias", (d + 2 * d_kv,), **layout),
            a + "attn.out.weight": src.take(hf + "attn.c_proj.weight", (d, d)),
            a + "attn.out.bias": src.take(hf + "attn.c_proj.bias", (d,)),
            a + "ffn.up.weight": src.take(hf + "mlp.c_fc.weight", (f, d)),
            a + "ffn.up.bias": src.take(hf + "mlp.c_fc.bias", (f,)),
            a + "ffn.down.weight": src.take(hf + "mlp.c_proj.weight", (d, f)),
            a + "ffn.down.bias": src.take(hf + "mlp.c_proj.bias", (d,)),
        }
        for hf_name, name in NORMS:
            out[f"{a}{name}.weight"] = src.take(f"{hf}{hf_name}.weight", (d,))
            out[f"{a}{name}.bias"] = src.take(f"{hf}{hf_name}.bias", (d,))
    if cfg.tie_embeddings:
        src.tied(HEAD, out["tok_emb.weight"])
    else:
        out["lm_head.weight"] = src.take(HEAD, (V, d))
    return out  # type: ignore[return-value]  # None entries only with src.missing/wrong


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: ModelConfig, model_type: str
) -> dict[str, Tensor]:
    """GPT-BigCode's tensors: ``c_attn`` as attnlab's [q; k; v] with one key/value head,
    head by head with one per query head; biases everywhere (zeros for a missing one)."""
    d, f, h = cfg.d_model, cfg.ffn.hidden_size(cfg.d_model), cfg.n_heads
    qkv_size = d + 2 * cfg.n_kv_heads * cfg.head_dim

    def bias(name: str, size: int) -> Tensor:  # GPT-BigCode's layers and norms have biases
        return or_zeros(sd, name, size)

    def qkv(t: Tensor) -> Tensor:
        return t if cfg.n_kv_heads == 1 else heads_together(t, h)  # [q; k; v] -> (h, 3, d_h)

    p = "transformer."
    out = {
        f"{p}wte.weight": sd["tok_emb.weight"],
        f"{p}wpe.weight": sd["pos_emb.weight"],
        f"{p}ln_f.weight": sd["norm.weight"],
        f"{p}ln_f.bias": bias("norm.bias", d),
    }
    for i in range(cfg.n_layers):
        hf, a = f"{p}h.{i}.", f"blocks.{i}."
        out |= {
            hf + "attn.c_attn.weight": qkv(sd[a + "attn.qkv.weight"]),
            hf + "attn.c_attn.bias": qkv(bias(a + "attn.qkv.bias", qkv_size)),
            hf + "attn.c_proj.weight": sd[a + "attn.out.weight"],
            hf + "attn.c_proj.bias": bias(a + "attn.out.bias", d),
            hf + "mlp.c_fc.weight": sd[a + "ffn.up.weight"],
            hf + "mlp.c_fc.bias": bias(a + "ffn.up.bias", f),
            hf + "mlp.c_proj.weight": sd[a + "ffn.down.weight"],
            hf + "mlp.c_proj.bias": bias(a + "ffn.down.bias", d),
        }
        for hf_name, name in NORMS:
            out[f"{hf}{hf_name}.weight"] = sd[f"{a}{name}.weight"]
            out[f"{hf}{hf_name}.bias"] = bias(f"{a}{name}.bias", d)
    if not cfg.tie_embeddings:  # a tied head is not stored: transformers re-ties it
        out[HEAD] = sd["lm_head.weight"]
    return out


FAMILY = Family(
    name="gpt_bigcode",
    arch="decoder",
    architectures=ARCHITECTURES,
    config_from_hf=config_from_hf,
    defaults=DEFAULTS,
    config_to_hf=config_to_hf,
    weights_to_attnlab=weights_to_attnlab,
    weights_from_attnlab=weights_from_attnlab,
    exports=exports,
    export_type=export_type,
    ignored=IGNORED,
)
