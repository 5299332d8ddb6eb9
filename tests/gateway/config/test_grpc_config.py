"""``kvgate serve``'s configuration: file, environment and flags merged; every problem at once;
the data directory's secret and dev key (0600, reused)."""

from __future__ import annotations

import json
import re
import stat
from pathlib import Path

import pytest

from gateway.cache.operations.factory import GiB
from gateway.config.keys import KeyEntry, Principal, key_digest
from gateway.config.loader import DEFAULT_DISK_BYTES, load_serve_config, parse_size
from gateway.config.secrets import DEV_ADMIN, dev_admin_key, dev_api_key
from gateway.config.settings import ConfigError, GrpcSettings, HttpSettings, ServeConfig
from gateway.service.assembly import build_authenticator
from gateway.service.auth import Authenticator
from gateway.service.server import ServeError

ROOT = Path(__file__).resolve().parents[3]

KEY_A = "tenant-a-key-Rw4Tx9Lq2Zm7Kc5V"
ADMIN = "admin-key-Qe7Mz2Vk9Tr4Xa6Nu3"


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_listen_on_loopback_with_three_tiers_under_the_data_dir() -> None:
    config = load_serve_config(None, env={})
    assert (config.host, config.port, config.model) == ("127.0.0.1", 50051, "bundled")
    assert config.data_dir == Path("data")
    assert config.cache.disk_path == Path("data/kv")
    assert config.cache.disk_bytes == DEFAULT_DISK_BYTES
    assert config.cache.device_bytes > 0 and config.cache.host_bytes > 0
    assert config.cache.redis_url is None
    assert config.keys == () and not config.uses_tls
    assert config.secret_path == Path("data/secret")
    assert config.dev_key_path == Path("data/dev-api-key")


def test_a_toml_file_env_keys_and_flags_merge(tmp_path: Path) -> None:
    path = write(tmp_path / "kvgate.toml", f"""
[server]
host = "127.0.0.1"
port = 6000
data_dir = "{tmp_path / 'from-file'}"

[grpc]
body_timeout_s = 2.5
max_deadline_s = 30

[limits]
max_calls_per_key = 8

[engine]
max_queue = 4
default_ttl_s = 60
linear_kernel = "blas"

[cache]
block_tokens = 64
host_bytes = "512MiB"
quotas = {{ tenant-a = "1GiB" }}

[[api_keys]]
tenant = "tenant-a"
key = "{KEY_A}"

[[api_keys]]
tenant = "tenant-c"
key_blake2b = "{key_digest('tenant-c-key-0123456789abc').hex()}"

[[admin_keys]]
name = "ops"
key = "{ADMIN}"
""")
    env = {"KVGATE_API_KEYS": "tenant-b-key-Hn3Pj8Wd6Ys1Fg4B=tenant-b", "HOME": "/x"}
    config = load_serve_config(path, env=env,
                               overrides={"port": 7000, "model": "/models/m", "host": None})
    assert (config.host, config.port, config.model) == ("127.0.0.1", 7000, "/models/m")
    assert config.data_dir == tmp_path / "from-file"
    assert config.cache.disk_path == tmp_path / "from-file" / "kv"
    assert config.grpc.body_timeout_s == 2.5 and config.grpc.max_deadline_s == 30
    assert config.limits.max_calls_per_key == 8 and config.limits.max_calls == 64
    assert config.engine.max_queue == 4 and config.engine.default_ttl_s == 60
    assert config.engine.linear_kernel == "blas"
    assert config.cache.block_tokens == 64 and config.cache.host_bytes == 512 << 20
    assert dict(config.cache.quotas) == {"tenant-a": GiB}
    auth = Authenticator(config.keys)
    assert auth.find(KEY_A) == Principal(tenant="tenant-a")
    assert auth.find("tenant-b-key-Hn3Pj8Wd6Ys1Fg4B") == Principal(tenant="tenant-b")
    assert auth.find("tenant-c-key-0123456789abc") == Principal(tenant="tenant-c")
    assert auth.find(ADMIN) == Principal(tenant="ops", is_admin=True)
    assert KEY_A not in repr(config)


def test_json_works_too(tmp_path: Path) -> None:
    path = write(tmp_path / "kvgate.json", json.dumps({
        "server": {"port": 0}, "api_keys": [{"tenant": "tenant-a", "key": KEY_A}]}))
    config = load_serve_config(path, env={})
    assert config.port == 0 and len(config.keys) == 1


