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


def test_every_variant_is_a_config_the_job_would_accept():
    # The config tree's own cross-section rules (DSpark and XPress refuse D-PACE, need the
    # target's distribution, ...) run at load: a variant written against them fails here,
    # not an hour into a table.
    for name in recipes.VARIANTS:
        recipes.variant_config(name, [])


def mark(tokens, steps, external=None):
    m = {"step": 10, "loss": 1.0, "walk_tau": round(sum(tokens) / sum(steps), 4), "walk_ci95": [1.0, 2.0],
         "walk_tokens": tokens, "walk_steps": steps, "slot_acc": [0.5], "s_per_step": 1.0}
    if external:
        m["external"] = {"walk_tau": round(sum(external[0]) / sum(external[1]), 4), "walk_ci95": [1.0, 2.0],
                         "walk_tokens": external[0], "walk_steps": external[1]}
    return m


def ngram(tokens, steps):
    return {"walk_tau": round(sum(tokens) / sum(steps), 4), "walk_tokens": tokens, "walk_steps": steps}


def test_the_external_texts_get_their_own_difference_and_ratio():
    toks = [60] * 8
    a = {"variant": "default", "first_loss": 9.0, "marks": [mark(toks, [40] * 8, (toks, [50] * 8))],
         "ngram": ngram(toks, [48] * 8), "ngram_external": ngram(toks, [55] * 8)}
    b = {"variant": "d2_dspark", "first_loss": 9.0, "marks": [mark(toks, [45] * 8, (toks, [40] * 8))],
         "ngram": ngram(toks, [48] * 8), "ngram_external": ngram(toks, [55] * 8)}
    held, ext = recipes.versus_first([a, b]), recipes.versus_first([a, b], external=True)
    assert held["d2_dspark"]["difference"] < 0 < ext["d2_dspark"]["difference"]
    assert recipes.versus_ngram([a, b], True)["d2_dspark"]["ratio"] == round((60 / 40) / (60 / 55), 4)
    assert recipes.versus_ngram([a, b])["default"]["ratio"] == round(1.5 / 1.25, 4)
    text = recipes.table([a, b])
    assert "external texts" in text and "the goal is 1.2x" in text
    # Without external walks, no external section.
    for r in (a, b):
        del r["marks"][0]["external"], r["ngram_external"]
    assert "external" not in recipes.table([a, b])
