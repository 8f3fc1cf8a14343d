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


def test_slurm_and_mpi_tasks_know_which_rank_they_are() -> None:
    slurm = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_NODEID": "1"}
    assert rank_identity({**slurm, "TORCHTOP_RUN_ID": "tt-1"}) == {
        "rank": 3,
        "local_rank": 1,
        "world_size": 4,
        "node_rank": 1,
        "run_id": "tt-1",
        "restart_count": None,
    }
    # The scheduler's job and step name the run where the tasks share no torchtop run.
    assert rank_identity({**slurm, "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0"})["run_id"] == (
        "slurm-77.0"
    )
    mpi = {
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "2",
    }
    identity = rank_identity({**mpi, "TORCHTOP_RUN_ID": "tt-2"})
    assert (identity["rank"], identity["local_rank"], identity["world_size"]) == (1, 1, 2)
    assert identity["run_id"] == "tt-2"


def test_lightnings_child_knows_its_rank_on_one_node() -> None:
    env = {"LOCAL_RANK": "1", "WORLD_SIZE": "2", "NODE_RANK": "0", "TORCHTOP_RUN_ID": "tt-3"}
    identity = rank_identity(env)
    assert (identity["rank"], identity["local_rank"], identity["world_size"]) == (1, 1, 2)
    assert identity["run_id"] == "tt-3"
    # On a later node the global rank depends on the processes per node: unknown until the
    # process group says it.
    assert rank_identity({**env, "NODE_RANK": "1"})["rank"] is None


def test_a_single_task_or_a_process_outside_any_rank_stays_a_single_process() -> None:
    one_task = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1"}
    assert set(rank_identity({**one_task, "TORCHTOP_RUN_ID": "tt-4"}).values()) == {None}
    assert set(rank_identity({"TORCHTOP_RUN_ID": "tt-4"}).values()) == {None}
