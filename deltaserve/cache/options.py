"""Cache choices the command line offers, torch-free so that parsing imports no torch."""

PREFIX_SNAPSHOTS = ("sparse", "grid")  # CacheConfig.prefix_snapshots: cache/prefix.py
