"""Every test here starts and ends with no memoized step or pending verdict."""

import pytest

from veomni_lite.utils import loss_utils


@pytest.fixture(autouse=True)
def _fresh_loss_state():
    loss_utils.reset_loss_memo()
    yield
    loss_utils.reset_loss_memo()
