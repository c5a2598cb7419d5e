"""Built-in eviction policies: each decides which cached block a pool reclaims next."""
