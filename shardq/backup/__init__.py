"""Online backup and verified restore of a data dir (``shardq backup``, ``shardq restore``).

* :mod:`.take`: ask every shard for its cut (``backup_cut``), copy what it staged, write
  the manifest last;
* :mod:`.restore`: check every file of a copy (records, hashes, the key file, a replay of
  each shard) and hand over a data dir that ``shardq serve`` starts on;
* :mod:`.manifest`: what a backup holds, as ``restore`` reads it;
* :mod:`.logfiles`: reading one copied log file, record by record, as replay would;
* :mod:`.sqs_catalog`: the SQS API's catalog, read consistently and checked.

The design and the guarantee are in docs/backup.md. Imports point down the layer map: the
client (the cut is asked through the router), the shard (its state, to replay a copy), the
log, and the ground floor.
"""
