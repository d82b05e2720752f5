"""Preference training (docs/preference.md): `config` (the `pref` section), `losses` (the `pref` head: the DPO family
and Bradley-Terry reward models, exact per pair), `pairs` (pairs from the user's files, cached; `collate_pairs`),
`trainer` (`PreferenceTrainer` on the one train loop; entry point `trainers/train_preference.py`).
`register_pair_loss` adds a loss `pref.loss` can name (docs/architecture.md, "Adding an algorithm").
"""

from veomni_lite.preference.losses import register_pair_loss

__all__ = ["register_pair_loss"]
