"""Data sources, tokenizers, token caches and samplers."""
