"""At an OOM, the snapshot's allocated blocks are attributed by address to the optimizers'
parameters, gradients and state; the rest is other allocated, and the split sums to allocated.

The fixture is ``cuda_snapshot_full.json`` (a real H200 OOM snapshot) with a ``holders`` key
added: the data pointers a job would have known, each naming a category."""

from __future__ import annotations

from typing import Any

from tests.gpu.test_oom_snapshot import load
from torchtop.agent.holders import DeviceHolders, Holders
from torchtop.agent.oom.capture import analyse_snapshot
from torchtop.protocol import MemoryCapture


def _holders(data: dict[str, Any]) -> Holders:
    holders = Holders(optimizers=1)
    for p in data["holders"]["pointers"]:
        holders.pointers[(p["device"], p["pointer"])] = (p["category"], 0)
        holders.devices.setdefault(p["device"], DeviceHolders())
    return holders


def attributed_capture(data: dict[str, Any]) -> MemoryCapture:
    """The fixture's OOM analysed as the agent does, its blocks attributed by address."""
    allocated = data["memory_stats"]["allocated_bytes.all.current"]
    return analyse_snapshot(
        7,
        device="cuda:0",
        index=0,
        emulated=False,
        requested=data["observer"]["alloc"],
        stream=0,
        free=data["observer"]["device_free"],
        total=data["observer"]["device_total"],
        snap=data["snapshot"],
        error="",
        figures=lambda _s: (allocated, data["memory_stats"]["reserved_bytes.all.current"]),
        holders=_holders(data),
    )


def test_blocks_are_attributed_by_address_and_the_split_sums_to_allocated() -> None:
    data = load("holders")
    blocks = [s["blocks"] for s in data["snapshot"]["segments"]]
    allocated = data["memory_stats"]["allocated_bytes.all.current"]
    capture = attributed_capture(data)
    split = {c.category: c.bytes for c in capture.by_category}
    # Two parameter blocks; a gradient pointer inside its block (a view's storage offset);
    # a pointer into an inactive block and one on another device count nowhere.
    assert split["parameters"] == blocks[0][0]["size"] + blocks[1][0]["size"]
    assert split["gradients"] == blocks[1][1]["size"]
    assert split["optimizer_state"] == blocks[3][0]["size"] + blocks[3][1]["size"]
    assert sum(split.values()) == allocated == capture.allocated_bytes
    assert split["other_allocated"] == allocated - sum(
        split[c] for c in ("parameters", "gradients", "optimizer_state")
    )


def test_no_optimizer_known_leaves_the_split_empty() -> None:
    data = load("holders")
    capture = analyse_snapshot(
        1,
        device="cuda:0",
        index=0,
        emulated=False,
        requested=None,
        stream=None,
        free=None,
        total=None,
        snap=data["snapshot"],
        error="",
        figures=lambda _s: (None, None),
    )
    assert capture.by_category == []
