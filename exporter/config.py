"""kvhit configuration: YAML file < ``KVHIT_*`` environment < command-line flags (later wins).

Keys (YAML nesting; the environment variable is ``KVHIT_`` + the path in upper case joined by
``_``, e.g. ``prices.hit_price_ratio`` → ``KVHIT_PRICES_HIT_PRICE_RATIO``; its value ``null`` is
YAML's, e.g. ``KVHIT_TARGET_HIT_RATIO=null``):

========================================  ======================================================
key                                       meaning (default)
========================================  ======================================================
target                                    full vLLM /metrics URL (``run`` needs it or prometheus)
prometheus                                base URL of a Prometheus HTTP API: fleet mode (not with
                                          target)
selector                                  PromQL label matchers picking the fleet's pods, e.g.
                                          ``{namespace="llm"}`` (fleet mode; unset: every pod)
prometheus_delay                          seconds fleet-mode queries lag behind now, for stores
                                          whose samples arrive late (0)
prometheus_headers                        HTTP headers of every fleet-mode query, a mapping of
                                          quoted strings, e.g. ``{X-Scope-OrgID: "team-a"}``
                                          (Mimir/Cortex tenant; in the environment: that YAML
                                          text, which replaces the file's whole mapping)
prometheus_bearer_token_file              file whose token is sent as ``Authorization: Bearer``
                                          with every fleet-mode query, read again each time (a
                                          rotated Kubernetes service-account token); not with a
                                          user:password in the URL
listen                                    address:port kvhit serves on (0.0.0.0:9471)
interval                                  seconds between scrapes, 0.1 to 86400 (5)
timeout                                   scrape timeout, seconds, at most 86400 (3; kvhit run:
                                          at most interval, as Prometheus' scrape_timeout)
window_seconds                            publish window, seconds, at most 3600 and 720 × interval (60)
gap_seconds                               a step longer than this is a scrape gap, not a step
                                          (unset: 2 × the larger of window_seconds and interval);
                                          must exceed interval
max_body_bytes                            scrape body cap, bytes, at least 4096 (4 MiB: at most
                                          180 MiB of peak RSS measured)
max_series                                (model_name, engine) series analysed at most (64)
web_config                                web-config YAML: TLS and basic auth of kvhit's endpoint
model.hf_config                           path to the model's HF config.json (geometry from it)
model.layers / kv_heads / head_dim        KV geometry (MODEL.md §3.6)
model.dtype_bytes                         bytes per KV element (unset: the engine's cache_dtype, 2 for auto)
model.kv_lora_rank / qk_rope_head_dim     MLA latent geometry (DeepSeek-V2/V3)
model.tp / model.pp                       tensor / pipeline parallel degree (1 / 1)
load_bandwidth_bytes_per_second           host→HBM bandwidth per GPU B_load (unset: unknown)
prices.miss_per_million                   price of 1M miss (computed) input tokens (1.0)
prices.hit_price_ratio                    ρ = hit price / miss price, in [0, 1] (0.1)
prices.output_per_million                 price of 1M output tokens (0: seed 002 prices input only)
slo.ttft_seconds / slo.tpot_seconds       TTFT / TPOT SLOs, seconds (unset)
instance_hour_price                       price of one instance-hour (a pod; fleet mode: x its pods),
                                          in [1e-12, 1e12], for cost per 1M SLO-passing output tokens
                                          (unset: cost unknown; MODEL.md §5)
retry_rate                                share of requests retried, in [0, 1): effective cost =
                                          cost / (1 - retry_rate) (0)
sizing.batch / sizing.max_len             planned batch B and max length N_max [tokens] for the peak
                                          KV B·N_max·S_kv per GPU (unset: not computed; MODEL.md §3.6)
target_hit_ratio                          what-if hit ratio for hit_ratio="target" predictions (0.9;
                                          null: none, the target series are not published)
========================================  ======================================================

Invalid configuration raises :class:`ConfigError` whose message names the key: an unknown key, a
wrong type, a value out of range (a negative price, ρ outside [0, 1]), both target and prometheus,
a selector that is not label matchers, incomplete KV geometry
(``model.layers`` without ``kv_heads``/``head_dim``, half of the MLA pair), a load bandwidth
without the geometry T_load needs, an unusable web-config file.

web-config (``web_config``, the layout of the Prometheus exporter-toolkit's file)::

    tls_server_config:            # optional: serve HTTPS
      cert_file: kvhit.crt        # PEM certificate (chain); relative to this file
      key_file: kvhit.key         # PEM private key
    basic_auth_users:             # optional: require HTTP basic auth (not on /healthz, /readyz)
      prometheus: pbkdf2_sha256$600000$<salt>$<base64 of the PBKDF2-HMAC-SHA256 hash>

Passwords are stored as PBKDF2-HMAC-SHA256 hashes in Django's ``pbkdf2_sha256$…`` format, which the
standard library verifies (``python -c "from exporter.server import hash_password as h;
print(h('secret'))"`` writes one). exporter-toolkit's bcrypt hashes would need a package kvhit
does not depend on: they are rejected with a message saying so.
"""
from __future__ import annotations

import argparse
import base64
import binascii
import difflib
import ipaddress
import json
import math
import os
import re
import signal
import socket
import ssl
import stat
import threading
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar
from urllib.parse import urlsplit

import yaml

from fitters.model import kv_bytes_per_token, kv_bytes_per_token_mla


MIN_INTERVAL, MAX_INTERVAL = 0.1, 86400.0  # seconds between scrapes
MAX_WINDOW = 3600.0  # seconds of the publish window
MAX_PRICE = 1e12  # an instance-hour in any currency: the cost per token stays finite
# A positive price below it (5e-324, a denormal) made TPS0·P_miss 0 and every analysis of the model fail
MIN_PRICE = 1e-12
# B_load below 1 MB/s is no host link (PCIe Gen4 x16 ≈ 25e9): 5e-324 overflowed the overlap fit's
# load time to inf, and every analysis failed (adversarial review)
MIN_LOAD_BANDWIDTH = 1e6
MAX_WINDOW_STEPS = 720  # scrapes the publish window holds (an hour at the default interval)
T = TypeVar("T")


class ConfigError(ValueError):
    """Invalid configuration; the message is one line naming the key."""


# Bytes per KV element by vLLM's --kv-cache-dtype, as cache_config_info's cache_dtype shows it. "auto"
# stores the model's dtype: 2 bytes as vLLM serves models on GPUs (fp16 or bf16; --dtype auto serves
# an fp32 checkpoint in fp16).
KV_CACHE_DTYPE_BYTES = {"auto": 2.0, "bfloat16": 2.0, "float16": 2.0,
                        "fp8": 1.0, "fp8_e4m3": 1.0, "fp8_e5m2": 1.0, "fp8_inc": 1.0}


