"""Bad configuration (issue 7): one clear line naming the key, exit code 2, nothing started.

Each case runs ``kvhit run`` in-process on a free port with a YAML file (or a variable, or a
flag) that is wrong in one way. Expected: ``main`` returns 2, stderr is exactly one line that
starts with ``kvhit: config key <key>`` (or names the variable/file), no HTTP server thread was
started and the port is still free.
"""
from __future__ import annotations

import json
import socket
import threading

import pytest

from exporter.cli import main


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_with(tmp_path, capsys, monkeypatch, yaml_text: str | None = None, env: dict | None = None,
             extra: list[str] | None = None) -> tuple[int, str, int]:
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    port = free_port()
    argv = ["run", "--target", "http://127.0.0.1:9/metrics", "--listen", f"127.0.0.1:{port}"]
    if yaml_text is not None:
        cfg = tmp_path / "kvhit.yaml"
        cfg.write_text(yaml_text)
        argv += ["--config", str(cfg)]
    before = {t.name for t in threading.enumerate()}
    code = main(argv + (extra or []))
    err = capsys.readouterr().err
    assert "kvhit-http" not in {t.name for t in threading.enumerate()} - before
    with socket.socket() as s:  # nothing listens on the port: binding it works
        s.bind(("127.0.0.1", port))
    return code, err, port


