"""What the shards and their clients agree on: the wire (``wire``: frames, ops, replies),
the socket handshake (``sockio``) and the checks every job field passes (``validate``).

Below both ``shard/`` and ``client/``, above ``wal/`` (the wire's arrays use the log's
header packer) and the ground floor."""
