#!/usr/bin/env python
"""Run the README's commands as a new user would, and check what each prints.

Extracts the command lines of README.md's "Using it" and "A tour" sections (the lines of
their ```bash blocks, the ``$ `` lines of their example blocks, and every inline code span
starting with ``meshfold``, ``python -m meshfold``, ``MESHFOLD_...=... meshfold`` or
``sudo meshfold``), skips those that need GPUs, root, a placeholder (HF_DIR, CONFIG, ...)
or only name a subcommand in prose (each skip printed with its reason), and runs the rest in
README order in one temporary folder (``configs``, ``docs``, ``README.md``... linked in from
the repository, so ``runs/``, ``data/`` and ``cluster-*.toml`` land there), with the
repository first on PYTHONPATH, MESHFOLD_STRICT unset unless the line sets it (as a user has
it), and ``meshfold``/``python`` meaning this Python.

Overrides, so that each command takes seconds on 2 cores (appended to every ``meshfold
train``, last so they win): ``--set train.steps=2`` (5 where the command injects a fault at
step 3, ``MESHFOLD_LIVE_KILL``), ``--set train.progress=false``. Nothing else is changed.

Checks per command: the exit status (0, or non-zero with one ``meshfold: error:`` line where
the README shows that error), no ``Traceback`` in stdout or stderr, at most one warning line.

    python scripts/readme_commands.py              # every command (minutes)
    python scripts/readme_commands.py --list       # what would run and what is skipped, why
    python scripts/readme_commands.py --match 'plot runs/debug' --match ...   # a subset, in README order
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SECTIONS = ("## Using it", "## A tour")
COMMAND_START = re.compile(r"^(sudo |(?:MESHFOLD_\w+=\S+ )*)(meshfold |python -m meshfold )")
PLACEHOLDERS = re.compile(r"\b(HF_DIR|OUT_HF|CONFIG|FILE|TOKENIZER|RUN_DIR|DOCS|SEED|NAME=SOURCE|DIR|CKPT|"
                          r"HOST:PORT)\b|\.\.\.|\[--|runs/X\b")
WARNING = re.compile(r"warning", re.IGNORECASE)
TRAIN = re.compile(r"((?:^|&& )(?:MESHFOLD_\w+=\S+ )*meshfold train [^&]*?)(\s*(?:&&|$))")
# The README's examples that build a model this host cannot hold (they show the refusal).
TOO_LARGE = re.compile(r"--set model\.preset=llama3-1b")


@dataclass
class Command:
    line: str             # as the README writes it
    where: str            # the README line number
    skip: str = ""        # why it is not run
    expect_error: str = ""  # the ``meshfold: error:`` the README shows after it


def extract(readme: str) -> list[Command]:
    """The commands of the README's "Using it" and "A tour", in order, with skip reasons."""
    lines = readme.splitlines()
    out: list[Command] = []
    inside, fence = False, None
    for number, text in enumerate(lines, 1):
        if text.startswith("## "):
            inside = text.startswith(SECTIONS)
            continue
        if not inside:
            continue
        if text.startswith("```"):
            fence = None if fence is not None else text[3:].strip()
            continue
        if fence is not None:
            body = text[2:] if text.startswith("$ ") else text if fence == "bash" else ""
            body = re.sub(r"\s+#.*$", "", body).strip()
            if COMMAND_START.match(body):
                cmd = Command(body, f"README.md:{number}")
                after = lines[number] if number < len(lines) else ""
                if text.startswith("$ ") and after.startswith("meshfold: error:"):
                    cmd.expect_error = after
                out.append(cmd)
            continue
        for match in re.finditer(r"`([^`]+)`", text):
            if COMMAND_START.match(match.group(1)):
                cmd = Command(match.group(1), f"README.md:{number}")
                before = text[:match.start()]
                if "(GPUs" in before[-60:]:
                    cmd.skip = "marked (GPUs)"
                out.append(cmd)
    first: dict[str, str] = {}
    for cmd in out:
        cmd.skip = cmd.skip or skip_reason(cmd)
        if not cmd.skip and cmd.line in first:
            cmd.skip = f"the same line as {first[cmd.line]}, run there"
        first.setdefault(cmd.line, cmd.where)
    return out