@dataclass(frozen=True)
class Geometry:
    """Model KV geometry (MODEL.md §3.6); None = not configured (``dtype_bytes``: the engine's)."""

    hf_config: str | None = None
    layers: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    dtype_bytes: float | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    tp: int = 1
    pp: int = 1

    def element_bytes(self, cache_dtype: str | None = None) -> float:
        """Bytes per KV element [bytes]: those of a known, explicit (not "auto") ``cache_dtype``
        (vLLM's cache_config_info: what the engine stores wins over the configuration); else
        ``dtype_bytes`` when configured; else 2 (:data:`KV_CACHE_DTYPE_BYTES`)."""
        engine = None if cache_dtype == "auto" else KV_CACHE_DTYPE_BYTES.get(cache_dtype)
        if engine is not None:
            return engine
        return self.dtype_bytes if self.dtype_bytes is not None else KV_CACHE_DTYPE_BYTES["auto"]

    def kv_bytes_per_token(self, cache_dtype: str | None = None) -> float | None:
        """S_kv per GPU [bytes/token] or None when the geometry is incomplete (MODEL.md §3.6), with
        :meth:`element_bytes` of ``cache_dtype``.

        With pipeline parallelism each GPU holds layers/pp of the layers.
        """
        if self.layers is None:
            return None
        layers, b = self.layers / self.pp, self.element_bytes(cache_dtype)
        if self.kv_lora_rank is not None and self.qk_rope_head_dim is not None:
            return kv_bytes_per_token_mla(layers, self.kv_lora_rank, self.qk_rope_head_dim, b)
        if self.kv_heads is None or self.head_dim is None:
            return None
        return kv_bytes_per_token(layers, self.kv_heads, self.head_dim, b, self.tp)

    def dtype_note(self, cache_dtype: str | None) -> str | None:
        """Why S_kv's element size needs a look (``kvhit_warning_info{warning="kv_cache_dtype"}``), or
        None: the engine's cache_dtype is one kvhit does not know and dtype_bytes is not configured,
        or it disagrees with the configured dtype_bytes (the engine's is used)."""
        if cache_dtype is None or self.kv_bytes_per_token() is None:
            return None
        engine = KV_CACHE_DTYPE_BYTES.get(cache_dtype)
        if engine is None and self.dtype_bytes is None:
            return (f"vLLM stores KV as cache_dtype={cache_dtype} (cache_config_info), a format kvhit has no "
                    f"element size for: S_kv is taken at {self.element_bytes():g} bytes per element; set "
                    "model.dtype_bytes")
        if engine is not None and cache_dtype != "auto" and self.dtype_bytes not in (None, engine):
            return (f"model.dtype_bytes is {self.dtype_bytes:g} but vLLM stores KV as {cache_dtype} ({engine:g} "
                    "bytes per element, cache_config_info): S_kv uses the engine's")
        return None

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
    prometheus: str | None = None
    selector: str | None = None
    prometheus_delay: float = 0.0
    prometheus_headers: dict[str, str] | None = None
    prometheus_bearer_token_file: str | None = None
    listen: str = "0.0.0.0:9471"
    interval: float = 5.0
    timeout: float = 3.0
    window_seconds: float = 60.0
    gap_seconds: float | None = None
    max_body_bytes: int = 4 * 1024 * 1024  # fits the sidecar's 256-MiB memory limit
    max_series: int = 64
    web_config: str | None = None
    model: Geometry = field(default_factory=Geometry)
    load_bandwidth_bytes_per_second: float | None = None
    prices: Prices = field(default_factory=Prices)
    slo: Slo = field(default_factory=Slo)
    target_hit_ratio: float | None = 0.9
    instance_hour_price: float | None = None
    retry_rate: float = 0.0
    sizing: Sizing = field(default_factory=Sizing)

    @property
    def max_value_age(self) -> float:
        """Oldest a published per-model value may be [s]: two intervals plus the timeout, when the
        retry after one failed attempt has completed at the latest (exporter/runner.py)."""
        return 2 * self.interval + self.timeout


_SECTIONS = {"model": Geometry, "prices": Prices, "slo": Slo, "sizing": Sizing}
METRICS_PATH_HINT = "vLLM serves /metrics, add it to the URL"  # a target URL without that path (also sources.py)


def key_paths(sep: str) -> dict[str, str]:
    """Every settable key's whole path (sections joined by ``sep``: "." in a file, "_" in the
    environment) → its last part."""
    return {**{f.name: f.name for f in fields(Config) if f.name not in _SECTIONS},
            **{f"{s}{sep}{f.name}": f.name for s, c in _SECTIONS.items() for f in fields(c)}}


def _unknown(key: str, leaf: str, sep: str, shown: Callable[[str], str] = str) -> str:
    """"unknown key", with the known key a typo most likely meant, as ``shown`` spells it: the key
    of that name in another section (``ttft_seconds`` → ``slo.ttft_seconds``), else the closest by
    difflib over whole paths (:func:`key_paths`) when it is close; a guess further off misled more
    than it helped (``interval_seconds`` read as ``window_seconds``). ``key``: the whole path
    written; ``leaf``: its last part."""
    paths = key_paths(sep)
    near = [p for p, name in paths.items() if name == leaf]
    if not near:  # the start of one key alone (model.dtype → model.dtype_bytes: difflib read model.tp)
        near = [p for p in paths if p.startswith(key)]
        near = near if len(near) == 1 else difflib.get_close_matches(key, list(paths), n=1, cutoff=0.76)
    return f"unknown key (did you mean {shown(near[0])}?)" if near else "unknown key"


def _coerce(key: str, value: Any, typ: str) -> Any:
    if value is None:
        if "None" in typ:
            return None
        # a YAML null (`interval:` with no value) is no setting: it crashed the checks, or passed
        # them and failed every analysis while kvhit read healthy
        raise ConfigError(f"config key {key}: expected {typ}, got null (leave the key out for its default)")
    if "dict" in typ:
        return _string_mapping(key, value)
    try:
        if "int" in typ and "float" not in typ:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            if isinstance(value, str):
                number(value)  # int() reads "1_0" and fullwidth digits too: refused first
            return int(value)
        if "float" in typ:
            if isinstance(value, bool):
                raise ValueError
            out = number(value) if isinstance(value, str) else float(value)
        elif "str" in typ:
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError
            return str(value)
        else:
            return value
    except (TypeError, ValueError):
        raise ConfigError(f"config key {key}: expected {typ.replace(' | None', '')}, got {_got(value)}") from None
    if not math.isfinite(out):  # a float, but YAML's .nan / .inf is no setting
        raise ConfigError(f"config key {key}: must be a finite number, got {value!r}")
    return out


def _got(value: Any) -> str:
    """A wrong-typed value as a message quotes it: a scalar as written (cut at 80 characters), a
    mapping or list by its type alone (it may hold a URL's credentials, or be a YAML alias bomb
    whose repr is gigabytes)."""
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, (list, tuple, set)):
        return "a list"
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."


def _string_mapping(key: str, value: Any) -> dict[str, str]:
    """A mapping of strings to strings, else ConfigError naming the first bad entry by its key
    only (header values can be secrets; YAML reads an unquoted 12345 as a number, 0123 as 83).
    A string is the mapping as YAML text (the environment)."""
    if isinstance(value, str):
        try:
            value = yaml.safe_load(value)
        except (yaml.YAMLError, RecursionError):  # RecursionError: nested deeper than Python recurses
            raise ConfigError(f"config key {key}: not a YAML mapping (value not shown)") from None
    if not isinstance(value, Mapping):
        raise ConfigError(f"config key {key}: expected a mapping of names to quoted strings (value not shown)")
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise ConfigError(f"config key {key}: the value of {str(k)[:40]!r} must be a quoted string, "
                              f"e.g. \"12345\" (value not shown)")
    return dict(value)


