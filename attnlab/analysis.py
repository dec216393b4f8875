"""Back-of-the-envelope calculators: parameters, FLOPs and KV-cache memory of a
:class:`~attnlab.config.ModelConfig`, from formulas (no model is built).

Symbols: V vocabulary, T sequence length (context), d d_model, L layers, h query heads,
h_kv key/value heads, d_h head dim, H feed-forward hidden size.

FLOP convention (Kaplan et al. 2020, Table 1; PaLM, Chowdhery et al. 2022, Appendix B):
one multiply-add is 2 FLOPs, and only matrix multiplications are counted (norms,
activations, softmax, RoPE and embedding lookups are O(d) per token and left out).

* dense:     2 N_matmul per token, N_matmul = the weights of every Linear layer, including
             the output projection d x V even when it is tied to the token embedding (the
             tied matrix is still multiplied; it is just stored once).
* attention: 2 * 2 * L * T * h * d_h per token: Q K^T and (weights) V, each 2 h d_h FLOPs
             per key, with T keys per query. This counts the full T x T score matrix, as
             dense kernels compute it; a causal mask makes half of it dead work (so exact
             causal accounting would be T/2). PaLM counts it the same way; Kaplan's Table 1
             counts only one of the two matmuls.
* training:  3 x forward (backward = 2 x forward: gradients for inputs and for weights),
             i.e. 6 N_matmul + 12 L T h d_h per token.

Attention kinds other than the formulas below are measured instead, on a model built on
the ``meta`` device (no memory, no arithmetic), so the calculators keep working as new
variants are added to the library.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from attnlab.cache import check_global_tokens
from attnlab.config import ModelConfig, NormConfig, is_int64_overflow

_FORMULA_KINDS = ("mha",)  # attention kinds whose structure the formulas below describe
_KV_FORMULA_KINDS = (
    "mha",
    "mla",
    "dsa",
    "nsa",
)  # attention kinds whose cache the KV formula describes


def _formula_applies(cfg: ModelConfig) -> bool:
    """True when the parameter/FLOP formulas describe cfg (else a meta model is measured)."""
    return (
        cfg.arch == "decoder"
        and cfg.attention.kind in _FORMULA_KINDS
        and not cfg.attention.sink_logits  # (a learned logit per head and layer)
        and cfg.ffn.kind in ("mlp", "glu")
    )


def _check_decoder(cfg: ModelConfig, what: str) -> None:
    """The FLOP and KV-cache formulas describe decoder-only language models."""
    if cfg.arch != "decoder":
        raise ValueError(
            f"{what} describe decoder-only language models, not arch {cfg.arch!r} "
            "(parameter counts cover every model)"
        )


def _norm_params(norm: NormConfig, d: int) -> int:
    if norm.kind in ("layernorm", "layernorm1p") and norm.bias:
        return 2 * d  # weight and bias
    return d  # RMSNorm, or LayerNorm without bias: weight only


def _position_extras(cfg: ModelConfig) -> int:
    """A decoder's parameters outside its blocks besides the embeddings, head and final
    norm: the embedding norm (``embedding_norm``) and a relative-bias table (one per
    layer with ``relative_bias_per_layer``). ALiBi has none (its slopes are fixed)."""
    n = _norm_params(cfg.norm, cfg.d_model) if cfg.embedding_norm else 0
    pos = cfg.position
    if pos.kind == "relative_bias":
        tables = cfg.n_layers if pos.relative_bias_per_layer else 1
        n += pos.relative_buckets * cfg.n_heads * tables
    return n


def _linear(d_in: int, d_out: int, bias: bool) -> tuple[int, int]:
    """(parameters, weight entries) of one Linear layer."""
    weights = d_in * d_out
    return weights + (d_out if bias else 0), weights


def _block_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(parameters, matmul weights) of one transformer block."""
    d, att, ffn = cfg.d_model, cfg.attention, cfg.ffn
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    hidden = ffn.hidden_size(d)
    up_width = 2 * hidden if ffn.kind == "glu" else hidden  # glu fuses gate and up
    linears = [
        _linear(d, q_dim + 2 * kv_dim, att.qkv_bias),  # fused q, k, v
        _linear(q_dim, d, att.out_bias),
        _linear(d, up_width, ffn.bias),
        _linear(hidden, d, ffn.bias),
    ]
    # attn + ffn norms (sandwich: a second one after each; post_sublayer: one after each;
    # parallel_shared: one both sublayers read)
    n_norms = {"sandwich": 4, "parallel_shared": 1}.get(cfg.norm.placement, 2)
    params = sum(p for p, _ in linears) + n_norms * _norm_params(cfg.norm, d)
    if att.qk_norm:  # QK-norm: a weight (and bias) for the queries, one for the keys
        if att.qk_norm_scope == "projection" or att.qk_norm_weight == "per_head":
            width = q_dim + kv_dim  # over whole widths, or a weight per head
        else:
            width = 2 * cfg.head_dim  # one for all query heads, one for all key heads
        params += width * (2 if att.qk_norm_bias else 1)
    return params, sum(w for _, w in linears)


