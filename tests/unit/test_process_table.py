"""The process table a viewer walks to count a job's children (DataLoader workers) from outside."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil

from torchtop.streams.outside import children_by_parent


def test_the_walk_finds_a_real_process_tree_as_psutil_does() -> None:
    # A parent with two children, one of which has a child of its own.
    script = (
        "import subprocess, sys, time\n"
        "inner = [sys.executable, '-c', 'import time; time.sleep(30)']\n"
        "mid = subprocess.Popen([sys.executable, '-c', "
        "'import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(30)', *inner])\n"
        "leaf = subprocess.Popen(inner)\n"
        "print('ready', flush=True)\n"
        "time.sleep(30)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == b"ready"
        expected = {p.pid for p in psutil.Process(parent.pid).children(recursive=True)}
        while len(expected) < 3:  # the grandchild may still be starting
            expected = {p.pid for p in psutil.Process(parent.pid).children(recursive=True)}
        table = children_by_parent()
        found: set[int] = set()
        todo = list(table.get(parent.pid, ()))
        while todo:
            pid = todo.pop()
            found.add(pid)
            todo.extend(table.get(pid, ()))
        assert found == expected
        assert os.getpid() in table[os.getppid()]
    finally:
        for child in psutil.Process(parent.pid).children(recursive=True):
            child.kill()
        parent.kill()
        parent.wait()


def test_a_name_with_spaces_and_parentheses_does_not_shift_the_parent(tmp_path: Path) -> None:
    # A process may name itself anything (prctl): the parent follows the last ")".
    (tmp_path / "41").mkdir()
    (tmp_path / "41" / "stat").write_bytes(b"41 (evil) 1 2 (x) y) S 7 41 41 0 -1\n")
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "stat").write_bytes(b"42 (python3) S 41 42 42 0 -1\n")
    (tmp_path / "43").mkdir()  # gone between the listing and the read: no stat
    (tmp_path / "44").mkdir()
    (tmp_path / "44" / "stat").write_bytes(b"44 (cut")  # truncated: skipped, not raised
    (tmp_path / "self").mkdir()
    (tmp_path / "meminfo").write_bytes(b"MemTotal: 1 kB\n")
    assert children_by_parent(str(tmp_path)) == {7: [41], 41: [42]}
