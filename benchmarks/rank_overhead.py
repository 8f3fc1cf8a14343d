"""The per-rank agent's cost on a DDP job's step time, next to a single process's in one run.

The ranks: ``--ranks`` (2) ranks of a DDP job (gloo, CPU) under ``torch.distributed.run``, each
rank's agent started as ``torchtop run torchrun ...`` starts it (the launcher's environment from
:func:`torchtop.agent.rank_start.rank_environment`: each rank's ``sitecustomize``), each with a
viewer process reading it. Each rank trains the model of :mod:`benchmarks.agent_overhead`
through alternating blocks, agent off (sampler paused, hooks out) then on, as that benchmark
does in one process; the ranks switch arms at the same step (blocks are counted in steps, the
count agreed at warm-up), so every all-reduce meets ranks in the same arm. Per rank: the ratio
of the median step times (on / off), and of the means (the op windows' amortized cost).

The same ranks started by ``torch.multiprocessing.spawn`` (``--launcher spawn``; ``both``, the
default, runs torchrun's then spawn's): the job runs with the environment ``torchtop run SCRIPT``
gives it (:func:`torchtop.agent.rank_start.job_environment`), so each rank's agent starts when
its process group is initialised.

The single process: the same model, rounds and block length through
:func:`benchmarks.agent_overhead.measure`, run just before in its own process, so the
ratios come from one invocation on one machine state.

    python -m benchmarks.rank_overhead                 # 2 ranks, both launchers, ~6 minutes
    python -m benchmarks.rank_overhead --quick         # a smoke run
    python -m benchmarks.rank_overhead --ranks 2 --model tiny-ops --rounds 60
    python -m benchmarks.rank_overhead --launcher torchrun --recorder both

``--recorder both`` runs the torchrun ranks twice, side by side: torch's flight recorder off
(``TORCH_FR_BUFFER_SIZE=0``: nothing recorded, nothing read) and on at the size ``torchtop run``
sets (each rank's agent reads its ring in the "on" blocks, when it changed, at most once a
second and within its share of the cost budget). The step time of the "off" blocks of each is
torch's own cost of recording; the ratios, the agent's with and without its reader. Each rank's
reader says what its reads cost: how many, their mean CPU time, the ring's length, the spacing
the last one's cost set, the reads left out (nothing new) and the entries lost out of the ring.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import torchtop
from benchmarks.agent_overhead import (
    MODELS,
    alternating,
    attach_viewer,
    make_step,
    measure,
    summarize,
)
from torchtop.agent import core
from torchtop.agent.collectives import BUFFER_ENV
from torchtop.agent.rank_start import job_environment, rank_environment

REPO = Path(__file__).resolve().parent.parent
#: Steps each rank takes before the block length is agreed.
WARM_STEPS = 30


def counted(step: Any, steps: int) -> list[float]:
    """``steps`` steps' times: a block that ends at the same step on every rank."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def rank_worker(
    model: str, rounds: int, seconds: float, out: Path, init: dict[str, Any] | None = None
) -> None:
    """One rank: its agent (started by its ``sitecustomize``) on against off. ``init``: the
    process group's rank, world size and address, where no launcher's environment says."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", **(init or {}))
    rank = dist.get_rank()
    agent = core.current()
    if agent is None:
        raise SystemExit(
            "no agent in this rank: run it through `python -m benchmarks.rank_overhead`"
        )
    torch.manual_seed(0)
    net, x, y = MODELS[model]()
    step = make_step(DistributedDataParallel(net), x, y)
    # The block's length in steps: what the slowest rank takes in ``seconds`` at warm-up. The
    # warm-up is counted in steps too: a timed one ends at a different step on each rank, and
    # the count's all-reduce would then meet the other rank's gradient all-reduce.
    warm = statistics.median(counted(step, WARM_STEPS))
    steps = torch.tensor([max(1, int(seconds / warm))])
    dist.all_reduce(steps, op=dist.ReduceOp.MIN)
    n = int(steps.item())
    viewer = attach_viewer(agent.info.address)
    time.sleep(1.0)  # the viewer connects and takes the history replay
    dist.barrier()
    try:
        off, on, pairs = alternating(agent, lambda: counted(step, n), rounds)
    finally:
        viewer.kill()
        viewer.wait()
    result = summarize(f"rank {rank}", agent, off, on, pairs, sum(on))
    result["reader"] = agent.collectives.stats()
    results: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    dist.destroy_process_group()
    torchtop.stop()
    if rank == 0:
        out.write_text(json.dumps(results))


def spawned_worker(
    rank: int, world: int, port: int, model: str, rounds: int, seconds: float, out: Path
) -> None:
    init = {"rank": rank, "world_size": world, "init_method": f"tcp://127.0.0.1:{port}"}
    rank_worker(model, rounds, seconds, out, init)


def spawn_ranks(world: int, model: str, rounds: int, seconds: float, out: Path) -> None:
    """The job's process: start the ranks with mp.spawn and wait, as the DDP tutorial does."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    torch.multiprocessing.spawn(
        spawned_worker, args=(world, port, model, rounds, seconds, out), nprocs=world
    )


