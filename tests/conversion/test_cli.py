"""The conversion CLI is reachable as ``megarl convert`` and lists its three commands."""
import pytest


def test_megarl_convert_dispatches_to_the_conversion_cli(capsys):
    from megarl.run.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["convert", "--help"])
    assert exit_info.value.code == 0
    usage = capsys.readouterr().out
    for command in ("hf-to-megatron", "megatron-to-hf", "verify"):
        assert command in usage


def test_required_world_size_follows_megatron_grid():
    from conversion.common import required_world_size
    from megarl.models import ParallelLayout

    assert required_world_size(ParallelLayout(tp=2, pp=2)) == 4
    assert required_world_size(ParallelLayout(ep=2)) == 2  # experts split over the data-parallel ranks
    assert required_world_size(ParallelLayout(tp=2, ep=2)) == 2  # EP carved from the TP ranks
    assert required_world_size(ParallelLayout(tp=2, ep=2, etp=2, pp=2)) == 8


def test_shard_sizes_parse():
    from conversion.megatron_to_hf import parse_size

    assert parse_size("2GB") == 2 * 10**9
    assert parse_size("500MiB") == 500 * 1024**2
    assert parse_size("123456") == 123456
