"""What the Hugging Face interop tests share: transformers models built offline from tiny
configs, every weight set far from its init, and the module fixture that saves one with
``save_pretrained`` and loads it back into attnlab with ``load_hf``.

Importing this module makes transformers run offline and quietly (it sets the environment
before transformers is imported) and skips the importing test file where transformers is not
installed. It lives apart from ``oracle.py``, which imports nothing from attnlab.

A family's test file names its classes, cases and norm rule once::

    HF = HFCases("Olmo2Config", "Olmo2ForCausalLM", CASES, V, norms=(0.5, 1.5))
    imported = HF.imported_fixture()

and builds with ``HF.config(case)``, ``HF.model(case, seed)`` and ``HF.randomize(model, seed)``.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from collections.abc import Callable, Iterable  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from oracle import randomize_weights  # noqa: E402

from attnlab.interop import load_hf  # noqa: E402

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()

# no bos/eos/pad: greedy decoding runs its full length and no token id is special
NO_SPECIAL = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def imported_fixture(cases: Iterable[str], hf_model: Callable[..., torch.nn.Module]):
    """A module-scoped fixture over the case names: (case, the transformers model
    ``hf_model(case, seed=<the case's index>)``, the attnlab model ``load_hf`` reads from its
    ``save_pretrained`` folder). Assign it to a module-level name ``imported``."""
    names = list(cases)

    @pytest.fixture(scope="module", params=names)
    def imported(request, tmp_path_factory):
        case = request.param
        ref = hf_model(case, seed=names.index(case))
        path = tmp_path_factory.mktemp(case)
        ref.save_pretrained(path)
        return case, ref, load_hf(path)

    return imported


@dataclass(frozen=True)
class HFCases:
    """One transformers family's test models: ``config_class`` and ``model_class`` (names in
    ``transformers``) built from ``cases`` (case name -> config fields) with a vocabulary of
    ``vocab_size``, no special tokens and eager attention (the reference path), then every
    weight drawn far from its init: norm weights (``is_norm(name, p)``; default: "norm" in
    the name) uniform in ``norms`` around the family's identity value, every other parameter
    (biases too) normal with std 0.3. ``attn_implementation``: transformers' attention path
    (eager, the reference, unless the family's eager path is the one that is wrong)."""

    config_class: str
    model_class: str
    cases: dict[str, dict]
    vocab_size: int
    norms: tuple[float, float]
    is_norm: Callable[[str, torch.Tensor], bool] | None = None
    attn_implementation: str = "eager"

    def randomize(self, model: torch.nn.Module, seed: int) -> None:
        """The family's rule on any model: a transformers one or an attnlab one."""
        randomize_weights(model, seed, std=0.3, norms=self.norms, is_norm=self.is_norm)

    def config(self, case: str):
        cfg = getattr(transformers, self.config_class)(
            vocab_size=self.vocab_size, **self.cases[case], **NO_SPECIAL
        )
        cfg._attn_implementation = self.attn_implementation
        return cfg

    def model(self, case: str, seed: int = 0) -> torch.nn.Module:
        torch.manual_seed(seed)
        model = getattr(transformers, self.model_class)(self.config(case))
        self.randomize(model, seed)
        return model.eval()

    def imported_fixture(self):
        return imported_fixture(self.cases, self.model)
