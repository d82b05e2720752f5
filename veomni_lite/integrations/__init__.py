"""Drop-ins that bring the exact loss normalization to other training loops (`hf`: the Hugging Face Trainer)."""
