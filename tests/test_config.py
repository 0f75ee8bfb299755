import dataclasses

import pytest

from lowvram.config import FIELD_DOCS, ControllerConfig, Profile, builtin_profile_names, load_profile
from lowvram.errors import ConfigError


def test_every_builtin_profile_loads_and_names_itself():
    assert builtin_profile_names() == ["2gb", "4gb", "6gb", "8gb", "cpu"]
    for name in builtin_profile_names():
        assert load_profile(name).name == name
    assert load_profile("4gb").memory_budget_gib == 4.0


def test_every_field_has_a_description():
    names = {f.name for f in dataclasses.fields(Profile)}
    names |= {f"controller.{f.name}" for f in dataclasses.fields(ControllerConfig)}
    assert names == set(FIELD_DOCS)


def _write(tmp_path, text):
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "text, words",
    [
        ("kv_precision: int3\n", ["kv_precision", "'int3'", "fp16, int8, int4, auto"]),
        ("memory_utilization: 1.5\n", ["memory_utilization", "1.5", "0.3 to 1.0"]),
        ("max_num_seqs: 0\n", ["max_num_seqs", "0", "1 to 1024"]),
        ("max_model_len: lots\n", ["max_model_len", "'lots'", "integer"]),
        ("kv_block_size: 12\n", ["kv_block_size", "12", "8, 16, 32, 64"]),
        ("turbo: true\n", ["unknown field 'turbo'", "max_model_len"]),
        ("controller:\n  patience: 3\n", ["controller.patience", "controller.patience_tokens"]),
        ("controller:\n  memory_high_water: 0.5\n  memory_low_water: 0.6\n", ["memory_low_water", "below"]),
        ("max_num_seqs: 64\nmax_num_batched_tokens: 32\n", ["max_num_batched_tokens", "max_num_seqs"]),
        ("allow_oversubscription: maybe\n", ["allow_oversubscription", "true or false"]),
        ("batch_invariant: sometimes\n", ["batch_invariant", "'sometimes'", "true or false"]),
        ("[1, 2\n", ["not valid YAML"]),
        ("- a\n- b\n", ["mapping"]),
    ],
)
def test_bad_profiles_name_the_field_the_value_and_what_is_allowed(tmp_path, text, words):
    with pytest.raises(ConfigError) as err:
        load_profile(_write(tmp_path, text))
    for word in words:
        assert word in str(err.value)


def test_a_user_file_overrides_defaults(tmp_path):
    profile = load_profile(_write(tmp_path, "memory_budget_gib: 3\ncontroller:\n  latency_high_ms: 200\n"))
    assert profile.name == "p" and profile.memory_budget_gib == 3 and profile.controller.latency_high_ms == 200
    assert profile.controller.latency_low_ms == ControllerConfig().latency_low_ms


def test_missing_file_and_unknown_name():
    with pytest.raises(ConfigError, match="does not exist"):
        load_profile("/no/such/profile.yaml")
    with pytest.raises(ConfigError, match="built-in profiles: 2gb, 4gb"):
        load_profile("5gb")


def test_replace_validates_overrides():
    with pytest.raises(ConfigError, match="emulate_vram_gib"):
        load_profile("4gb").replace(emulate_vram_gib=-1.0)
    assert load_profile("4gb").replace(emulate_vram_gib=4.0, max_model_len=None).max_model_len == 16384


def test_the_profiles_page_is_current():
    """docs/profiles.md is what `lowvram profiles --markdown` writes from the field docs and
    the built-in profiles: a field or a default changed without regenerating it fails here."""
    from pathlib import Path

    from lowvram.config import FIELD_DOCS, profiles_markdown

    page = (Path(__file__).resolve().parents[1] / "docs" / "profiles.md").read_text()
    assert page == profiles_markdown(), "run: lowvram profiles --markdown > docs/profiles.md"
    assert all(f"| `{name}` |" in page for name in FIELD_DOCS if name not in ("name", "description"))