MAX_MEASURED_LAYERS = 10_000  # building 1e18 layers one module at a time never ends


def meta_model(cfg: ModelConfig):
    """The model of ``cfg`` on the meta device (shapes only). ValueError for a model that
    cannot be built so: more than MAX_MEASURED_LAYERS layers (each is built in turn: 1e18 of
    them never finished), or a tensor of more elements than torch counts (2**63)."""
    from attnlab.models import build_model

    for name in ("n_layers", "n_decoder_layers"):
        layers = getattr(cfg, name, None)
        if layers is not None and layers > MAX_MEASURED_LAYERS:
            raise ValueError(
                f"model.{name}={layers}: a model of this kind is measured by building it, "
                f"layer by layer, on the meta device; give at most {MAX_MEASURED_LAYERS:,} layers"
            )
    with _countable("the model's tensors", "smaller sizes (model.d_model, model.vocab_size, ...)"):
        with torch.device("meta"):  # shapes only: no memory, no initialisation work
            return build_model(cfg)


@contextmanager
def _countable(what: str, fix: str):
    """Meta tensors past int64's elements, as one ValueError saying which sizes to lower."""
    try:
        yield
    except (RuntimeError, TypeError, ValueError) as e:
        if not is_int64_overflow(e):
            raise
        raise ValueError(
            f"{what} would have more elements than torch can count (2**63); give {fix}"
        ) from None


def count_parameters(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts, tied weights counted once (as ``model.num_parameters()``).

    ``embedding`` is the token embedding plus learned position embeddings; everything else,
    including an untied output head, is ``non_embedding`` (Kaplan et al.'s N excludes the
    embeddings). ``lm_head`` is the head's share of that: its weight when untied (a tied one
    is the embedding's), its bias (``final_logits_bias``) either way."""
    cfg.validate()
    d, V = cfg.d_model, cfg.vocab_size
    head = (0 if cfg.tie_embeddings else d * V) + (V if cfg.final_logits_bias else 0)
    if not _formula_applies(cfg):
        model = meta_model(cfg)
        total = sum(p.numel() for p in model.parameters())  # tied ones once
        if cfg.arch == "decoder":
            non_embedding = model.num_parameters(exclude_embeddings=True)
        else:  # other architectures: their embedding tables, and tables kept as plain
            # parameters (ViT's learned positions)
            tables = {
                id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Embedding)
            }
            for name in getattr(model, "embedding_tables", ()):
                tables[id(getattr(model, name))] = getattr(model, name)
            non_embedding = total - sum(w.numel() for w in tables.values())
        heads = [p for n, p in model.named_parameters() if n.startswith("lm_head.")]
        return {
            "total": total,
            "embedding": total - non_embedding,
            "non_embedding": non_embedding,
            # the bias, and the weight untied only (tied: listed once, as the embedding)
            "lm_head": sum(p.numel() for p in heads),
        }
    embedding = V * d + (cfg.max_seq_len * d if cfg.position.kind == "learned" else 0)
    block, _ = _block_counts(cfg)
    final_norm = _norm_params(cfg.norm, d) if cfg.norm.placement != "post" else 0
    non_embedding = cfg.n_layers * block + final_norm + head + _position_extras(cfg)
    return {
        "total": embedding + non_embedding,
        "embedding": embedding,
        "non_embedding": non_embedding,
        "lm_head": head,
    }


