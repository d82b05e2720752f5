from veomni_lite.utils.loss_utils import IGNORE_INDEX, count_loss_token, mean_global_loss

__all__ = ["IGNORE_INDEX", "count_loss_token", "mean_global_loss"]
