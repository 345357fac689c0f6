"""The durable tier's formats. For now the snapshot manifest, shared with replication."""
