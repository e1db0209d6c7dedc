"""Config: defaults -> YAML -> dotted overrides, validation errors that name the field, every YAML loads."""

import importlib.util
from pathlib import Path

import pytest
import yaml

from async_vla.config import Config, ConfigError, load_config, write_resolved

REPO = Path(__file__).resolve().parent.parent


def test_defaults_are_simplevla_rl_recipe():
    cfg = load_config()
    assert cfg.actor.temperature == 1.6 and cfg.actor.group_size == 8
    assert (cfg.loss.eps_low, cfg.loss.eps_high) == (0.2, 0.28)
    assert cfg.learner.lr == 5e-6 and cfg.loss.kl_beta == 0.0
    assert cfg.tokens_per_call == 56


def test_yaml_then_overrides_take_precedence(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"loss": {"eps_high": 0.3}, "learner": {"lr": 1e-4}}))
    cfg = load_config(f, ["learner.lr=5e-6", "buffer.difficulty_mask=[0.1,0.95]"])
    assert cfg.loss.eps_high == 0.3
    assert cfg.learner.lr == 5e-6
    assert cfg.buffer.difficulty_mask == (0.1, 0.95)


@pytest.mark.parametrize("override, field", [
    ("loss.eps_hgh=0.3", "loss.eps_hgh: unknown key"),
    ("learner.lr=fast", "learner.lr"),
    ("loss.eps_low=1.5", "loss.eps_low"),
    ("actor.group_size=1", "actor.group_size"),
    ("nosuchsection.x=1", "nosuchsection: unknown key"),
    ("loss.correction=vtrace", "loss.correction"),
    ("loss.mis_low=6", "mis_low"),
    ("buffer.difficulty_mask=[0.9,0.1]", "difficulty_mask"),
    ("weights.backend=zmq", "weights.backend"),
])
def test_bad_values_name_the_dotted_field(override, field):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert field in str(err.value)


def test_error_shows_value_and_allowed_range():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["loss.eps_low=1.5"])
    assert "1.5" in str(err.value) and "less than 1" in str(err.value)


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="buffer.groups_per_batch .* learner.num_ranks"):
        load_config(None, ["learner.num_ranks=3", "buffer.groups_per_batch=4"])
    with pytest.raises(ConfigError, match="policy.path"):
        load_config(None, ["policy.arch=openvla_oft"])
    with pytest.raises(ConfigError, match="env.image_size"):
        load_config(None, ["env.image_size=30", "policy.patch_size=8"])
    with pytest.raises(ConfigError, match=r"weights.publish_every \(4\) > buffer.max_staleness \+ 1 \(3\)"):
        load_config(None, ["weights.publish_every=4", "buffer.max_staleness=2"])
    with pytest.raises(ConfigError, match="weights.publish_every"):
        load_config(None, ["weights.publish_every=2", "run.mode=sync"])
    assert load_config(None, ["weights.publish_every=3", "buffer.max_staleness=2"]).weights.publish_every == 3
    with pytest.raises(ConfigError, match="actor.temperature=0 .* buffer.dynamic_sampling"):
        load_config(None, ["actor.temperature=0"])
    assert load_config(None, ["actor.temperature=0", "buffer.dynamic_sampling=false"]).actor.temperature == 0
    for bad in ("[7]", "[0,0]", "[]"):
        with pytest.raises(ConfigError, match=r"actor.sampled_dims .* \(policy.action_dim=7\)"):
            load_config(None, [f"actor.sampled_dims={bad}"])
    assert load_config(None, ["actor.sampled_dims=[0,1,2,6]"]).actor.sampled_dims == [0, 1, 2, 6]
    with pytest.raises(ConfigError, match=r"actor.task_ids \[8\] must be a subset of env.task_ids \[0, 1\].*add \[8\]"):
        load_config(None, ["env.task_ids=[0,1]", "actor.task_ids=[8]"])
    for bad in ("[]", "[1,1]"):
        with pytest.raises(ConfigError, match="actor.task_ids .* distinct"):
            load_config(None, [f"actor.task_ids={bad}"])
    with pytest.raises(ConfigError, match=r"actor.num_init_states \(5\) > env.num_train_init_states \(4\)"):
        load_config(None, ["env.num_train_init_states=4", "actor.num_init_states=5"])
    ok = load_config(None, ["env.task_ids=[0,8]", "actor.task_ids=[8]", "actor.num_init_states=4"]).actor
    assert (ok.task_ids, ok.num_init_states) == ([8], 4)
    with pytest.raises(ConfigError, match=r"actor.init_state_ids \[1\] and actor.num_init_states \(4\)"):
        load_config(None, ["actor.init_state_ids=[1]", "actor.num_init_states=4"])
    for bad in ("[]", "[3,3]", "[-1]", "[4]"):
        with pytest.raises(ConfigError, match=r"actor.init_state_ids .* distinct train init states in 0..3"):
            load_config(None, ["env.num_train_init_states=4", f"actor.init_state_ids={bad}"])
    chosen = load_config(None, ["env.num_train_init_states=40", "actor.init_state_ids=[5,2,31]"])
    assert chosen.practised_init_states(range(40)) == [5, 2, 31]
    assert load_config(None, ["actor.num_init_states=3"]).practised_init_states([7, 8, 9, 10]) == [7, 8, 9]
    assert load_config(None, []).practised_init_states([7, 8, 9, 10]) == [7, 8, 9, 10]