# (yaml, the key the one line must name)
CASES = {
    "unknown top-level key": ("intervall: 5\n", "config key intervall: unknown key (did you mean interval?)"),
    # where (1-based), not what: line 2's "[" is still open where the text ends, line 3 column 1
    "not YAML": ("interval: 5\nprices: [1, 2\n", "kvhit.yaml: not valid YAML at line 3, column 1 (ParserError)"),
    "unknown nested key": ("prices:\n  hit_price: 0.1\n",
                           "config key prices.hit_price: unknown key (did you mean prices.hit_price_ratio?)"),
    "unknown key, nothing close": ("scrape_every: 5\n", "config key scrape_every: unknown key\n"),
    # YAML keys need not be strings: the closest-key search crashed on them (TypeError, a self-review)
    "key a number": ("123: 5\n", "config key 123: unknown key\n"),
    # a section's key written at the top: named where it belongs; a guess further off is none
    # (review: interval_seconds was read as window_seconds, ttft_seconds as gap_seconds)
    "section key at the top": ("ttft_seconds: 1\n", "config key ttft_seconds: unknown key (did you mean slo.ttft_seconds?)"),
    # the start of one key: difflib's closest whole path was model.tp (config breaker)
    "start of a key": ("model:\n  dtype: 2\n", "config key model.dtype: unknown key (did you mean model.dtype_bytes?)"),
    "nothing close enough": ("interval_seconds: 5\n", "config key interval_seconds: unknown key\n"),
    "wrong type, number": ("interval: fast\n", "config key interval: expected float"),
    "wrong type, integer": ("model:\n  tp: 1.5\n", "config key model.tp: expected int"),
    "wrong type, section": ("prices: 5\n", "config key prices: expected a mapping"),
    "wrong type, boolean": ("max_series: true\n", "config key max_series: expected int"),
    "negative price": ("prices:\n  miss_per_million: -2\n", "config key prices.miss_per_million: must be in [1e-12, 1e12]"),
    "negative output price": ("prices:\n  output_per_million: -0.5\n",
                              "config key prices.output_per_million: must be in [0, 1e12]"),
    # accepted: R'(h)'s interval overflowed to NaN and kvhit_valley_active read 0 (offline breaker)
    "miss price past any": ("prices:\n  miss_per_million: 1e160\n", "config key prices.miss_per_million: must be in [1e-12, 1e12]"),
    "rho below zero": ("prices:\n  hit_price_ratio: -0.1\n", "config key prices.hit_price_ratio: must be in [0, 1]"),
    "rho above one": ("prices:\n  hit_price_ratio: 1.5\n", "config key prices.hit_price_ratio: must be in [0, 1]"),
    "rho NaN": ("prices:\n  hit_price_ratio: .nan\n", "config key prices.hit_price_ratio: must be a finite number, got nan"),
    "window infinite": ("window_seconds: .inf\n", "config key window_seconds: must be a finite number, got inf"),
    "timeout past a day": ("timeout: 1e10\n", "config key timeout: must be in (0, 86400] seconds"),
    "window over an hour": ("window_seconds: 1e12\n", "config key window_seconds: must be in (0, 3600] seconds"),
    # 900 s of 1-s scrapes are 900 steps summed every cycle: 720 at most
    "window over 720 scrapes": ("interval: 1\nwindow_seconds: 900\n",
                                "config key window_seconds: holds at most 720 scrapes: at interval 1 s at most 720 "
                                "seconds"),
    "max_series zero": ("max_series: 0\n", "config key max_series: must be >= 1"),
    # accepted, a denormal: TPS0·P_miss was 0 and every analysis of the model failed (adversarial review)
    "miss price a denormal": ("prices:\n  miss_per_million: 5e-324\n",
                              "config key prices.miss_per_million: must be in [1e-12, 1e12]"),
    # accepted: the overlap fit's load time overflowed to inf, every analysis failed, kvhit_up read 0
    "B_load a denormal": ("load_bandwidth_bytes_per_second: 5e-324\nmodel:\n  layers: 32\n  kv_heads: 8\n"
                          "  head_dim: 128\n",
                          "config key load_bandwidth_bytes_per_second: must be >= 1e6 bytes/s (PCIe Gen4 x16 is "
                          "about 25e9)"),
    # 1e303 × 1e6 / (tokens/s × 3600) overflowed: the cost went absent with no reason (a hand-checker)
    "price past any instance's": ("instance_hour_price: 1e303\n", "config key instance_hour_price: must be in [1e-12, 1e12]"),
    # an int beyond a float's range passed its check and raised OverflowError at every analysis (review)
    "batch beyond a float": (f"sizing:\n  batch: {10 ** 400}\n  max_len: 8\n",
                             "config key sizing.batch: must be a finite number, got an integer of 401 digits"),
    # each alone a float, their product (the GPUs) not: every analysis raised OverflowError (review)
    "tp beyond a count": (f"model:\n  tp: {10 ** 300}\n",
                          "config key model.tp: must be at most 2147483648, got an integer of 301 digits"),
    "layers beyond a float": (f"model:\n  layers: {10 ** 400}\n  kv_heads: 8\n  head_dim: 128\n",
                              "config key model.layers: must be a finite number, got an integer of 401 digits"),
    "gap not above the interval": ("interval: 10\ngap_seconds: 10\n", "config key gap_seconds: must be > interval"),
    "geometry without kv_heads": ("model:\n  layers: 32\n  head_dim: 128\n", "config key model.kv_heads: required"),
    "geometry without layers": ("model:\n  kv_heads: 8\n  head_dim: 128\n", "config key model.layers: required"),
    # Qwen2.5-72B's 8 KV heads over tp 3: 8/3 heads per GPU is no layout (vLLM refuses it; physics review)
    "tp not dividing the KV heads": ("model:\n  layers: 80\n  kv_heads: 8\n  head_dim: 128\n  tp: 3\n",
                                     "config key model.tp: 3 neither divides model.kv_heads (8) nor is a multiple"),
    "half of MLA": ("model:\n  layers: 61\n  kv_lora_rank: 512\n", "config key model.qk_rope_head_dim: required"),
    # MLA won silently: the dense keys were read as nothing (config breaker)
    "MLA and dense": ("model:\n  layers: 61\n  kv_heads: 128\n  head_dim: 128\n  kv_lora_rank: 512\n"
                      "  qk_rope_head_dim: 64\n", "config key model.kv_heads: not with model.kv_lora_rank"),
    "T_load without geometry": ("load_bandwidth_bytes_per_second: 25.0e9\n",
                                "config key model.layers: required when load_bandwidth_bytes_per_second is set"),
    "web_config missing file": ("web_config: /nonexistent/web.yml\n",
                                "config key web_config: /nonexistent/web.yml: cannot read"),
    # PyYAML alone keeps the last of two equal keys: kvhit would scrape the second target unannounced
    "key given twice": ("target: http://127.0.0.1:9/metrics\ninterval: 5\ntarget: http://x/\n",
                        "key 'target' twice (line 3)"),
    "nested key given twice": ("prices:\n  miss_per_million: 2\n  miss_per_million: 3\n",
                               "key 'miss_per_million' twice (line 3)"),
    # a YAML null: a traceback (interval, timeout, window_seconds), or passed and failed every
    # analysis while kvhit read healthy (prices, model.tp, max_series) (newcomer review)
    "interval null": ("interval:\n", "config key interval: expected float, got null (leave the key out"),
    "timeout null": ("timeout: null\n", "config key timeout: expected float, got null"),
    "rho null": ("prices:\n  hit_price_ratio: null\n", "config key prices.hit_price_ratio: expected float, got null"),
    "tp null": ("model:\n  tp: ~\n", "config key model.tp: expected int, got null"),
    "max_series null": ("max_series: null\n", "config key max_series: expected int, got null"),
    "max_body_bytes null": ("max_body_bytes: null\n", "config key max_body_bytes: expected int, got null"),
    # PyYAML recurses per level: a RecursionError traceback, exit 1, before (review)
    "nested too deeply": ("a: " + "[" * 3000 + "]" * 3000 + "\n", "nested too deeply to be a configuration"),
    # accepted before (config breaker): bits for bytes made S_kv 8x, a pod's fleet-only key did nothing,
    # an empty path turned off the file's TLS and auth
    "dtype in bits": ("model:\n  dtype_bytes: 16\n", "config key model.dtype_bytes: must be in [0.5, 4] bytes per KV "
                                                      "element (2 for bf16, 1 for fp8; not bits), got 16"),
    "fleet delay in a pod": ("prometheus_delay: 30\n", "config key prometheus_delay: only with prometheus (fleet mode)"),
    "empty web_config": ("web_config: ''\n", "config key web_config: empty (give a path, or null for none)"),
    # the whole value was quoted: a URL's password, or the gigabytes of a YAML alias bomb's repr (breaker)
    "mapping for a number": ("interval:\n  url: http://admin:hunter2@127.0.0.1:9/metrics\n",
                             "config key interval: expected float, got a mapping"),
    "alias bomb": ("interval: [" + ", ".join(["&l0 [x, x, x, x, x, x, x, x, x]"]
                                             + [f"&l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 6)]) + "]\n",
                   "config key interval: expected float, got a list"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_yaml_exits_2_with_one_line_naming_the_key(tmp_path, capsys, monkeypatch, case):
    text, expected = CASES[case]
    code, err, _ = run_with(tmp_path, capsys, monkeypatch, text)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("kvhit: "), err
    assert expected in err, err
    assert "hunter2" not in err and len(err) < 400, err  # never a secret, never a whole document


@pytest.mark.parametrize("target", ["http://127.0.0.1:9/metrics ", "http://127.0.0.1:9/metrics\n"])
def test_a_target_with_whitespace_exits_2_saying_so(tmp_path, capsys, monkeypatch, target):
    # a trailing space (or a YAML block's newline) was kept: every scrape a 404 whose URL looked right (breaker)
    code, err, _ = run_with(tmp_path, capsys, monkeypatch, extra=["--target", target])
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("kvhit: config key target: holds whitespace (a trailing space, or the newline of a YAML "
                          "block?), got "), err


@pytest.mark.parametrize("target", ["http://127.0.0.1:9/metrics\x00", "http://127.0.0.1:9/met\x7frics"])
def test_a_target_with_a_control_character_exits_2_saying_so(tmp_path, capsys, monkeypatch, target):
    # a NUL was scraped as %00 and carried raw in every series' target label (adversarial review)
    code, err, _ = run_with(tmp_path, capsys, monkeypatch, extra=["--target", target])
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("kvhit: config key target: holds a control character (percent-encode it), got "), err


@pytest.mark.parametrize("serve", [False, True], ids=["exit", "on_config_error_serve"])
def test_check_config_exits_0_or_2_and_serves_nothing(tmp_path, capsys, monkeypatch, serve):
    # the runbook's pre-apply check: a good file exits 0 saying so (it ran a sidecar forever), a bad
    # one 2 with the same line as run, --on-config-error=serve or not; run_with checks nothing listens
    serving = ["--on-config-error=serve"] if serve else []
    code, err, port = run_with(tmp_path, capsys, monkeypatch, "interval: 7\n", extra=["--check-config", *serving])
    assert code == 0 and err == "", err
    code, err, _ = run_with(tmp_path, capsys, monkeypatch, CASES["rho below zero"][0], extra=["--check-config", *serving])
    assert code == 2 and err.startswith("kvhit: ") and CASES["rho below zero"][1] in err, err


def test_check_config_warns_as_run_does(tmp_path, capsys, monkeypatch, caplog):
    # break-it review: run warned of a timeout above the interval at start, --check-config ("checks
    # it all") printed OK alone
    import logging
    with caplog.at_level(logging.WARNING, logger="kvhit"):
        code, _, _ = run_with(tmp_path, capsys, monkeypatch, "timeout: 10\nwindow_seconds: 3\n", extra=["--check-config"])
    assert code == 0
    text = caplog.text
    assert "timeout 10.0s > interval 5.0s" in text and "window_seconds 3.0s < interval 5.0s" in text, text


def test_config_file_not_utf8_exits_2_naming_the_file(tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "latin1.yaml"
    cfg.write_bytes(b"\xff\xfe interval: 5\n")
    code, err, _ = run_with(tmp_path, capsys, monkeypatch, extra=["--config", str(cfg)])
    assert code == 2 and err.count("\n") == 1 and f"config file {cfg}: not UTF-8 text" in err, err


def test_a_section_as_one_environment_variable_says_how_to_set_it(tmp_path, capsys, monkeypatch):
    code, err, _ = run_with(tmp_path, capsys, monkeypatch, env={"KVHIT_PRICES": "{miss_per_million: 2}"})
    assert code == 2 and err.count("\n") == 1, err
    assert "KVHIT_PRICES: prices is a section; set its keys one by one, e.g. KVHIT_PRICES_" in err, err


def test_a_yaml_value_nested_too_deeply_in_the_environment_is_a_config_error(tmp_path, capsys, monkeypatch):
    code, err, _ = run_with(tmp_path, capsys, monkeypatch, env={"KVHIT_PROMETHEUS_HEADERS": "[" * 3000 + "]" * 3000})
    assert code == 2 and err.count("\n") == 1, err[-300:]
    assert "config key prometheus_headers: not a YAML mapping (value not shown)" in err, err


def test_an_hf_config_nested_too_deeply_is_a_config_error(tmp_path, capsys, monkeypatch):
    hf = tmp_path / "config.json"
    hf.write_text("[" * 3000 + "]" * 3000)  # json recurses per level: a RecursionError traceback before (review)
    code, err, _ = run_with(tmp_path, capsys, monkeypatch, env={"KVHIT_MODEL_HF_CONFIG": str(hf)})
    assert code == 2 and err.count("\n") == 1, err[-300:]
    assert f"config key model.hf_config: {hf}: nested too deeply to be a Hugging Face config.json" in err, err


def test_an_hf_config_that_cannot_be_read_says_why(tmp_path, capsys, monkeypatch):
    # "cannot read JSON from X" alone for a missing file, a directory and malformed JSON (config breaker)
    (tmp_path / "bad.json").write_text('{"num_hidden_layers": 32,\n "head_dim": }\n')
    monkeypatch.chdir(tmp_path)
    for path, why in [("missing.json", f"missing.json: cannot read (No such file or directory; from {tmp_path})"),
                      (".", f".: cannot read (Is a directory; from {tmp_path})"),
                      ("bad.json", "bad.json: not JSON (Expecting value at line 2, column 14)"),
                      # an absolute path is no working directory's (review)
                      ("/nonexistent/config.json", "/nonexistent/config.json: cannot read (No such file or directory)")]:
        code, err, _ = run_with(tmp_path, capsys, monkeypatch, env={"KVHIT_MODEL_HF_CONFIG": path})
        assert code == 2 and err == f"kvhit: environment variable KVHIT_MODEL_HF_CONFIG sets config key model.hf_config: {why}\n"
    # a NUL: "cannot read JSON … not UTF-8" with the NUL itself on stderr (review)
    monkeypatch.delenv("KVHIT_MODEL_HF_CONFIG")
    code, err, _ = run_with(tmp_path, capsys, monkeypatch, "model:\n  hf_config: \"a\\0b\"\n")
    assert code == 2 and err == "kvhit: config key model.hf_config: a\\0b: cannot read (a NUL byte in the path)\n"


def test_dense_keys_with_an_hf_config_s_mla_geometry_are_refused(tmp_path, capsys, monkeypatch):
    # DeepSeek-V3's config.json gives kv_lora_rank: a kv_heads given too was read as nothing (review)
    hf = tmp_path / "config.json"
    hf.write_text(json.dumps({"num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
                              "hidden_size": 7168, "kv_lora_rank": 512, "qk_rope_head_dim": 64}))
    code, err, _ = run_with(tmp_path, capsys, monkeypatch, env={"KVHIT_MODEL_HF_CONFIG": str(hf), "KVHIT_MODEL_KV_HEADS": "1"})
    assert code == 2 and err.startswith("kvhit: environment variable KVHIT_MODEL_KV_HEADS sets config key model.kv_heads: "
                                        "not with model.kv_lora_rank"), err
    monkeypatch.delenv("KVHIT_MODEL_KV_HEADS")
    code, err, _ = run_with(tmp_path, capsys, monkeypatch, env={"KVHIT_MODEL_HF_CONFIG": str(hf)},
                            extra=["--check-config"])
    assert code == 0, err  # its own num_key_value_heads beside kv_lora_rank is no mistake


def test_good_geometry_and_t_load_accepted(tmp_path):
    from exporter.config import load_config
    path = tmp_path / "ok.yaml"
    path.write_text("model:\n  layers: 32\n  kv_heads: 8\n  head_dim: 128\nload_bandwidth_bytes_per_second: 25.0e9\n")
    cfg = load_config(str(path), environ={})
    # S_kv = 2 · 32 · 8 · 128 · 2 bytes = 131,072 bytes per token
    assert cfg.model.kv_bytes_per_token() == 131072
    assert cfg.max_series == 64 and cfg.web_config is None  # defaults


def test_free_hits_are_a_valid_price(tmp_path):
    # ρ = 0 (hits not billed) is a real price list: R(h) = TPS0·P_miss·(1 − a·h), well defined
    from exporter.config import load_config
    path = tmp_path / "free.yaml"
    path.write_text("prices:\n  hit_price_ratio: 0\n")
    cfg = load_config(str(path), environ={})
    assert cfg.prices.hit_price_ratio == 0.0 and cfg.prices.p_hit == 0.0


def test_unknown_environment_variable_and_bad_flag(tmp_path, capsys, monkeypatch):
    code, err, _ = run_with(tmp_path, capsys, monkeypatch, env={"KVHIT_MAX_SERIESS": "3"})
    assert code == 2 and err.count("\n") == 1 and "KVHIT_MAX_SERIESS: unknown key (did you mean KVHIT_MAX_SERIES?)" in err
    monkeypatch.delenv("KVHIT_MAX_SERIESS")
    # a section's key mistyped in the environment is named as the variable the user set, not as a
    # file's key (a newcomer with no file was told "config key prices.hit_ratio")
    code, err, _ = run_with(tmp_path, capsys, monkeypatch, env={"KVHIT_PRICES_HIT_RATIO": "0.2"})
    assert code == 2 and err.count("\n") == 1 and ("environment variable KVHIT_PRICES_HIT_RATIO: unknown key "
                                                   "(did you mean KVHIT_PRICES_HIT_PRICE_RATIO?)") in err
    monkeypatch.delenv("KVHIT_PRICES_HIT_RATIO")
    code, err, _ = run_with(tmp_path, capsys, monkeypatch, env={"KVHIT_CONFIG": "kvhit.yaml"})  # no such variable
    assert code == 2 and err.endswith("KVHIT_CONFIG: unknown key (the config file is given with --config FILE)\n")
    monkeypatch.delenv("KVHIT_CONFIG")
    # a bad value names the variable that set it (a newcomer was told "config key interval" alone)
    code, err, _ = run_with(tmp_path, capsys, monkeypatch, env={"KVHIT_PRICES_HIT_PRICE_RATIO": "-1"})
    assert code == 2 and ("environment variable KVHIT_PRICES_HIT_PRICE_RATIO sets config key "
                          "prices.hit_price_ratio: must be in [0, 1]") in err
    monkeypatch.delenv("KVHIT_PRICES_HIT_PRICE_RATIO")
    code, err, _ = run_with(tmp_path, capsys, monkeypatch, env={"KVHIT_INTERVAL": "abc"})
    assert code == 2 and err.endswith("environment variable KVHIT_INTERVAL sets config key interval: expected float, "
                                      "got 'abc'\n"), err
    monkeypatch.delenv("KVHIT_INTERVAL")
    code, err, _ = run_with(tmp_path, capsys, monkeypatch, extra=["--interval", "-5"])
    assert code == 2 and "config key interval: must be in [0.1, 86400] seconds" in err
    # a misspelt flag is the command's: "kvhit: unrecognized arguments" did not say which command's
    with pytest.raises(SystemExit) as exc:
        main(["run", "--targt", "http://127.0.0.1:9/metrics"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == \
        "kvhit run: unrecognized arguments: --targt http://127.0.0.1:9/metrics (did you mean --target?) " \
        "(see kvhit run --help)"
    # the URL without its flag: argparse's "unrecognized arguments" alone did not say the fix (a newcomer's find)
    with pytest.raises(SystemExit) as exc:
        main(["run", "http://127.0.0.1:9/metrics"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == \
        "kvhit run: unrecognized arguments: http://127.0.0.1:9/metrics (give the URL with --target, or " \
        "--prometheus for fleet mode) (see kvhit run --help)"
    # hints from review: options compared without their shared "--" (with it --port read as --out,
    # --model as --help), and a second URL where --target is given already
    for argv, said in [(["report", "http://127.0.0.1:9", "--port", "1"], "kvhit report: unrecognized arguments: --port 1 "
                                                                         "(see kvhit report --help)"),
                       (["run", "--target", "http://127.0.0.1:9/metrics", "--model", "m"],
                        "kvhit run: unrecognized arguments: --model m (see kvhit run --help)"),
                       # a Kubernetes args item holding both: argparse's line looked right (config breaker)
                       (["run", "--config /etc/kvhit/config.yaml"], "kvhit run: unrecognized arguments: --config "
                        "/etc/kvhit/config.yaml (one argument holds a space: give --config=/etc/kvhit/config.yaml, "
                        "or --config and its value as two items) (see kvhit run --help)"),
                       (["run", "--web_config", "w.yml"], "kvhit run: unrecognized arguments: --web_config w.yml "
                                                          "(did you mean --web-config?) (see kvhit run --help)"),
                       # a config key as a flag: README's replay line read as if run had --window-seconds (newcomer)
                       (["run", "--window-seconds", "30"], "kvhit run: unrecognized arguments: --window-seconds 30 "
                        "(--window-seconds is no flag here: set window_seconds in the --config file or "
                        "KVHIT_WINDOW_SECONDS in the environment) (see kvhit run --help)"),
                       (["run", "--prices.hit_price_ratio=0.2"], "kvhit run: unrecognized arguments: "
                        "--prices.hit_price_ratio=0.2 (--prices.hit_price_ratio is no flag here: set prices.hit_price_ratio "
                        "in the --config file or KVHIT_PRICES_HIT_PRICE_RATIO in the environment) (see kvhit run --help)"),
                       # not on another command, which ignores some keys (listen, target); calibrate's own
                       # --request-timeout is what --timeout meant there (diff review)
                       (["calibrate", "--endpoint", "http://127.0.0.1:9", "--model", "m", "--timeout", "3"], "kvhit calibrate: "
                        "unrecognized arguments: --timeout 3 (did you mean --request-timeout?) (see kvhit calibrate --help)"),
                       (["run", "--target", "http://a:1/metrics", "http://b:1/metrics"],
                        "kvhit run: unrecognized arguments: http://b:1/metrics (kvhit run reads one target: a kvhit per "
                        "vLLM pod, or fleet mode for many) (see kvhit run --help)"),
]:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2 and capsys.readouterr().err.splitlines()[-1] == said
    with pytest.raises(SystemExit):  # before the command: the top parser's word, not the command's
        main(["--quiet", "replay", "trace", "--bogus"])
    assert capsys.readouterr().err.splitlines()[-1] == "kvhit: unrecognized arguments: --quiet (see kvhit --help)"


WEB = {
    "unknown key": ("tls_config: {}\n", "config key web_config.tls_config: unknown key"),
    "unknown tls key": ("tls_server_config:\n  cert: a.pem\n", "config key web_config.tls_server_config.cert: unknown key"),
    "key file missing": ("tls_server_config:\n  cert_file: a.pem\n",
                         "config key web_config.tls_server_config.cert_file: no such file"),
    "bcrypt": ("basic_auth_users:\n  prometheus: $2y$10$abcdefghijklmnopqrstuv\n",
               "config key web_config.basic_auth_users.prometheus: bcrypt hashes are not supported"),
    "plain password": ("basic_auth_users:\n  prometheus: hunter2\n",
                       "config key web_config.basic_auth_users.prometheus: expected pbkdf2_sha256$"),
    "nested too deeply": ("a: " + "{a: " * 3000 + "}" * 3000 + "\n", "nested too deeply to be a configuration"),
    # accepted, every request then ended in an OverflowError (over 2^32 - 1) or pinned a core (breaker)
    "too many iterations": ("basic_auth_users:\n  prometheus: pbkdf2_sha256$5000001$abc$AAAA\n",
                            "config key web_config.basic_auth_users.prometheus: 5000001 iterations, at most 5000000"),
    # a hash cut short was accepted and every login refused without a word (breaker), or, cut at 4
    # characters (3 bytes), a 3-byte check (review); 4301 digits: int()'s ValueError, exit 1 (review)
    "hash cut short": ("basic_auth_users:\n  prometheus: pbkdf2_sha256$1000$abc$AAAAA\n",
                       "config key web_config.basic_auth_users.prometheus: the hash after the last $ is not 32 bytes "
                       "in base64 (cut short?)"),
    "hash of 3 bytes": ("basic_auth_users:\n  prometheus: pbkdf2_sha256$1000$abc$AAAA\n",
                        "config key web_config.basic_auth_users.prometheus: the hash after the last $ is not 32 bytes"),
    "iterations of 4301 digits": ("basic_auth_users:\n  prometheus: pbkdf2_sha256$" + "9" * 4301 + "$abc$AAAA\n",
                                  "config key web_config.basic_auth_users.prometheus: a 4301-digit number of "
                                  "iterations, at most 5000000"),
    "client certificates": ("tls_server_config:\n  client_auth_type: RequireAndVerifyClientCert\n",
                            "config key web_config.tls_server_config.client_auth_type: only NoClientCert"),
    "tls version": ("tls_server_config:\n  cert_file: a.pem\n  key_file: a.pem\n  min_version: TLS11\n",
                    "config key web_config.tls_server_config.min_version: 'TLS11', expected TLS12 or TLS13"),
    "tls version a list": ("tls_server_config:\n  min_version: [TLS13]\n",
                           "config key web_config.tls_server_config.min_version: a list, expected TLS12 or TLS13"),
    "nul in the path": (None, "web.yml\\0: cannot read (a NUL byte in the path)"),
}


@pytest.mark.parametrize("case", sorted(WEB))
def test_bad_web_config_exits_2_naming_the_key(tmp_path, capsys, monkeypatch, case):
    text, expected = WEB[case]
    web = tmp_path / "web.yml"
    if text is not None:
        web.write_text(text)
    code, err, _ = run_with(tmp_path, capsys, monkeypatch, extra=["--web-config", str(web) + ("" if text else "\0")])
    assert code == 2 and err.count("\n") == 1, err
    assert expected in err, err
    assert "hunter2" not in err  # a secret in the file is never echoed


def test_certificate_that_does_not_load(tmp_path, capsys, monkeypatch):
    (tmp_path / "c.pem").write_text("-----BEGIN CERTIFICATE-----\nnot a certificate\n-----END CERTIFICATE-----\n")
    (tmp_path / "k.pem").write_text("not a key\n")
    web = tmp_path / "web.yml"
    web.write_text("tls_server_config:\n  cert_file: c.pem\n  key_file: k.pem\n")
    code, err, _ = run_with(tmp_path, capsys, monkeypatch, extra=["--web-config", str(web)])
    assert code == 2 and err.count("\n") == 1
    assert "config key web_config.tls_server_config.cert_file: certificate and key do not load" in err


@pytest.mark.parametrize("url", ["http://", "https:///metrics", "http://[::1/metrics", "http://127.0.0.1:0/metrics",
                                 "http://127.0.0.1:65536/metrics"])
def test_target_without_a_host_or_with_a_port_no_server_has_exits_2(tmp_path, capsys, monkeypatch, url):
    code, err, _ = run_with(tmp_path, capsys, monkeypatch, extra=["--target", url])
    assert code == 2 and err.count("\n") == 1
    assert "config key target: must be an http(s) URL of /metrics with a host" in err, err


def test_target_without_a_path_exits_2_saying_vllm_serves_metrics(tmp_path, capsys, monkeypatch):
    code, err, _ = run_with(tmp_path, capsys, monkeypatch, extra=["--target", "http://127.0.0.1:19400"])
    assert code == 2 and err.count("\n") == 1
    assert "config key target: no path in 'http://127.0.0.1:19400': vLLM serves /metrics, add it to the URL" in err, err
