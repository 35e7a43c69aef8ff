"""Serving engines ctxrelay plugs into. `vllm_connector.py` is the KV connector vLLM loads by module path
(it imports vLLM; nothing else here does); `kv_payload.py` is the K/V ctxrelay hands an engine for one
request, `paged.py` the block arithmetic of a paged cache."""
