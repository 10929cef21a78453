"""kvhit configuration: YAML file < ``KVHIT_*`` environment < command-line flags (later wins).

Keys (YAML nesting; the environment variable is ``KVHIT_`` + the path in upper case joined by
``_``, e.g. ``prices.hit_price_ratio`` → ``KVHIT_PRICES_HIT_PRICE_RATIO``):

========================================  ======================================================
key                                       meaning (default)
========================================  ======================================================
target                                    full vLLM /metrics URL (required for ``run``)
listen                                    address:port kvhit serves on (0.0.0.0:9471)
interval                                  seconds between scrapes (5)
timeout                                   scrape timeout, seconds (3)
window_seconds                            publish window, seconds (60)
max_body_bytes                            scrape body cap, bytes (16 MiB)
model.hf_config                           path to the model's HF config.json (geometry from it)
model.layers / kv_heads / head_dim        KV geometry (MODEL.md §3.6)
model.dtype_bytes                         bytes per KV element (2)
model.kv_lora_rank / qk_rope_head_dim     MLA latent geometry (DeepSeek-V2/V3)
model.tp / model.pp                       tensor / pipeline parallel degree (1 / 1)
load_bandwidth_bytes_per_second           host→HBM bandwidth per GPU B_load (unset: unknown)
prices.miss_per_million                   price of 1M miss (computed) input tokens (1.0)
prices.hit_price_ratio                    ρ = hit price / miss price, in (0, 1] (0.1)
prices.output_per_million                 price of 1M output tokens (0: seed 002 prices input only)
slo.ttft_seconds / slo.tpot_seconds       TTFT / TPOT SLOs, seconds (unset)
instance_hour_price                       price of one instance-hour, for cost per 1M SLO-passing
                                          output tokens (unset: cost unknown; MODEL.md §5)
retry_rate                                share of requests retried, in [0, 1): effective cost =
                                          cost / (1 - retry_rate) (0)
sizing.batch / sizing.max_len             planned batch B and max length N_max [tokens] for the peak
                                          KV B·N_max·S_kv per GPU (unset: not computed; MODEL.md §3.6)
target_hit_ratio                          what-if hit ratio for hit_ratio="target" predictions (0.9)
========================================  ======================================================

Invalid configuration raises :class:`ConfigError` whose message names the key.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

import yaml

from fitters.model import kv_bytes_per_token, kv_bytes_per_token_mla


class ConfigError(ValueError):
    """Invalid configuration; the message is one line naming the key."""


@dataclass(frozen=True)
class Geometry:
    """Model KV geometry (MODEL.md §3.6); None = not configured."""

    hf_config: str | None = None
    layers: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    dtype_bytes: float = 2.0
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    tp: int = 1
    pp: int = 1

    def kv_bytes_per_token(self) -> float | None:
        """S_kv per GPU [bytes/token] or None when the geometry is incomplete (MODEL.md §3.6).

        With pipeline parallelism each GPU holds layers/pp of the layers.
        """
        if self.layers is None:
            return None
        layers = self.layers / self.pp
        if self.kv_lora_rank is not None and self.qk_rope_head_dim is not None:
            return kv_bytes_per_token_mla(layers, self.kv_lora_rank, self.qk_rope_head_dim, self.dtype_bytes)
        if self.kv_heads is None or self.head_dim is None:
            return None
        return kv_bytes_per_token(layers, self.kv_heads, self.head_dim, self.dtype_bytes, self.tp)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp


@dataclass(frozen=True)
class Prices:
    """Token prices (MODEL.md §4): per 1M tokens, hit price as a ratio ρ of the miss price."""

    miss_per_million: float = 1.0
    hit_price_ratio: float = 0.1
    output_per_million: float = 0.0

    @property
    def p_miss(self) -> float:
        return self.miss_per_million / 1e6

    @property
    def p_hit(self) -> float:
        return self.p_miss * self.hit_price_ratio

    @property
    def p_out(self) -> float:
        return self.output_per_million / 1e6


@dataclass(frozen=True)
class Slo:
    ttft_seconds: float | None = None
    tpot_seconds: float | None = None


@dataclass(frozen=True)
class Sizing:
    """A planned batch and maximum sequence length for the peak-KV what-if (seed 000 §7.1)."""

    batch: int | None = None
    max_len: int | None = None


@dataclass(frozen=True)
class Config:
    target: str | None = None
    listen: str = "0.0.0.0:9471"
    interval: float = 5.0
    timeout: float = 3.0
    window_seconds: float = 60.0
    max_body_bytes: int = 16 * 1024 * 1024
    model: Geometry = field(default_factory=Geometry)
    load_bandwidth_bytes_per_second: float | None = None
    prices: Prices = field(default_factory=Prices)
    slo: Slo = field(default_factory=Slo)
    target_hit_ratio: float | None = 0.9
    instance_hour_price: float | None = None
    retry_rate: float = 0.0
    sizing: Sizing = field(default_factory=Sizing)


_SECTIONS = {"model": Geometry, "prices": Prices, "slo": Slo, "sizing": Sizing}


def _coerce(key: str, value: Any, typ: str) -> Any:
    if value is None:
        return None
    try:
        if "int" in typ and "float" not in typ:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if "float" in typ:
            if isinstance(value, bool):
                raise ValueError
            out = float(value)
            if not math.isfinite(out):
                raise ValueError
            return out
        if "str" in typ:
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"config key {key}: expected {typ.replace(' | None', '')}, got {value!r}") from None
    return value


def _build(cls, data: Mapping[str, Any], prefix: str = ""):
    known = {f.name: f for f in fields(cls)}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if k not in known:
            raise ConfigError(f"config key {key}: unknown key")
        if k in _SECTIONS and cls is Config:
            if v is None:
                v = {}
            if not isinstance(v, Mapping):
                raise ConfigError(f"config key {key}: expected a mapping, got {v!r}")
            kwargs[k] = _build(_SECTIONS[k], v, key + ".")
        else:
            kwargs[k] = _coerce(key, v, str(known[k].type))
    return cls(**kwargs)


def _merge(base: dict, over: Mapping[str, Any]) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def env_overrides(environ: Mapping[str, str]) -> dict:
    """``KVHIT_*`` variables as a nested mapping; an unknown variable raises ConfigError."""
    out: dict = {}
    flat = {f.name: None for f in fields(Config) if f.name not in _SECTIONS}
    for name, value in environ.items():
        if not name.startswith("KVHIT_"):
            continue
        rest = name[len("KVHIT_"):].lower()
        section = next((s for s in _SECTIONS if rest.startswith(s + "_")), None)
        if section:
            out.setdefault(section, {})[rest[len(section) + 1:]] = value
        elif rest in flat:
            out[rest] = value
        else:
            raise ConfigError(f"environment variable {name}: unknown key")
    return out


def load_config(path: str | None = None, environ: Mapping[str, str] | None = None,
                flags: Mapping[str, Any] | None = None) -> Config:
    """Build and validate the configuration (YAML < env < flags).

    Args:
        path: YAML file or None.
        environ: environment (default ``os.environ``).
        flags: command-line values already named by key (None values are ignored).
    Raises:
        ConfigError: unknown key, wrong type, out-of-range value, unreadable file.
    """
    data: dict = {}
    if path:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"config file {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path}: not valid YAML ({type(exc).__name__})") from None
        if loaded is not None and not isinstance(loaded, Mapping):
            raise ConfigError(f"config file {path}: top level must be a mapping")
        data = dict(loaded or {})
    data = _merge(data, env_overrides(os.environ if environ is None else environ))
    data = _merge(data, {k: v for k, v in (flags or {}).items() if v is not None})
    cfg = _build(Config, data)
    cfg = replace(cfg, model=_with_hf_config(cfg.model))
    validate(cfg)
    return cfg


def _with_hf_config(g: Geometry) -> Geometry:
    """Fill geometry left unset from the HF config.json (explicit keys win)."""
    if not g.hf_config:
        return g
    try:
        hf = json.loads(Path(g.hf_config).read_text())
    except (OSError, ValueError):
        raise ConfigError(f"config key model.hf_config: cannot read JSON from {g.hf_config}") from None
    heads = hf.get("num_attention_heads")
    derived = {
        "layers": hf.get("num_hidden_layers"),
        "kv_heads": hf.get("num_key_value_heads", heads),
        "head_dim": hf.get("head_dim") or (hf["hidden_size"] // heads if heads and hf.get("hidden_size") else None),
        "kv_lora_rank": hf.get("kv_lora_rank"),
        "qk_rope_head_dim": hf.get("qk_rope_head_dim"),
    }
    return replace(g, **{k: v for k, v in derived.items() if getattr(g, k) is None and v is not None})


def validate(cfg: Config) -> None:
    """Range checks; raises ConfigError naming the key."""
    checks = [
        ("interval", cfg.interval, lambda v: v > 0, "must be > 0 seconds"),
        ("timeout", cfg.timeout, lambda v: v > 0, "must be > 0 seconds"),
        ("window_seconds", cfg.window_seconds, lambda v: v > 0, "must be > 0 seconds"),
        ("max_body_bytes", cfg.max_body_bytes, lambda v: v > 0, "must be > 0"),
        ("load_bandwidth_bytes_per_second", cfg.load_bandwidth_bytes_per_second, lambda v: v > 0, "must be > 0"),
        ("prices.miss_per_million", cfg.prices.miss_per_million, lambda v: v > 0, "must be > 0"),
        ("prices.hit_price_ratio", cfg.prices.hit_price_ratio, lambda v: 0 < v <= 1, "must be in (0, 1]"),
        ("prices.output_per_million", cfg.prices.output_per_million, lambda v: v >= 0, "must be >= 0"),
        ("slo.ttft_seconds", cfg.slo.ttft_seconds, lambda v: v > 0, "must be > 0"),
        ("slo.tpot_seconds", cfg.slo.tpot_seconds, lambda v: v > 0, "must be > 0"),
        ("target_hit_ratio", cfg.target_hit_ratio, lambda v: 0 <= v < 1, "must be in [0, 1)"),
        ("instance_hour_price", cfg.instance_hour_price, lambda v: v > 0, "must be > 0"),
        ("retry_rate", cfg.retry_rate, lambda v: 0 <= v < 1, "must be in [0, 1)"),
        ("sizing.batch", cfg.sizing.batch, lambda v: v >= 1, "must be >= 1"),
        ("sizing.max_len", cfg.sizing.max_len, lambda v: v >= 1, "must be >= 1 tokens"),
        ("model.layers", cfg.model.layers, lambda v: v > 0, "must be > 0"),
        ("model.kv_heads", cfg.model.kv_heads, lambda v: v > 0, "must be > 0"),
        ("model.head_dim", cfg.model.head_dim, lambda v: v > 0, "must be > 0"),
        ("model.dtype_bytes", cfg.model.dtype_bytes, lambda v: v > 0, "must be > 0"),
        ("model.tp", cfg.model.tp, lambda v: v >= 1, "must be >= 1"),
        ("model.pp", cfg.model.pp, lambda v: v >= 1, "must be >= 1"),
    ]
    for key, value, ok, what in checks:
        if value is not None and not ok(value):
            raise ConfigError(f"config key {key}: {what}, got {value!r}")
    if cfg.target is not None and not cfg.target.startswith(("http://", "https://")):
        raise ConfigError(f"config key target: must be an http(s) URL of /metrics, got {cfg.target!r}")
    host, sep, port = cfg.listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"config key listen: expected ADDRESS:PORT, got {cfg.listen!r}")
