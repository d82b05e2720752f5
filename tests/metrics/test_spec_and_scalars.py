from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from veomni_lite.metrics import MetricSpec
from veomni_lite.metrics.sinks import as_scalar, format_value, scalars


def test_learning_rate_format():
    lr = MetricSpec("lr", "last", ".1e")
    assert format_value(1e-4, lr.fmt) == "1.0e-04"
    assert format_value(2.34564, MetricSpec("loss", "mean").fmt) == "2.3456"
    assert format_value(1e-4) == "1.000e-04"  # the default never rounds a small value to 0.0000
    assert format_value(2.5) == "2.5000"
    assert format_value(7) == "7"
    assert format_value(12.0, "d") == "12.0000"  # an inapplicable fmt falls back instead of raising
    assert format_value(math.nan) == "nan"


def test_spec_validation():
    with pytest.raises(ValueError, match="unknown reduce 'avg'"):
        MetricSpec("loss", "avg")
    with pytest.raises(ValueError, match="fmt 'q'"):
        MetricSpec("loss", "mean", fmt="q")
    with pytest.raises(ValueError, match="non-empty"):
        MetricSpec("", "sum")


def test_as_scalar():
    assert as_scalar(3) == 3 and isinstance(as_scalar(3), int)
    assert as_scalar(True) == 1
    assert as_scalar(np.float32(0.5)) == 0.5
    assert as_scalar(torch.tensor([2.5])) == 2.5
    assert as_scalar(torch.tensor(4)) == 4
    assert as_scalar(np.array([1.5])) == 1.5
    assert math.isnan(as_scalar(math.nan))
    for not_scalar in (None, [1.0], {"a": 1}, torch.randn(8), "1.0", 1j, torch.tensor(1j), np.zeros(3)):
        assert as_scalar(not_scalar) is None


def test_scalars_warns_once_per_key(caplog):
    warned: set[str] = set()
    values = {"a": 1.0, "hist": torch.randn(16), "table": [[1, 2]], "nested": {"x": 1}, "none": None}
    assert scalars(values, warned) == {"a": 1.0}
    assert scalars(values, warned) == {"a": 1.0}
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 4
    for key in ("hist", "table", "nested", "none"):
        assert sum(f"'{key}'" in m for m in messages) == 1
