"""The recipe tables' bookkeeping: which variants share one feature store, and which
config each variant is written against. No model is loaded."""

from benchmarks import recipes


def key(*sets):
    return recipes.feature_key(recipes.variant_config("default", list(sets)))


def test_named_taps_share_features_at_any_depth():
    taps = "drafter.target_layer_ids=[1, 27]"
    assert key(taps, "drafter.num_layers=3") == key(taps, "drafter.num_layers=2")
    # Left to the default, the depth picks the taps, so it picks the store.
    assert key("drafter.num_layers=3") != key("drafter.num_layers=2")
    # What the features do depend on still separates the stores.
    assert key(taps, "batching.token_budget=1024") != key(taps)
    assert key("drafter.target_layer_ids=[18, 23]") != key(taps)


def test_d2_variants_change_the_config_as_it_is_and_older_ones_keep_dflash():
    assert recipes.overrides("d2_lr3e-3") == recipes.VARIANTS["d2_lr3e-3"]
    older = recipes.overrides("lr6e-4")
    assert all(o in older for o in recipes.BEFORE_DFLASH2)
    # A variant that sets one of those keys itself keeps its own value.
    assert "train.head_vocab=sampled" not in recipes.overrides("dflash_full")
