"""The management HTTP surface: the quart-trio API app (`api` and its record and retention routes),
the route table (`routes`), the OpenAPI document (`openapi`) and what both HTTP front ends share
(`common`: the error→status table, request ids, the body limit)."""
