"""Typed, validated configuration dataclasses.

A typo must never silently become a default: ``from_dict`` rejects unknown keys and
values of the wrong type, and ``validate`` rejects inconsistent values, each with a
message naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, TypeVar

from attnlab.fileio import atomic_write_text
from attnlab.functional.attention import SOFTCAP_BACKENDS, backend_names, softcap_refusal

T = TypeVar("T")


# torch.manual_seed takes 64-bit seeds; this range leaves room for the trainer's seed + rank
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def is_int64_overflow(error: BaseException) -> bool:
    """Whether ``error`` is torch refusing a size past int64 (a RuntimeError for a tensor's
    storage, a TypeError or ValueError for a size argument)."""
    text = str(error)
    return "Overflow when unpacking long" in text or "Storage size calculation overflowed" in text


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type or inconsistent."""


def _fail(path: str, message: str) -> typing.NoReturn:
    raise ConfigError(f"{path}: {message}" if path else message)


def _choice(path: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        _fail(path, f"unknown value {value!r}; choose one of {', '.join(choices)}")


def _positive(path: str, value: int | float | None, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    if not (value >= 0 if allow_zero else value > 0):  # written so that NaN fails too
        _fail(path, f"must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    # Infinity is no size, rate or scale: lr=inf trains to NaN, rope_theta=inf stops the
    # rotation, norm.eps=inf zeroes every activation.
    if value == math.inf:
        _fail(path, "must be finite, got inf")


class _OutOfRange(ConfigError):
    """An integer past int64: its own message, not a union's "expected int or null"."""


def _short(value: int) -> str:
    """An integer as a message shows it: 1.000e+300 for one of 301 digits."""
    return str(value) if abs(value) < 10**20 else f"{Decimal(value):.3e}"


def _seed(path: str, value: int) -> None:
    """A seed torch.manual_seed takes (with room for the trainer's seed + rank)."""
    if not SEED_MIN <= value <= SEED_MAX:
        _fail(path, f"must be from -2**63 to 2**63 - 1, got {value}")


def _coerce(path: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; build nested dataclasses."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(path, value, arg)
            except _OutOfRange:
                raise
            except ConfigError:
                pass
        _fail(path, f"expected {_type_name(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            _fail(path, f"expected a mapping for {tp.__name__}, got {value!r}")
        return _from_dict(_variant(tp, value, path), value, path)
    if origin is dict:
        if not isinstance(value, dict):
            _fail(path, f"expected a mapping, got {value!r}")
        return dict(value)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            _fail(path, f"expected a list, got {value!r}")
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        items = [_coerce(f"{path}[{i}]", v, item_tp) for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        _fail(path, f"expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            _fail(path, f"expected an integer, got {value!r}")
        if not SEED_MIN <= value <= SEED_MAX:  # torch's sizes and counts are int64
            message = f"must be from -2**63 to 2**63 - 1 (torch's int64), got {_short(value)}"
            raise _OutOfRange(f"{path}: {message}" if path else message)
        return value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # an integer of more than ~308 digits
                _fail(path, "expected a number, got an integer beyond the float range")
        _fail(path, f"expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        _fail(path, f"expected a string, got {value!r}")
    return value


def _variant(tp: type, data: dict[str, Any], path: str) -> type:
    """A config class with registered variants (``ModelConfig`` by ``arch``) picks the
    subclass that the data's discriminating key names."""
    key = getattr(tp, "_variant_key", None)
    if key is None or key not in data:
        return tp
    variants = tp._variants  # type: ignore[attr-defined]
    name = data[key]
    where = f"{path}.{key}" if path else key
    if not isinstance(name, str):  # (a list or mapping cannot even be looked up)
        _fail(where, f"expected a string, got {name!r}")
    if name not in variants:
        import attnlab.models  # noqa: F401  (model families register their configs)
    if name not in variants:
        _fail(where, f"unknown value {name!r}; choose one of {', '.join(variants)}")
    return variants[name]


def _type_name(tp: Any) -> str:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (list, tuple):
        return f"a list of {_type_name(args[0])}" if args else "a list"
    if args:
        return " or ".join(_type_name(a) for a in args)
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _from_dict(cls: type[T], data: dict[str, Any], path: str = "") -> T:
    if not isinstance(data, dict):
        _fail(path, f"expected a mapping for {cls.__name__}, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else key
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(names)}"
            _fail(where, f"unknown key{hint}")
        kwargs[key] = _coerce(where, value, hints[key])
    return cls(**kwargs)


class _Config:
    """Shared behaviour: dict/JSON round trip, dotted overrides, validation."""

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any]) -> T:
        cfg = _from_dict(_variant(cls, data, ""), data)
        cfg.validate()  # type: ignore[attr-defined]
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls: type[T], text: str) -> T:
        return cls.from_dict(json.loads(text))  # type: ignore[attr-defined]

    def save(self, path: str | Path) -> None:
        atomic_write_text(path, self.to_json() + "\n")

    @classmethod
    def load(cls: type[T], path: str | Path) -> T:
        """Read a JSON config file, naming the file in any error."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(data)  # type: ignore[attr-defined]

    def override(self: T, assignments: dict[str, Any]) -> T:
        """Return a copy with dotted keys replaced: ``{"attention.n_heads": 8}``. Keys of a
        free mapping field (``data.options``) may be added: their owner checks them. A
        mapping given for a section (``{"attention": {"n_heads": 8}}``) is merged into it,
        as a config file's sections are: the section's other keys stay; one given for a
        free mapping replaces it."""
        data = self.to_dict()  # type: ignore[attr-defined]
        for dotted, value in assignments.items():
            node = data
            *parents, leaf = dotted.split(".")
            for i, part in enumerate(parents):
                if not isinstance(node.get(part), dict):
                    sections = sorted(k for k, v in node.items() if isinstance(v, dict))
                    close = difflib.get_close_matches(part, sections, n=1)
                    hint = f"; did you mean {close[0]!r}?" if close else ""
                    where = ".".join(parents[:i]) or "the top level"
                    _fail(
                        ".".join(parents[: i + 1]),
                        f"unknown section{hint} (sections of {where}: {', '.join(sections)})",
                    )
                node = node[part]
            owner: Any = self
            for part in parents:
                owner = owner.get(part) if isinstance(owner, dict) else getattr(owner, part, None)
            if leaf not in node and not isinstance(owner, dict):
                close = difflib.get_close_matches(leaf, list(node), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                section = ".".join(parents) or "the top level"
                valid = ", ".join(sorted(node))
                _fail(dotted, f"unknown key{hint} (valid keys of {section}: {valid})")
            current = owner.get(leaf) if isinstance(owner, dict) else getattr(owner, leaf, None)
            if isinstance(value, dict) and dataclasses.is_dataclass(current):
                # a section: the keys not given stay (a free mapping, data.options, is
                # replaced whole: another task's options would linger in it)
                value = deep_merge(node[leaf], value)
            node[leaf] = value
        return type(self).from_dict(data)  # type: ignore[attr-defined]

    def validate(self) -> None:
        """Raise :class:`ConfigError`, naming the field, where a value is out of range or
        conflicts with another; called whenever a config is built or parsed."""
        pass


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """``update`` over ``base``, recursing into sections present in both."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _lr_schedules() -> tuple[str, ...]:
    from attnlab.training.optim import SCHEDULES  # the registry of learning-rate schedules

    return tuple(SCHEDULES)


def _attention_kinds() -> tuple[str, ...]:
    from attnlab.nn.registry import attention_kinds  # the registry of attention modules

    return attention_kinds()


ATTENTION_BACKENDS = backend_names()  # the one list: the registry in functional/attention.py
# relative_bias (T5): no position in the embeddings; a learned bias per head, looked up by
# the bucket of the key's position relative to the query's, added to every layer's scores;
# alibi (Press et al. 2022): no position in the embeddings; a fixed bias -m_h (i - j) per
# head, linear in the distance from query i back to key j, added to every layer's scores;
# disentangled (DeBERTa, He et al. 2021): shared relative-position embeddings that every
# layer projects and scores against its queries and keys (c2p, p2c: nn/disentangled.py)
POSITION_KINDS = (
    "learned", "sinusoidal", "rope", "none", "relative_bias", "alibi", "disentangled"
)  # fmt: skip
# the terms of disentangled attention beside content-to-content: content-to-position (each
# query against the relative-position keys), position-to-content (each key against the
# relative-position queries)
DISENTANGLED_TERMS = ("c2p", "p2c")
# the kinds that add a bias to the self-attention scores (nn/position_bias.py)
POSITION_BIAS_KINDS = ("relative_bias", "alibi")
ROPE_LAYOUTS = ("split", "interleaved")
ROPE_SCALINGS = ("linear", "llama3", "yarn", "longrope")
FFN_KINDS = ("mlp", "glu", "moe")
MLA_PATHS = ("auto", "naive", "absorbed")
LATENT_KINDS = ("mla", "dsa")  # attention kinds built on multi-head latent attention
CAUSAL_KINDS = ("linear", "nsa")  # attention kinds for causal self-attention only
DSA_STAGES = ("warmup", "sparse")
MOE_ROUTERS = ("deepseek-v3", "deepseek-v2")


class MLADims(typing.NamedTuple):
    """The resolved widths of multi-head latent attention (DeepSeek-V2, Sec. 2.1)."""

    q_lora_rank: int | None  # None: queries come from one full-rank projection
    kv_lora_rank: int  # d_c, the latent cached per token
    qk_nope_head_dim: int  # per-head query/key part without position
    qk_rope_head_dim: int  # d_h^R, the decoupled RoPE part (one key shared by every head)
    v_head_dim: int


# elementwise: act(x); relu2 is the squared ReLU, relu(x)^2 (Primer; Persimmon, Nemotron)
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "sigmoid", "relu2")
# Gated activations of both projections (gate, up) at once, for gated FFNs and experts only
# (nn/feedforward.py): GPT-OSS's clamped SwiGLU.
GATED_ACTIVATIONS = ("clamped_swiglu",)
# gemma_rmsnorm: RMSNorm whose weight is stored as an offset from one, x / rms(x) * (1 + w),
# scaled in float32 before casting back (Gemma); layernorm1p: LayerNorm whose weight is stored
# the same way, (x - mean) / std * (1 + w) + b, in x's dtype (Nemotron's LayerNorm1P)
NORM_KINDS = ("layernorm", "rmsnorm", "gemma_rmsnorm", "layernorm1p")
# sandwich (Gemma 2 and 3): x + post_norm(f(pre_norm(x))), a norm on each side of f;
# post_sublayer (OLMo 2): x + post_norm(f(x)), a norm on f's output only, inside the residual;
# parallel (GPT-NeoX, Pythia): x + attn(norm1(x)) + ffn(norm2(x)), both sublayers reading the
# block's input; parallel_shared (Phi-1/1.5/2, GPT-J, Cohere): the same with one norm,
# x + attn(norm(x)) + ffn(norm(x)) (nn/parallel_block.py)
NORM_PLACEMENTS = ("pre", "post", "sandwich", "post_sublayer", "parallel", "parallel_shared")
PARALLEL_NORM_PLACEMENTS = ("parallel", "parallel_shared")
# Placements only the decoder builds (its blocks and final norm); other architectures refuse
DECODER_NORM_PLACEMENTS = ("sandwich", "post_sublayer", *PARALLEL_NORM_PLACEMENTS)
# What QK-norm normalises (attention.qk_norm_scope): each head's d_h features (Qwen3, Gemma 3)
# or the whole query and key projections, h d_h and h_kv d_h wide, before the split into heads
# (OLMo 2)
QK_NORM_SCOPES = ("head", "projection")
# QK-norm's kind (attention.qk_norm_kind): an RMSNorm (Qwen3, Gemma 3, OLMo 2; Gemma's unit
# offset where norm.kind is gemma_rmsnorm) or a LayerNorm, mean subtracted (Phi, Cohere,
# StableLM), with a bias where attention.qk_norm_bias says (Phi's)
QK_NORM_KINDS = ("rmsnorm", "layernorm")
# Whose QK-norm weight (attention.qk_norm_weight): one of d_h that every head shares (Qwen3,
# Phi), or one of d_h per head, (h, d_h) for the queries, (h_kv, d_h) for the keys (Cohere's
# Command R+, StableLM 2 12B). Scope "projection" has one weight over the whole width already.
QK_NORM_WEIGHTS = ("shared", "per_head")


@dataclass
class AttentionConfig(_Config):
    """Self-attention. MHA: n_kv_heads == n_heads; GQA: divides n_heads; MQA: 1."""

    kind: str = "mha"
    n_heads: int = 4
    n_kv_heads: int | None = None  # None means n_heads (MHA)
    head_dim: int | None = None  # None means d_model // n_heads
    qkv_bias: bool = False
    out_bias: bool = False
    dropout: float = 0.0  # on the attention weights
    # Each query sees the last `sliding_window` positions, its own included (keys k > p - w)
    sliding_window: int | None = None
    # Which layers use the window: None = every layer; else a string of "L" (local, the
    # window) and "G" (global) cycled over the layers: "LLLG" is 3 local : 1 global,
    # "LLLLLG" Gemma 3's 5 : 1. Windowed layers keep a ring of `sliding_window` entries.
    layer_pattern: str | None = None
    # Attention sinks (StreamingLLM, Xiao et al. 2023): the first `sink_tokens` tokens stay
    # visible to every query of a windowed layer, and the window counts them: a query sees
    # at most sliding_window keys, the sinks and the last sliding_window - sink_tokens
    # positions, its own included. transformers' SinkCache(window_length=sliding_window,
    # num_sink_tokens=sink_tokens); the paper's code's start_size=sink_tokens,
    # recent_size=sliding_window - sink_tokens - 1 (its cache excludes the query). Decoding
    # keeps un-rotated keys and places them at their positions within the cache, as the
    # paper does.
    sink_tokens: int = 0
    # Global tokens (Longformer, Beltagy et al. 2020): these absolute positions attend to
    # every position and every position attends to them, beside the local sliding_window
    # (which they need: without a window every causal query already sees them). Distinct,
    # increasing, below max_seq_len. Cached decoding keeps their keys for good (like
    # sinks, at their own positions), so they must lie inside the first window there.
    global_tokens: list[int] = field(default_factory=list)
    # Learned sink logit per head (GPT-OSS): one more softmax column with no value.
    sink_logits: bool = False
    # QK-norm (Qwen3): an RMSNorm (qk_norm_kind) over each head's query and key features
    # (one weight of head_dim for the query heads, one for the key heads: qk_norm_weight;
    # eps = norm.eps), after the projections and before RoPE and the cache. Multi-head
    # attention only.
    qk_norm: bool = False
    # What QK-norm normalises: "head", each head's features as above; "projection" (OLMo 2),
    # all the queries at once (one weight of n_heads * head_dim) and all the keys (one of
    # n_kv_heads * head_dim), before the split into heads, RoPE and the cache.
    qk_norm_scope: str = "head"
    # QK-norm's kind, "rmsnorm" (x / rms(x) * g, as above; g stored as g - 1 where norm.kind
    # is gemma_rmsnorm) or "layernorm" ((x - mean) / std * g, normalised and scaled in
    # float32), and whether it adds a bias (LayerNorm only).
    qk_norm_kind: str = "rmsnorm"
    qk_norm_bias: bool = False
    # "shared": one weight (and bias) of head_dim for all query heads, one for all key heads;
    # "per_head": each head its own, (n_heads, head_dim) and (n_kv_heads, head_dim).
    qk_norm_weight: str = "shared"
    # The softmax scale of q . k: None is 1 / sqrt(head_dim); Gemma 3 sets
    # query_pre_attn_scalar**-0.5. Multi-head attention only.
    scale: float | None = None
    # Clamp every q, k and v feature to [-clip_qkv, clip_qkv] straight after the projection
    # (MPT's clip_qkv, before the split into heads). None: no clamp. Multi-head attention only.
    clip_qkv: float | None = None
    # Attention logit soft-capping (Gemma 2): the scaled scores become
    # softcap * tanh(scores / softcap) before the mask. None: no cap. Multi-head attention
    # only, with a backend that caps the scores: eager, flash, triton or flex (not sdpa).
    softcap: float | None = None
    backend: str = "sdpa"
    # Multi-head latent attention (kind "mla", DeepSeek-V2). None derives a width from
    # d_h = d_model // n_heads as the paper does: d_c = 4 d_h, d_h^R = d_h / 2, and d_h for
    # the no-position query/key part and the values. q_lora_rank None: no query compression.
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    # "naive" rebuilds per-head keys/values from the latent; "absorbed" folds the up-projections
    # into the query and output and attends in latent space; "auto" takes the cheaper one.
    mla_path: str = "auto"
    # DeepSeek sparse attention (kind "dsa", DeepSeek-V3.2): MLA whose queries attend only to
    # the index_topk keys a lightning indexer picks: index_n_heads heads of index_head_dim
    # (None: max(32, qk_rope_head_dim)) from the query latent, one key per token. Needs
    # q_lora_rank (the indexer's queries come from the query latent).
    index_topk: int = 64
    index_n_heads: int = 4
    index_head_dim: int | None = None
    # "warmup": dense attention, only the indexer trains (KL to the attention distribution,
    # everything else frozen); "sparse": top-k attention, indexer by KL on its selection.
    dsa_stage: str = "sparse"
    index_hadamard: bool = False  # rotate index q/k by a Hadamard matrix (reference inference)
    index_fp8: bool = False  # simulate FP8 (e4m3) per-block quantisation of index q/k
    # Native sparse attention (kind "nsa", Yuan et al. 2025): compressed blocks of
    # nsa_block_len keys every nsa_stride, nsa_n_select selected blocks of nsa_select_len
    # (counting the initial block and 2 local blocks, always selected, as the paper's runs),
    # a sliding window of nsa_window; branches mixed by learned sigmoid gates.
    nsa_block_len: int = 8
    nsa_stride: int = 4
    nsa_select_len: int = 8
    nsa_n_select: int = 4
    nsa_window: int = 32

    # Fields that change how a model trains, not its parameters: a resumed run may change
    # them (DSA: dense warm-up, then the sparse stage; the number of keys selected).
    STAGE_FIELDS: typing.ClassVar[tuple[str, ...]] = ("dsa_stage", "index_topk")

    _MLA_FIELDS: typing.ClassVar[tuple[str, ...]] = (
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
    )

    def mla_dims(self, d_model: int) -> MLADims:
        """The latent-attention widths for a model of width ``d_model``: each field as set,
        or derived from the head size (kv_lora_rank 4 d_h, qk_nope_head_dim d_h, ...)."""
        d_h = self.head_dim or d_model // self.n_heads
        return MLADims(
            self.q_lora_rank,
            self.kv_lora_rank or 4 * d_h,
            self.qk_nope_head_dim or d_h,
            self.qk_rope_head_dim or max(2, d_h // 2 // 2 * 2),  # even: RoPE rotates pairs
            self.v_head_dim or d_h,
        )

    def index_dim(self, d_model: int) -> int:
        """d_I, the lightning indexer's head width (DSA)."""
        return self.index_head_dim or max(32, self.mla_dims(d_model).qk_rope_head_dim)

    def rope_dim(self, d_model: int) -> int:
        """Width that RoPE rotates in each query/key head."""
        if self.kind in LATENT_KINDS:
            return self.mla_dims(d_model).qk_rope_head_dim
        return self.head_dim or d_model // self.n_heads

    def _validate_sparse(self, path: str, d_model: int) -> None:
        _choice(f"{path}.dsa_stage", self.dsa_stage, DSA_STAGES)
        if self.kind == "dsa":
            for name in ("index_topk", "index_n_heads", "index_head_dim"):
                _positive(f"{path}.{name}", getattr(self, name))
            if self.q_lora_rank is None:
                _fail(
                    f"{path}.q_lora_rank",
                    "DSA's lightning indexer reads the query latent: set q_lora_rank "
                    "(the MLA query compression rank)",
                )
            d_i, d_r = self.index_dim(d_model), self.mla_dims(d_model).qk_rope_head_dim
            if d_i < d_r:
                _fail(
                    f"{path}.index_head_dim",
                    f"{d_i} is narrower than qk_rope_head_dim={d_r}, which it rotates",
                )
            if self.index_hadamard and d_i & (d_i - 1):
                _fail(
                    f"{path}.index_head_dim", f"a Hadamard rotation needs a power of 2, got {d_i}"
                )
            if self.index_fp8 and d_i > 128 and d_i % 128:
                _fail(
                    f"{path}.index_head_dim",
                    f"FP8 quantises blocks of 128 values: give up to 128 or a multiple, got {d_i}",
                )
        if self.kind == "nsa":
            names = ("nsa_block_len", "nsa_stride", "nsa_select_len", "nsa_n_select", "nsa_window")
            for name in names:
                _positive(f"{path}.{name}", getattr(self, name))
            if self.nsa_block_len % self.nsa_stride:
                _fail(
                    f"{path}.nsa_stride",
                    f"{self.nsa_stride} must divide nsa_block_len={self.nsa_block_len} "
                    "(compression blocks overlap by whole strides)",
                )
            if self.nsa_select_len % self.nsa_stride:  # Eq. 9 needs d | l' (and d | l)
                _fail(
                    f"{path}.nsa_select_len",
                    f"{self.nsa_select_len} must be a multiple of nsa_stride={self.nsa_stride} "
                    "(NSA Eq. 9 weighs compression blocks by the strides they share with a "
                    "selection block)",
                )
            if self.nsa_n_select < 3:
                _fail(
                    f"{path}.nsa_n_select",
                    f"must be >= 3, got {self.nsa_n_select} (the selected blocks count the "
                    "initial block and 2 local blocks, which are always selected)",
                )
            for name in ("sliding_window", "sink_tokens", "sink_logits"):
                if getattr(self, name):
                    _fail(f"{path}.{name}", "does not apply to NSA, which has its own window: "
                          "use nsa_window")  # fmt: skip
            if self.dropout:  # its three branches attend without dropout (nn/sparse.py)
                _fail(f"{path}.dropout", "is not implemented for attention.kind='nsa'; set it to 0")

    def _validate_mla(self, path: str, d_model: int) -> None:
        self._validate_sparse(path, d_model)
        if self.kind not in LATENT_KINDS:
            for name in self._MLA_FIELDS:
                if getattr(self, name) is not None:
                    _fail(
                        f"{path}.{name}",
                        f"is used by attention.kind='mla' or 'dsa' only, not {self.kind!r}",
                    )
            return
        for name in self._MLA_FIELDS:
            _positive(f"{path}.{name}", getattr(self, name))
        if self.n_kv_heads not in (None, self.n_heads):
            _fail(
                f"{path}.n_kv_heads",
                "MLA shares one latent among all heads; leave n_kv_heads unset",
            )
        dims = self.mla_dims(d_model)
        if dims.qk_rope_head_dim % 2:
            _fail(
                f"{path}.qk_rope_head_dim",
                f"RoPE rotates pairs, so it must be even, got {dims.qk_rope_head_dim}",
            )
        per_head = self.n_heads * (dims.qk_nope_head_dim + dims.v_head_dim)
        if dims.kv_lora_rank >= per_head:
            _fail(
                f"{path}.kv_lora_rank",
                f"{dims.kv_lora_rank} is not a compression: the keys and values it expands to "
                f"have n_heads * (qk_nope_head_dim + v_head_dim) = {per_head} values; "
                "use a smaller rank (or kind='mha')",
            )
        if dims.q_lora_rank is not None:
            q_width = self.n_heads * (dims.qk_nope_head_dim + dims.qk_rope_head_dim)
            if dims.q_lora_rank >= q_width:
                _fail(
                    f"{path}.q_lora_rank",
                    f"{dims.q_lora_rank} is not a compression of the {q_width}-wide queries; "
                    "use a smaller rank, or leave it unset for a full-rank query projection",
                )

    def validate(self, path: str = "attention") -> None:
        _choice(f"{path}.kind", self.kind, _attention_kinds())
        _choice(f"{path}.backend", self.backend, ATTENTION_BACKENDS)
        _choice(f"{path}.mla_path", self.mla_path, MLA_PATHS)
        _positive(f"{path}.n_heads", self.n_heads)
        _positive(f"{path}.n_kv_heads", self.n_kv_heads)
        _positive(f"{path}.head_dim", self.head_dim)
        _positive(f"{path}.sliding_window", self.sliding_window)
        if self.layer_pattern is not None:
            if not self.layer_pattern or set(self.layer_pattern) - {"L", "G"}:
                _fail(
                    f"{path}.layer_pattern",
                    f"must be a non-empty string of L (local) and G (global), "
                    f"got {self.layer_pattern!r}",
                )
            if self.sliding_window is None:
                _fail(f"{path}.layer_pattern", "local layers need attention.sliding_window")
        _positive(f"{path}.sink_tokens", self.sink_tokens, allow_zero=True)
        if self.sink_tokens and (
            self.sliding_window is None or self.sliding_window <= self.sink_tokens
        ):
            _fail(
                f"{path}.sink_tokens",
                f"{self.sink_tokens} sinks need a sliding_window larger than them, got "
                f"{self.sliding_window}",
            )
        if self.sink_logits and self.sink_tokens:
            _fail(f"{path}.sink_logits", "cannot be combined with sink_tokens (yet)")
        if self.kind in LATENT_KINDS:  # sinks are multi-head attention's (nn/attention.py)
            for name in ("sink_tokens", "sink_logits"):
                if getattr(self, name):
                    _fail(f"{path}.{name}", f"is implemented by attention.kind='mha' only, "
                          f"not {self.kind!r}")  # fmt: skip
        self._validate_global(path)
        if self.qk_norm and self.kind != "mha":
            _fail(f"{path}.qk_norm", f"is implemented by attention.kind='mha' only, not "
                  f"{self.kind!r}; set it to false")  # fmt: skip
        _choice(f"{path}.qk_norm_scope", self.qk_norm_scope, QK_NORM_SCOPES)
        if self.qk_norm_scope != "head" and not self.qk_norm:
            _fail(f"{path}.qk_norm_scope", f"{self.qk_norm_scope!r} says what QK-norm "
                  "normalises, and attention.qk_norm is false: set it to true, or the scope "
                  "to 'head'")  # fmt: skip
        self._validate_qk_norm(path)
        _positive(f"{path}.scale", self.scale)
        if self.scale is not None and self.kind != "mha":
            _fail(f"{path}.scale", f"is implemented by attention.kind='mha' only, not "
                  f"{self.kind!r}; set it to null")  # fmt: skip
        _positive(f"{path}.clip_qkv", self.clip_qkv)
        if self.clip_qkv is not None and self.kind != "mha":
            _fail(f"{path}.clip_qkv", f"is implemented by attention.kind='mha' only, not "
                  f"{self.kind!r}; set it to null")  # fmt: skip
        self._validate_softcap(path)
        if not 0.0 <= self.dropout < 1.0:
            _fail(f"{path}.dropout", f"must be in [0, 1), got {self.dropout}")
        if self.kind == "linear":  # a running sum over every past token: no window, no sinks,
            linear_off = ("sliding_window", "layer_pattern", "sink_tokens", "sink_logits")
            for name in (*linear_off, "dropout"):  # no attention weights to drop
                if getattr(self, name):
                    _fail(f"{path}.{name}", "does not apply to attention.kind='linear'")
            if self.backend not in ("eager", "sdpa"):  # (sdpa: the default)
                _fail(f"{path}.backend", "does not apply to attention.kind='linear', which "
                      f"forms no softmax attention for {self.backend!r}; leave it at sdpa or "
                      "eager")  # fmt: skip
        if self.n_heads % self.kv_heads:
            _fail(
                f"{path}.n_kv_heads",
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.kv_heads}; "
                "use a divisor of n_heads (n_heads for MHA, 1 for MQA)",
            )

    def _validate_qk_norm(self, path: str) -> None:
        """QK-norm's kind, bias and weights: each off (its default) without QK-norm."""
        _choice(f"{path}.qk_norm_kind", self.qk_norm_kind, QK_NORM_KINDS)
        _choice(f"{path}.qk_norm_weight", self.qk_norm_weight, QK_NORM_WEIGHTS)
        if not self.qk_norm:
            for name, default in (("qk_norm_kind", "rmsnorm"), ("qk_norm_bias", False),
                                  ("qk_norm_weight", "shared")):  # fmt: skip
                value = getattr(self, name)
                if value != default:
                    shown = [str(v).lower() if isinstance(v, bool) else repr(v)
                             for v in (value, default)]  # fmt: skip
                    _fail(f"{path}.{name}", f"{shown[0]} says what QK-norm is, and "
                          f"attention.qk_norm is false: set it to true, or {name} to "
                          f"{shown[1]}")  # fmt: skip
        if self.qk_norm_bias and self.qk_norm_kind != "layernorm":
            _fail(f"{path}.qk_norm_bias", "an RMSNorm has no bias: set attention.qk_norm_kind "
                  "to 'layernorm', or qk_norm_bias to false")  # fmt: skip
        if self.qk_norm_weight == "per_head" and self.qk_norm_scope != "head":
            _fail(f"{path}.qk_norm_weight", f"'per_head' needs attention.qk_norm_scope='head' "
                  f"(scope {self.qk_norm_scope!r} has one weight over the whole width, each "
                  "head's features their own already)")  # fmt: skip

    def _validate_softcap(self, path: str) -> None:
        _positive(f"{path}.softcap", self.softcap)
        if self.softcap is None:
            return
        if self.kind != "mha":
            _fail(f"{path}.softcap", f"is implemented by attention.kind='mha' only, not "
                  f"{self.kind!r}; set it to null")  # fmt: skip
        if self.backend not in SOFTCAP_BACKENDS:
            _fail(f"{path}.backend", softcap_refusal(self.backend))

    def _validate_global(self, path: str) -> None:
        g, at = self.global_tokens, f"{path}.global_tokens"
        if not g:
            return
        if any(p < 0 for p in g) or any(a >= b for a, b in zip(g, g[1:])):
            _fail(at, f"must be distinct positions >= 0 in increasing order, got {g}")
        if self.sliding_window is None:
            _fail(at, "global tokens only change a windowed layer; set attention.sliding_window")
        if self.kind != "mha":
            _fail(at, f"is implemented by attention.kind='mha' only, not {self.kind!r}")
        for name in ("sink_tokens", "sink_logits"):
            if getattr(self, name):
                _fail(at, f"cannot be combined with {name} (leading global tokens are sinks)")

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``n_kv_heads``, or ``n_heads`` (multi-head attention) when unset."""
        return self.n_kv_heads or self.n_heads

    def window_of(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None: global attention)."""
        if self.layer_pattern is None:
            return self.sliding_window
        local = self.layer_pattern[layer % len(self.layer_pattern)] == "L"
        return self.sliding_window if local else None

    def for_layer(self, layer: int) -> AttentionConfig:
        """This config with the sliding window of layer ``layer`` resolved."""
        if self.layer_pattern is None:
            return self
        window = self.window_of(layer)
        local = window is not None  # global layers see everything: no sinks, no global tokens
        return dataclasses.replace(
            self,
            sliding_window=window,
            layer_pattern=None,
            sink_tokens=self.sink_tokens if local else 0,
            global_tokens=list(self.global_tokens) if local else [],
        )


@dataclass
class PositionConfig(_Config):
    """Token positions: ``kind`` is learned, sinusoidal, rope or none; the ``rope_*``
    fields set RoPE's base ``rope_theta``, layout and context-extension scaling."""

    kind: str = "learned"
    rope_theta: float = 10000.0
    rope_layout: str = "split"  # "split" halves (LLaMA/HF) or "interleaved" pairs (RoFormer)
    # Context extension by rescaling frequencies: None, "linear" (position interpolation,
    # Chen et al. 2023: every frequency / factor) or "llama3" (low frequencies / factor,
    # high ones kept, a smooth ramp between, as in LLaMA 3.1).
    rope_scaling: str | None = None
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0  # llama3 only
    rope_high_freq_factor: float = 4.0  # llama3 only
    # llama3, yarn, longrope: the context length before scaling (LongRoPE: the longest
    # context of its short factors)
    rope_original_max_seq_len: int = 8192
    # "yarn" (Peng et al. 2023): frequencies with fewer than beta_slow rotations over the
    # original context are divided by factor, those with more than beta_fast are kept, a ramp
    # between (its bounds rounded outward to whole pairs unless rope_truncate is false, as
    # in gpt-oss); cos/sin are multiplied by rope_attention_factor, or when it is null by
    # mscale(factor, mscale) / mscale(factor, mscale_all_dim), and DeepSeek's MLA multiplies
    # its softmax scale by mscale(factor, mscale_all_dim)^2.
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float | None = None
    rope_mscale_all_dim: float | None = None
    rope_truncate: bool = True  # yarn only
    rope_attention_factor: float | None = None  # yarn and longrope
    # "longrope" (Phi-3, Ding et al. 2024): pair i's frequency is divided by
    # rope_short_factor[i] while a forward pass's positions stay within
    # rope_original_max_seq_len, by rope_long_factor[i] (for every position) once one lies
    # past it; cos/sin are multiplied by rope_attention_factor, or when it is null by
    # sqrt(1 + ln(rope_factor) / ln(rope_original_max_seq_len)) (1 for rope_factor <= 1;
    # rope_factor: how far the context was stretched, transformers' max_position_embeddings
    # / original_max_position_embeddings). One factor per rotated pair: rope_dim / 2.
    rope_short_factor: list[float] | None = None
    rope_long_factor: list[float] | None = None
    # The fraction of each query/key head RoPE rotates (transformers' partial_rotary_factor,
    # Phi-4-mini's 0.75): the first int(head_dim * rope_fraction) features, pairs laid out
    # within them; the rest pass unrotated. Decoders with attention.kind 'mha' only.
    rope_fraction: float = 1.0
    # A second RoPE base for the local (sliding-window) layers, unscaled, as Gemma 3's
    # rope_local_base_freq and ModernBERT's local_rope_theta; None: every layer uses
    # rope_theta and its scaling. Decoder and encoder only.
    local_rope_theta: float | None = None
    # NoPE layers (SmolLM3's no_rope_layers = 0): the indices of the layers that rotate
    # nothing, their queries and keys passed as projected; every other layer takes RoPE.
    # Decoders with attention.kind 'mha' and position.kind 'rope' only.
    nope_layers: list[int] = field(default_factory=list)
    # Learned positions counted past a padding id, as RoBERTa's (fairseq's make_positions):
    # the token id that is padding (transformers' pad_token_id). A token's position is
    # padding_idx + 1 + the number of non-padding tokens up to it (padding_idx + 1 for a
    # row's first real token, whatever padding precedes it), a padding token's is
    # padding_idx, and neither that row of the table nor the padding token's embedding is
    # trained (transformers' padding_idx). The table holds max_seq_len + padding_idx + 1
    # rows (RoBERTa's max_position_embeddings 514 for 512 tokens). None: positions 0, 1, ...
    # Encoders with position.kind 'learned' only; encoder–decoders count sinusoidal positions
    # so (M2M100's, fairseq's: see Seq2SeqConfig).
    padding_idx: int | None = None
    # kind "relative_bias" (T5's relative_attention_num_buckets and _max_distance): the
    # buckets of relative positions (half per sign in an encoder) and the distance from which
    # all share the last one; exact below buckets / 2 (/ 4 in an encoder), logarithmic above
    relative_buckets: int = 32
    relative_max_distance: int = 128
    # kind "relative_bias": a table in every layer (UMT5's), not one per stack shared by its
    # layers (T5's, kept in the first layer)
    relative_bias_per_layer: bool = False
    # kind "alibi": head h of n has the slope m_h = 2^(-alibi_max_bias h / n) (n a power of
    # two; else BLOOM's and MPT's interleaving: nn/position_bias.py), 8 in the paper, BLOOM
    # and MPT (its alibi_bias_max)
    alibi_max_bias: float = 8.0
    # kind "alibi": the bias is multiplied by the softmax scale with q . k, softmax((q . k +
    # bias) * scale), as Falcon-RW adds it (else softmax(q . k * scale + bias), BLOOM's)
    alibi_scaled: bool = False
    # kind "alibi": the slopes, and each slope times a key's absolute position, rounded to
    # bfloat16 as transformers' Falcon forms them (its build_alibi_tensor; the original
    # Falcon-RW code's too); the bias is then that of the key alone (softmax ignores a
    # constant per query). Decoders only.
    alibi_bfloat16: bool = False
    # kind "disentangled" (DeBERTa-v2/v3, transformers' DebertaV2 names in brackets): the
    # score terms beside q . k (pos_att_type), each one more unit in the scale 1 /
    # sqrt(d_h (1 + len(terms))); relative positions (query - key) log-bucketed past
    # disentangled_buckets / 2 (position_buckets; 0: not bucketed) up to
    # disentangled_max_distance (max_relative_positions), then clamped to the table of
    # 2 x (disentangled_buckets, or disentangled_max_distance unbucketed) shared embeddings
    disentangled_terms: list[str] = field(default_factory=lambda: ["c2p", "p2c"])
    disentangled_buckets: int = 256
    disentangled_max_distance: int = 512
    # the relative embeddings projected by each layer's own query and key projections
    # (share_att_key, v3's), else by separate pos_key / pos_query projections (v2's)
    disentangled_share_key: bool = True
    # a LayerNorm on the shared relative embeddings (norm_rel_ebd "layer_norm")
    disentangled_norm: bool = True
    # learned absolute positions added to the token embeddings too (position_biased_input,
    # v2-base's; v3 has none)
    disentangled_absolute: bool = False

    def disentangled_span(self) -> int:
        """k, half the rows of the relative-embedding table (2 k rows, indices
        clamp(bucket + k, 0, 2 k - 1))."""
        return self.disentangled_buckets or self.disentangled_max_distance

    def validate(self, path: str = "position") -> None:
        _choice(f"{path}.kind", self.kind, POSITION_KINDS)
        self._validate_disentangled(path)
        self._validate_relative_bias(path)
        self._validate_alibi(path)
        _choice(f"{path}.rope_layout", self.rope_layout, ROPE_LAYOUTS)
        _positive(f"{path}.rope_theta", self.rope_theta)
        if self.rope_scaling is not None:
            _choice(f"{path}.rope_scaling", self.rope_scaling, ROPE_SCALINGS)
        _positive(f"{path}.rope_factor", self.rope_factor)
        _positive(f"{path}.rope_low_freq_factor", self.rope_low_freq_factor)
        _positive(f"{path}.rope_high_freq_factor", self.rope_high_freq_factor)
        for name in ("rope_mscale", "rope_mscale_all_dim"):  # YaRN's temperatures
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                _fail(f"{path}.{name}", f"must be a finite number or null, got {value}")
        if self.rope_attention_factor is not None:
            _positive(f"{path}.rope_attention_factor", self.rope_attention_factor)
        _positive(f"{path}.rope_original_max_seq_len", self.rope_original_max_seq_len)
        if self.rope_scaling == "longrope" and self.rope_original_max_seq_len < 2:
            # the default attention factor divides by ln(rope_original_max_seq_len)
            got = self.rope_original_max_seq_len
            _fail(f"{path}.rope_original_max_seq_len", f"must be >= 2 with longrope, got {got}")
        _positive(f"{path}.rope_beta_fast", self.rope_beta_fast)
        _positive(f"{path}.rope_beta_slow", self.rope_beta_slow)
        _positive(f"{path}.local_rope_theta", self.local_rope_theta)
        if self.local_rope_theta is not None and self.kind != "rope":
            _fail(f"{path}.local_rope_theta", f"needs position.kind 'rope', got {self.kind!r}")
        if self.rope_scaling == "yarn" and self.rope_theta <= 1:
            # YaRN finds its ramp by ln(theta): frequencies must fall with the pair index
            _fail(f"{path}.rope_theta", f"must be > 1 with yarn scaling, got {self.rope_theta}")
        if self.rope_scaling == "yarn" and self.rope_beta_fast <= self.rope_beta_slow:
            _fail(f"{path}.rope_beta_fast", "must be larger than rope_beta_slow")
        if (
            self.rope_scaling == "llama3"
            and self.rope_high_freq_factor <= self.rope_low_freq_factor
        ):
            _fail(f"{path}.rope_high_freq_factor", "must be larger than rope_low_freq_factor")
        for name in ("rope_short_factor", "rope_long_factor"):  # LongRoPE's rescale factors
            factors = getattr(self, name)
            if self.rope_scaling != "longrope":
                if factors is not None:
                    _fail(
                        f"{path}.{name}",
                        "is read by rope_scaling 'longrope' only; set it to null or set "
                        "rope_scaling to 'longrope'",
                    )
            elif not factors:
                _fail(
                    f"{path}.{name}",
                    "rope_scaling 'longrope' needs one factor per rotated pair of dimensions "
                    "(rope_dim / 2)",
                )
            else:
                for i, f in enumerate(factors):
                    _positive(f"{path}.{name}[{i}]", f)
        if not 0.0 < self.rope_fraction <= 1.0:  # (written so that NaN fails too)
            _fail(f"{path}.rope_fraction", f"must be in (0, 1], got {self.rope_fraction}")
        if self.rope_fraction != 1.0 and self.kind != "rope":
            _fail(f"{path}.rope_fraction", f"needs position.kind 'rope', got {self.kind!r}")
        n = self.nope_layers
        if any(i < 0 for i in n) or any(a >= b for a, b in zip(n, n[1:])):
            _fail(
                f"{path}.nope_layers", f"must be distinct layers >= 0 in increasing order, got {n}"
            )
        if n and self.kind != "rope":
            _fail(f"{path}.nope_layers", f"needs position.kind 'rope', got {self.kind!r}")
        if self.padding_idx is not None:
            _positive(f"{path}.padding_idx", self.padding_idx, allow_zero=True)
            if self.kind not in ("learned", "sinusoidal"):
                _fail(f"{path}.padding_idx", f"counts learned (or an encoder–decoder's "
                      f"sinusoidal) positions; needs position.kind 'learned', got "
                      f"{self.kind!r} (or set it to null)")  # fmt: skip

    def _only_with_kind(self, kind: str, path: str, *names: str) -> None:
        """Fields read by position.kind ``kind`` only: set away from their defaults under
        another kind they would do nothing, so they are refused by name."""
        if self.kind == kind:
            return
        defaults = {f.name: f for f in dataclasses.fields(self)}
        for name in names:
            f = defaults[name]
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            if getattr(self, name) != default:
                _fail(f"{path}.{name}", f"needs position.kind {kind!r}, got {self.kind!r} "
                      f"(or leave it at its default, {json.dumps(default)})")  # fmt: skip

    def _validate_disentangled(self, path: str) -> None:
        """Disentangled attention's fields: read by kind 'disentangled' only; one or two
        distinct terms; a logarithmic range above the exact bucket distances."""
        self._only_with_kind("disentangled", path, "disentangled_absolute",
                             "disentangled_terms", "disentangled_buckets",
                             "disentangled_max_distance", "disentangled_share_key",
                             "disentangled_norm")  # fmt: skip
        terms = self.disentangled_terms
        for i, term in enumerate(terms):
            _choice(f"{path}.disentangled_terms[{i}]", term, DISENTANGLED_TERMS)
        if len(set(terms)) != len(terms):
            _fail(f"{path}.disentangled_terms", f"lists a term twice: {terms}")
        if self.kind == "disentangled" and not terms:
            _fail(f"{path}.disentangled_terms", "needs c2p, p2c or both (without either the "
                  "relative positions reach no score: use position.kind 'none')")  # fmt: skip
        _positive(f"{path}.disentangled_buckets", self.disentangled_buckets, allow_zero=True)
        _positive(f"{path}.disentangled_max_distance", self.disentangled_max_distance)
        mid = self.disentangled_buckets // 2
        if self.disentangled_buckets and self.disentangled_max_distance - 1 <= mid:
            _fail(f"{path}.disentangled_max_distance", f"must exceed disentangled_buckets / 2 "
                  f"+ 1 = {mid + 1} (the exact distances), got "
                  f"{self.disentangled_max_distance}")  # fmt: skip
        if self.disentangled_buckets == 1:
            _fail(f"{path}.disentangled_buckets", "must be 0 (no buckets) or >= 2, got 1")

    def _validate_alibi(self, path: str) -> None:
        """ALiBi's fields: read by kind 'alibi' only, a positive finite largest bias."""
        self._only_with_kind("alibi", path, "alibi_max_bias", "alibi_scaled", "alibi_bfloat16")
        if not (math.isfinite(self.alibi_max_bias) and self.alibi_max_bias > 0):
            _fail(f"{path}.alibi_max_bias", f"must be a positive number, got {self.alibi_max_bias}")

    def _validate_relative_bias(self, path: str) -> None:
        """The bucket scheme needs one exact bucket per side at least (buckets >= 4: an
        encoder's half holds buckets / 4 exact distances) and a logarithmic range above the
        exact ones (max_distance > buckets / 2, the decoder's exact distances)."""
        self._only_with_kind("relative_bias", path, "relative_buckets",
                             "relative_max_distance", "relative_bias_per_layer")  # fmt: skip
        if self.relative_buckets < 4:
            _fail(f"{path}.relative_buckets", f"must be >= 4, got {self.relative_buckets}")
        if self.relative_max_distance <= self.relative_buckets // 2:
            _fail(
                f"{path}.relative_max_distance",
                f"must exceed relative_buckets / 2 = {self.relative_buckets // 2} (the exact "
                f"distances), got {self.relative_max_distance}",
            )

    def rotary_dim(self, head_dim: int) -> int:
        """The features of a head of width ``head_dim`` that RoPE rotates: transformers'
        int(head_dim * partial_rotary_factor)."""
        return head_dim if self.rope_fraction == 1.0 else int(head_dim * self.rope_fraction)


@dataclass
class FFNConfig(_Config):
    """``mlp``: act(x W1) W2. ``glu``: (act(x W_gate) * x W_up) W_down — GLU with sigmoid,
    GeGLU with gelu, SwiGLU with silu; ``clamped_swiglu`` (GPT-OSS, gated kinds only):
    g * sigmoid(swiglu_alpha g) * (u + 1) with g = min(x W_gate, swiglu_limit) and u = x W_up
    clamped to [-swiglu_limit, swiglu_limit].
    ``switch_aux_loss_coef``: the Switch balance loss over all MoE layers (softmax routers)."""

    kind: str = "mlp"
    activation: str = "gelu"
    hidden_dim: int | None = None  # None: 4 d (mlp) or 2/3 * 4 d rounded up (glu, moe)
    multiple_of: int = 256  # glu hidden size is rounded up to a multiple of this
    bias: bool = True
    # Mixture of experts (kind "moe", DeepSeekMoE): gated experts of moe_hidden_dim (None:
    # hidden_size / (n_activated_experts + n_shared_experts), so that a token's active FFN
    # weights equal one dense glu layer); the first first_k_dense layers are dense glu.
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    n_activated_experts: int = 2  # routed experts per token (top-k)
    moe_hidden_dim: int | None = None
    first_k_dense: int = 0
    router: str = "deepseek-v3"  # "deepseek-v3": sigmoid, bias for balance; "-v2": softmax
    n_groups: int = 1  # experts split in groups; each token picks from topk_groups of them
    topk_groups: int = 1
    norm_topk_prob: bool = True  # renormalise the chosen experts' weights to sum to 1
    routed_scaling_factor: float = 1.0
    bias_update_speed: float = 1e-3  # aux-loss-free balance (DeepSeek-V3 gamma)
    seq_aux_loss_coef: float = 0.0  # sequence-wise balance loss (DeepSeek-V3 alpha)
    # Switch Transformer balance loss, coef E sum_i F_i P_i over all MoE layers' choices and
    # softmax scores (Mixtral's, Qwen2-MoE's, Qwen3-MoE's and GPT-OSS's router_aux_loss_coef)
    switch_aux_loss_coef: float = 0.0
    # GPT-OSS: a learned bias on the router's logits (x W_r^T + b), and biases on every
    # expert's gate/up and down projections (routed and shared experts)
    router_bias: bool = False
    expert_bias: bool = False
    # Qwen2-MoE: the shared experts' output multiplied by sigmoid(x w_g), w_g a learned
    # (1, d) weight per layer (``shared_gate``): y = routed(x) + sigmoid(x w_g) shared(x)
    shared_expert_gate: bool = False
    # Layers past the first first_k_dense that are dense gated FFNs too (Qwen2-MoE's and
    # Qwen3-MoE's mlp_only_layers and decoder_sparse_step), in increasing order
    dense_layers: list[int] = field(default_factory=list)
    # activation "clamped_swiglu" (GPT-OSS): the sigmoid's gain and the clamp
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def validate(self, path: str = "ffn") -> None:
        _choice(f"{path}.kind", self.kind, FFN_KINDS)
        _choice(f"{path}.activation", self.activation, ACTIVATIONS + GATED_ACTIVATIONS)
        if self.activation in GATED_ACTIVATIONS and self.kind == "mlp":
            _fail(
                f"{path}.activation",
                f"{self.activation!r} gates an up projection: use ffn.kind 'glu' or 'moe', or an "
                f"elementwise activation ({', '.join(ACTIVATIONS)})",
            )
        _positive(f"{path}.swiglu_alpha", self.swiglu_alpha)
        _positive(f"{path}.swiglu_limit", self.swiglu_limit)
        _choice(f"{path}.router", self.router, MOE_ROUTERS)
        _positive(f"{path}.hidden_dim", self.hidden_dim)
        _positive(f"{path}.multiple_of", self.multiple_of)
        for name in ("n_routed_experts", "n_activated_experts", "n_groups", "topk_groups"):
            _positive(f"{path}.{name}", getattr(self, name))
        _positive(f"{path}.moe_hidden_dim", self.moe_hidden_dim)
        for name in (
            "n_shared_experts",
            "first_k_dense",
            "bias_update_speed",
            "seq_aux_loss_coef",
            "switch_aux_loss_coef",
        ):
            _positive(f"{path}.{name}", getattr(self, name), allow_zero=True)
        if self.kind == "moe" and self.switch_aux_loss_coef > 0 and self.router != "deepseek-v2":
            _fail(
                f"{path}.switch_aux_loss_coef",
                f"the Switch balance loss averages a softmax router's probabilities; router "
                f"{self.router!r} scores by sigmoid: use router 'deepseek-v2' or seq_aux_loss_coef",
            )
        _positive(f"{path}.routed_scaling_factor", self.routed_scaling_factor)
        if self.n_routed_experts % self.n_groups:
            _fail(
                f"{path}.n_groups",
                f"n_routed_experts={self.n_routed_experts} is not divisible by "
                f"n_groups={self.n_groups}",
            )
        if self.topk_groups > self.n_groups:
            _fail(f"{path}.topk_groups", f"{self.topk_groups} exceeds n_groups={self.n_groups}")
        per_group = self.n_routed_experts // self.n_groups
        if self.n_activated_experts > self.topk_groups * per_group:
            _fail(
                f"{path}.n_activated_experts",
                f"{self.n_activated_experts} experts per token cannot come from topk_groups="
                f"{self.topk_groups} groups of {per_group} experts",
            )
        if self.router == "deepseek-v3" and self.n_groups > 1 and per_group < 2:
            _fail(f"{path}.n_groups", "deepseek-v3 scores a group by its top 2 experts")
        if self.shared_expert_gate and (self.kind != "moe" or not self.n_shared_experts):
            _fail(
                f"{path}.shared_expert_gate",
                f"gates a mixture of experts' shared experts; this one has kind={self.kind!r}, "
                f"n_shared_experts={self.n_shared_experts}",
            )
        d = self.dense_layers
        if any(i < 0 for i in d) or any(a >= b for a, b in zip(d, d[1:])):
            _fail(
                f"{path}.dense_layers",
                f"must be distinct layers >= 0 in increasing order, got {d}",
            )

    def moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` has a mixture of experts (kind ``moe``, past the first
        ``first_k_dense`` layers and not in ``dense_layers``, which are dense gated FFNs) or
        a dense feed-forward."""
        return self.kind == "moe" and layer >= self.first_k_dense and layer not in self.dense_layers

    def expert_hidden_size(self, d_model: int) -> int:
        """Hidden width of one MoE expert: ``moe_hidden_dim``, else the dense hidden width
        shared among the activated and shared experts."""
        if self.moe_hidden_dim is not None:
            return self.moe_hidden_dim
        return max(
            1, self.hidden_size(d_model) // (self.n_activated_experts + self.n_shared_experts)
        )

    def hidden_size(self, d_model: int) -> int:
        """Hidden width of the feed-forward layer: ``hidden_dim``, else 4 d_model for an MLP
        and LLaMA's 2/3 of that (rounded up to ``multiple_of``) for gated FFNs."""
        if self.hidden_dim is not None:
            return self.hidden_dim
        if self.kind == "mlp":
            return 4 * d_model
        hidden = int(2 * 4 * d_model / 3)  # LLaMA: keep parameter count of a 4d MLP
        return self.multiple_of * -(-hidden // self.multiple_of)


@dataclass
class NormConfig(_Config):
    """Normalisation: ``kind`` layernorm, rmsnorm, gemma_rmsnorm (weight 1 + w) or
    layernorm1p (a LayerNorm of weight 1 + w: Nemotron's), its ``eps``, a LayerNorm ``bias``,
    and ``placement`` pre (GPT-2, LLaMA), post (the original Transformer), sandwich (Gemma 2
    and 3: a norm before and after each sublayer), post_sublayer (OLMo 2: a norm after each
    sublayer only, inside its residual branch),
    parallel (GPT-NeoX, Pythia: attention and feed-forward side by side on the block's input,
    each after a norm of its own) or parallel_shared (Phi-1/1.5/2, GPT-J: the same with one
    norm both read)."""

    kind: str = "layernorm"
    eps: float = 1e-5
    bias: bool = True  # LayerNorm only (layernorm, layernorm1p)
    # "pre": x + f(norm(x)); "post": norm(x + f(x)); "sandwich": x + norm'(f(norm(x)));
    # "post_sublayer": x + norm'(f(x)); "parallel": x + attn(norm(x)) + ffn(norm'(x));
    # "parallel_shared": x + attn(norm(x)) + ffn(norm(x)) (decoders only)
    placement: str = "pre"

    def validate(self, path: str = "norm") -> None:
        _choice(f"{path}.kind", self.kind, NORM_KINDS)
        _choice(f"{path}.placement", self.placement, NORM_PLACEMENTS)
        _positive(f"{path}.eps", self.eps)


# ModelConfig's scalars of the decoder alone (Granite's muP multipliers); 1 is none
SCALAR_MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "logit_divisor")
# ... and Cohere's factor on the output logits (1 is none)
DECODER_SCALARS = (*SCALAR_MULTIPLIERS, "logit_scale")


@dataclass
class ModelConfig(_Config):
    """A transformer model. ``arch`` names the architecture (``decoder``: a decoder-only
    language model, of which GPT-2 and LLaMA are presets); architectures that need more
    fields subclass this config and register it with :func:`register_model_config`."""

    _variant_key: typing.ClassVar[str] = "arch"
    _variants: typing.ClassVar[dict[str, type]] = {}
    # Fields the model reads at every forward pass, not in building its weights, which
    # `attnlab eval` and `attnlab generate` (`--set model.NAME=...`) may change on a trained
    # model (Transformer-XL's memory length, distance clamp and same-length mask).
    EVAL_FIELDS: typing.ClassVar[tuple[str, ...]] = ()

    arch: str = "decoder"
    vocab_size: int = 256
    max_seq_len: int = 256
    d_model: int = 128
    n_layers: int = 4
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    position: PositionConfig = field(default_factory=PositionConfig)
    ffn: FFNConfig = field(default_factory=FFNConfig)
    norm: NormConfig = field(default_factory=NormConfig)
    tie_embeddings: bool = True
    # Multiply the token embeddings by sqrt(d_model) (Vaswani et al.; Gemma, whose decoder
    # rounds the factor to the embedding's dtype first). Decoder and encoder-decoder only.
    scale_embeddings: bool = False
    # Final logit soft-capping (Gemma 2): logits -> final_logit_softcap * tanh(logits /
    # final_logit_softcap), in training, evaluation and generation. Decoder only.
    final_logit_softcap: float | None = None
    # Granite's muP scalars, decoder only (1: none): the token embeddings are multiplied by
    # embedding_multiplier (after any scale_embeddings), each sublayer's output by
    # residual_multiplier before its residual add (x + m f(norm(x)) in a pre-norm block),
    # and the output logits divided by logit_divisor (Granite's logits_scaling; before
    # any final_logit_softcap), in training, evaluation and generation.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logit_divisor: float = 1.0
    # A bias on the output logits, learned: the head's own (logits = W_out h + b; Phi-1/1.5/2
    # and GPT-J's lm_head.bias, Marian's final_logits_bias), before any logit_divisor and
    # soft-capping, tied head or not. Decoder and encoder-decoder only (an encoder's masked-LM
    # head has decoder_bias).
    final_logits_bias: bool = False
    # The output logits multiplied by logit_scale (Cohere's; a product, as transformers
    # forms it: dividing by 1 / logit_scale would round differently), after any
    # logit_divisor and before any final_logit_softcap. Decoder only (1: none).
    logit_scale: float = 1.0
    # A norm on the token embeddings before the first block: BLOOM's word_embeddings_layernorm
    # and BART's layernorm_embedding (in each seq2seq stack, positions added), of norm.kind;
    # BERT's embedding LayerNorm (on by default in the encoder), a LayerNorm. Bias as
    # norm.bias, epsilon norm.eps. Decoder, encoder and seq2seq only.
    embedding_norm: bool = False
    dropout: float = 0.0  # embedding and residual dropout
    init_std: float = 0.02

    def validate(self, path: str = "") -> None:
        at = (lambda name: f"{path}.{name}") if path else (lambda name: name)
        if self.arch not in self._variants:
            import attnlab.models  # noqa: F401  (model families register their configs)
        _choice(at("arch"), self.arch, tuple(self._variants))
        for name in ("vocab_size", "max_seq_len", "d_model", "n_layers"):
            _positive(at(name), getattr(self, name))
        _positive(at("init_std"), self.init_std)
        if not 0.0 <= self.dropout < 1.0:
            _fail(at("dropout"), f"must be in [0, 1), got {self.dropout}")
        self.attention.validate(at("attention"))
        self.position.validate(at("position"))
        self.ffn.validate(at("ffn"))
        self.norm.validate(at("norm"))
        if self.attention.head_dim is None and self.d_model % self.attention.n_heads:
            _fail(
                at("d_model"),
                f"d_model={self.d_model} is not divisible by attention.n_heads="
                f"{self.attention.n_heads}; change one, or set attention.head_dim",
            )
        self.attention._validate_mla(at("attention"), self.d_model)
        if (
            self.position.kind == "rope"
            and self.attention.kind not in LATENT_KINDS
            and self.position.rope_fraction == 1.0  # (else: _validate_rope_pieces)
            and self.head_dim % 2
        ):
            _fail(
                at("attention.head_dim"),
                f"RoPE rotates pairs of dimensions, so head_dim must be even, got {self.head_dim}",
            )
        if self.attention.global_tokens and self.attention.global_tokens[-1] >= self.max_seq_len:
            _fail(
                at("attention.global_tokens"),
                f"position {self.attention.global_tokens[-1]} is not below max_seq_len="
                f"{self.max_seq_len}",
            )
        window = self.attention.sliding_window
        if window is not None and self.position.kind == "learned" and window >= self.max_seq_len:
            _fail(
                at("attention.sliding_window"),
                f"{window} >= max_seq_len={self.max_seq_len} with learned positions masks "
                "nothing (sequences never exceed max_seq_len); lower it or set it to null",
            )
        if self.ffn.kind == "moe" and self.ffn.first_k_dense > self.n_layers:
            _fail(
                at("ffn.first_k_dense"),
                f"{self.ffn.first_k_dense} exceeds n_layers={self.n_layers}",
            )
        if self.ffn.dense_layers and self.ffn.dense_layers[-1] >= self.n_layers:
            _fail(
                at("ffn.dense_layers"),
                f"layer {self.ffn.dense_layers[-1]} is not below n_layers={self.n_layers}",
            )
        if self.position.kind == "sinusoidal" and self.d_model % 2:
            _fail(at("d_model"), f"sinusoidal positions need an even d_model, got {self.d_model}")
        self._validate_pieces_by_arch(at)
        self._validate_rope_pieces(at)
        self._validate_nope_layers(at)

    def _validate_nope_layers(self, at) -> None:
        """NoPE layers (``position.nope_layers``): built by the decoder's multi-head
        attention only, within the stack."""
        nope = self.position.nope_layers
        if not nope:
            return
        where = at("position.nope_layers")
        if nope[-1] >= self.n_layers:
            _fail(where, f"layer {nope[-1]} is not below n_layers={self.n_layers}")
        if self.arch != "decoder":
            _fail(where, f"is implemented by the decoder architecture only, not {self.arch!r}")
        if self.attention.kind != "mha":
            _fail(where, f"is implemented by attention.kind='mha' only, not "
                  f"{self.attention.kind!r}")  # fmt: skip

    def _validate_rope_pieces(self, at) -> None:
        """Partial rotation (``position.rope_fraction``) and LongRoPE's factor lists, which
        depend on the head width."""
        pos, att = self.position, self.attention
        if pos.rope_fraction != 1.0:
            where = at("position.rope_fraction")
            if self.arch != "decoder":
                _fail(where, f"is implemented by the decoder architecture only, not {self.arch!r}")
            if att.kind != "mha":
                latent = " (latent attention rotates qk_rope_head_dim)"
                _fail(
                    where,
                    f"is implemented by attention.kind='mha' only, not "
                    f"{att.kind!r}{latent if att.kind in LATENT_KINDS else ''}",
                )
            d_r = self.rope_dim
            if d_r < 2 or d_r % 2:
                _fail(
                    where,
                    f"rotates int({self.head_dim} * {pos.rope_fraction}) = {d_r} features of "
                    "each head; RoPE rotates pairs: must be even and >= 2",
                )
        if pos.kind != "rope" or pos.rope_scaling != "longrope":
            return
        pairs = self.rope_dim // 2
        for name in ("rope_short_factor", "rope_long_factor"):
            n = len(getattr(pos, name))
            if n != pairs:
                _fail(
                    at(f"position.{name}"),
                    f"has {n} factors; LongRoPE needs one per rotated pair of dimensions: "
                    f"rope_dim / 2 = {pairs}",
                )
        if att.sink_tokens:
            _fail(
                at("attention.sink_tokens"),
                "attention sinks rotate cached keys again at their places in the cache, which "
                "LongRoPE's switch of factors (chosen per forward pass) would mix; set it to 0 "
                "or use another rope_scaling",
            )

    def _validate_pieces_by_arch(self, at) -> None:
        """Pieces only some architectures build (Gemma's): refused by name in the others."""
        if self.scale_embeddings and self.arch not in ("decoder", "seq2seq"):
            _fail(at("scale_embeddings"), f"is implemented by the decoder and seq2seq "
                  f"architectures only, not {self.arch!r}; set it to false")  # fmt: skip
        _positive(at("final_logit_softcap"), self.final_logit_softcap)
        if self.final_logit_softcap is not None and self.arch != "decoder":
            _fail(at("final_logit_softcap"), f"is implemented by the decoder architecture "
                  f"only, not {self.arch!r}; set it to null")  # fmt: skip
        for name in DECODER_SCALARS:  # (Granite's and Cohere's)
            value = getattr(self, name)
            _positive(at(name), value)
            if value != 1.0 and self.arch != "decoder":
                _fail(at(name), f"is implemented by the decoder architecture only, not "
                      f"{self.arch!r}; set it to 1")  # fmt: skip
        if self.final_logits_bias and self.arch not in ("decoder", "seq2seq"):
            hint = (
                " (an encoder's masked-LM head has decoder_bias)" if self.arch == "encoder" else ""
            )
            _fail(at("final_logits_bias"), f"is implemented by the decoder and seq2seq "
                  f"architectures only, not {self.arch!r}; set it to false{hint}")  # fmt: skip
        self._validate_position_bias(at)
        if self.embedding_norm and self.arch not in ("decoder", "encoder", "seq2seq"):
            _fail(at("embedding_norm"), f"is implemented by the decoder, encoder and seq2seq "
                  f"architectures only, not {self.arch!r}; set it to false")  # fmt: skip
        if self.norm.placement in DECODER_NORM_PLACEMENTS and self.arch != "decoder":
            _fail(at("norm.placement"), f"{self.norm.placement!r} is implemented by the "
                  f"decoder architecture only, not {self.arch!r}")  # fmt: skip
        if self.position.padding_idx is not None and self.arch not in ("encoder", "seq2seq"):
            _fail(at("position.padding_idx"), f"is implemented by the encoder and seq2seq "
                  f"architectures only, not {self.arch!r}; set it to null")  # fmt: skip
        if (
            self.position.padding_idx is not None
            and self.arch == "encoder"
            and (self.position.kind != "learned")
        ):
            _fail(at("position.padding_idx"), f"counts an encoder's learned positions; "
                  f"position.kind is {self.position.kind!r} (set it to null)")  # fmt: skip
        if self.position.local_rope_theta is None:
            return
        where = at("position.local_rope_theta")
        if self.arch not in ("decoder", "encoder"):
            _fail(where, f"is implemented by the decoder and encoder architectures only, not "
                  f"{self.arch!r}")  # fmt: skip
        if self.attention.kind != "mha":
            _fail(where, f"is implemented by attention.kind='mha' only, not "
                  f"{self.attention.kind!r}")  # fmt: skip
        if self.attention.sliding_window is None:
            _fail(where, "applies to local layers, and none has a window: set "
                  "attention.sliding_window (and layer_pattern)")  # fmt: skip

    def _validate_position_bias(self, at) -> None:
        """Position biases on the scores (``POSITION_BIAS_KINDS``): built by the models that
        hand them to their self-attention; a decoder's need every key's position under a
        cache, which its window rings, sinks and global tokens do not share with the model
        (the bias is formed once per pass over the cache's keys)."""
        kind, att = self.position.kind, self.attention
        where = at("position.kind")
        built_by = {"relative_bias": ("seq2seq", "encoder", "decoder"),
                    "alibi": ("encoder", "decoder"),
                    "disentangled": ("encoder",)}.get(kind)  # fmt: skip
        if built_by is None:
            return
        if self.arch not in built_by:
            _fail(where, f"{kind!r} is implemented by the {' and '.join(built_by)} "
                  f"architectures only, not {self.arch!r}")  # fmt: skip
        if self.position.alibi_bfloat16 and self.arch != "decoder":
            _fail(at("position.alibi_bfloat16"), "rounds the bias of each key's absolute "
                  "position, which only a causal decoder may use; set it to false")  # fmt: skip
        if self.arch != "decoder":
            return
        if att.kind != "mha":
            _fail(where, f"{kind!r} decoders need attention.kind 'mha' (it takes the bias), "
                  f"not {att.kind!r}")  # fmt: skip
        for name, value, off in (
            ("sliding_window", att.sliding_window, "null"),
            ("sink_tokens", att.sink_tokens, "0"),
            ("global_tokens", att.global_tokens, "[]"),
        ):
            if value:
                _fail(at(f"attention.{name}"), f"cannot be combined with position.kind {kind!r} "
                      "in a decoder: its cache keeps keys whose positions the bias does not "
                      f"see; set it to {off}")  # fmt: skip

    @property
    def head_dim(self) -> int:
        """Width of one attention head: ``attention.head_dim``, else d_model / n_heads."""
        return self.attention.head_dim or self.d_model // self.attention.n_heads

    @property
    def rope_dim(self) -> int:
        """The width RoPE rotates per head: qk_rope_head_dim for MLA, else the first
        int(head_dim * position.rope_fraction) features (all of head_dim by default)."""
        if self.attention.kind in LATENT_KINDS:
            return self.attention.rope_dim(self.d_model)
        return self.position.rotary_dim(self.head_dim)

    @property
    def n_heads(self) -> int:
        """Query heads (``attention.n_heads``)."""
        return self.attention.n_heads

    @property
    def n_kv_heads(self) -> int:
        """Key/value heads (``attention.kv_heads``)."""
        return self.attention.kv_heads


def register_model_config(arch: str, cls: type[ModelConfig]) -> type[ModelConfig]:
    """Make ``{"arch": arch, ...}`` parse as ``cls`` (a subclass of ModelConfig)."""
    ModelConfig._variants[arch] = cls
    return cls


register_model_config("decoder", ModelConfig)


# --------------------------------------------------------------------------- training


@dataclass
class DataConfig(_Config):
    """Training data: ``path`` (a text file or folder; None: the embedded corpus), the
    ``tokenizer`` kind (char or bpe) and BPE vocabulary size, the validation fraction and how
    undecodable bytes are handled (``errors``)."""

    path: str | None = None  # a .txt file or a folder of them; None: the embedded corpus
    tokenizer: str = "char"  # "char" or "bpe" (byte-level BPE trained on the corpus)
    bpe_vocab_size: int = 4096
    val_fraction: float = 0.1
    errors: str = "strict"  # undecodable bytes: "strict" (error) or "replace"
    # Settings of a task's own data (e.g. the numbers task's language), checked by the
    # task's typed options class (unknown keys are rejected); empty: its defaults.
    options: dict[str, Any] = field(default_factory=dict)

    def validate(self, path: str = "data") -> None:
        _choice(f"{path}.tokenizer", self.tokenizer, ("char", "bpe"))
        _choice(f"{path}.errors", self.errors, ("strict", "replace"))
        if self.path == "":  # Path("") is the current folder: it was read as the corpus
            _fail(
                f"{path}.path",
                "is empty; give a text file or a folder of .txt / .md files (or null for the "
                "embedded corpus)",
            )
        if not 0.0 < self.val_fraction < 1.0:
            _fail(f"{path}.val_fraction", f"must be in (0, 1), got {self.val_fraction}")
        if self.bpe_vocab_size < 257:
            _fail(
                f"{path}.bpe_vocab_size",
                f"must be > 256 (the byte alphabet), got {self.bpe_vocab_size}",
            )


@dataclass
class TrainConfig(_Config):
    """The optimisation: batch and block sizes, steps or time budget, AdamW and schedule
    settings, evaluation/logging/saving cadence, seed, dtype and device."""

    batch_size: int = 12  # sequences per optimizer step, per process, before accumulation
    block_size: int | None = None  # None: model.max_seq_len
    grad_accum: int = 1
    max_steps: int = 2000
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    schedule: str = "cosine"  # after the warm-up: "cosine", or "wsd" (constant, linear decay)
    decay_fraction: float = 0.3  # wsd: the share of the post-warm-up steps spent decaying
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # 0 disables clipping
    dtype: str = "float32"  # "float32" or "bfloat16" (autocast)
    eval_every: int = 250
    eval_batches: int = 20
    log_every: int = 10
    save_every: int = 0  # 0: save at evaluations and at the end only
    seed: int = 1337
    time_budget: float | None = None  # seconds; fits the schedule to the steps that fit
    tensorboard: bool = False
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1", ...
    compile: bool = False
    optimizer: str = "adamw"  # "adamw", or "muon" (hidden matrices; AdamW for the rest)
    # CPU: malloc keeps the memory a step frees for the next (glibc; attnlab/allocator.py)
    keep_freed_memory: bool = True

    def validate(self, path: str = "train") -> None:
        for name in ("batch_size", "grad_accum", "max_steps", "eval_batches", "log_every"):
            _positive(f"{path}.{name}", getattr(self, name))
        if self.batch_size * self.grad_accum > SEED_MAX:  # one step samples them as one tensor
            _fail(
                f"{path}.grad_accum",
                f"{self.batch_size} x {self.grad_accum} accumulated sequences per step exceed "
                "torch's int64; lower train.batch_size or train.grad_accum",
            )
        for name in (
            "warmup_steps",
            "weight_decay",
            "grad_clip",
            "save_every",
            "eval_every",
            "min_lr",
        ):
            _positive(f"{path}.{name}", getattr(self, name), allow_zero=True)
        _positive(f"{path}.lr", self.lr)
        if self.min_lr > self.lr:  # the schedule would raise the rate as it "decays"
            _fail(f"{path}.min_lr", f"must be <= train.lr ({self.lr}), got {self.min_lr}")
        _seed(f"{path}.seed", self.seed)
        _positive(f"{path}.block_size", self.block_size)
        _positive(f"{path}.time_budget", self.time_budget)
        _choice(f"{path}.dtype", self.dtype, ("float32", "bfloat16"))
        _choice(f"{path}.optimizer", self.optimizer, ("adamw", "muon"))
        _choice(f"{path}.schedule", self.schedule, _lr_schedules())
        if not 0.0 < self.decay_fraction <= 1.0:
            _fail(f"{path}.decay_fraction", f"must be in (0, 1], got {self.decay_fraction}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                _fail(f"{path}.{name}", f"must be in [0, 1), got {getattr(self, name)}")


@dataclass
class RunConfig(_Config):
    """Everything a training run needs; saved as config.json beside each checkpoint.
    ``task`` names an entry of ``attnlab.tasks.TASKS`` (config files without it: "lm")."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    task: str = "lm"

    @classmethod
    def for_inference(cls, data: dict[str, Any]) -> RunConfig:
        """A saved run's config to run its model: like ``from_dict``, but training settings
        that a later version refuses (a ``train.min_lr`` above ``train.lr``, accepted
        before) do not stop it; resuming the run still checks them."""
        cfg = _from_dict(cls, data)
        cfg.validate(train=False)
        return cfg

    def validate(self, train: bool = True) -> None:
        """Check every section; ``train=False`` leaves out the training settings' own
        checks (what running a trained model reads from them is only typed)."""
        from attnlab.tasks import TASKS  # the registry imports this module

        _choice("task", self.task, tuple(TASKS))
        self.model.validate("model")
        if train:
            self.train.validate()
        self.data.validate()
        TASKS[self.task].data_options(self)  # the task's own settings are typed too
        block = self.train.block_size
        if train and block is not None and block > self.model.max_seq_len:
            _fail(
                "train.block_size",
                f"{self.train.block_size} exceeds model.max_seq_len="
                f"{self.model.max_seq_len}; lower it or raise model.max_seq_len",
            )
