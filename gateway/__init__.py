"""The async I/O shell: FastAPI app, auth, request profiling, SSE relay, metrics.

Composition root of the serving path: it wires the pure policies (slomax,
fleetmind, tokenpilot) to the engine adapters. Entry point: `gateway.app.create_app`.
"""
