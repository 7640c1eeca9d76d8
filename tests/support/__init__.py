"""What the tests share: services started as real processes (``service``), fakes, fault
injection, a PostgreSQL server, a moto SQS server, a browser, and the doc-example runner.
Test modules import from here, never from each other."""
