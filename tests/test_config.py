"""Config: overrides with type conversion, YAML loading, and validate() naming the bad values."""

import pytest

from scaletrain.config import Config, load_config, validate
from scaletrain.config.doc import field_docs
from scaletrain.errors import ConfigError


def test_overrides_convert_types():
    cfg = load_config(None, ["model.n_layers=8", "train.lr=3e-4", "model.tie_embeddings=false",
                             "parallel.schedule=1f1b", "data.source=/tmp/x.txt", "model.dropout=0"])
    assert cfg.model.n_layers == 8 and isinstance(cfg.model.n_layers, int)
    assert cfg.train.lr == 3e-4 and cfg.model.tie_embeddings is False
    assert cfg.parallel.schedule == "1f1b" and cfg.model.dropout == 0.0


def test_yaml_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  n_layers: 3\n  d_model: 64\ntrain:\n  steps: 7\n")
    cfg = load_config(f, ["train.steps=9"])
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.train.steps) == (3, 64, 9)


@pytest.mark.parametrize("override, words", [
    ("model.n_layer=2", ["unknown config key", "model.n_layer"]),
    ("nope.x=1", ["unknown config key", "nope"]),
    ("model.n_layers=two", ["model.n_layers", "integer", "two"]),
    ("model.tie_embeddings=maybe", ["model.tie_embeddings", "maybe"]),
    ("model=3", ["section"]),
    ("justtext", ["key=value"]),
])
def test_bad_overrides_are_named(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("overrides, words", [
    (["model.d_model=100", "model.n_heads=3"], ["d_model (100)", "n_heads (3)"]),
    (["train.global_batch=10", "train.micro_batch=4"], ["global_batch (10)", "micro_batch (4)"]),
    (["train.global_batch=8", "train.micro_batch=2", "parallel.dp=3"], ["global_batch (8)", "dp (3)"]),
    (["model.n_layers=0"], ["model.n_layers must be positive, got 0"]),
    (["train.steps=-5"], ["train.steps must be positive, got -5"]),
    (["train.dtype=fp8"], ["train.dtype", "fp8"]),
    (["parallel.zero=5"], ["parallel.zero", "5"]),
    (["data.val_fraction=0.9"], ["data.val_fraction", "0.9"]),
])
def test_validate_names_values(overrides, words):
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, overrides))
    for w in words:
        assert w in str(e.value), str(e.value)


def test_world_size_must_match_layout():
    cfg = load_config(None, ["parallel.dp=2", "train.global_batch=16", "train.micro_batch=8"])
    validate(cfg, 2)
    with pytest.raises(ConfigError, match=r"= 2 does not match the number of processes \(4\)"):
        validate(cfg, 4)


def test_every_field_is_documented():
    cfg = Config()
    for section in ("model", "parallel", "train", "optim", "memory", "data"):
        node = getattr(cfg, section)
        docs = field_docs(type(node))
        missing = [f for f in vars(node) if f not in docs]
        assert not missing, f"{section}: undocumented {missing}"


def test_design_keys_exist():
    # DESIGN.md's contract keys
    cfg = Config()
    for key in ["model.n_layers", "model.d_model", "model.n_heads", "model.seq_len", "model.vocab_size",
                "parallel.dp", "parallel.tp", "parallel.pp", "parallel.zero", "parallel.schedule",
                "parallel.microbatches", "parallel.virtual_stages", "train.steps", "train.global_batch",
                "train.micro_batch", "train.seed", "train.lr", "train.dtype", "data.source"]:
        section, name = key.split(".")
        assert hasattr(getattr(cfg, section), name), key


def test_validate_refuses_to_run_without_rules(monkeypatch):
    """An empty registry is an internal error, never a silent pass (the rule modules were not imported)."""
    from scaletrain.config import rules

    monkeypatch.setattr(rules, "_RULES", {name: [] for name in rules._RULES})
    with pytest.raises(RuntimeError, match="no validation rules are registered"):
        validate(Config())


def test_every_rules_module_is_registered_by_the_package_root():
    """Each feature's rules.py registers at least one rule, and the package root imports it (so importing any
    scaletrain module registers every rule)."""
    from pathlib import Path

    import scaletrain
    from scaletrain.config import rules

    root = Path(scaletrain.__file__).parent
    found = {".".join(("scaletrain", *p.relative_to(root).with_suffix("").parts)) for p in root.rglob("rules.py")}
    found.discard("scaletrain.config.rules")  # the registry itself
    found.add("scaletrain.config.ignored")  # the one cross-feature rules module: settings a configuration ignores
    registering = {fn.__module__ for stage in rules.STAGES for fn in rules.registered(stage.name)}
    assert found and found == registering, sorted(found ^ registering)


def test_closed_sets_load_as_their_type_and_validate_names_unknown_values():
    cfg = load_config(None, ["parallel.zero=2", "parallel.tp_mode=2.5d", "parallel.schedule=1f1b"])
    assert (cfg.parallel.zero, cfg.parallel.tp_mode, cfg.parallel.schedule) == (2, "2.5d", "1f1b")
    with pytest.raises(ConfigError, match="parallel.zero: expected an integer, got 'two'"):
        load_config(None, ["parallel.zero=two"])
    with pytest.raises(ConfigError, match=r"^parallel.tp_mode must be one of 1d, 2d, 2.5d, 3d, got '4d'$"):
        validate(load_config(None, ["parallel.tp_mode=4d"]))
