"""The inference engine: everything that holds tensors.

`model/` (families, weight formats, the native step), `kvcache/` (paged pool, block manager,
host and disk KV tiers), `sampling/`, `speculative/` (draft sources, verify, adaptive choice),
`grammar/` (constrained decoding), `quality/` (the gate a cheaper format must pass) and
`core/` (scheduler -> runner -> step loop). It imports `shared/` and `kernels/`, never a
service: the workers import it, the coordinator never does.
"""
