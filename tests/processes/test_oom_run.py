"""``torchtop run --memory-limit`` as a user runs it: a script that doubles its batch until it
runs out of emulated memory, with and without ``--pause-on-oom``."""

from __future__ import annotations

import json
import pickle
import re
import time
from pathlib import Path

from torch.cuda import _memory_viz

from tests.conftest import SCRIPTS, torchtop
from torchtop.streams.recording import read_recording

DOUBLING = str(SCRIPTS / "oom_doubling.py")
MiB = 1 << 20


def _traceback(stderr: str) -> str:
    """The job's traceback, from its first line to the error (torchtop's own note follows)."""
    start = stderr.index("Traceback (most recent call last)")
    end = stderr.find("\ntorchtop: out of memory", start)
    return stderr[start : end if end >= 0 else None].strip()


def test_memory_limit_captures_the_oom_and_the_pause_times_out(tmp_path: Path) -> None:
    tracebacks = []
    for pause in (False, True):
        folder = tmp_path / ("paused" if pause else "plain")
        folder.mkdir()
        rec = folder / "r.ttr"
        extra = ["--pause-on-oom", "--pause-timeout", "1.5"] if pause else []
        start = time.monotonic()
        out = torchtop(
            "run", "--headless", "--memory-limit", "256MiB", *extra, "--record", str(rec),
            DOUBLING,
        )  # fmt: skip
        elapsed = time.monotonic() - start
        assert out.returncode == 1, out.stderr
        assert "step 2 batch 16384" in out.stdout and "no OOM" not in out.stdout
        traceback = _traceback(out.stderr)
        assert 'oom_doubling.py", line 25, in make_batch' in traceback
        assert traceback.splitlines()[-1].startswith(
            "torch.OutOfMemoryError: Emulated out of memory (torchtop --memory-limit 256.00 MiB)."
            " Tried to allocate 256.00 MiB."
        )
        tracebacks.append(traceback)
        note = f"torchtop: out of memory on cpu captured; snapshot: {folder / 'r.oom-1.pickle'}"
        assert note in out.stderr  # after the job's output, once it has exited

        report = json.loads(torchtop("report", str(rec), "--json").stdout)
        assert report["exit_code"] == 1 and "OutOfMemoryError" in report["exit_reason"]
        (oom,) = [e for e in report["events"] if e["kind"] == "oom"]
        for key in (
            "requested_bytes",
            "free_bytes",
            "reserved_bytes",
            "allocated_bytes",
            "fragmented",
            "emulated",
            "top_sites",
            "snapshot_path",
        ):
            assert key in oom, key
        assert oom["emulated"] is True and oom["fragmented"] is False
        assert oom["requested_bytes"] == 256 * MiB
        assert oom["free_bytes"] + oom["allocated_bytes"] == 256 * MiB
        for site in oom["top_sites"]:
            assert set(site) >= {"file", "line", "function", "bytes", "count"}
        top = oom["top_sites"][0]
        assert (top["function"], top["line"], top["count"]) == ("make_batch", 25, 1)
        assert top["file"] == DOUBLING and top["bytes"] == 128 * MiB
        assert oom["snapshot_path"] == str(folder / "r.oom-1.pickle")
        with open(oom["snapshot_path"], "rb") as f:
            assert "segments:" in _memory_viz.segsum(pickle.load(f))
        assert {s["id"] for s in oom["suggestions"]} >= {"batch-size"}
        assert report["devices"][0]["source"] == "cpu-tensors"
        assert report["devices"][0]["num_ooms"] == 1

        assert oom["paused"] is pause
        if pause:
            # No viewer dismissed it: the pause ended by itself after its timeout.
            assert oom["resumed"] == "timeout" and elapsed > 1.5
        else:
            assert "resumed" not in oom
        kinds = [getattr(m, "KIND", "") for m in read_recording(rec).messages]
        assert kinds.count("oom") == 1

    plain, paused = tracebacks
    assert plain == paused  # the job's own error, unchanged by the pause


def test_bad_sizes_are_one_clear_line(tmp_path: Path) -> None:
    for size, expected in [
        ("lots", "expected a size such as 256MiB, 2GiB, 500MB or 1e9, got 'lots'"),
        ("12XB", "unknown unit 'XB'"),
        ("0", "at least one byte"),
    ]:
        out = torchtop("run", "--headless", "--memory-limit", size, "x.py", cwd=tmp_path)
        assert out.returncode == 2
        assert re.search(r"argument --memory-limit: .*" + re.escape(expected), out.stderr)
        assert "Traceback" not in out.stderr
    out = torchtop("run", "--pause-timeout", "0", "x.py", cwd=tmp_path)
    assert out.returncode == 2 and "must be positive" in out.stderr


def test_bad_sizes_and_addresses_are_one_line_errors() -> None:
    for args, words in (
        (("--memory-limit", "12XB"), "unknown unit 'XB'"),
        (("--memory-limit", "lots"), "--memory-limit"),
        (("--metrics", "foo:bar"), "expected [ADDR:]PORT"),
    ):
        out = torchtop("run", "--headless", *args, str(SCRIPTS / "train_mlp.py"))
        assert out.returncode == 2, out.stderr
        assert words in out.stderr and "Traceback" not in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def _held_oom(tmp_path: Path, kind: str) -> dict[str, object]:
    rec = tmp_path / f"{kind}.ttr"
    out = torchtop(
        "run", "--headless", "--memory-limit", "280MiB", "--record", str(rec),
        str(SCRIPTS / "oom_holders.py"), "--kind", kind,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    report = json.loads(torchtop("report", str(rec), "--json").stdout)
    (oom,) = [e for e in report["events"] if e["kind"] == "oom"]
    return oom


def test_an_adam_oom_names_optimizer_state_and_the_advice_follows(tmp_path: Path) -> None:
    oom = _held_oom(tmp_path, "adam")
    split = oom["by_category"]
    assert isinstance(split, dict)
    assert sum(split.values()) == oom["allocated_bytes"]
    params = 4 * (2048 * 2048 + 2048) * 4
    assert split["parameters"] == params
    # The failure came inside Adam's first step: both moments (and the step counts) exist.
    assert split["optimizer_state"] == 2 * params + 8 * 4  # 8 float32 step counts
    assert max(split, key=split.__getitem__) == "optimizer_state"
    assert "Held by: optimizer state 128 MiB" in str(oom["verdict"])
    suggestions = oom["suggestions"]
    assert isinstance(suggestions, list) and suggestions[0]["id"] == "sharded-optimizer"
    assert "free about 96.0 MiB" in suggestions[0]["evidence"]


def test_an_activation_oom_gets_the_checkpointing_advice_first(tmp_path: Path) -> None:
    oom = _held_oom(tmp_path, "activations")
    split = oom["by_category"]
    assert isinstance(split, dict)
    assert sum(split.values()) == oom["allocated_bytes"]
    assert max(split, key=split.__getitem__) == "other_allocated"
    suggestions = oom["suggestions"]
    assert isinstance(suggestions, list) and suggestions[0]["id"] == "checkpointing"
