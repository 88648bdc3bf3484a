"""Preference pairs: TRL's pair formats (records.py), a pair -> two masked sequences rendered as chat renders
(encode.py), the record format over the store of units (store.py)."""
