"""A shard: a pure state machine (:mod:`.state`), its log operations (:mod:`.ops`),
input validation (:mod:`.validate`), the durable pairing of state and WAL
(:mod:`.durable`), and the process loop serving clients (:mod:`.process`)."""