def matmul_parameters(cfg: ModelConfig) -> int:
    """N_matmul: weight entries multiplied once per token in a forward pass (biases and
    norms excluded, the output projection included even when tied). Mixture-of-experts
    layers count their router and the experts a token uses (k routed + the shared ones)."""
    if not _formula_applies(cfg):
        from attnlab.nn.moe import MoE

        model = meta_model(cfg)
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        n = sum(m.weight.numel() for m in linears)
        for m in model.modules():
            if isinstance(m, MoE):
                per_expert = (m.experts.gate_up.numel() + m.experts.down.numel()) // m.n_experts
                n += m.gate.weight.numel() + m.top_k * per_expert
        return n
    _, block_weights = _block_counts(cfg)
    return cfg.n_layers * block_weights + cfg.d_model * cfg.vocab_size


def _attention_widths(cfg: ModelConfig) -> tuple[int, int]:
    """(query/key width, value width) per head."""
    if cfg.attention.kind in ("mla", "dsa"):
        dims = cfg.attention.mla_dims(cfg.d_model)
        return dims.qk_nope_head_dim + dims.qk_rope_head_dim, dims.v_head_dim
    return cfg.head_dim, cfg.head_dim


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> dict[str, int]:
    """FLOPs per token for a forward pass over ``seq_len`` tokens (default max_seq_len),
    and for training; see the module docstring for the convention (MLA: its naive path,
    query/key width d_n + d_r and value width d_v; DSA: that plus the lightning indexer,
    2 n_I (d_I + 1) per key; linear attention: its recurrent form, a d_h x d_h state per
    key/value head updated and one read per query head per token, 2 (h_kv + h) d_h^2 per
    layer whatever T; NSA and windows: counted as dense attention over all T keys, the
    baseline they are compared with, not the keys they select)."""
    cfg.validate()
    _check_decoder(cfg, "FLOPs per token")
    T = cfg.max_seq_len if seq_len is None else seq_len
    if T < 1:
        raise ValueError(f"seq_len must be >= 1, got {T}")
    dense = 2 * matmul_parameters(cfg)
    qk, v = _attention_widths(cfg)
    att, L = cfg.attention, cfg.n_layers
    if att.kind == "linear":
        # S += k^T v per key/value head; y = q S per query head
        attention = 2 * L * (cfg.n_kv_heads + cfg.n_heads) * qk * v
    else:
        attention = 2 * L * T * cfg.n_heads * (qk + v)
    if att.kind == "dsa":  # the indexer scores every key: n_I dot products, then weighted
        attention += 2 * L * T * att.index_n_heads * (att.index_dim(cfg.d_model) + 1)
    forward = dense + attention
    return {
        "dense": dense,
        "attention": attention,
        "forward": forward,
        "training": 3 * forward,
    }


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kv_cache_values_per_token(cfg: ModelConfig) -> int:
    """Values cached per token of one sequence, all layers: 2 L h_kv d_h for MHA/GQA/MQA
    (a key and a value per key/value head; NSA keeps the same and compresses on the fly),
    L (d_c + d_r) for MLA (the latent and the shared RoPE key), L (d_c + d_r + d_I) for DSA
    (and the lightning indexer's key)."""
    att = cfg.attention
    if att.kind in ("mla", "dsa"):
        dims = att.mla_dims(cfg.d_model)
        index = att.index_dim(cfg.d_model) if att.kind == "dsa" else 0
        return cfg.n_layers * (dims.kv_lora_rank + dims.qk_rope_head_dim + index)
    if att.kind in ("mha", "nsa"):
        return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim
    raise ValueError(f"no KV formula for attention kind {att.kind!r}")


def mha_kv_values_per_token(cfg: ModelConfig) -> int:
    """The same model with full multi-head attention caching every head's key and value:
    L h (d_qk + d_v)."""
    qk, v = _attention_widths(cfg)
    return cfg.n_layers * cfg.n_heads * (qk + v)


