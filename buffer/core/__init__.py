"""The buffer core: groups, the write and read paths, the hooks, statistics, generator discovery.

Plain Python, testable without an event loop or a server. It may import the shared leaves
(``buffer.errors``, ``buffer.encoding``, ``buffer.storable``) and ``buffer.policy``; never HTTP
(FastAPI, httpx), the store's implementations, the toolkit, the workers or the service
(``.importlinter`` holds the rules; CI checks them). It keeps its changes in a store through the
interface ``buffer.store.base.Store``, which the service hands it (``RolloutBuffer.attach``).
"""
