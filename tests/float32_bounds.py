"""Cross-layout tolerances derived from what float32 promises, never tuned on one machine.

Two layouts of one run (one process, DP, SP, packed rows) compute the same float32 quantities with other reduction
orders and matmul shapes (and a CPU's kernels pick their own blocking), so each float32 sum may round differently: by
a few units of eps32 = 2^-23 relative to the magnitudes it adds. A value that is itself of that magnitude agrees to a
small relative tolerance, but a difference of near-equal sums (a KL estimate, the mean of pi - ref; a reward
beta (pi - ref)) can differ by eps32 x the magnitudes it cancels, however small the difference is: its bound is
absolute, scaled by those terms. From step 2 on the weights carry every earlier step's rounding into the next
forwards, so the bound grows with the steps trained.
"""

from __future__ import annotations

import torch

EPS32 = torch.finfo(torch.float32).eps
# units of eps32 x scale per step trained: a sum's rounding in each of the two orders (a few units each, the depth of a
# float32 reduction), and the log-softmax that makes the terms
PER_STEP = 8


def cancelling_atol(scale: float, step: int) -> float:
    """The absolute disagreement float32 allows two layouts on a difference of float32 sums whose terms total `scale`
    in magnitude, at step `step` (from 1) of a run."""
    return PER_STEP * step * EPS32 * scale
