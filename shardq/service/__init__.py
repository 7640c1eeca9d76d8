"""The service side: the supervisor that runs the shard processes."""
