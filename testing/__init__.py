"""The test engine: vLLM's real Scheduler and real WORKER-role connectors, driven by a
synthetic model, without a GPU (`kvdepot.testing.vllm_engine.SyntheticEngine`).

Used by the test suite and `kvdepot bench`; the connector (`kvdepot.client.vllm`) never
imports it. What both also share: the `kvdepot serve` process wrapper and Admin/GetStats
(`daemon.py`), waiting for an event (`waiting.py`), and what the pool and the disk hold
as the daemon announces it, with the rows no lookup reaches (`tiers.py`). This
package's `__init__` and `environment` import no vLLM, so `cpu_environment()` can be
read before vLLM picks its platform.
"""
