"""kvhit configuration: precedence YAML < KVHIT_* env < flags, HF config.json geometry, defaults.

KV sizes are worked by hand (MODEL.md §3.6): S_kv = 2·L·max(1, n_kv/tp)·d_head·b_elem.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from exporter.config import Config, ConfigError, load_config


def _yaml(tmp_path, text: str) -> str:
    p = tmp_path / "kvhit.yaml"
    p.write_text(text)
    return str(p)


# ---- precedence ------------------------------------------------------------------------------


def test_precedence_yaml_env_flags_top_level_key(tmp_path):
    path = _yaml(tmp_path, "interval: 1\nlisten: 127.0.0.1:1111\n")
    env = {"KVHIT_INTERVAL": "2", "KVHIT_LISTEN": "127.0.0.1:2222"}
    flags = {"interval": 3.0, "listen": "127.0.0.1:3333"}
    assert load_config(path, environ={}).interval == 1.0
    assert load_config(path, environ=env).interval == 2.0
    assert load_config(path, environ=env, flags=flags).interval == 3.0
    assert load_config(path, environ={}).listen == "127.0.0.1:1111"
    assert load_config(path, environ=env).listen == "127.0.0.1:2222"
    assert load_config(path, environ=env, flags=flags).listen == "127.0.0.1:3333"
    # A flag left unset (None) does not hide the lower layers.
    assert load_config(path, environ=env, flags={"interval": None}).interval == 2.0
    # Env alone and flags alone over the defaults.
    assert load_config(None, environ={"KVHIT_INTERVAL": "7"}).interval == 7.0
    assert load_config(None, environ={}, flags={"interval": 9.0}).interval == 9.0


def test_a_command_s_defaults_are_the_lowest_layer(tmp_path):
    # kvhit demo serves on 127.0.0.1 by default, yet --config and KVHIT_LISTEN still win over that
    local = {"listen": "127.0.0.1:9471"}
    assert load_config(None, environ={}, defaults=local).listen == "127.0.0.1:9471"
    assert load_config(_yaml(tmp_path, "listen: 127.0.0.1:1111\n"), environ={}, defaults=local).listen == "127.0.0.1:1111"
    assert load_config(None, environ={"KVHIT_LISTEN": "127.0.0.1:2222"}, defaults=local).listen == "127.0.0.1:2222"
    assert load_config(None, environ={}).listen == "0.0.0.0:9471"  # the sidecar's own default


def test_precedence_nested_key(tmp_path):
    path = _yaml(tmp_path, "prices:\n  hit_price_ratio: 0.2\n  miss_per_million: 3\n")
    env = {"KVHIT_PRICES_HIT_PRICE_RATIO": "0.25"}
    flags = {"prices": {"hit_price_ratio": 0.5}}
    assert load_config(path, environ={}).prices.hit_price_ratio == 0.2
    assert load_config(path, environ=env).prices.hit_price_ratio == 0.25
    got = load_config(path, environ=env, flags=flags).prices
    assert got.hit_price_ratio == 0.5
    assert got.miss_per_million == 3.0  # the sibling from YAML survives the merge


def test_env_overrides_yaml_geometry(tmp_path):
    path = _yaml(tmp_path, "model:\n  layers: 32\n  kv_heads: 8\n  head_dim: 128\n  tp: 1\n")
    assert load_config(path, environ={}).model.kv_bytes_per_token() == 131072
    assert load_config(path, environ={"KVHIT_MODEL_TP": "4"}).model.kv_bytes_per_token() == 32768


def test_kubernetes_service_links_of_a_service_named_kvhit_are_not_configuration():
    # A Service named kvhit (or kvhit-fleet) gives every pod of its namespace these variables
    # (enableServiceLinks): kvhit refused them as unknown keys, so a sidecar analysed nothing (breaker)
    links = {"KVHIT_SERVICE_HOST": "10.96.0.15", "KVHIT_SERVICE_PORT": "9471", "KVHIT_SERVICE_PORT_METRICS": "9471",
             "KVHIT_PORT": "tcp://10.96.0.15:9471", "KVHIT_PORT_9471_TCP": "tcp://10.96.0.15:9471",
             "KVHIT_PORT_9471_TCP_PROTO": "tcp", "KVHIT_PORT_9471_TCP_PORT": "9471",
             "KVHIT_PORT_9471_TCP_ADDR": "10.96.0.15", "KVHIT_FLEET_SERVICE_HOST": "10.96.0.16",
             "KVHIT_FLEET_PORT_9471_UDP": "udp://10.96.0.16:9471"}
    links["KVHIT_V6_PORT"] = "tcp://[fd00::a]:9471"  # an IPv6 cluster's
    assert load_config(environ={**links, "KVHIT_INTERVAL": "7"}).interval == 7.0
    # not a link's shape, by name or by value: a guess at a key, refused (review: the name alone let
    # KVHIT_LISTEN_PORT=9000 pass unsaid)
    for typo, value in (("KVHIT_PORTS", "1"), ("KVHIT_SERVICE", "1"), ("KVHIT_PORT_METRICS", "1"), ("KVHIT_PORT", "9000"),
                        ("KVHIT_LISTEN_PORT", "9000"), ("KVHIT_SERVICE_HOST", "kvhit.llm.svc")):
        with pytest.raises(ConfigError, match=f"environment variable {typo}: unknown key"):
            load_config(environ={typo: value})


def test_the_fleet_example_s_config_is_read_by_every_command():
    # its prometheus_delay is fleet mode's (--prometheus is in its args): replay and report read the
    # file too; only kvhit run --target refuses it (review)
    cfg = load_config(str(Path(__file__).resolve().parents[1] / "deploy/kustomize/examples/kvhit-fleet/config.yaml"),
                      environ={})
    assert cfg.prometheus_delay > 0 and cfg.prometheus is None


def test_yaml_merge_keys_are_read_and_the_mapping_s_own_keys_override_them(tmp_path):
    # "<<:" is YAML's (1.1 merge key): it was refused as "not valid YAML" (config breaker)
    path = _yaml(tmp_path, "<<: {interval: 7, window_seconds: 60}\ninterval: 9\n"
                           "slo:\n  <<: {ttft_seconds: 2, tpot_seconds: 0.1}\n  ttft_seconds: 1\n")
    cfg = load_config(path, environ={})
    assert (cfg.interval, cfg.window_seconds, cfg.slo.ttft_seconds, cfg.slo.tpot_seconds) == (9.0, 60.0, 1.0, 0.1)
    with pytest.raises(ConfigError, match="key 'interval' twice"):  # its own key twice is still refused
        load_config(_yaml(tmp_path, "<<: {window_seconds: 60}\ninterval: 9\ninterval: 8\n"), environ={})


def test_a_quoted_number_is_the_number_and_a_word_is_a_wrong_type(tmp_path):
    # README "Configuration": a number may be quoted, as every environment value is a string
    path = _yaml(tmp_path, "model:\n  layers: '32'\n  kv_heads: \"8\"\n  head_dim: 128\n")
    assert load_config(path, environ={}).model.kv_bytes_per_token() == 32 * 8 * 128 * 2 * 2  # K and V, 2 bytes
    with pytest.raises(ConfigError, match="model.layers"):
        load_config(_yaml(tmp_path, "model:\n  layers: thirty-two\n"), environ={})


def test_null_in_the_environment_is_yaml_s_and_a_body_cap_below_any_exposition_is_refused(tmp_path):
    # README "Configuration": target_hit_ratio null publishes no target series; from the environment
    # it was "expected float, got 'null'" (newcomer helper); a non-nullable key says null is no setting
    assert load_config(None, environ={"KVHIT_TARGET_HIT_RATIO": "null"}).target_hit_ratio is None
    assert load_config(_yaml(tmp_path, "target_hit_ratio: 0.5\n"), environ={"KVHIT_TARGET_HIT_RATIO": "~"}).target_hit_ratio is None
    with pytest.raises(ConfigError, match="interval: expected float, got null"):
        load_config(None, environ={"KVHIT_INTERVAL": "NULL"})
    # and so for a refused configuration's lenient read (--on-config-error=serve): the file's target,
    # not a target "null" (review)
    from exporter.config import layered_string
    path = _yaml(tmp_path, "target: http://vllm:8000/metrics\n")
    assert layered_string("target", path, environ={"KVHIT_TARGET": "Null"}) == "http://vllm:8000/metrics"
    # a 10-byte cap passed --check-config and failed every scrape as too_large
    with pytest.raises(ConfigError, match="max_body_bytes: must be >= 4096"):
        load_config(None, environ={"KVHIT_MAX_BODY_BYTES": "10"})
    assert load_config(None, environ={"KVHIT_MAX_BODY_BYTES": "4096"}).max_body_bytes == 4096


def test_unknown_env_variable_and_key_named(tmp_path):
    with pytest.raises(ConfigError, match="KVHIT_NOPE"):
        load_config(None, environ={"KVHIT_NOPE": "1"})
    with pytest.raises(ConfigError, match="model.nope"):
        load_config(_yaml(tmp_path, "model:\n  nope: 1\n"), environ={})
    with pytest.raises(ConfigError, match="interval"):
        load_config(None, environ={"KVHIT_INTERVAL": "-1"})
    with pytest.raises(ConfigError, match="prices.hit_price_ratio"):
        load_config(None, environ={}, flags={"prices": {"hit_price_ratio": 1.5}})
    # Variables without the KVHIT_ prefix are not kvhit's business.
    assert load_config(None, environ={"PATH": "/bin", "KVHITX": "1"}).interval == 5.0


# ---- HF config.json geometry (MODEL.md §3.6) --------------------------------------------------


@pytest.fixture
def hf_config(tmp_path) -> str:
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                             "hidden_size": 4096, "torch_dtype": "bfloat16"}))
    return str(p)


def test_hf_config_geometry_tp1(hf_config):
    g = load_config(None, environ={}, flags={"model": {"hf_config": hf_config}}).model
    assert (g.layers, g.kv_heads, g.head_dim) == (32, 8, 4096 // 32)
    assert g.head_dim == 128
    # 2 (K and V) · 32 layers · 8 KV heads · 128 · 2 bytes = 131072 bytes per token
    assert g.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2 == 131072


def test_hf_config_geometry_tp4(hf_config):
    g = load_config(None, environ={}, flags={"model": {"hf_config": hf_config, "tp": 4}}).model
    # 8 KV heads over 4 ranks = 2 per GPU: 2 · 32 · 2 · 128 · 2 = 32768 bytes per token per GPU
    assert g.kv_bytes_per_token() == 2 * 32 * 2 * 128 * 2 == 32768
    assert g.gpus == 4


def test_hf_config_explicit_key_wins(hf_config, tmp_path):
    path = _yaml(tmp_path, f"model:\n  hf_config: {hf_config}\n  kv_heads: 32\n")
    g = load_config(path, environ={}).model
    assert (g.layers, g.kv_heads, g.head_dim) == (32, 32, 128)
    assert g.kv_bytes_per_token() == 2 * 32 * 32 * 128 * 2


def test_hf_config_unreadable_names_key(tmp_path):
    with pytest.raises(ConfigError, match="model.hf_config"):
        load_config(None, environ={}, flags={"model": {"hf_config": str(tmp_path / "missing.json")}})


# ---- defaults ------------------------------------------------------------------------------


def test_defaults():
    cfg = load_config(None, environ={})
    assert cfg == Config()
    assert cfg.listen == "0.0.0.0:9471"
    assert cfg.interval == 5.0
    assert cfg.window_seconds == 60.0
    assert cfg.prices.hit_price_ratio == 0.1
    assert cfg.prices.miss_per_million == 1.0
    assert cfg.prices.output_per_million == 0.0
    assert cfg.target is None
    assert cfg.model.kv_bytes_per_token() is None  # unknown until geometry is configured


def test_hf_config_of_a_multimodal_model_reads_its_text_config(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"architectures": ["Gemma3ForConditionalGeneration"], "vision_config": {"hidden_size": 1152},
                             "text_config": {"num_hidden_layers": 34, "num_attention_heads": 8,
                                             "num_key_value_heads": 4, "head_dim": 256}}))
    g = load_config(None, environ={}, flags={"model": {"hf_config": str(p)}}).model
    # 2 (K and V) · 34 layers · 4 KV heads · 256 · 2 bytes = 139264 bytes per token
    assert g.kv_bytes_per_token() == 2 * 34 * 4 * 256 * 2 == 139264


@pytest.mark.parametrize("doc, says", [
    ([1, 2], "not a JSON object"),
    ({"schema_version": 1, "models": {}}, "no KV geometry in it"),  # e.g. a saved kvhit fit, not config.json
    ({"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": "4096"}, "must be whole numbers"),
    ({"num_hidden_layers": -1, "num_attention_heads": 32, "hidden_size": 4096}, "must be whole numbers > 0"),
])
def test_hf_config_without_usable_geometry_names_the_key(tmp_path, doc, says):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=f"config key model.hf_config: {p}: .*{says}"):
        load_config(None, environ={}, flags={"model": {"hf_config": str(p)}})



def test_hf_config_with_a_bad_pp_names_pp_not_a_traceback(hf_config):
    with pytest.raises(ConfigError, match="config key model.pp: must be >= 1"):
        load_config(None, environ={}, flags={"model": {"hf_config": hf_config, "pp": 0}})


def test_a_number_argument_refuses_underscores():
    # int() and float() read "0_5" as 5 and "1_000" as 1000; nobody writing a number means that
    import argparse

    from exporter.config import bounded
    for text in ("0_5", "1_000"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a number"):
            bounded(0.0, 1e9)(text)
    assert bounded(0.0, 1e9)("1000") == 1000.0
    with pytest.raises(argparse.ArgumentTypeError, match="expected a number"):
        bounded(0.0, 1e9)("\uff15")  # fullwidth 5, which float() reads as 5.0


def test_a_setting_from_a_flag_or_the_environment_refuses_underscores_and_fullwidth_digits():
    # `kvhit run --interval 1_0` scraped every 10 s, KVHIT_MAX_SERIES=1_0 tracked 10 (a breaker)
    for flags, environ in (({"interval": "1_0"}, {}), ({"interval": "\uff15"}, {}), ({}, {"KVHIT_MAX_SERIES": "1_0"})):
        with pytest.raises(ConfigError, match="expected (float|int), got"):
            load_config(None, environ=environ, flags=flags)
    assert load_config(None, environ={"KVHIT_MAX_SERIES": "8"}, flags={"interval": " 10 "}).interval == 10.0


def test_stop_event_keeps_a_signal_the_process_was_started_ignoring():
    # `nohup kvhit run …` ignores SIGHUP so a closed terminal does not stop it: kvhit's own
    # handler used to replace that, and a closed terminal stopped kvhit after all
    import signal

    from exporter.config import stop_event
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        for sig in saved:  # SIGTERM too: a review's `trap '' TERM; exec kvhit …` then needed SIGKILL
            signal.signal(sig, signal.SIG_IGN)
        stop = stop_event()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # SIGTERM always stops it
        assert stop.is_set()
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_a_config_file_or_hf_config_too_large_to_be_one_is_refused_before_it_is_read_whole(tmp_path):
    # KVHIT_MODEL_HF_CONFIG=/dev/zero (an adversarial review): read whole, it filled memory
    # (MemoryError traceback under a ulimit); the YAML config file was read the same way
    from exporter.config import MAX_FILE_BYTES
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)  # sparse: no disk written
    with pytest.raises(ConfigError, match=f"over {MAX_FILE_BYTES} bytes: not a Hugging Face config.json"):
        load_config(None, environ={}, flags={"model": {"hf_config": str(big)}})
    with pytest.raises(ConfigError, match=f"config file {big}: over {MAX_FILE_BYTES} bytes: not a configuration"):
        load_config(str(big), environ={})


@pytest.mark.parametrize("settings, timeout", [
    ({"interval": 1.0}, 1.0),  # the default 3 s over a 1-s interval warned at every start
    ({"interval": 10.0}, 3.0),
    ({"interval": 1.0, "timeout": 2.0}, 2.0),  # one the user set stays, with its warning
])
def test_the_default_timeout_is_never_over_the_interval(settings, timeout):
    from exporter.config import load_config
    assert load_config(None, environ={}, flags=settings, live=True).timeout == timeout
    # kvhit run's rule only: calibrate's recorder keeps its 3-s deadline under a saturated vLLM
    assert load_config(None, environ={}, flags={"interval": 1.0}).timeout == 3.0
