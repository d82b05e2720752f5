"""veomni_lite: a lite, PyTorch-native trainer core for text and vision-language models."""

__version__ = "0.1.0"
