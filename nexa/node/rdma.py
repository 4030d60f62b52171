"""The node's RDMA device nodes, which a replica group's containers get when their runtime is
registered with `--fabric rdma` (`container_spec.container_spec(rdma_devices=…)`). One directory
listing, nothing else; fabric discovery for the inventory is `node.inventory`'s."""

from __future__ import annotations

from pathlib import Path

from nexa.container_spec import RDMA_DEVICE_DIR


def rdma_device_nodes(root: Path = Path(RDMA_DEVICE_DIR)) -> list[str]:
    """The character devices under `root` (`/dev/infiniband`: `uverbs0`, `rdma_cm`, …), sorted; none
    when it does not exist (no RDMA driver loaded) or cannot be read."""
    try:
        return sorted(str(path) for path in root.iterdir() if path.is_char_device())
    except OSError:
        return []
