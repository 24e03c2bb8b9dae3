"""AscendStoreConnector: a shared KV pool (Mooncake store or memcache) for prefix reuse, KVPP-aware."""
