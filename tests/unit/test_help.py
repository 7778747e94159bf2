"""``python -m parallel_lab --help`` lists every config group of conf/ with every option, and the
bare --help, built without Hydra (cli/help.py), prints what Hydra's composition prints."""

from __future__ import annotations

import subprocess
import sys

from tests.support.cli import ROOT

CONF = ROOT / "conf"
NOT_GROUPS = {"bench"}  # conf/bench/: a bench's own file (its first line says so), not group=<name>
LABELS = {"hardware": "plan.hardware"}  # picked by a key, not by group=<name>


def expected_lines() -> list[str]:
    """'<group>: a, b, c' per folder of conf/, from the tree. A group's subfolders (strategy/cp,
    strategy/ep) are the comparison experiments' rows, which the command line refuses: not listed."""
    lines = []
    for folder in sorted(p for p in CONF.iterdir() if p.is_dir() and p.name not in NOT_GROUPS):
        options = sorted(p.stem for p in folder.glob("*.yaml"))
        assert options, f"conf/{folder.name}/ holds no yaml"
        lines.append(f"{LABELS.get(folder.name, folder.name)}: {', '.join(options)}")
    return lines


def test_help_names_every_group_and_option_and_imports_no_hydra():
    probe = (
        "import runpy, sys\n"
        "sys.argv = ['parallel_lab', '--help']\n"
        "try:\n    runpy.run_module('parallel_lab', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'hydra', 'torch'}), file=sys.stderr)"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.stderr.strip().splitlines()[-1] == "[]", result.stderr[-2000:]
    shown = result.stdout.splitlines()
    missing = [line for line in expected_lines() if line not in shown]
    assert not missing, f"--help lacks {missing}"


def test_bare_help_is_what_hydra_composes():
    from parallel_lab.cli.help import hydra_help, quick_help

    assert quick_help() == hydra_help(["--help"])
