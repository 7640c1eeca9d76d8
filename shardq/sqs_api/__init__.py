"""The Amazon SQS API of ``shardq serve`` (``[sqs_api] listen``; docs/sqs-api.md): a client
of shardq's public API, so an SQS queue is the shardq queue of the same name.

* ``server`` -- the listener (the console's bounded HTTP stack) and each request's path;
  ``head`` -- the request line and headers, read once;
* ``sigv4`` -- signature checks; ``protocol`` -- AWS JSON 1.0 and the query protocol;
* ``api`` -- the queue actions; ``messages`` -- the message actions; ``moves`` -- message
  move tasks;
* ``catalog`` -- queues, attributes and tags, durable in the data dir;
* ``message`` -- bodies, envelopes, MD5s, ids; ``handles`` -- receipt handles (fenced leases);
  ``attributes`` -- queue attributes; ``params`` -- typed parameters; ``faults`` -- every
  error AWS answers, one table.

A shardq worker reading what SQS producers send gets the body and its attributes with
:func:`shardq.sqs_api.message.unwrap`.
"""
