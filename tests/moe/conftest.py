import pytest


@pytest.fixture(scope="session")
def demo_bins():
    """20+ packed bins of the built-in data and the demo tokenizer's vocab size."""
    from slipstream.data import demo_samples, demo_tokenizer, pack_samples

    tokenizer = demo_tokenizer()
    bins, _ = pack_samples(demo_samples(tokenizer, num_rows=400, seed=0), 512, seed=0)
    return bins, len(tokenizer)
