"""The command line's help and errors: every option described, the subcommand's usage on
a mistake, "did you mean" for typos, and a ``--help`` that does not load torch."""

import argparse
import subprocess
import sys

import pytest

from meshfold.cli import SUBCOMMANDS, build_parser, main
from meshfold.config import load_config
from meshfold.errors import ConfigError
from meshfold.planner.cluster import PRESET_ALIASES, PRESETS, load_cluster


def _subparsers(parser: argparse.ArgumentParser, prog: str = "meshfold"):
    """(name, parser) for every subcommand at every depth (``netlab train``, ``convert check``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield f"{prog} {name}", child
                yield from _subparsers(child, f"{prog} {name}")


def test_every_option_and_argument_has_help():
    missing = [f"{name} {action.option_strings[0] if action.option_strings else action.dest}"
               for name, parser in _subparsers(build_parser())
               for action in parser._actions
               if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))
               and (not action.help or action.help == argparse.SUPPRESS)]
    assert missing == []


def test_the_top_level_list_is_each_subcommands_own_help():
    """``meshfold --help`` lists SUBCOMMANDS' lines without importing the modules: they
    must say what each module's add_parser says."""
    (action,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert {c.dest: c.help for c in action._choices_actions} == {n: c.help for n, c in SUBCOMMANDS.items()}


def test_cluster_help_lists_every_preset_as_the_error_does(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in [*PRESETS, *PRESET_ALIASES, "NAME:DEVICES"]:
        assert name in text
    with pytest.raises(ConfigError) as err:
        load_cluster("h10")
    assert "(did you mean 'h100'?)" in str(err.value) and "NAME:DEVICES" in str(err.value)
    assert all(name in str(err.value) for name in PRESETS)


def test_preset_typo_says_did_you_mean():
    with pytest.raises(ConfigError, match=r"'llama3-1c' is not a shipped shape \(did you mean 'llama3-1b'\?\)"):
        load_config("configs/debug.toml", ["model.preset=llama3-1c"])


@pytest.mark.parametrize("argv,usage", [
    (["plan", "configs/debug.toml", "--cluster", "cpu", "--bogus"], "usage: meshfold plan "),
    (["netlab", "train", "configs/debug.toml", "--bogus"], "usage: meshfold netlab train "),
    (["calibrate", "--bogus"], "usage: meshfold calibrate "),
])
def test_unknown_arguments_show_the_subcommands_usage(argv, usage, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith(usage) and "error: unrecognized arguments: --bogus" in err, err


def test_unknown_command_says_did_you_mean(capsys):
    with pytest.raises(SystemExit):
        main(["trian", "configs/debug.toml"])
    assert "unknown command 'trian' (did you mean 'train'?)" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--help"], ["calibrate", "--help"], ["dry-run", "--help"], ["plan", "--help"],
                                  ["convert", "export", "--help"], ["btm", "merge", "--help"]])
def test_help_does_not_load_torch(argv):
    """What made ``--help`` take seconds: importing torch to build the parser."""
    code = ("import sys\nfrom meshfold.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('torch loaded' if 'torch' in sys.modules else 'no torch')")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip().endswith("no torch"), proc.stdout + proc.stderr
    assert "usage: meshfold" in proc.stdout
