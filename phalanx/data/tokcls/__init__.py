"""Token classification data: tagged sentences -> windows of subwords with word-level labels (store.py)."""
