"""VeOmni's public path: `veomni_lite.utils.loss_utils` is the loss module (same names and signatures)."""

from veomni_lite.utils.loss_utils import (
    IGNORE_INDEX,
    count_loss_token,
    mean_global_loss,
    reduce_global_loss_token,
)

__all__ = ["IGNORE_INDEX", "count_loss_token", "mean_global_loss", "reduce_global_loss_token"]
