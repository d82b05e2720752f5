"""The model contract's old import path: `veomni_lite.models.contract` defines it (beside the models)."""

from veomni_lite.models.contract import (
    HostInput,
    TrainableModel,
    check_model_contract,
    on_host,
    with_companions,
)

__all__ = ["HostInput", "TrainableModel", "check_model_contract", "on_host", "with_companions"]
