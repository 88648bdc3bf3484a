"""Stores on object storage: where a store lives (place.py: local, or data.store_url with claims, uploads and
the index last) and the node-local cache of its shards (cache.py: one downloader, verified downloads,
eviction). A store's on-disk layout is data/layout.py."""
