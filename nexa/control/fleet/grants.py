"""What a node may receive: the admin's grant, narrowed (never widened) by what the node says.

A node's labels and data classes decide which replicas it is given (placement) and which prompts
reach it (the gateway's data-class routing). The admin sets them at enrollment (the enrollment
token's labels, copied to the node's record); the node's inventory.json, which whoever runs the
host writes, may narrow them and never widen them:

- labels: the admin's win. The inventory's only add keys the admin did not set, and never a key
  under `nexa.io/` or a `*.nexa.io/` prefix (reserved for the admin's grants).
- data classes: the admin grants them with one label per class, `data-class.nexa.io/<class>`
  (any value), e.g. `nexa tokens create --label data-class.nexa.io/confidential=`. Without any,
  a node is granted the default (`public`). A node may process the classes its inventory lists
  that the admin granted: `confidential` in inventory.json without the grant gives it no
  confidential replica and no confidential prompt.
- taints: the inventory's (they only keep replicas away).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

from nexa.contracts.node import DEFAULT_DATA_CLASSES, DataClassName, LabelKey, LabelValue, NodeInventory

#: The label prefix of the admin's data-class grants: `data-class.nexa.io/<class>`.
DATA_CLASS_PREFIX: Final = "data-class.nexa.io/"
#: Label prefixes only the admin may set (`nexa.io/...`, `<anything>.nexa.io/...`).
_RESERVED_DOMAIN: Final = "nexa.io"


def reserved(key: str) -> bool:
    """Whether a label key is the admin's alone (a node's inventory cannot set it)."""
    prefix, slash, _ = key.rpartition("/")
    return bool(slash) and (prefix == _RESERVED_DOMAIN or prefix.endswith("." + _RESERVED_DOMAIN))


def granted_data_classes(admin_labels: Mapping[str, str]) -> frozenset[str]:
    """The data classes the admin granted (`DATA_CLASS_PREFIX` labels); the default without any."""
    granted = {k.removeprefix(DATA_CLASS_PREFIX) for k in admin_labels if k.startswith(DATA_CLASS_PREFIX)}
    return frozenset(granted) if granted else frozenset(DEFAULT_DATA_CLASSES)


def data_classes(admin_labels: Mapping[str, str], inventory: NodeInventory | None) -> tuple[DataClassName, ...]:
    """What the node may process: its inventory's classes that the admin granted (none without an inventory)."""
    if inventory is None:
        return ()
    granted = granted_data_classes(admin_labels)
    return tuple(c for c in inventory.data_classes if c in granted)


def labels(admin_labels: Mapping[str, str], inventory_labels: Iterable[tuple[str, str]]) -> dict[LabelKey, LabelValue]:
    """The admin's labels, plus the inventory's for keys the admin did not set and that are not reserved."""
    merged = {LabelKey(k): LabelValue(v) for k, v in admin_labels.items()}
    for key, value in inventory_labels:
        if key not in merged and not reserved(key):
            merged[LabelKey(key)] = LabelValue(value)
    return merged
