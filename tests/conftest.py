"""Shared pytest setup: every test starts from the same random state.

Tests run tiny models: one intra-op thread is as fast, and avoids spinning threads fighting
over the 2 shared cores (which made small forward passes 50x slower under load)."""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
