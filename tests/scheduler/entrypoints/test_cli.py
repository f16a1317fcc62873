"""The ``paged-kv`` command line: subcommands, and ``serve`` taking the main job's engine options."""

from __future__ import annotations

import pytest

from scheduler.entrypoints.cli import main, serve_parser
from scheduler.entrypoints.main_job import engine_config, parse_args


def test_serve_takes_the_engine_options_of_the_main_job():
    args = serve_parser().parse_args(["--port", "9001", "--kv-blocks", "64", "--block-size", "8",
                                      "--preemption-mode", "swap", "--max-num-seqs", "4"])  # fmt: skip
    assert (args.host, args.port, args.model) == ("127.0.0.1", 9001, None)
    config = engine_config(args)
    assert (config.cache.num_gpu_blocks, config.cache.block_size, config.cache.num_cpu_blocks) == (64, 8, 128)
    assert (config.scheduler.preemption_mode, config.scheduler.max_num_seqs) == ("swap", 4)
    assert engine_config(parse_args(["--kv-blocks", "64", "--block-size", "8", "--preemption-mode", "swap",
                                      "--max-num-seqs", "4"])) == config  # fmt: skip


@pytest.mark.parametrize(("argv", "code"), [([], 2), (["nope"], 2), (["--help"], 0)])
def test_unknown_or_missing_subcommands_print_usage(argv, code, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == code and "paged-kv {serve,run}" in capsys.readouterr().err