def test_every_problem_is_reported_at_once_without_keys_in_the_message(tmp_path: Path) -> None:
    path = write(tmp_path / "bad.toml", f"""
[server]
port = 70000
colour = "blue"
tls_cert = "{tmp_path / 'missing.crt'}"

[grpc]
max_receive_bytes = -1
max_deadline_s = 900

[engine]
max_queue = 0
block_tokens = 16
linear_kernel = "mkl"

[cache]
host_bytes = "lots"

[[api_keys]]
tenant = "shared"
key = "{KEY_A}"

[[api_keys]]
tenant = "tenant-b"
key = "short"

[extras]
""")
    with pytest.raises(ConfigError) as excinfo:
        load_serve_config(path, env={"KVGATE_ADMIN_KEYS": f"{KEY_A}=ops"})
    message = str(excinfo.value)
    for hint in ("unknown sections ['extras']", "server.port", "['colour']",
                 "tls_cert and server.tls_key go together", "missing.crt",
                 "grpc.max_receive_bytes must be > 0", "[engine] has unknown keys ['block_tokens']",
                 "engine.max_queue", "engine.linear_kernel", "cache.host_bytes", "reserved",
                 "characters long"):
        assert hint in message, hint
    assert KEY_A not in message and "short" not in message.replace("shorter", "")


def test_the_connection_age_grace_must_cover_the_longest_request() -> None:
    assert GrpcSettings(max_deadline_s=900).problems()
    assert not GrpcSettings(max_deadline_s=900, max_connection_age_grace_s=900).problems()


def test_the_same_key_for_a_tenant_and_an_admin_is_refused() -> None:
    with pytest.raises(ConfigError, match="more than once"):
        load_serve_config(None, env={"KVGATE_API_KEYS": f"{KEY_A}=tenant-a",
                                     "KVGATE_ADMIN_KEYS": f"{KEY_A}=ops"})


def test_the_removed_max_concurrent_rpcs_names_what_replaces_it(tmp_path: Path) -> None:
    path = write(tmp_path / "old.toml", "[grpc]\nmax_concurrent_rpcs = 64\n")
    with pytest.raises(ConfigError, match=r"\[limits\] max_calls .* max_calls_per_key"):
        load_serve_config(path, env={})


def test_per_key_limits_must_fit_inside_the_server_wide_ones(tmp_path: Path) -> None:
    path = write(tmp_path / "limits.toml",
                 "[limits]\nmax_calls = 8\nmax_calls_per_key = 9\nmax_lookups = 8\n")
    with pytest.raises(ConfigError) as excinfo:
        load_serve_config(path, env={})
    assert "max_calls_per_key must be <= limits.max_calls" in str(excinfo.value)
    assert "max_lookups must be < limits.max_calls" in str(excinfo.value)


