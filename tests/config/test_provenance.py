"""Every value knows where it came from: default, group option, recipe or command line."""

from miles_runner.config.compose import compose


def test_group_choice_made_by_the_recipe_is_attributed_to_the_recipe():
    prov = compose(["+recipe=qwen3_30b_a3b_r3_session"]).provenance
    assert prov.display("session.version", "v1") == ("session=v1", prov.choice_origins["session"])
    assert str(prov.choice_origins["session"]) == "recipe qwen3_30b_a3b_r3_session"


def test_group_choice_on_the_command_line_wins_and_is_attributed_to_it():
    composed = compose(["+recipe=qwen3_30b_a3b_r3_session", "pause_generation_mode=abort"])
    assert composed.config.weight_sync.pause_generation_mode == "abort"
    shown, origin = composed.provenance.display("weight_sync.pause_generation_mode", "abort")
    assert (shown, str(origin)) == ("pause_generation_mode=abort", "command line")


def test_recipe_value_is_attributed_to_the_recipe():
    prov = compose(["+recipe=glm52_lora_agentic"]).provenance
    assert str(prov.origin("trainer.parallel.ep")) == "recipe glm52_lora_agentic"


def test_command_line_value_beats_the_recipe():
    composed = compose(["+recipe=glm52_lora_agentic", "trainer.parallel.ep=16"])
    assert composed.config.trainer.parallel.ep == 16
    assert str(composed.provenance.origin("trainer.parallel.ep")) == "command line"


def test_untouched_value_is_a_default():
    prov = compose([]).provenance
    assert str(prov.origin("optimizer.weight_decay")) == "default"


def test_default_group_choice_is_attributed_to_the_defaults():
    prov = compose([]).provenance
    shown, origin = prov.display("topology.kind", "colocated")
    assert shown == "topology=colocated"
    assert str(origin) == "default"
