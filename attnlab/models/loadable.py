"""Models that stay whole through PyTorch's own loading and conversion paths: tied parameters
(one Parameter that two modules hold, a head tied to the token embedding) and the
non-persistent buffers no state dict holds.

PyTorch keeps a tie only while both modules hold the same Parameter object, and some
standard paths make a new Parameter for each module, one module at a time:
``load_state_dict(assign=True)`` (each module takes its own entry), ``model.to("meta")``
and ``to_empty`` (each module's parameters re-made). The two then hold equal values, which
the first optimizer step moves apart, and a save that stores the tied tensor once keeps
only one of them.

A model that ties parameters subclasses :class:`LoadableModel` and says which in
``tied_parameters()`` (from its config). The base class keeps them one Parameter:

- ``tie_weights()`` makes each tied name its source's Parameter again (the source's values
  win), as transformers' ``tie_weights`` does; the model's ``__init__`` ties through it;
- ``load_state_dict`` fills a tied name missing from the state dict from its partner (a file
  that stores the tensor once, as safetensors does, loads strictly), refuses tied names
  given different values (an untied model's state dict), and re-ties afterwards;
- conversions (``to``, ``to_empty``, ``half``, ...) re-tie afterwards the pairs that were
  one Parameter before (one untied by hand keeps its values), as ``torch.nn.RNNBase``
  re-flattens its weights after them.

The same base keeps a model whole through those paths in what no state dict holds: its
non-persistent buffers (RoPE frequencies, MoE token counts), which each module's
``reset_buffers()`` recomputes as its constructor makes them (through
:func:`attnlab.weights.reset_buffers`, which attnlab's own loaders call too). Every model
with such buffers subclasses it, tied parameters or not:

- after ``load_state_dict`` (any ``assign``), buffers still on the meta device (a model
  built there) while the loaded parameters are real are recomputed on the parameters'
  device, each in the dtype the model's conversions gave it (``model.to(bf16)`` on the meta
  device included): exactly a normally built model's. A model left on meta stays there;
- ``to_empty`` recomputes them all: it leaves every tensor uninitialised, and
  ``load_state_dict`` refills only those of the state dict.

:func:`check_tied` is the save paths' guard: a model whose config ties parameters that are
not one tensor is refused, rather than saved with one of them dropped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attnlab.weights import reset_buffers


class UntiedWeightsError(ValueError):
    """A model's config ties two parameters that are not the same tensor."""


class LoadableModel(nn.Module):
    """Base class of the models that tie parameters or hold non-persistent buffers; see the
    module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.register_load_state_dict_pre_hook(_fill_tied_entries)
        self.register_load_state_dict_post_hook(_retie_after_load)
        self.register_load_state_dict_post_hook(_real_buffers_after_load)

    def tied_parameters(self) -> dict[str, str]:
        """``{name: source}``: the parameters that are another parameter, by this model's
        config (a source may itself be tied to an earlier one). None by default: {}."""
        return {}

    def tie_weights(self) -> None:
        """Make each tied parameter (:meth:`tied_parameters`) its source's Parameter again;
        the source's values win. Loading calls it (conversions keep the ties there were);
        call it yourself after replacing parameters by other means."""
        self._tie(self.tied_parameters().items())

    def _tie(self, pairs) -> None:
        for name, source in pairs:
            module_name, _, attr = name.rpartition(".")
            setattr(self.get_submodule(module_name), attr, self.get_parameter(source))

    def _apply(self, fn, recurse: bool = True):
        # a conversion that cannot work in place (to("meta"), to_empty) gives each module a
        # new Parameter of its own: the pairs that were one Parameter become one again (a
        # pair untied by hand stays apart, its values kept, as in any module)
        apart = set(untied_parameters(self))
        tied = [pair for pair in self.tied_parameters().items() if pair not in apart]
        super()._apply(fn, recurse)
        self._tie(tied)
        return self

    def to_empty(self, *, device, recurse: bool = True):
        # uninitialised memory for every tensor: the state dict refills its own, not the
        # non-persistent buffers (RoPE recomputes its table in _apply; MoE counts would not)
        super().to_empty(device=device, recurse=recurse)
        if recurse:
            reset_buffers(self)
        return self


def _fill_tied_entries(
    module: LoadableModel,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata,
    strict,
    missing_keys,
    unexpected_keys,
    error_msgs: list[str],
) -> None:
    """Load-state-dict pre-hook: a tied name missing from ``state_dict`` (the loader's own
    copy) takes its partner's tensor; tied names given different values (an untied model's
    state dict) are an error, not one of the two chosen silently."""
    pairs = [(prefix + a, prefix + b) for a, b in module.tied_parameters().items()]
    for a, b in pairs:
        if a in state_dict and b in state_dict and not _same_values(state_dict[a], state_dict[b]):
            error_msgs.append(
                f"{a} is tied to {b} by the model's config, but the state dict holds "
                "different values for them (an untied model's?)"
            )
    for _ in pairs:  # a chain of n ties is filled within n rounds
        for a, b in pairs:
            if a in state_dict and b not in state_dict:
                state_dict[b] = state_dict[a]
            elif b in state_dict and a not in state_dict:
                state_dict[a] = state_dict[b]


def _same_values(x: Any, y: Any) -> bool:
    """Whether a tied pair's two state-dict entries agree: views of one tensor do, or equal
    values (other shapes are left to load_state_dict's size check; meta tensors hold none)."""
    if not (isinstance(x, Tensor) and isinstance(y, Tensor)) or x.is_meta or y.is_meta:
        return True
    if x.shape != y.shape or (x.data_ptr() == y.data_ptr() and x.stride() == y.stride()):
        return True
    return bool(torch.allclose(x, y.to(x.device, x.dtype), rtol=0, atol=0, equal_nan=True))


def _retie_after_load(module: LoadableModel, incompatible_keys) -> None:
    """Load-state-dict post-hook: ``assign=True`` gave each module a Parameter of its own."""
    module.tie_weights()


def _real_buffers_after_load(module: LoadableModel, incompatible_keys) -> None:
    """Load-state-dict post-hook: the non-persistent buffers of a model built on the meta
    device stay there, since no state dict holds them; made on the loaded parameters'
    device (none real: the model stays on meta)."""
    device = next((p.device for p in module.parameters() if not p.is_meta), None)
    if device is not None:
        reset_buffers(module, meta_to=device)


def untied_parameters(model: nn.Module) -> list[tuple[str, str]]:
    """``(name, source)`` pairs that ``model``'s config ties but that are not the same
    Parameter (an identity check: no data is read)."""
    tied = model.tied_parameters() if isinstance(model, LoadableModel) else {}
    return [(a, b) for a, b in tied.items() if model.get_parameter(a) is not model.get_parameter(b)]


def check_tied(model: nn.Module) -> None:
    """Raise :class:`UntiedWeightsError` if ``model`` has tied parameters that came apart:
    a save, which stores a tied tensor once, would drop one of them."""
    for name, source in untied_parameters(model):
        raise UntiedWeightsError(
            f"cannot save: {name} is not the same tensor as {source}, which the model's "
            f"config ties it to, so one of them would be lost; call model.tie_weights() "
            f"to make {name} {source} again (it takes {source}'s values), then save"
        )
