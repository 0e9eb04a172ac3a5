"""Storage levels and the shard format."""
