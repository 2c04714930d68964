"""The coordinator: the OpenAI API in front of the worker pools, laid out along a request's path.

    api/ -> prepare/ -> route/ -> attempt/ -> stream/        playground/ beside them

`api/` parses and answers HTTP, `prepare/` turns a body into tokenized generation requests,
`route/` picks the models and the replica pair (the registry, saved routers, admission by
service tier), `attempt/` runs a request's attempts (fallback, migration) over gRPC, and
`stream/` turns the workers' chunks into the client's text, SSE events and bodies. The
modules at this level are the words every folder shares: the generation backend interface,
API errors, service tiers, API keys, settings; `main` is the process. No folder imports one
to its left, and nothing here loads torch, the engine or worker code.
"""