def skip_reason(cmd: Command) -> str:
    if cmd.line.startswith("sudo "):
        return "needs root (network namespaces)"
    if PLACEHOLDERS.search(cmd.line):
        return f"a placeholder ({PLACEHOLDERS.search(cmd.line).group(0)}) to fill in"
    words = shlex.split(COMMAND_START.sub("", cmd.line, count=1))
    if all(w.startswith("-") for w in words[1:]):
        return "names a subcommand or option in prose, not a command line"
    if TOO_LARGE.search(cmd.line) and not cmd.expect_error:
        return "builds llama3-1b (1.24 B parameters): minutes and ~20 GiB, not seconds"
    if TOO_LARGE.search(cmd.line):
        return "builds llama3-1b (1.24 B parameters) or refuses by this host's memory: not reproducible"
    return ""


def with_overrides(line: str) -> str:
    steps = 5 if "MESHFOLD_LIVE_KILL" in line else 2
    extra = f" --set train.steps={steps} --set train.progress=false"
    return TRAIN.sub(lambda m: m.group(1).rstrip() + extra + m.group(2), line)


def prepare_folder(root: Path) -> Path:
    """A folder holding the repository's files as links (what the README's paths name), and
    ``bin/meshfold``/``bin/python`` running this Python."""
    for entry in REPO.iterdir():
        if entry.name not in {".git", ".venv", "runs", "data"} and not entry.name.startswith("cluster-"):
            (root / entry.name).symlink_to(entry)
    bin_dir = root / ".readme-bin"
    bin_dir.mkdir()
    for name, run in (("meshfold", f'exec "{sys.executable}" -m meshfold "$@"'),
                      ("python", f'exec "{sys.executable}" "$@"')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{run}\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


def check(cmd: Command, rc: int, output: str) -> str:
    """'' when the output is as it should be, else what is wrong."""
    if "Traceback" in output:
        return "a traceback"
    warnings = [line for line in output.splitlines() if WARNING.search(line)]
    if len(warnings) > 1:
        return f"{len(warnings)} warning lines: " + " | ".join(w.strip()[:120] for w in warnings[:3])
    if cmd.expect_error:
        errors = [line for line in output.splitlines() if line.startswith("meshfold: error:")]
        return "" if rc != 0 and len(errors) == 1 else f"expected one 'meshfold: error:' line, got rc {rc}"
    return "" if rc == 0 else f"exit status {rc}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="print the commands and the skips, run nothing")
    ap.add_argument("--match", action="append", default=[],
                    help="run only the commands containing this text (repeatable; README order kept)")
    ap.add_argument("--match-exact", action="append", default=[],
                    help="run only the commands that are exactly this line (repeatable)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per command before it counts as failed")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (its path is printed)")
    args = ap.parse_args(argv)

    commands = extract((REPO / "README.md").read_text())
    if args.match or args.match_exact:
        commands = [c for c in commands if any(m in c.line for m in args.match) or c.line in args.match_exact]
    ran = failed = skipped = 0
    with tempfile.TemporaryDirectory(prefix="readme-") as tmp:
        root = Path(tmp)
        bin_dir = prepare_folder(root)
        env = {k: v for k, v in os.environ.items() if k != "MESHFOLD_STRICT"}  # as a user has it
        env = dict(env, PATH=f"{bin_dir}:{os.environ['PATH']}",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        for cmd in commands:
            if cmd.skip:
                skipped += 1
                print(f"SKIP  {cmd.where}  {cmd.line}\n      ({cmd.skip})", flush=True)
                continue
            line = with_overrides(cmd.line)
            if args.list:
                print(f"RUN   {cmd.where}  {line}", flush=True)
                continue
            start = time.monotonic()
            try:
                proc = subprocess.run(["bash", "-c", line], cwd=root, env=env, capture_output=True,
                                      text=True, timeout=args.timeout)
                rc, output = proc.returncode, proc.stdout + proc.stderr
            except subprocess.TimeoutExpired as e:
                rc, output = -1, f"timed out after {args.timeout:.0f} s " + str(e.stdout or "") + str(e.stderr or "")
            problem = check(cmd, rc, output)
            ran += 1
            failed += bool(problem)
            print(f"{'FAIL' if problem else 'OK  '}  {cmd.where}  {line}  ({time.monotonic() - start:.0f} s)",
                  flush=True)
            if problem:
                tail = "\n".join(output.strip().splitlines()[-15:])
                print(f"      {problem}\n" + "\n".join("      | " + t for t in tail.splitlines()), flush=True)
        if args.keep:
            keep = Path(tempfile.mkdtemp(prefix="readme-kept-"))
            subprocess.run(["cp", "-a", f"{root}/.", str(keep)], check=False)
            print(f"kept: {keep}")
    print(f"readme commands: {ran} run, {skipped} skipped, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
