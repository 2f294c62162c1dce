"""Shared fixtures of the method tests."""

import pytest

from ncljax.data import pipeline, synthetic

B, N = 32, 40  # batch size; training images of the data fixture


@pytest.fixture(scope="module")
def data():
    """Synthetic region/token training batches of ``B`` pairs of ``N`` (the last padded)."""
    cfg = synthetic.default_config()
    cfg.num_train, cfg.num_val, cfg.num_test = N, 4, 4
    ds = synthetic.SyntheticDataset(cfg)
    record = pipeline.pair_records(
        ds.split("train"), image_fields=("regions",), text_fields=("tokens", "length")
    )
    return ds.info, list(pipeline.batches(record, N, batch_size=B, seed=0))  # 2nd padded