def test_unreadable_and_unknown_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_serve_config(tmp_path / "absent.toml", env={})
    with pytest.raises(ConfigError, match=".toml or .json"):
        load_serve_config(write(tmp_path / "x.yaml", "a: 1"), env={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_serve_config(write(tmp_path / "x.toml", "[server"), env={})


def test_server_options_set_every_limit_on_purpose() -> None:
    options = dict(GrpcSettings().server_options())
    assert options["grpc.max_receive_message_length"] == 4 << 20
    assert options["grpc.so_reuseport"] == 0
    for name in ("grpc.max_send_message_length", "grpc.max_concurrent_streams",
                 "grpc.max_metadata_size", "grpc.keepalive_time_ms", "grpc.keepalive_timeout_ms",
                 "grpc.keepalive_permit_without_calls", "grpc.http2.max_pings_without_data",
                 "grpc.http2.min_ping_interval_without_data_ms", "grpc.http2.max_ping_strikes",
                 "grpc.max_connection_idle_ms", "grpc.max_connection_age_ms",
                 "grpc.max_connection_age_grace_ms", "grpc.server_handshake_timeout_ms"):
        assert name in options
    assert options["grpc.max_connection_age_grace_ms"] >= GrpcSettings().max_deadline_s * 1000


@pytest.mark.parametrize(
    ("text", "num_bytes"),
    [(1024, 1024), ("1024", 1024), ("4KiB", 4096), ("1.5 GiB", 3 << 29), ("2GB", 2 * 10**9),
     ("10b", 10)],
)
def test_sizes(text: object, num_bytes: int) -> None:
    assert parse_size(text) == num_bytes


@pytest.mark.parametrize("text", ["lots", "-1GiB", True, 1.5, "4 parsecs"])
def test_bad_sizes(text: object) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_without_keys_a_dev_key_is_created_announced_and_reused(tmp_path: Path) -> None:
    config = ServeConfig(data_dir=tmp_path / "data")
    lines: list[str] = []
    auth = build_authenticator(config, lines.append, announces_to_terminal=True)
    key = config.dev_key_path.read_text().strip()
    assert mode_of(config.dev_key_path) == 0o600
    assert auth.find(key) == Principal(tenant="default")
    assert len(lines) == 1 and key in lines[0] and "default" in lines[0]
    assert dev_api_key(config) == key
    assert build_authenticator(config, lines.append).find(key) is not None


def test_without_keys_a_dev_admin_key_is_created_beside_it_and_named_not_printed(
    tmp_path: Path,
) -> None:
    config = ServeConfig(data_dir=tmp_path / "data")
    for to_terminal in (True, False):
        lines: list[str] = []
        auth = build_authenticator(config, lines.append, announces_to_terminal=to_terminal)
        admin_key = config.dev_admin_key_path.read_text().strip()
        assert config.dev_admin_key_path.parent == config.dev_key_path.parent
        assert mode_of(config.dev_admin_key_path) == 0o600
        assert auth.find(admin_key) == Principal(tenant=DEV_ADMIN, is_admin=True)
        assert DEV_ADMIN not in auth.tenants and auth.tenants == {"default"}
        assert len(lines) == 1 and str(config.dev_admin_key_path) in lines[0]
        assert admin_key not in lines[0]
    assert dev_admin_key(config) == admin_key != dev_api_key(config)


def test_the_dev_key_is_printed_only_to_a_terminal_else_only_its_path(tmp_path: Path) -> None:
    config = ServeConfig(data_dir=tmp_path / "data")
    lines: list[str] = []
    build_authenticator(config, lines.append, announces_to_terminal=False)
    key = config.dev_key_path.read_text().strip()
    assert len(lines) == 1 and key not in lines[0]
    assert str(config.dev_key_path) in lines[0] and "not a terminal" in lines[0]


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "kvgate.internal"])
def test_keyless_development_mode_is_refused_off_loopback(tmp_path: Path, host: str) -> None:
    config = ServeConfig(host=host, data_dir=tmp_path / "data", allow_insecure_remote=True)
    with pytest.raises(ServeError, match="loopback only"):
        build_authenticator(config, print, announces_to_terminal=True)
    assert not config.dev_key_path.exists()


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::"])
def test_keyless_development_mode_is_refused_when_the_http_front_is_off_loopback(
        tmp_path: Path, host: str) -> None:
    config = ServeConfig(data_dir=tmp_path / "data", allow_insecure_remote=True,
                         http=HttpSettings(host=host))
    with pytest.raises(ServeError, match=r"loopback only, not on .*\(the HTTP front"):
        build_authenticator(config, print, announces_to_terminal=True)
    assert not config.dev_key_path.exists()
    off = ServeConfig(data_dir=tmp_path / "data", http=HttpSettings(host=host, enabled=False))
    assert build_authenticator(off, lambda line: None).find(dev_api_key(off)) is not None


@pytest.mark.parametrize("key", [
    "REPLACE-tenant-a-key", "replace-me-with-a-random-key", "changeme-0123456789",
    "your-key-goes-here-123", "kvg-dev-xxxxxxxxxxxxxxxxxxxx", "aaaaaaaaaaaaaaaaaaaaaaaa",
    "abababababababababababab", "0123401234012340123401234",
])
def test_placeholder_and_low_entropy_keys_are_refused(key: str) -> None:
    with pytest.raises(ConfigError, match="placeholder|too little entropy") as excinfo:
        load_serve_config(None, env={"KVGATE_API_KEYS": f"{key}=tenant-a"})
    assert key not in str(excinfo.value)