def _build(cls, data: Mapping[str, Any], prefix: str = ""):
    known = {f.name: f for f in fields(cls)}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if k not in known:
            raise ConfigError(f"config key {key}: {_unknown(str(key), str(k), '.')}")
        if k in _SECTIONS and cls is Config:
            if v is None:
                v = {}
            if not isinstance(v, Mapping):
                raise ConfigError(f"config key {key}: expected a mapping, got {_got(v)}")
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


class _DuplicateKey(yaml.YAMLError):
    """A mapping names the same key twice."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (YAML forbids it; PyYAML would
    keep the last one silently, so ``target:`` twice would scrape the second target unannounced).
    A merge key's (``<<:``) keys are not the mapping's own: the mapping's own override them."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # <<: a mapping's keys, which its own override
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                if key in seen:
                    raise _DuplicateKey(f"key {str(key)[:60]!r} twice (line {key_node.start_mark.line + 1})")
                seen.add(key)
            except TypeError:  # an unhashable key: SafeLoader refuses it below
                pass
        return super().construct_mapping(node, deep)


# No configuration, HF config.json or kvhit analysis is this large (an analysis of 64 models is ~2
# MB); read whole, /dev/zero would fill memory before a parser could refuse it
MAX_FILE_BYTES = 64 * 1024 * 1024


class FileTooLarge(ValueError):
    """A file over MAX_FILE_BYTES (:func:`read_bounded`)."""


def read_bounded(path: str | os.PathLike) -> bytes:
    """The bytes of the file at ``path``, reading at most MAX_FILE_BYTES + 1 of them.

    Raises:
        OSError: it cannot be read. FileTooLarge: it holds more than MAX_FILE_BYTES.
    """
    with open(path, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise FileTooLarge(f"over {MAX_FILE_BYTES} bytes")
    return data


def _refuse_nul(path: str, where: str) -> None:
    """ConfigError starting with ``where`` (its NUL shown as \\0) when ``path`` holds a NUL byte,
    which open() refuses with ValueError."""
    if "\0" in path:
        shown = where.replace("\0", "\\0")
        raise ConfigError(f"{shown}: cannot read (a NUL byte in the path)")


def _read_yaml(path: str, where: str) -> Any:
    """The YAML document in file ``path``; every problem is a ConfigError starting with ``where``:
    unreadable, over MAX_FILE_BYTES, not UTF-8, not YAML (its place and type only: values can be secrets), a
    key given twice."""
    _refuse_nul(path, where)
    try:
        return yaml.load(read_bounded(path).decode("utf-8"), Loader=_UniqueKeyLoader)  # noqa: S506 (safe)
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read ({exc.strerror})") from None
    except FileTooLarge as exc:
        raise ConfigError(f"{where}: {exc}: not a configuration") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: not UTF-8 text") from None
    except _DuplicateKey as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except yaml.YAMLError as exc:  # where, not what: the text there may be a secret
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{where}: not valid YAML{at} ({type(exc).__name__})") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply to be a configuration") from None


def layered_string(key: str, path: str | None, flag: str | None = None,
                   environ: Mapping[str, str] | None = None) -> str | None:
    """Top-level ``key`` as :func:`load_config` layers it (flag, then ``KVHIT_<KEY>``, then the
    file at ``path``), read leniently for a configuration that was refused as a whole: the first
    layer giving a non-empty string, None when none does (an unreadable file gives nothing)."""
    value = flag or (os.environ if environ is None else environ).get(f"KVHIT_{key.upper()}")
    if value is not None and _env_null(value):
        value = None
    if not value and path:
        try:
            doc = _read_yaml(path, f"config file {path}")
        except ConfigError:
            doc = None
        value = doc.get(key) if isinstance(doc, Mapping) else None
    return value if isinstance(value, str) and value else None


def _env_null(value: str) -> bool:
    """Whether a ``KVHIT_*`` value is YAML's null (``null``, ``Null``, ``NULL``, ``~``)."""
    return value.strip() in ("null", "Null", "NULL", "~")


# The variables Kubernetes' service links give every pod of a namespace for each Service in it
# (enableServiceLinks, on by default): a Service named kvhit or kvhit-fleet gives KVHIT_PORT,
# KVHIT_FLEET_SERVICE_HOST, … No config key has this shape.
# The name and value (NAME=value) together: KVHIT_PORT=9000 or KVHIT_LISTEN_PORT=9000 is a guess at a
# key, refused (a link's …_PORT is a URL).
_IP = r"[0-9A-Fa-f.:]+"
_LINK_URL = rf"(?:tcp|udp|sctp)://(?:{_IP}|\[{_IP}\]):[0-9]+"
_SERVICE_LINK = re.compile(
    rf"KVHIT(?:_[A-Z0-9_]+)?_(?:SERVICE_HOST={_IP}|SERVICE_PORT(?:_[A-Z0-9_]+)?=[0-9]+|PORT={_LINK_URL}"
    rf"|PORT_[0-9]+_(?:TCP|UDP|SCTP)(?:={_LINK_URL}|_PROTO=(?:tcp|udp|sctp)|_PORT=[0-9]+|_ADDR={_IP}))")


def env_overrides(environ: Mapping[str, str]) -> dict:
    """``KVHIT_*`` variables as a nested mapping; an unknown variable raises ConfigError, but for
    those Kubernetes sets for a Service whose name starts with kvhit (``_SERVICE_LINK``), skipped."""
    out: dict = {}
    known = key_paths("_")
    for name, value in environ.items():
        if not name.startswith("KVHIT_"):
            continue
        rest = name[len("KVHIT_"):].lower()
        value = None if _env_null(value) else value  # YAML's null: a nullable key unset
        section = next((s for s in _SECTIONS if rest.startswith(s + "_")), None)
        if rest in known and section:
            out.setdefault(section, {})[rest[len(section) + 1:]] = value
        elif rest in known:
            out[rest] = value
        elif rest in _SECTIONS:
            raise ConfigError(f"environment variable {name}: {rest} is a section; set its keys one by one, e.g. "
                              f"{name}_{next(f.name for f in fields(_SECTIONS[rest])).upper()}")
        elif _SERVICE_LINK.fullmatch(f"{name}={value}"):  # Kubernetes sets these for a Service named kvhit or kvhit-…
            continue
        elif rest == "config":  # a natural guess at the file's variable: none exists
            raise ConfigError(f"environment variable {name}: unknown key (the config file is given with --config FILE)")
        else:  # named as the variable, not as a file's key: the user may have no file (a newcomer's find)
            leaf = rest[len(section) + 1:] if section else rest
            raise ConfigError(f"environment variable {name}: {_unknown(rest, leaf, '_', lambda k: 'KVHIT_' + k.upper())}")
    return out


