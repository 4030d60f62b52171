"""The fabric firewall (nexa.node.firewall): the nft file it writes, and that file's effect with the
real nft in a network namespace the test makes (`unshare --net`): a listener bound on every address
(as torch.distributed's rendezvous store binds) is reached on the fabric address only while a
member holds its port, and on every address again once none does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nexa import config
from nexa.config import NodeConfig
from nexa.contracts.groups import GroupMember
from nexa.errors import ConfigError
from nexa.node.firewall import Closed, FabricFirewall, FirewallError, ruleset
from tests.support.netns import probe_in_own_netns

REPO = Path(__file__).resolve().parents[2]


def test_the_table_holds_each_closed_port_s_accept_on_its_fabric_address_then_its_reset() -> None:
    closed = {
        29500: Closed(port=29500, address="192.0.2.10", interface="enp1s0f0np0"),
        5000: Closed(port=5000, address="2001:db8::a"),
    }
    assert ruleset("nexa", closed) == (
        "table inet nexa {}\n"
        "delete table inet nexa\n"
        "table inet nexa {\n"
        "  chain fabric_ports {\n"
        "    type filter hook input priority filter - 10; policy accept;\n"
        "    tcp dport 5000 ip6 daddr 2001:db8::a accept\n"
        "    tcp dport 5000 reject with tcp reset\n"
        '    tcp dport 29500 ip daddr 192.0.2.10 iifname { "enp1s0f0np0", "lo" } accept\n'
        "    tcp dport 29500 reject with tcp reset\n"
        "  }\n"
        "}\n"
    )
    # Nothing closed: the table goes (created first, so the delete never fails on a missing one).
    assert ruleset("nexa", {}) == "table inet nexa {}\ndelete table inet nexa\n"


@pytest.mark.parametrize("table", ["", "1nexa", "nexa table", 'nexa"; flush ruleset', "n" * 65])
def test_a_table_name_nft_would_read_otherwise_is_refused_by_the_config(tmp_path: Path, table: str) -> None:
    path = tmp_path / "node.toml"
    path.write_text(f"[firewall]\ntable = {json.dumps(table)}\n")
    with pytest.raises(ConfigError, match=r"firewall: table: ") as info:
        config.load(path, NodeConfig)
    assert "e.g. nexa" in str(info.value)
    with pytest.raises(ValueError, match="a table name is a letter"):
        FabricFirewall(table)


async def test_an_nft_that_cannot_run_or_refuses_changes_nothing_and_says_what_to_do(tmp_path: Path) -> None:
    member = GroupMember(rank=0, node_id="n", address="127.0.0.11", port=29500)
    missing = FabricFirewall("nexa", nft=str(tmp_path / "no-nft"))
    with pytest.raises(
        FirewallError, match=r"install nftables \(apt install nftables\), or set \[firewall\] enabled = false"
    ):
        await missing.close(("w", member))
    assert missing.closed() == {}
    # An nft that refuses (as without CAP_NET_ADMIN): a stand-in printing nft's own message.
    refusing = tmp_path / "nft"
    refusing.write_text("#!/bin/sh\necho 'Error: Could not process rule: Operation not permitted' >&2\nexit 1\n")
    refusing.chmod(0o755)
    fw = FabricFirewall("nexa", nft=str(refusing))
    with pytest.raises(
        FirewallError,
        match=r"Operation not permitted; the agent needs CAP_NET_ADMIN \(units/nexa-node.service.d/fabric.conf",
    ) as info:
        await fw.close(("w", member))
    assert "exit 1" in info.value.message and fw.closed() == {}


def test_with_the_real_nft_a_port_is_reached_on_its_fabric_address_only_while_held() -> None:
    steps = probe_in_own_netns("tests.support.fwprobe")
    every = ["127.0.0.11", "127.0.0.1", "127.0.0.12"]
    assert steps["before"] == every
    assert steps["closed"] == ["127.0.0.11"]  # management and other addresses: reset
    assert steps["one_hold_left"] == ["127.0.0.11"]  # a second hold on the port keeps it closed
    assert 'iifname "lo" accept' in steps["table"] and "reject with tcp reset" in steps["table"]
    assert steps["released"] == every
    assert steps["table_after"] == ""  # no port closed: the agent's table is gone


async def test_holds_share_a_port_and_the_newest_rule_wins() -> None:
    """Pure bookkeeping (no nft): what the table would hold as holds come and go."""
    written: list[dict[int, Closed]] = []

    class Recording(FabricFirewall):
        async def _apply(self) -> None:
            written.append(self.closed())

    fw = Recording("nexa")
    a = GroupMember(rank=0, node_id="n", address="127.0.0.11", port=29500)
    b = GroupMember(rank=0, node_id="n", address="127.0.0.11", port=29500, interface="lo")
    await fw.close(("old", a))
    await fw.close(("new", b))
    await fw.release("old")
    await fw.release("old")  # twice: nothing to write
    await fw.release("new")
    assert [{p: c.interface for p, c in w.items()} for w in written] == [{29500: ""}, {29500: "lo"}, {29500: "lo"}, {}]