def kv_cache_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of keys and values stored per token per sequence (see
    :func:`kv_cache_values_per_token`) x itemsize."""
    cfg.validate()
    _check_decoder(cfg, "KV-cache sizes")
    if cfg.attention.kind == "linear":
        return 0  # a fixed-size state: nothing grows with the tokens
    if cfg.attention.kind not in _KV_FORMULA_KINDS:
        return kv_cache_bytes(cfg, 1, 1, dtype)
    return kv_cache_values_per_token(cfg) * _itemsize(dtype)


def kv_cache_bytes(
    cfg: ModelConfig, seq_len: int, batch: int = 1, dtype: torch.dtype = torch.float32
) -> int:
    """Bytes of a KV cache holding ``batch`` sequences of ``seq_len`` tokens (the keys and
    values of ``model.new_cache(batch, seq_len, dtype)``). Sliding-window layers need only
    the last ``sliding_window`` tokens (``model.new_cache(batch, window, rolling=True)``)."""
    cfg.validate()
    _check_decoder(cfg, "KV-cache sizes")
    if seq_len < 1 or batch < 1:
        raise ValueError(f"seq_len and batch must be >= 1, got {seq_len} and {batch}")
    window = cfg.attention.sliding_window
    if window is not None:  # the global tokens new_cache refuses
        check_global_tokens(cfg.attention.global_tokens, window)
    held = min(seq_len, window) if window is not None else seq_len
    if cfg.attention.kind not in _KV_FORMULA_KINDS:
        model = meta_model(cfg)
        with _countable(
            f"a KV cache of batch {batch} x {held} tokens", "a smaller batch or seq_len"
        ):
            cache = model.new_cache(batch, held, dtype, device="meta")
        return int(cache.nbytes)
    if window is not None:  # local layers hold their window, global ones everything
        per_layer = kv_cache_bytes_per_token(cfg, dtype) // cfg.n_layers
        return batch * windowed_kv_entries(cfg, seq_len) * per_layer
    return batch * seq_len * kv_cache_bytes_per_token(cfg, dtype)


# --------------------------------------------------------------------------- long context


def windowed_kv_entries(cfg: ModelConfig, seq_len: int) -> int:
    """Token entries held over all layers for a context of ``seq_len``: a local
    (sliding-window) layer of multi-head attention keeps min(window, T) (its ring; with
    ``attention.sink_tokens`` the whole window, sinks and ring preallocated) plus one entry
    per ``attention.global_tokens`` position (kept for good), a global layer T. Latent
    attention (MLA, DSA) keeps every token on every layer: its window only masks."""
    if cfg.attention.kind != "mha":
        return cfg.n_layers * seq_len
    n_global = len(cfg.attention.global_tokens)
    sinks = cfg.attention.sink_tokens > 0

    def held(w: int | None) -> int:
        if w is None:  # a global layer
            return seq_len
        return (w if sinks else min(w, seq_len)) + n_global

    # the layers repeat attention.layer_pattern: one period's count times the periods (a
    # loop over n_layers never ended for a config of 1e18 layers)
    period = len(cfg.attention.layer_pattern or "L")
    full, rest = divmod(cfg.n_layers, period)
    windows = [cfg.attention.window_of(layer) for layer in range(period)]
    return full * sum(map(held, windows)) + sum(map(held, windows[:rest]))


def weights_bytes(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> int:
    """Bytes to hold the parameters in ``dtype`` (tied weights stored once). In a dtype
    narrower than float32, mixture-of-experts routers stay float32 (as ``model.to(dtype)``
    and the loaders keep them: :class:`~attnlab.nn.moe.KeepsPrecision`)."""
    if cfg.ffn.kind == "moe" and _itemsize(dtype) < 4:
        cfg.validate()
        params = {id(p): p for p in meta_model(cfg).to(dtype).parameters()}  # tied once
        return sum(p.numel() * p.element_size() for p in params.values())
    return count_parameters(cfg)["total"] * _itemsize(dtype)
