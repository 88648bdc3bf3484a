"""Classification data: the record format (store.py: texts and labels -> ids, segment ids and labels) and
predict's input texts (inputs.py)."""