def _named_as_set(exc: ConfigError, env: Mapping[str, Any], flags: Mapping[str, Any]) -> ConfigError:
    """``exc`` naming the ``KVHIT_*`` variable that set its key, where the environment did and no flag
    overrode it (a newcomer was told "config key interval" for KVHIT_INTERVAL=abc; env: as
    :func:`env_overrides` gives it)."""
    text = str(exc)
    match = re.match(r"config key ([\w.]+):", text)
    if match is None or match[1].split(".")[0] in flags:
        return exc
    node: Any = env
    for part in match[1].split("."):
        if not isinstance(node, Mapping) or part not in node:
            return exc
        node = node[part]
    return ConfigError(f"environment variable KVHIT_{match[1].replace('.', '_').upper()} sets {text}")


def load_config(path: str | None = None, environ: Mapping[str, str] | None = None,
                flags: Mapping[str, Any] | None = None, defaults: Mapping[str, Any] | None = None,
                live: bool = False) -> Config:
    """Build and validate the configuration (defaults < YAML < env < flags).

    Args:
        path: YAML file or None.
        environ: environment (default ``os.environ``).
        flags: command-line values already named by key (None values are ignored).
        defaults: a command's own defaults, by key, in place of :class:`Config`'s (e.g. ``kvhit
            demo`` serves on 127.0.0.1 unless told otherwise).
        live: the configuration of ``kvhit run``, which scrapes and serves: a timeout no layer sets
            is at most the interval (as Prometheus' scrape_timeout), and the ``listen`` host must
            resolve (an IPv4 name: the server binds IPv6 only to a bracketed address).
    Raises:
        ConfigError: unknown key, wrong type, out-of-range value, unreadable file.
    """
    data: dict = dict(defaults or {})
    if path:
        loaded = _read_yaml(path, f"config file {path}")
        if loaded is not None and not isinstance(loaded, Mapping):
            raise ConfigError(f"config file {path}: top level must be a mapping")
        data = _merge(data, dict(loaded or {}))
    env = env_overrides(os.environ if environ is None else environ)
    data = _merge(data, env)
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    data = _merge(data, flags)
    try:
        cfg = _build(Config, data)
        given = cfg.model
        cfg = replace(cfg, model=_with_hf_config(given))
        if cfg.model.kv_lora_rank is not None:  # given, or hf_config's: the dense keys given would read as nothing
            for key in ("kv_heads", "head_dim"):  # (DeepSeek's config.json has both, filled below MLA's)
                if getattr(given, key) is not None:
                    raise ConfigError(f"config key model.{key}: not with model.kv_lora_rank (MLA caches the latent: "
                                      "S_kv = layers x (kv_lora_rank + qk_rope_head_dim) x dtype_bytes, MODEL.md §3.6)")
        validate(cfg)
        if live:
            listen_address(cfg.listen, "config key listen", resolve=True)
            if "timeout" not in data:  # as Prometheus' scrape_timeout: the default, but never over the interval
                cfg = replace(cfg, timeout=min(cfg.timeout, cfg.interval))
        _check_hf_geometry(cfg.model)
        if cfg.web_config:
            load_web_config(cfg.web_config)
    except ConfigError as exc:
        raise _named_as_set(exc, env, flags) from None
    return cfg


