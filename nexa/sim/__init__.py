"""`nexa sim`: a scripted campaign against a whole local cluster, through its public interfaces only.

`cluster` starts the parts (registry, S3, `nexa control` as a process, four `nexa node` agents, `sim`
runtimes), `steps` are the campaign's steps in order (`impostor` serves the forged and stale sets of
`signed-sets`), `campaign` runs them and makes the live lines, the table and the `SimSummary`, and
`run` puts them together for the CLI. `load` is the sim's one HTTP client.
"""
