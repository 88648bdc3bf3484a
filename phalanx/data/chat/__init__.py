"""Chat data: records in users' formats -> messages (formats.py), the chat template (template.py), where each
message sits in a rendering (layout.py), ids and the loss mask (encode.py), the record format over the store
of units (store.py)."""
