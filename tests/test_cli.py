"""What a user meets first at the command line (cli.py), through the CLI's own entry point in this process."""
from __future__ import annotations

import pytest
from conftest import SHAKESPEARE

from phalanx.cli import EXTRA_COMMANDS, main


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


COMMANDS = ["train", "prepare", "config", *EXTRA_COMMANDS]


def test_a_bare_phalanx_lists_the_commands_with_their_help(capsys):
    """A bare `phalanx` printed argparse's 'the following arguments are required: command'."""
    code, out, err = _run([], capsys)
    assert code == 2 and "arguments are required" not in err, err
    for name in COMMANDS:
        assert any(line.split()[:1] == [name] and len(line.split()) > 1 for line in err.splitlines()), (name, err)
    assert "sample text from a trained language model" in err  # each command's one-line help
    code, out, _ = _run(["--help"], capsys)
    assert code == 0 and all(name in out for name in COMMANDS)


def test_prepare_says_each_splits_summary_once(tmp_path, capsys):
    """A fresh store's summary was printed twice: by the pipeline as the split finished, then by the command."""
    args = ["prepare", f"data.train={SHAKESPEARE}", f"data.cache_dir={tmp_path}", "data.vocab_size=300", "--quiet"]
    for how in ("prepared in", "already prepared"):
        code, out, err = _run(args, capsys)
        summaries = [line for line in out.splitlines() if "train: " in line and "tokens" in line]
        assert code == 0 and len(summaries) == 1 and how in summaries[0], out


@pytest.mark.parametrize("argv", [["--run-dir", "x"]])
def test_flags_without_a_command_list_the_commands(argv, capsys):
    code, _, err = _run(argv, capsys)
    assert code == 2 and "train" in err and "prepare" in err
