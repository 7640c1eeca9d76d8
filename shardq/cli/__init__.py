"""The ``shardq`` command (``shardq.cli:main``); ``python -m shardq.cli`` runs it too."""
from .main import main

__all__ = ["main"]