def test_vllm_backend_without_vllm_fails_at_config_time():
    if importlib.util.find_spec("vllm") is not None:  # find_spec: no CUDA start-up just to ask
        pytest.skip("vllm installed")
    with pytest.raises(ConfigError, match="vllm is not installed"):
        load_config(None, ["actor.backend=vllm", "policy.decoding=autoregressive"])


def test_override_syntax_error_is_clear():
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config(None, ["learner.lr"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("loss: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_sync_mode_runs_with_zero_staleness_as_a_derived_value():
    from async_vla.buffer import GroupBuffer

    sync = load_config(None, ["run.mode=sync", "buffer.max_staleness=3"])
    assert sync.max_staleness == 0 and sync.buffer.max_staleness == 3   # derived, the field is left as written
    assert GroupBuffer.from_config(sync, "run").max_staleness == 0
    assert load_config(None, ["buffer.max_staleness=3"]).max_staleness == 3


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["run.name=x", f"run.out_dir={tmp_path}", "loss.nsr=band"])
    path = write_resolved(cfg)
    assert path == tmp_path / "x" / "config.yaml"
    again = load_config(path)
    assert again == cfg


def test_every_field_has_a_docstring():
    def walk(model, prefix=""):
        for name, info in model.model_fields.items():
            assert info.description, f"{prefix}{name} has no docstring"
            ann = info.annotation
            if isinstance(ann, type) and issubclass(ann, Config.__mro__[1]):
                walk(ann, f"{prefix}{name}.")
    walk(Config)


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_yaml_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)


def test_config_doc_is_current():
    from async_vla.config.docs import render_config_doc

    assert (REPO / "docs" / "CONFIG.md").read_text() == render_config_doc(), "run bin/config-docs"


def test_vllm_with_openvla_oft_is_refused_naming_the_torch_backend():
    """OFT's one bidirectional pass is not something vLLM decodes (docs/GPU.md): refused whether or not vLLM is
    installed, with the fix named."""
    with pytest.raises(ConfigError, match="set actor.backend=torch"):
        load_config(None, ["actor.backend=vllm", "policy.arch=openvla_oft", "policy.path=ckpt",
                           "policy.decoding=autoregressive"])


def test_a_config_that_cannot_form_a_batch_fails_at_load_naming_the_fields_and_the_fix():
    # SimpleVLA-RL's batch (64 x 8) of LIBERO-spatial trajectories (224 px, 220 steps: 28 calls, ~4 MiB) is
    # ~2.0 GiB, above the 2 GiB default: the buffer would fill with ready groups and never hand out a batch.
    recipe = ["env.kind=libero", "env.suite=spatial", "env.image_size=224", "buffer.groups_per_batch=64"]
    with pytest.raises(ConfigError) as err:
        load_config(None, recipe)
    msg = str(err.value)
    assert "buffer.max_bytes" in msg and "buffer.groups_per_batch (64)" in msg and "actor.group_size (8)" in msg
    need = int(msg.split("set buffer.max_bytes >= ")[1].split()[0])
    assert load_config(None, recipe + [f"buffer.max_bytes={need}"]).buffer.max_bytes == need
    with pytest.raises(ConfigError, match="buffer.max_bytes"):
        load_config(None, recipe + [f"buffer.max_bytes={need - 1}"])
    with pytest.raises(ConfigError, match=r"transport.max_message_mb \(1\) is below one trajectory"):
        load_config(None, recipe + [f"buffer.max_bytes={need}", "transport.max_message_mb=1"])


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("libero_*.yaml")), ids=lambda p: p.name)
def test_shipped_libero_configs_hold_at_least_two_batches(path):
    cfg = load_config(path)
    batch = cfg.buffer.groups_per_batch * cfg.actor.group_size * cfg.trajectory_bytes
    assert cfg.buffer.max_bytes >= 2 * batch
