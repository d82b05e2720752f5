"""Every test here starts and ends with no memoized step, kept counts or agreed key sets."""

import pytest

from veomni_lite.utils import loss_utils


@pytest.fixture(autouse=True)
def _fresh_loss_state():
    loss_utils.reset_loss_memo()
    loss_utils.forget_loss_agreements()
    yield
    loss_utils.reset_loss_memo()
    loss_utils.forget_loss_agreements()