def test_every_key_of_the_deploy_examples_secret_is_refused() -> None:
    text = (ROOT / "deploy" / "k8s" / "secret.yaml").read_text(encoding="utf-8")
    values = dict(re.findall(r'^\s+([a-z-]+): "([^"]*)"', text, flags=re.MULTILINE))
    for env_name, entry in (("KVGATE_API_KEYS", "api-keys"), ("KVGATE_ADMIN_KEYS", "admin-keys")):
        with pytest.raises(ConfigError, match="placeholder"):
            load_serve_config(None, env={env_name: values[entry]})


def test_an_admin_named_like_a_tenant_is_refused() -> None:
    with pytest.raises(ConfigError, match="admin name 'tenant-a' is also a tenant id"):
        load_serve_config(None, env={"KVGATE_API_KEYS": f"{KEY_A}=tenant-a",
                                     "KVGATE_ADMIN_KEYS": f"{ADMIN}=tenant-a"})
    with pytest.raises(ValueError, match="also tenant ids"):
        Authenticator([KeyEntry.of_key(KEY_A, "tenant-a"),
                       KeyEntry.of_key(ADMIN, "tenant-a", is_admin=True)])


def test_configured_keys_mean_no_dev_key(tmp_path: Path) -> None:
    config = load_serve_config(None, env={"KVGATE_API_KEYS": f"{KEY_A}=tenant-a"},
                               overrides={"data_dir": tmp_path / "data"})
    lines: list[str] = []
    auth = build_authenticator(config, lines.append)
    assert auth.num_keys == 1 and not lines
    assert not config.dev_key_path.exists()


def test_the_redis_url_can_come_from_the_environment_so_the_file_holds_no_password() -> None:
    config = load_serve_config(None, env={"KVGATE_REDIS_URL": "redis://:pw@127.0.0.1:6399/0"})
    assert config.cache.redis_url == "redis://:pw@127.0.0.1:6399/0"


def test_the_http_front_is_on_by_default_on_loopback_and_flags_move_or_stop_it(
    tmp_path: Path,
) -> None:
    default = load_serve_config(None, env={})
    assert (default.http.enabled, default.http.host, default.http.port) == (True, "127.0.0.1",
                                                                            8000)
    config = tmp_path / "kvgate.toml"
    config.write_text('[http]\nport = 9000\nmax_body_bytes = "1MiB"\n', encoding="utf-8")
    loaded = load_serve_config(config, env={}, overrides={"http_port": 0, "http_host": None})
    assert (loaded.http.port, loaded.http.max_body_bytes) == (0, 1 << 20)
    assert not load_serve_config(None, env={}, overrides={"http_enabled": False}).http.enabled


def test_bad_http_settings_are_reported_with_the_others(tmp_path: Path) -> None:
    config = tmp_path / "kvgate.toml"
    config.write_text('[server]\nport = 8000\n[http]\nmax_body_bytes = "lots"\n'
                      "retry_after_s = 0\nspeed = 1\n", encoding="utf-8")
    with pytest.raises(ConfigError) as excinfo:
        load_serve_config(config, env={})
    message = str(excinfo.value)
    for part in ("http.max_body_bytes", "http.retry_after_s must be an integer >= 1",
                 "[http] has unknown keys ['speed']",
                 "http.port and server.port are both 8000"):
        assert part in message, message


def test_http_deadlines_and_the_waiting_cap_are_read_and_checked(tmp_path: Path) -> None:
    default = load_serve_config(None, env={}).http
    assert (default.header_timeout_s, default.body_timeout_s,
            default.max_waiting_connections) == (5.0, 5.0, 256)
    path = write(tmp_path / "http.toml", "[http]\nheader_timeout_s = 0.5\nbody_timeout_s = 2\n"
                                         "max_waiting_connections = 16\n")
    loaded = load_serve_config(path, env={}).http
    assert (loaded.header_timeout_s, loaded.body_timeout_s,
            loaded.max_waiting_connections) == (0.5, 2, 16)
    bad = write(tmp_path / "bad.toml", '[http]\nheader_timeout_s = 0\nbody_timeout_s = "soon"\n'
                                       "max_waiting_connections = 0\n")
    with pytest.raises(ConfigError) as excinfo:
        load_serve_config(bad, env={})
    for part in ("http.header_timeout_s must be a number of seconds > 0, got 0",
                 "http.body_timeout_s must be a number of seconds > 0, got 'soon'",
                 "http.max_waiting_connections must be an integer >= 1, got 0"):
        assert part in str(excinfo.value)
    over = write(tmp_path / "over.toml", "[http]\nmax_connections = 8\n"
                                         "max_waiting_connections = 9\n")
    with pytest.raises(ConfigError, match="max_waiting_connections must be <= http.max_conn"):
        load_serve_config(over, env={})


