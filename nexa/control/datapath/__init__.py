"""The data path: one inference call from its HTTP front end to a replica and back.

`inference` (the OpenAI-compatible and canonical routes) hands a call to `gateway`, the pipeline
resolve → quota (`quotas`) → admission (`admission`) → route (`routing`) → relay (`relay`, over the
node channels) → meter (`metering`); `calls` is one call as it runs, `answers` checks what a runtime
answered, `workloads` keeps canonical workloads and their receipts, `retention` keeps payloads a
policy asks for. Nothing here imports the operations, cluster or HTTP-surface planes."""
