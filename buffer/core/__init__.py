"""The buffer core: groups, the write and read paths, the jobs' ledger, the record format of
every change, the hooks, statistics, generator discovery.

Plain Python, testable without an event loop or a server. It may import the shared leaves
(``buffer.errors``, ``buffer.encoding``, ``buffer.storable``) and ``buffer.policy``; never HTTP
(FastAPI, httpx), the store, the toolkit, the workers or the service (``.importlinter`` holds
the rules; CI checks them). It keeps its changes, as records (``records``), in a store that the
service hands it (``RolloutBuffer.attach``); it names the interface, ``buffer.store.base.Store``,
in annotations only (under ``TYPE_CHECKING``).
"""
