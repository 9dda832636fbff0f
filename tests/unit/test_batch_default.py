"""The default batch: 2,048 rows a step, halved on a small train split so an epoch still holds 64 steps."""

from __future__ import annotations

from ctrflow.config import DataConfig


def test_the_default_batch_follows_the_train_split_and_a_given_one_is_kept():
    auto = DataConfig()
    assert auto.batch_size is None
    assert auto.batch_for(200_000) == 2048  # 97 steps: the quality benchmark's runs, as before
    assert auto.batch_for(131_072) == 2048  # exactly 64 steps
    assert auto.batch_for(100_000) == 1024  # 48 steps at 2,048; 97 at 1,024
    assert auto.batch_for(20_000) == 256  # never below 256, even if an epoch then has fewer steps
    assert auto.batch_for(1_000) == 256
    assert DataConfig(batch_size=2048).batch_for(100_000) == 2048
    assert DataConfig(batch_size=64).batch_for(10**9) == 64
