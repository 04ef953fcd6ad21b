"""vLLM: :class:`~deltasync.engines.vllm.engine.VllmEngine` (the agent's side: a vLLM server
running the deltasync weight-transfer backend), :mod:`~deltasync.engines.vllm.backend` (the
backend inside vLLM's workers; its parts: :mod:`~deltasync.engines.vllm.staging`,
:mod:`~deltasync.engines.vllm.reload`, :mod:`~deltasync.engines.vllm.record`,
:mod:`~deltasync.engines.vllm.repair`, :mod:`~deltasync.engines.vllm.cost`),
:mod:`~deltasync.engines.vllm.weights` (what an update loads, read from the agent's copy),
:mod:`~deltasync.engines.vllm.sparse` (changed elements patched in place),
:mod:`~deltasync.engines.vllm.live` (live weights hashed) and
:mod:`~deltasync.engines.vllm.plugin` (the entry point vLLM loads). Nothing here imports vLLM
until it runs inside vLLM."""