def test_a_default_tenant_quota_per_tier_and_a_redis_write_budget(tmp_path: Path) -> None:
    path = write(tmp_path / "quota.toml", """
[cache]
tenant_quota = { device = "512MiB", disk = "2GiB" }
redis_url = "redis://127.0.0.1:6399/0"
redis_write_bytes_per_s = "64MiB"
""")
    config = load_serve_config(path, env={})
    assert dict(config.cache.tenant_quota) == {"device": 512 << 20, "disk": 2 * GiB}
    assert config.cache.redis_write_bytes_per_s == 64 << 20


def test_the_write_queue_is_a_size_and_must_hold_something(tmp_path: Path) -> None:
    path = write(tmp_path / "queue.toml", '[cache]\nwrite_queue_bytes = "3GiB"\n')
    assert load_serve_config(path, env={}).cache.write_queue_bytes == 3 * GiB
    zero = write(tmp_path / "zero.toml", "[cache]\nwrite_queue_bytes = 0\n")
    with pytest.raises(ConfigError, match="write_queue_bytes must be >= 1"):
        load_serve_config(zero, env={})


def test_a_tenant_quota_for_an_unknown_tier_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "quota.toml", '[cache]\ntenant_quota = { redis = "1GiB" }\n')
    with pytest.raises(ConfigError, match="tenant_quota names the tier 'redis'"):
        load_serve_config(path, env={})


def test_keys_and_the_redis_url_can_come_from_secret_files(tmp_path: Path) -> None:
    keys = tmp_path / "api-keys"
    keys.write_text(f"{KEY_A}=tenant-a\ntenant-b-key-Hn3Pj8Wd6Ys1Fg4B=tenant-b\n")
    admins = tmp_path / "admin-keys"
    admins.write_text(f"{ADMIN}=ops\n")
    url = tmp_path / "redis-url"
    url.write_text("rediss://kvgate:pw@redis.internal:6380/0\n")
    for path in (keys, admins, url):
        path.chmod(0o400)
    config = load_serve_config(None, env={"KVGATE_API_KEYS_FILE": str(keys),
                                          "KVGATE_ADMIN_KEYS_FILE": str(admins),
                                          "KVGATE_REDIS_URL_FILE": str(url)})
    auth = Authenticator(config.keys)
    assert auth.find(KEY_A) == Principal(tenant="tenant-a")
    assert auth.find("tenant-b-key-Hn3Pj8Wd6Ys1Fg4B") == Principal(tenant="tenant-b")
    assert auth.find(ADMIN) == Principal(tenant="ops", is_admin=True)
    assert config.cache.redis_url == "rediss://kvgate:pw@redis.internal:6380/0"


def test_a_key_file_open_to_other_users_is_refused(tmp_path: Path) -> None:
    keys = tmp_path / "api-keys"
    keys.write_text(f"{KEY_A}=tenant-a\n")
    keys.chmod(0o644)
    with pytest.raises(ConfigError, match="KVGATE_API_KEYS_FILE: .*open to other users"):
        load_serve_config(None, env={"KVGATE_API_KEYS_FILE": str(keys)})
    with pytest.raises(ConfigError, match="cannot read"):
        load_serve_config(None, env={"KVGATE_API_KEYS_FILE": str(tmp_path / "absent")})


def test_the_admin_service_can_have_a_listener_of_its_own(tmp_path: Path) -> None:
    path = write(tmp_path / "admin.toml", '[server]\nadmin_host = "0.0.0.0"\nadmin_port = 50052\n')
    config = load_serve_config(path, env={})
    assert config.admin_address == "0.0.0.0:50052"
    assert load_serve_config(None, env={}).admin_address is None
    with pytest.raises(ConfigError, match="admin_port must differ"):
        load_serve_config(write(tmp_path / "same.toml", "[server]\nadmin_port = 50051\n"),
                          env={})
