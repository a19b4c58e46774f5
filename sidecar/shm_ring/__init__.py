"""The engine->sidecar shared-memory ring: layout, writer, reader, snapshot exchange.

Imports: stdlib, numpy, posix_ipc only; both the engine and the sidecar import it.
"""
