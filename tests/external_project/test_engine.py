"""The engine team's own test, using the plugin's fixtures next to the collected case items."""


def test_seed_bug_is_caught_on_the_attn_tp_gather_case(specharness_check):
    assert specharness_check("tp4_attn_tp_gather", props=["P1"])
    broken = specharness_check("tp4_attn_tp_gather", props=["P1"], mutant="sglang-26416")
    assert not broken.verdicts["P1"].ok


def test_the_configured_cases_load(specharness_cases):
    assert "tp4_attn_tp_gather" in {c.name for c in specharness_cases}
