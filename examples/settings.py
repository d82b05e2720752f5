"""The checks of the `example` section (`veomni_lite.config_sections.ExampleConfig`: the tiny models' sizes and the
synthetic and help-page datasets' settings), which only the examples read: each example trainer runs them on its
config before any process group exists. The messages name the keys as the example configs write them
(`model.num_heads`, the old names that keep working)."""

from __future__ import annotations

from veomni_lite.config import Config, ConfigError


def check_example(config: Config, tiny: bool = False) -> None:
    """ConfigError naming the key where the example settings cannot work; `tiny`: the tiny models' sizes too (their
    heads split by Ulysses, their images cut into patches)."""
    example = config.example
    positive = {"data.num_samples": example.num_samples}
    if tiny:
        positive |= {
            "model.num_heads": example.num_heads,
            "model.num_layers": example.num_layers,
            "model.hidden_size": example.hidden_size,
        }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key}: must be >= 1, got {value}")
    if not tiny:
        return
    if example.hidden_size % example.num_heads:
        raise ConfigError(
            f"model.hidden_size ({example.hidden_size}) is not divisible by model.num_heads ({example.num_heads})"
        )
    sp_size = config.parallel.sp_size
    if example.num_heads % sp_size:
        raise ConfigError(
            f"parallel.sp_size ({sp_size}) does not divide model.num_heads ({example.num_heads}): "
            "Ulysses attention splits heads across the sp group"
        )
    if example.image_size % example.patch_size:
        raise ConfigError(
            f"model.image_size ({example.image_size}) is not divisible by model.patch_size ({example.patch_size})"
        )
