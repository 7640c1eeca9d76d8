"""``python -m shardq ...`` is the ``shardq`` command."""
import sys

from .cli import main

sys.exit(main())
