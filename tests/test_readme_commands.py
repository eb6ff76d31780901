"""The README's commands (scripts/readme_commands.py): the extraction finds them, so an edit
of the README that hides a command from the script fails here, and a small fixed subset runs
as a new user runs it (the whole list is the script's: minutes, not for the suite)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "readme_commands.py"


def _script():
    spec = importlib.util.spec_from_file_location("readme_commands", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_extraction_finds_the_readmes_commands():
    script = _script()
    commands = script.extract((REPO / "README.md").read_text())
    by_line = {c.line: c for c in reversed(commands)}  # the first of repeated lines
    run = [c for c in commands if not c.skip]
    assert len(run) >= 20 and len(commands) - len(run) >= 8
    for line in ("meshfold train configs/debug.toml",
                 "python -m meshfold plot runs/debug",
                 "meshfold plan configs/llama3-405b.toml --cluster h100:16384 --top 5",
                 "meshfold calibrate-cost configs/debug.toml"):
        assert line in by_line and not by_line[line].skip, line
    # every section's command kinds: a ```bash line, a `$ ` example, a tour span, an env prefix
    assert any(c.line.startswith("MESHFOLD_STRICT=1 meshfold train") and not c.skip for c in commands)
    assert any(c.line.startswith("MESHFOLD_LIVE_KILL=") and not c.skip for c in commands)
    assert any("--nproc 4 --set parallel.tp=2 --set parallel.sp=true" in c.line for c in run)
    assert any("--nproc 4 --set parallel.pp=4" in c.line and "meshfold timeline runs/pp4" in c.line for c in run)
    error = [c for c in commands if c.expect_error and not c.skip]
    assert len(error) == 1 and "parallel.dp_shard=3" in error[0].line
    # the skips, each with its reason
    assert any(c.skip == "needs root (network namespaces)" and c.line.startswith("sudo meshfold netlab")
               for c in commands)
    assert sum(c.skip == "marked (GPUs)" for c in commands) == 2
    assert all(c.skip for c in commands if "RUN_DIR" in c.line or " DIR" in c.line or "CONFIG" in c.line)
    # the overrides keep every training command short, whatever the line sets
    for c in run:
        assert script.with_overrides(c.line).count("--set train.steps=") >= c.line.count("meshfold train ")


def test_a_subset_of_the_readme_runs_clean():
    """One process trains, its curves are drawn, the planner plans 405B on 16,384 H100s, and a
    bad layout stops with its one line: exit status, no traceback, at most one warning each
    (the README's second `meshfold train configs/debug.toml` is skipped as a repeat)."""
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--timeout", "400",
         "--match", "meshfold train configs/debug.toml --nproc 4 --set parallel.dp_shard=3",
         "--match", "python -m meshfold plot runs/debug",
         "--match", "meshfold plan configs/llama3-405b.toml --cluster h100:16384 --top 5"]
        + ["--match-exact", "meshfold train configs/debug.toml"],
        capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "readme commands: 4 run, 1 skipped, 0 failed" in out.stdout, out.stdout
