"""A module-level handler for process-mode workers in the PostgreSQL tests (picklable)."""


def handle(ctx):
    ctx.db.execute("INSERT INTO effects (job_id, n) VALUES (%s, %s)", (ctx.job_id, int(ctx.body)))
