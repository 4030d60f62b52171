"""The container engines that run runtimes, one family of drivers behind one interface.

* `interface`: `ContainerEngine`, what the supervisor, the agent and the doctor use of an engine;
* `libpod` (podman's libpod REST API) and `docker` (the Docker Engine API, also podman's
  Docker-compatible one): each translates its own engine's answers into `nexa.errors`' engine tree
  (`EngineError`: `EngineUnavailable`, `ContainerNotFound`, `ImageNotFound`);
* `common`: what both drivers share, by composition (`EngineApi`, answers' messages, spec checks);
* `http`: the transport, HTTP over the engine's unix socket (the only node code talking to it);
* `configured`: the driver `[container]` names.
"""