def single_worker(model: str, rounds: int, seconds: float, out: Path) -> None:
    torch.set_num_threads(1)
    # As the ranks measure: their first op window in the blocks, and no self-measure.
    result = measure(
        "single", MODELS[model], rounds, seconds, self_measure=False, first_apart=False
    )
    out.write_text(json.dumps(result))


def run(args: list[str], env: dict[str, str] | None = None) -> None:
    subprocess.run([sys.executable, *args], env=env, cwd=REPO, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--model", choices=sorted(MODELS), default="mlp")
    parser.add_argument("--rounds", type=int, help="paired blocks (default 40)")
    parser.add_argument("--seconds", type=float, help="length of a block (default 1.0)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--launcher", choices=("torchrun", "spawn", "both"), default="both")
    parser.add_argument(
        "--recorder",
        choices=("on", "off", "both"),
        default="on",
        help="torch's flight recorder in the torchrun ranks (both: off, then on)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON at the end")
    parser.add_argument("--worker", choices=("rank", "single", "spawn"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 40)
    seconds = args.seconds or (0.5 if args.quick else 1.0)
    if args.worker == "rank":
        rank_worker(args.model, rounds, seconds, args.out)
        return
    if args.worker == "single":
        single_worker(args.model, rounds, seconds, args.out)
        return
    if args.worker == "spawn":
        spawn_ranks(args.ranks, args.model, rounds, seconds, args.out)
        return
    common = ["--model", args.model, "--rounds", str(rounds), "--seconds", str(seconds)]
    options = {"linger_s": 0.0, "capture_output": False}
    launchers: tuple[str, ...] = (
        ("torchrun", "spawn") if args.launcher == "both" else (args.launcher,)
    )
    if args.recorder != "on" and "torchrun" in launchers:
        arms = ("off", "on") if args.recorder == "both" else ("off",)
        launchers = tuple(
            name for launcher in launchers
            for name in ([f"torchrun-fr-{arm}" for arm in arms] if launcher == "torchrun"
                         else [launcher])
        )  # fmt: skip
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        single_out = Path(folder, "single.json")
        print(f"single process, {args.model}:", flush=True)
        run(["-m", "benchmarks.rank_overhead", "--worker", "single", "--out", str(single_out),
             *common])  # fmt: skip
        results["single"] = json.loads(single_out.read_text())
        for launcher in launchers:
            out = Path(folder, f"{launcher}.json")
            print(f"{args.ranks} ranks (DDP, gloo) by {launcher}, {args.model}:", flush=True)
            if launcher.startswith("torchrun"):
                target = ["-m", "torch.distributed.run", "--standalone",
                          f"--nproc_per_node={args.ranks}", "-m", "benchmarks.rank_overhead",
                          "--worker", "rank", "--out", str(out), *common]  # fmt: skip
                env = rank_environment(os.environ, options, target)
                if launcher.endswith("-fr-off"):
                    env[BUFFER_ENV] = "0"
            else:
                target = ["-m", "benchmarks.rank_overhead", "--worker", "spawn", "--ranks",
                          str(args.ranks), "--out", str(out), *common]  # fmt: skip
                env = job_environment(os.environ, options)
            env["PYTHONPATH"] += os.pathsep + str(REPO)
            run(target, env)
            results[launcher] = json.loads(out.read_text())
    single = results["single"]
    print(f"\nagent on / off, median step time ({args.model}, {rounds} paired blocks):")
    print(f"  single process  {single['ratio']:.4f}  (mean {single['mean_ratio']:.4f})")
    for launcher in launchers:
        ranks = results[launcher]
        for rank, result in enumerate(ranks):
            print(
                f"  {launcher:16} rank {rank}  {result['ratio']:.4f}"
                f"  (mean {result['mean_ratio']:.4f})"
            )
        print(
            f"  {launcher:16} median  {statistics.median(r['ratio'] for r in ranks):.4f}"
            f"  (step {statistics.median(r['median_step_off_ms'] for r in ranks):.2f} ms off;"
            f" single {single['median_step_off_ms']:.2f} ms; agent's threads"
            f" {100 * statistics.median(r['self_measured_share'] for r in ranks):.2f}% of a"
            " core in the on blocks)"
        )
    for launcher in launchers:
        for rank, result in enumerate(results[launcher]):
            reader = result.get("reader") or {}
            if reader.get("reads"):
                print(
                    f"  {launcher:16} rank {rank}  reader: {reader['reads']} reads of"
                    f" {reader['read_ms_mean']:.2f} ms (mean; last {reader['last_read_ms']:.2f}),"
                    f" ring {reader['ring']}, {reader['spacing_s']:.1f} s apart,"
                    f" {reader['unchanged']} left out (nothing new), {reader['lost']} lost"
                )
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
