"""A rank's identity, read from the environment torchrun gives each rank."""

from __future__ import annotations

from torchtop.agent.identity import rank_identity
from torchtop.protocol import Hello, decode, encode

TORCHRUN_RANK_2 = {
    # What torch.distributed.run exports to the third rank of a 2-node, 2-per-node job.
    "RANK": "2",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "ROLE_RANK": "2",
    "TORCHELASTIC_RUN_ID": "job-42",
    "TORCHELASTIC_RESTART_COUNT": "1",
}


def test_a_torchrun_rank_knows_which_it_is() -> None:
    assert rank_identity(TORCHRUN_RANK_2) == {
        "rank": 2,
        "local_rank": 0,
        "world_size": 4,
        "node_rank": 1,
        "run_id": "job-42",
        "restart_count": 1,
    }


def test_a_single_process_has_no_rank() -> None:
    assert set(rank_identity({}).values()) == {None}


def test_unreadable_values_and_torchruns_default_run_id_are_none() -> None:
    identity = rank_identity(
        {"RANK": "two", "LOCAL_RANK": "-1", "NODE_RANK": "3", "TORCHELASTIC_RUN_ID": "none"}
    )
    assert identity["rank"] is None and identity["local_rank"] is None
    assert identity["node_rank"] == 3
    assert identity["run_id"] is None


def test_the_identity_crosses_the_wire() -> None:
    hello = Hello(1, 7, ["train.py"], "/", 0.0, "3.11", None, [], 0.1, "node1")
    hello = Hello(**{**hello.__dict__, **rank_identity(TORCHRUN_RANK_2)})
    decoded = decode(encode(hello))
    assert decoded == hello
    # A frame from an agent without the fields still reads, as a single process.
    old = encode(Hello(1, 7, ["train.py"], "/", 0.0, "3.11", None, [], 0.1)).replace(
        b',"rank":null', b""
    )
    assert b'"rank"' in encode(hello) and b'"rank"' not in old
    assert isinstance(decode(old), Hello)
