"""The client side: the router apps embed and its connection to one shard."""
