"""The disk tier's keys: sizes with units, a clear error naming the key for every bad combination, and the
server-wide `--disk-dir` giving each pool its own directory and an even split of the capacity."""

from __future__ import annotations

import pytest

from radixkv.server.process.flags import parse_args
from radixkv.server.rules.config import config_from_mapping, pool_keys_help

SHAPE = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "num_blocks": 16}
TIERED = {**SHAPE, "host_num_blocks": 16}


def pools(**tables: dict[str, object]) -> dict[str, object]:
    return {"pools": tables}


def test_the_flags_give_every_pool_a_directory_and_a_share_of_the_capacity() -> None:
    config, _ = parse_args(["--pool", "a:num_layers=2,num_kv_heads=2,head_dim=8,num_blocks=16,host_num_blocks=8",
                            "--pool", "b:num_layers=2,num_kv_heads=2,head_dim=8,num_blocks=16,host_num_blocks=8",
                            "--disk-dir", "/d", "--disk-capacity", "200GiB"])  # fmt: skip
    half = f"{100 << 30}B"
    assert [(p.disk_dir, p.disk_capacity) for p in config.pools] == [("/d/a", half), ("/d/b", half)]


def test_pool_keys_and_toml_take_sizes_with_units() -> None:
    config = config_from_mapping(pools(p={**TIERED, "disk_dir": "/x", "disk_capacity": "1.5TB"}))
    assert config.pools[0].disk_capacity == "1.5TB" and config.pools[0].disk_dir == "/x"
    with pytest.raises(ValueError, match="disk_capacity '4096' has no unit"):  # a bare TOML number, as a flag's
        config_from_mapping(pools(p={**TIERED, "disk_dir": "/x", "disk_capacity": 4096}))
    assert "disk_prefill_tokens_per_s" in pool_keys_help()


@pytest.mark.parametrize(
    ("table", "says"),
    [
        ({**SHAPE, "disk_dir": "/x", "disk_capacity": "1GiB"}, "needs a host tier"),
        ({**TIERED, "disk_dir": "/x"}, "needs disk_capacity"),
        ({**TIERED, "disk_capacity": "1GiB"}, "disk_capacity needs disk_dir"),
        ({**TIERED, "disk_dir": "/x", "disk_capacity": "lots"}, "not a size"),
        ({**TIERED, "disk_dir": "/x", "disk_capacity": "0GiB"}, "must be > 0"),
        ({**TIERED, "disk_dir": "/x", "disk_capacity": "1GiB", "disk_prefill_tokens_per_s": -5}, "must be > 0"),
    ],
)
def test_a_bad_disk_key_is_a_clear_error(table: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        config_from_mapping(pools(p=table))


def test_disk_capacity_without_disk_dir_is_refused_on_the_command_line() -> None:
    with pytest.raises(ValueError, match="--disk-capacity needs --disk-dir"):
        parse_args(["--pool", "a:num_layers=2,num_kv_heads=2,head_dim=8,num_blocks=16", "--disk-capacity", "1GiB"])
