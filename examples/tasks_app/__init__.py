"""A small task app: a sync task and an async task writing exactly-once effects, and a
periodic task. See docs/tasks.md and ``python -m examples.tasks_app.produce --help``."""
