"""Shared pytest setup: every test runs in float64 with a fixed seed."""
import pytest
import torch


@pytest.fixture(autouse=True)
def float64_and_seed():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(old)
