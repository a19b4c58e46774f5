"""The test bed: what imitates the world around the sidecar, for the demo, replay, tests and bench.

Imports: engine_hook, sidecar.* (never imported by the daemon or by engine_hook). One entry per
role:
  engines    ring_engine (a ring engine with a snapshot provider: `cache`; without: `plain`,
             `tiers`; raw writers), simulator (the demo's chat workload), prefill_engine (replay),
             c/ + cbuild (the compiled C producer), zmq_publisher (vLLM- and SGLang-format ZMQ)
  manager    the KVCM-compatible server lives in sidecar.kvcm_server (`kvcm-sidecar kvcm-server`);
             kvcm_cluster runs it as a cluster on a real redis-server, with ranks (tests, bench)
  drivers    proc (a ring engine as a child process, driven by JSON lines)
"""
