"""Tasks: ``App`` and ``@app.task`` (``app``), the task body format (``body``), running task
jobs by name with their retries (``dispatch``) and one worker per queue of a task module
(``runner``, behind ``shardq worker mymodule``).

Above ``consumer/`` (whose runners execute the jobs) and ``client/`` (which sends them)."""
