"""Where the buffer keeps its changes: the store interface (``base``), its backends (``sqlite``,
the data folder; ``memory``, the process), the export, and what only the data folder needs: its
database (``schema``), the migration of the former journal files and ``rollout-buffer check``.

A backend keeps the event log the core replays and the export of what reads delivered; it knows
the record format (``buffer.core.records``) and nothing of the rules that make the records.
It may import the core and the shared leaves; never the service, the toolkit or the workers.
"""