def _with_hf_config(g: Geometry) -> Geometry:
    """Fill geometry left unset from the HF config.json (explicit keys win).

    Raises:
        ConfigError (model.hf_config): unreadable, not a JSON object, or sizes that are not whole
        numbers (whether it gives S_kv at all is :func:`_check_hf_geometry`'s, after validate).
    """
    if not g.hf_config:
        return g
    key = f"config key model.hf_config: {g.hf_config}"
    _refuse_nul(g.hf_config, key)
    try:
        hf = json.loads(read_bounded(g.hf_config))
    except FileTooLarge as exc:
        raise ConfigError(f"{key}: {exc}: not a Hugging Face config.json") from None
    except OSError as exc:  # a relative path is the working directory's
        cwd = "" if os.path.isabs(g.hf_config) else f"; from {os.getcwd()}"
        raise ConfigError(f"{key}: cannot read ({exc.strerror or exc}{cwd})") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{key}: not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{key}: not UTF-8 text") from None
    except ValueError as exc:  # an integer of more than 4300 digits
        raise ConfigError(f"{key}: not a Hugging Face config.json ({exc})") from None
    except RecursionError:  # nested deeper than Python recurses
        raise ConfigError(f"{key}: nested too deeply to be a Hugging Face config.json") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{key}: not a JSON object (a Hugging Face config.json)")
    if "num_hidden_layers" not in hf and isinstance(hf.get("text_config"), dict):
        hf = hf["text_config"]  # multimodal models keep the language model's geometry there
    heads = hf.get("num_attention_heads")
    try:
        derived = {
            "layers": hf.get("num_hidden_layers"),
            "kv_heads": hf.get("num_key_value_heads") or heads,
            "head_dim": hf.get("head_dim") or (hf["hidden_size"] // heads if heads and hf.get("hidden_size") else None),
            "kv_lora_rank": hf.get("kv_lora_rank"),
            "qk_rope_head_dim": hf.get("qk_rope_head_dim"),
        }
    except TypeError:
        raise ConfigError(f"{key}: hidden_size and num_attention_heads must be whole numbers") from None
    if not all(v is None or (isinstance(v, int) and not isinstance(v, bool) and (v > 0 or k == "qk_rope_head_dim" and v == 0))
               for k, v in derived.items()):
        raise ConfigError(f"{key}: num_hidden_layers, num_key_value_heads, head_dim, kv_lora_rank and "
                          "qk_rope_head_dim must be whole numbers > 0")
    return replace(g, **{k: v for k, v in derived.items() if getattr(g, k) is None and v is not None})


def _check_hf_geometry(g: Geometry) -> None:
    """After :func:`validate` (S_kv divides by tp and pp): an HF config that, with the explicit
    keys, gives no S_kv is no model's config.json. Raises ConfigError naming model.hf_config."""
    if g.hf_config and g.kv_bytes_per_token() is None:
        raise ConfigError(f"config key model.hf_config: {g.hf_config}: no KV geometry in it (num_hidden_layers with "
                          "num_key_value_heads or num_attention_heads and head_dim or hidden_size; or kv_lora_rank "
                          "and qk_rope_head_dim): is it the model's config.json? (else set model.layers, kv_heads, "
                          "head_dim)")


def number(text: str) -> float:
    """``float(text)`` of a number as people write one. Raises ValueError, also for an underscore
    (float() reads "0_5" as 5.0) or a character beyond ASCII (it reads fullwidth "５" as 5.0)."""
    if "_" in text or not text.isascii():
        raise ValueError(f"{text!r}: not a number as written in ASCII without underscores")
    return float(text)


def bounded(lo: float, hi: float = math.inf, integer: bool = False, open_low: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite number in [lo, hi] ((lo, hi] with ``open_low``), a whole one
    with ``integer``; anything else is argparse's usage error (one line, exit 2)."""
    def parse(text: str) -> float:
        try:
            v = number(text)  # int() reads "1_0" as 10 too: refused here first
            if integer:
                v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {'whole ' if integer else ''}number, got {text!r}") from None
        if not (math.isfinite(v) and (lo < v if open_low else lo <= v) and v <= hi):
            raise argparse.ArgumentTypeError(f"must be in {'(' if open_low else '['}{lo:g}, {hi:g}], got {text}")
        return v
    return parse


def listen_address(listen: str, key: str, any_port: bool = False, resolve: bool = False) -> tuple[str, int]:
    """(host, port) of ``ADDR:PORT`` or ``[v6 address]:PORT`` (host "" when ADDR is empty: every
    interface); port 1-65535, or 0 (any free port) with ``any_port``; with ``resolve``, an ADDR
    outside brackets must resolve to an IPv4 address (the server binds it so).

    Raises:
        ConfigError: not of that form, an IPv6 ADDR not in brackets, or (``resolve``) an ADDR
            that does not resolve to IPv4; the message starts with ``key``.
    """
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit():
        raise ConfigError(f"{key}: expected ADDR:PORT, got {listen!r}")
    if not (0 if any_port else 1) <= int(port) < 65536:  # said apart: 99999 read as a malformed address
        raise ConfigError(f"{key}: the port must be {'0-65535 (0: any free one)' if any_port else '1-65535'}, got {listen!r}")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ConfigError(f"{key}: {host} is not an IPv6 address, in {listen!r}") from None
        return host[1:-1], int(port)
    if ":" in host or "[" in host or "]" in host:
        raise ConfigError(f"{key}: expected ADDR:PORT (an IPv6 ADDR in brackets), got {listen!r}")
    if host and resolve:
        try:  # a name that does not resolve is refused here, as a bad key, not when binding
            socket.getaddrinfo(host, int(port), family=socket.AF_INET, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except (socket.gaierror, UnicodeError) as exc:
            raise ConfigError(f"{key}: cannot resolve {host!r} to an IPv4 address ({getattr(exc, 'strerror', None) or exc}; "
                              f"an IPv6 one goes in brackets), in {listen!r}") from None
    return host, int(port)


def listening(bind: Callable[[], T], where: str) -> T:
    """``bind()`` (a server constructor that binds), with an OSError (e.g. the port is in use)
    raised again as one naming ``where``, the ADDR:PORT, not only the errno."""
    try:
        return bind()
    except OSError as exc:
        raise OSError(f"cannot listen on {where}: {exc.strerror or exc}") from None


def stop_event() -> threading.Event:
    """An event set by SIGTERM, SIGINT or SIGHUP, for a command that serves until stopped (a
    closed terminal: kvhit has nothing to reload, and ending without a log line left no trace).
    SIGHUP or SIGINT this process was started ignoring stays ignored (``nohup`` ignores SIGHUP, a
    shell's background job SIGINT); SIGTERM always stops it, as the README promises."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        if sig == signal.SIGTERM or signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, lambda *_: stop.set())
    return stop


def _host(url: str) -> str | None:
    """The URL's host; None when there is none or the URL cannot be used as given: an unbalanced
    "[", a port that is no number or 0 (no server listens there), or an "@" after the host (a
    user:password with an unencoded "/", "?" or "#" ends the host part early)."""
    try:
        parts = urlsplit(url)
        if parts.port == 0:  # raises ValueError for a port that is no number or past 65535
            return None
    except ValueError:
        return None
    return None if "@" in parts.path + parts.query + parts.fragment else parts.hostname


def validate(cfg: Config) -> None:
    """Range checks; raises ConfigError naming the key."""
    checks = [
        # more often than 10 times a second hammers vLLM's /metrics; a day is no sidecar's cadence
        ("interval", cfg.interval, lambda v: MIN_INTERVAL <= v <= MAX_INTERVAL,
         f"must be in [{MIN_INTERVAL:g}, {MAX_INTERVAL:g}] seconds"),
        # sockets take no deadline past ~1e9 s (OverflowError at every scrape): a day bounds any sane one
        ("timeout", cfg.timeout, lambda v: 0 < v <= MAX_INTERVAL, f"must be in (0, {MAX_INTERVAL:g}] seconds"),
        # the window holds every scrape inside it: an hour is what a sidecar's memory should carry
        ("window_seconds", cfg.window_seconds, lambda v: 0 < v <= MAX_WINDOW, f"must be in (0, {MAX_WINDOW:g}] seconds"),
        # every cycle sums the steps inside the window: 0.1-s scrapes over an hour would be 36000
        ("window_seconds", cfg.window_seconds, lambda v: v / cfg.interval <= MAX_WINDOW_STEPS,
         f"holds at most {MAX_WINDOW_STEPS} scrapes: at interval {cfg.interval:g} s at most "
         f"{MAX_WINDOW_STEPS * cfg.interval:g} seconds (or scrape less often)"),
        ("gap_seconds", cfg.gap_seconds, lambda v: v > cfg.interval,
         f"must be > interval ({cfg.interval:g} s), or every step would be a gap"),
        ("prometheus_delay", cfg.prometheus_delay, lambda v: v >= 0, "must be >= 0 seconds"),
        # below it every scrape of a vLLM /metrics (tens of KiB) fails as too_large
        ("max_body_bytes", cfg.max_body_bytes, lambda v: v >= 4096, "must be >= 4096"),
        ("max_series", cfg.max_series, lambda v: v >= 1, "must be >= 1"),
        ("load_bandwidth_bytes_per_second", cfg.load_bandwidth_bytes_per_second, lambda v: v >= MIN_LOAD_BANDWIDTH,
         "must be >= 1e6 bytes/s (PCIe Gen4 x16 is about 25e9)"),
        # bounded as instance_hour_price: 1e160 overflowed R'(h)'s interval to NaN, and valley_active read 0
        ("prices.miss_per_million", cfg.prices.miss_per_million, lambda v: MIN_PRICE <= v <= MAX_PRICE,
         "must be in [1e-12, 1e12]"),
        ("prices.hit_price_ratio", cfg.prices.hit_price_ratio, lambda v: 0 <= v <= 1, "must be in [0, 1]"),
        ("prices.output_per_million", cfg.prices.output_per_million, lambda v: 0 <= v <= MAX_PRICE, "must be in [0, 1e12]"),
        ("slo.ttft_seconds", cfg.slo.ttft_seconds, lambda v: v > 0, "must be > 0"),
        ("slo.tpot_seconds", cfg.slo.tpot_seconds, lambda v: v > 0, "must be > 0"),
        ("target_hit_ratio", cfg.target_hit_ratio, lambda v: 0 <= v < 1, "must be in [0, 1)"),
        # above it the cost per token could overflow to inf, published as absent with no reason (a hand-checker)
        ("instance_hour_price", cfg.instance_hour_price, lambda v: MIN_PRICE <= v <= MAX_PRICE,
         "must be in [1e-12, 1e12]"),
        ("retry_rate", cfg.retry_rate, lambda v: 0 <= v < 1, "must be in [0, 1)"),
        ("sizing.batch", cfg.sizing.batch, lambda v: v >= 1, "must be >= 1"),
        ("sizing.max_len", cfg.sizing.max_len, lambda v: v >= 1, "must be >= 1 tokens"),
        ("model.layers", cfg.model.layers, lambda v: v > 0, "must be > 0"),
        ("model.kv_heads", cfg.model.kv_heads, lambda v: v > 0, "must be > 0"),
        ("model.head_dim", cfg.model.head_dim, lambda v: v > 0, "must be > 0"),
        ("model.kv_lora_rank", cfg.model.kv_lora_rank, lambda v: v > 0, "must be > 0"),
        ("model.qk_rope_head_dim", cfg.model.qk_rope_head_dim, lambda v: v >= 0, "must be >= 0"),
        # a KV element is 0.5 (FP4) to 4 bytes (FP32): 16 or 8 is a number of bits
        ("model.dtype_bytes", cfg.model.dtype_bytes, lambda v: 0.5 <= v <= 4,
         "must be in [0.5, 4] bytes per KV element (2 for bf16, 1 for fp8; not bits)"),
        ("model.tp", cfg.model.tp, lambda v: v >= 1, "must be >= 1"),
        ("model.pp", cfg.model.pp, lambda v: v >= 1, "must be >= 1"),
    ]
    for key, value, ok, what in checks:
        if value is None:
            continue
        if not _finite(value):  # .inf, or 10**400 (beyond a float: OverflowError later)
            raise ConfigError(f"config key {key}: must be a finite number, got {_shown(value)}")
        if key.startswith(("sizing.", "model.")) and value > MAX_COUNT:
            raise ConfigError(f"config key {key}: must be at most {MAX_COUNT}, got {_shown(value)}")
        if not ok(value):
            raise ConfigError(f"config key {key}: {what}, got {value!r}")
    for key in ("target", "prometheus"):  # a trailing space or a YAML block's newline: every scrape a 404
        if any(c.isspace() for c in getattr(cfg, key) or ""):
            raise ConfigError(f"config key {key}: holds whitespace (a trailing space, or the newline of a YAML "
                              f"block?), got {redact_url(getattr(cfg, key))!r}")
        # a NUL or another control character: requests sends it percent-encoded, and the target
        # label carried it raw into every series (adversarial review)
        if any(not c.isprintable() for c in getattr(cfg, key) or ""):
            raise ConfigError(f"config key {key}: holds a control character (percent-encode it), got "
                              f"{redact_url(getattr(cfg, key))!r}")
    if cfg.web_config == "":  # no file, unlike null (no web config): it turned off the file's TLS
        raise ConfigError("config key web_config: empty (give a path, or null for none)")
    if cfg.target is not None and not (cfg.target.startswith(("http://", "https://")) and _host(cfg.target)):
        raise ConfigError(f"config key target: must be an http(s) URL of /metrics with a host, a port (if "
                          f"any) of 1-65535 (percent-encode / ? # @ in a user:password), got {redact_url(cfg.target)!r}")
    if cfg.target is not None and not urlsplit(cfg.target).path:
        raise ConfigError(f"config key target: no path in {redact_url(cfg.target)!r}: {METRICS_PATH_HINT}")
    if cfg.prometheus is not None:
        if not (cfg.prometheus.startswith(("http://", "https://")) and _host(cfg.prometheus)):
            raise ConfigError(f"config key prometheus: must be the http(s) base URL of a Prometheus API with a "
                              f"host, a port (if any) of 1-65535 (percent-encode / ? # @ in a user:password), got {redact_url(cfg.prometheus)!r}")
        path = urlsplit(cfg.prometheus).path.rstrip("/")
        extra = path[path.find("/api/v1"):] if "/api/v1" in path else "/metrics" if path.endswith("/metrics") else ""
        if extra:  # kvhit adds /api/v1/query to the base
            raise ConfigError(f"config key prometheus: the base URL of the Prometheus API (e.g. http://prometheus:9090, "
                              f"Mimir's …/prometheus), without {extra}, got {redact_url(cfg.prometheus)!r}")
        parts = urlsplit(cfg.prometheus)
        if parts.query or parts.fragment or cfg.prometheus.endswith(("?", "#")):  # /api/v1/query would land in them
            raise ConfigError("config key prometheus: the base URL of the Prometheus API, without a query string "
                              f"or fragment (kvhit adds /api/v1/query to its path), got {redact_url(cfg.prometheus)!r}")
        if cfg.target is not None:
            raise ConfigError("config key prometheus: fleet mode reads Prometheus instead of a target: "
                              "set target or prometheus, not both")
        _validate_prometheus_auth(cfg)
    else:
        for key in ("selector", "prometheus_headers", "prometheus_bearer_token_file"):
            if getattr(cfg, key) is not None:
                raise ConfigError(f"config key {key}: only with prometheus (fleet mode)")
    selector_matchers(cfg.selector)
    listen_address(cfg.listen, "config key listen")
    _validate_geometry(cfg)


# Bound of a count or size of the geometry and sizing (tp 10**300 × pp 10**300 passed alone and its
# product overflowed every analysis): products of up to five stay far inside a float.
MAX_COUNT = 2 ** 31


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond a float's range
        return False


def _shown(value: float) -> str:
    """A config value as a message quotes it: an int of hundreds of digits by its size."""
    return f"an integer of {len(str(abs(value)))} digits" if isinstance(value, int) and abs(value) > 10 ** 30 \
        else repr(value)


MAX_TOKEN_BYTES = 64 * 1024  # a Kubernetes service-account token is ~1 KB


def redact_url(url: str) -> str:
    """The URL without ``user:password@`` and without the values of its query, path parameters and
    fragment (``?token=…`` → ``?token=<redacted>``, ``;jsessionid=…``, ``#access_token=…`` alike: a
    credential there is as secret; a redirect's Location may carry them) — for logs, messages and
    the ``target`` label. Userinfo up to the last ``@``, so a password with an unencoded ``/``,
    ``?`` or ``#`` (which ends the URL's authority early) is hidden too; an ``@`` in a path or
    query hides more than needed."""
    scheme, sep, rest = url.partition("://")
    if sep and "@" in rest:
        rest = "<redacted>@" + rest.rpartition("@")[2]
    rest, hash_, fragment = rest.partition("#")
    head, qmark, query = rest.partition("?")
    path, semi, params = head.partition(";")
    return f"{scheme}{sep}{path}{semi}{_values_redacted(params, ';')}{qmark}{_values_redacted(query, '&')}" \
           f"{hash_}{_values_redacted(fragment, '&')}"


def _values_redacted(pairs: str, sep: str) -> str:
    """``k=v`` pairs joined by ``sep`` with every value ``<redacted>`` (keys stay: they tell URLs apart)."""
    return sep.join(k + ("=<redacted>" if eq else "") for k, eq, _ in (kv.partition("=") for kv in pairs.split(sep)))


def read_bearer_token(path: str) -> str:
    """The token in file ``path``: its content stripped, one line of printable ASCII without
    spaces (RFC 6750 b64token; a Kubernetes service-account token is a ~1-KB JWT).

    Raises:
        ValueError: the file is missing, not a regular file (a FIFO would block), unreadable,
            empty, over MAX_TOKEN_BYTES, or not such a line; the message never shows the content.
    """
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ValueError(f"the bearer token file {path} is not a regular file")
        with open(path, "rb") as f:
            raw = f.read(MAX_TOKEN_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"cannot read the bearer token file {path}: {exc.strerror}") from None
    if len(raw) > MAX_TOKEN_BYTES:
        raise ValueError(f"the bearer token file {path} is over {MAX_TOKEN_BYTES} bytes")
    token = raw.strip()
    if not token:
        raise ValueError(f"the bearer token file {path} is empty")
    if not all(0x21 <= b <= 0x7E for b in token):
        raise ValueError(f"the bearer token file {path} is not one line of printable ASCII")
    return token.decode("ascii")


_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 token
_RESERVED_HEADERS = ("content-type", "content-length", "host", "transfer-encoding")  # the query's own


def _validate_prometheus_auth(cfg: Config) -> None:
    """Headers that requests can send as given, one Authorization, a readable token (values never shown)."""
    key = "config key prometheus_headers"
    seen: set[str] = set()
    for name, value in (cfg.prometheus_headers or {}).items():
        if not _HEADER_NAME.fullmatch(name):
            raise ConfigError(f"{key}: {name[:40]!r} is not an HTTP header name")
        if name.lower() in seen:
            raise ConfigError(f"{key}: {name} is given twice (header names ignore case)")
        seen.add(name.lower())
        if name.lower() in _RESERVED_HEADERS:
            raise ConfigError(f"{key}: {name} is set by kvhit's query itself")
        if not value or value != value.strip() or any(c in value for c in "\r\n\0") or not _latin1(value):
            raise ConfigError(f"{key}: the value of {name} must be non-empty, without surrounding spaces, line "
                              f"breaks or NUL, in ISO-8859-1 (value not shown)")
    authorization = "authorization" in seen
    if cfg.prometheus_bearer_token_file is not None:
        if authorization:
            raise ConfigError(f"{key}: Authorization is set by prometheus_bearer_token_file; set one of them")
        try:
            read_bearer_token(cfg.prometheus_bearer_token_file)
        except ValueError as exc:
            raise ConfigError(f"config key prometheus_bearer_token_file: {exc}") from None
        authorization = True
    if authorization and redact_url(cfg.prometheus) != cfg.prometheus:  # it carries a user:password
        raise ConfigError("config key prometheus: a user:password in the URL and an Authorization (header or "
                          "bearer token file) cannot both be sent; set one of them")


def _latin1(value: str) -> bool:
    try:
        value.encode("latin-1")
    except UnicodeEncodeError:
        return False
    return True


_MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*(?:,|\Z)')
# The escapes PromQL's lexer takes in a double-quoted string (Go's): any other backslash, e.g. the
# regex \d written unescaped (Prometheus wants "\\d"), fails every query with HTTP 400.
_SIMPLE_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v"}
_ESCAPE = re.compile(r'\\(?:[abfnrtv\\"]|[0-7]{3}|x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|(.|\Z))', re.S)


def _unquotes_to_utf8(value: str) -> bool:
    """Whether a double-quoted PromQL value whose escapes are well formed (:data:`_ESCAPE`) unquotes,
    as Go's strconv does, to UTF-8 text: \\x and octal escapes are bytes, \\u and \\U code points
    (a surrogate or one above U+10FFFF is refused), and Prometheus takes UTF-8 label values only."""
    out, pos = bytearray(), 0
    for e in _ESCAPE.finditer(value):
        out += value[pos:e.start()].encode()
        pos, esc = e.end(), e.group(0)
        if esc[1] in "uU":
            point = int(esc[2:], 16)
            if point > 0x10FFFF or 0xD800 <= point <= 0xDFFF:
                return False
            out += chr(point).encode()
        elif esc[1] == "x" or esc[1].isdigit():
            byte = int(esc[2:], 16) if esc[1] == "x" else int(esc[1:], 8)
            if byte > 0xFF:
                return False
            out.append(byte)
        else:
            out.append(ord(_SIMPLE_ESCAPES.get(esc[1], esc[1])))
    out += value[pos:].encode()
    try:
        out.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def selector_matchers(selector: str | None) -> tuple[str, ...]:
    """The label matchers of a PromQL selector ``{label="value", ...}`` (braces optional, values in
    double quotes, operators = != =~ !~), each as ``label<op>"value"``; () for None or ``{}``.

    Raises:
        ConfigError: naming the key ``selector`` when the text is not such matchers, when a value
            has a backslash PromQL does not take as an escape, or when it matches ``__name__``
            (kvhit picks the vLLM families itself).
    """
    text = (selector or "").strip()
    if text.startswith("{") and text.endswith("}"):
        text = text[1:-1].strip()
    out, pos = [], 0
    while pos < len(text):
        m = _MATCHER.match(text, pos)
        if m is None:
            raise ConfigError(f'config key selector: expected PromQL label matchers like {{namespace="llm"}} '
                              f"(values in double quotes), got {selector!r}")
        if m.group(1) == "__name__":
            raise ConfigError("config key selector: __name__ cannot be matched (kvhit picks the vLLM families)")
        if bad := next((e for e in _ESCAPE.finditer(m.group(3)) if e.group(1) is not None), None):
            raise ConfigError(f"config key selector: {bad.group(0)} in {m.group(0).strip()} "
                              "is no PromQL string escape (a regex backslash is written twice: \\\\d)")
        if not _unquotes_to_utf8(m.group(3)):
            raise ConfigError(f"config key selector: the escapes of {m.group(0).strip()} do not spell UTF-8 text "
                              "(a surrogate, a code point above U+10FFFF, or bytes that are no UTF-8)")
        out.append(f'{m.group(1)}{m.group(2)}"{m.group(3)}"')
        pos = m.end()
    return tuple(out)


def _validate_geometry(cfg: Config) -> None:
    """KV geometry is all or nothing: a partial one would silently make S_kv (and T_load) unknown."""
    g = cfg.model
    mla = {"model.kv_lora_rank": g.kv_lora_rank, "model.qk_rope_head_dim": g.qk_rope_head_dim}
    if sum(v is not None for v in mla.values()) == 1:
        missing = next(k for k, v in mla.items() if v is None)
        raise ConfigError(f"config key {missing}: required with {' and '.join(k for k in mla if k != missing)} "
                          "(MLA latent geometry)")
    if g.kv_lora_rank is None:
        dense = {"model.layers": g.layers, "model.kv_heads": g.kv_heads, "model.head_dim": g.head_dim}
        given = [k for k, v in dense.items() if v is not None]
        if given and len(given) < len(dense):
            missing = next(k for k, v in dense.items() if v is None)
            raise ConfigError(f"config key {missing}: required with {', '.join(given)} "
                              "(S_kv = 2 x layers x kv_heads x head_dim x dtype_bytes, MODEL.md §3.6)")
        # vLLM splits the KV heads over the TP ranks, or replicates them when tp is a multiple of
        # them, and refuses any other tp: S_kv of another (kv_heads/tp fractional) is no layout's
        if g.kv_heads is not None and g.kv_heads % g.tp and g.tp % g.kv_heads:
            raise ConfigError(f"config key model.tp: {g.tp} neither divides model.kv_heads ({g.kv_heads}) nor is a "
                              "multiple of it, which vLLM refuses (its KV heads are split over the tensor-parallel "
                              "ranks or replicated)")
    elif g.layers is None:
        raise ConfigError("config key model.layers: required with model.kv_lora_rank (MLA latent geometry)")


def check_t_load(cfg: Config) -> None:
    """A configured B_load means T_load is wanted; it needs S_kv (MODEL.md §3.2, §3.6).

    Called by the commands once the geometry is final (``kvhit demo`` fills the recorded model's).
    Raises ConfigError naming model.layers when the geometry is missing.
    """
    if cfg.load_bandwidth_bytes_per_second is not None and cfg.model.kv_bytes_per_token() is None:
        raise ConfigError("config key model.layers: required when load_bandwidth_bytes_per_second is set "
                          "(T_load = tokens x S_kv / B_load needs the KV geometry: model.layers, kv_heads, "
                          "head_dim, or model.hf_config)")


# --- web-config: TLS and basic auth of kvhit's own endpoint --------------------------------

_PBKDF2 = re.compile(r"pbkdf2_sha256\$([1-9][0-9]*)\$([^$]+)\$([A-Za-z0-9+/]+={0,2})\Z")
# every new login (a header not seen yet) costs this many SHA-256 rounds of the sidecar's CPU: ~2 s
MAX_PBKDF2_ITERATIONS = 5_000_000
# exporter-toolkit's keys kvhit honours; client_auth_type only as its default (no client certificates)
_TLS_VERSIONS = {"TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
_WEB_KEYS = {"tls_server_config": {"cert_file", "key_file", "min_version", "client_auth_type"}, "basic_auth_users": None}


@dataclass(frozen=True)
class WebConfig:
    """TLS and basic auth of kvhit's endpoint (see the module docstring for the file layout).

    Attributes:
        cert_file, key_file: absolute paths of the PEM certificate and key (None: plain HTTP).
        users: user name → ``pbkdf2_sha256$<iterations>$<salt>$<base64 hash>`` ({}: no auth).
    """

    cert_file: str | None = None
    key_file: str | None = None
    users: Mapping[str, str] = field(default_factory=dict)
    min_version: str = "TLS12"  # exporter-toolkit's spelling, a key of _TLS_VERSIONS

    @property
    def tls(self) -> bool:
        return self.cert_file is not None

    def context(self) -> ssl.SSLContext:
        """The server's TLS context. Raises ssl.SSLError or OSError when the certificate and key do
        not load, ConfigError when the key is encrypted (no passphrase is read: OpenSSL would
        prompt on the terminal)."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = _TLS_VERSIONS[self.min_version]

        def passphrase():
            raise ConfigError(f"config key web_config.tls_server_config.key_file: {self.key_file} is encrypted; "
                              "kvhit reads an unencrypted PEM key (as exporter-toolkit)")
        ctx.load_cert_chain(self.cert_file, self.key_file, password=passphrase)
        return ctx


def load_web_config(path: str | None) -> WebConfig:
    """Read and check a web-config file; every problem is a ConfigError naming the key."""
    if not path:
        return WebConfig()
    where = Path(path)
    doc = _read_yaml(path, f"config key web_config: {path}")
    doc = {} if doc is None else doc
    if not isinstance(doc, Mapping):
        raise ConfigError("config key web_config: top level must be a mapping")
    for key, value in doc.items():
        if key not in _WEB_KEYS:
            raise ConfigError(f"config key web_config.{key}: unknown key (tls_server_config, basic_auth_users)")
        if value is not None and not isinstance(value, Mapping):
            raise ConfigError(f"config key web_config.{key}: expected a mapping, got {type(value).__name__}")
    tls = doc.get("tls_server_config") or {}
    for key in tls:
        if key not in _WEB_KEYS["tls_server_config"]:
            raise ConfigError(f"config key web_config.tls_server_config.{key}: unknown key "
                              f"({', '.join(sorted(_WEB_KEYS['tls_server_config']))})")
    web = _tls(tls, where) if tls else WebConfig()
    users = doc.get("basic_auth_users") or {}
    for user, hashed in users.items():
        key = f"web_config.basic_auth_users.{user}"
        if not isinstance(user, str) or not user or ":" in user:
            raise ConfigError(f"config key {key}: a user name is a non-empty string without ':'")
        if isinstance(hashed, str) and hashed.startswith(("$2a$", "$2b$", "$2y$")):
            raise ConfigError(f"config key {key}: bcrypt hashes are not supported (no bcrypt in Python's standard "
                              "library); use pbkdf2_sha256$<iterations>$<salt>$<base64 hash>")
        match = _PBKDF2.match(hashed) if isinstance(hashed, str) else None
        if not match:
            raise ConfigError(f"config key {key}: expected pbkdf2_sha256$<iterations>$<salt>$<base64 hash>")
        if len(match[1]) > 9 or int(match[1]) > MAX_PBKDF2_ITERATIONS:  # int() refuses 4301 digits
            count = match[1] if len(match[1]) <= 9 else f"a {len(match[1])}-digit number of"
            raise ConfigError(f"config key {key}: {count} iterations, at most {MAX_PBKDF2_ITERATIONS} (every new "
                              "login costs them on the sidecar's CPU)")
        try:  # PBKDF2-SHA256's 32 bytes: else every login refused unsaid, or, cut at 4 characters, a weak check
            digest = base64.b64decode(match[3], validate=True)
        except binascii.Error:
            digest = b""
        if len(digest) != 32:
            raise ConfigError(f"config key {key}: the hash after the last $ is not 32 bytes in base64 (cut short?)")
    return replace(web, users=dict(users))


def _tls(tls: Mapping[str, Any], where: Path) -> WebConfig:
    """The WebConfig of a web-config file's ``tls_server_config`` (paths relative to the file at
    ``where``), its certificate and key loaded once; every problem a ConfigError naming the key."""
    version = tls.get("min_version") or "TLS12"  # null or "": exporter-toolkit's default
    if not isinstance(version, str) or version not in _TLS_VERSIONS:
        raise ConfigError(f"config key web_config.tls_server_config.min_version: {_got(version)}, expected "
                          f"{' or '.join(_TLS_VERSIONS)}")
    if tls.get("client_auth_type") not in (None, "", "NoClientCert"):  # null or "": the default, NoClientCert
        raise ConfigError("config key web_config.tls_server_config.client_auth_type: only NoClientCert (client "
                          "certificates are not supported)")
    files = {}
    for key in ("cert_file", "key_file"):
        value = tls.get(key)
        if not isinstance(value, str) or not value or "\0" in value:
            raise ConfigError(f"config key web_config.tls_server_config.{key}: required (a PEM file path)")
        p = (where.parent / value).resolve()
        try:
            found = p.is_file()
        except OSError as exc:  # a name too long
            raise ConfigError(f"config key web_config.tls_server_config.{key}: {exc.strerror}") from None
        if not found:
            raise ConfigError(f"config key web_config.tls_server_config.{key}: no such file {p}")
        files[key] = str(p)
    web = WebConfig(files["cert_file"], files["key_file"], min_version=version)
    try:
        web.context()
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError("config key web_config.tls_server_config.cert_file: certificate and key do not load "
                          f"({type(exc).__name__}: {getattr(exc, 'reason', None) or exc.strerror or 'invalid'})"
                          ) from None
    return web


def load_web_tls(path: str | None) -> WebConfig | None:
    """The TLS part alone of the web-config file at ``path`` when it loads (None otherwise), read
    for a configuration refused as a whole, whose web config may be what was refused: its HTTPS
    probes then still find HTTPS (nothing it serves is secret, so basic auth is not needed)."""
    try:
        doc = _read_yaml(path, "web_config") if path else None
        tls = doc.get("tls_server_config") if isinstance(doc, Mapping) else None
        return _tls(tls, Path(path)) if isinstance(tls, Mapping) and tls else None
    except ConfigError:
        return None
