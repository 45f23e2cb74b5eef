"""Checkpoints of other implementations in and out (Hugging Face Kimi Linear: kimi_hf)."""
