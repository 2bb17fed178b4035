"""`train --help`, `plan --help` and `sample --help` show examples, and every example is a command that works as
written: it parses with the real parser; train's configs validate; plan's --model/--layers/--params examples run."""

from __future__ import annotations

import shlex

import pytest

from scaletrain.cli import build_parser, main
from scaletrain.commands.plan import EXAMPLES as PLAN_EXAMPLES
from scaletrain.commands.train import SAMPLE_EXAMPLES, TRAIN_EXAMPLES


def commands(epilog: str) -> list[list[str]]:
    """The `scaletrain ...` lines of an epilog, split as a shell would (without the leading `scaletrain`)."""
    text = epilog.replace("\\\n", " ")  # a command continued on the next line with a backslash, as in a shell
    return [shlex.split(line.strip())[1:] for line in text.splitlines() if line.strip().startswith("scaletrain ")]


@pytest.mark.parametrize("command,epilog,least", [("train", TRAIN_EXAMPLES, 4), ("plan", PLAN_EXAMPLES, 4),
                                                  ("sample", SAMPLE_EXAMPLES, 2)])
def test_help_shows_its_examples(capsys, command, epilog, least):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and epilog.strip() in out  # RawDescriptionHelpFormatter: the lines as written
    argvs = commands(epilog)
    assert len(argvs) >= least and all(argv[0] == command for argv in argvs)


def test_train_examples_parse_and_their_configs_validate():
    from scaletrain.config import load_config, validate

    parser = build_parser()
    for argv in commands(TRAIN_EXAMPLES):
        args = parser.parse_args(argv)
        if args.init_from is None:  # --init-from's model keys come from a folder the test does not have
            cfg = load_config(args.config, args.set)
            validate(cfg, args.nproc if args.nproc is not None else cfg.world_size)


def test_sample_examples_parse():
    parser = build_parser()
    runs = [parser.parse_args(argv).run for argv in commands(SAMPLE_EXAMPLES)]
    assert runs == ["runs/zero3", "runs/train"]


def test_plan_examples_parse_and_the_cheap_ones_run(capsys):
    parser = build_parser()
    ran = 0
    for argv in commands(PLAN_EXAMPLES):
        parser.parse_args(argv)
        if not {"--layout", "--params"} & set(argv):  # full searches (seconds each) and --calibrate: parsed only
            continue
        assert main(argv) == 0, argv
        ran += 1
        capsys.readouterr()
    assert ran >= 2
