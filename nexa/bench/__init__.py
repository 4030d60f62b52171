"""`nexa bench`: load through the gateway as a client sends it, measured step by step.

`stats` (pure: samples → percentiles → `BenchPoint`, the stop rule), `gateway` (the one httpx
home of the OpenAI API calls), `load` (closed- and open-loop steps in trio), `progress` (the bar on
stderr), `runner` (the kinds, the job, the memory sampler and the post, over `nexa.client`).
"""
