"""Tenants' secrets in Redis: encrypted under the operator's key, bound to their tenant and name,
rotated all or nothing, refused in one sentence without a key, with a wrong key, for a short value
or an unknown name; the CLI never takes a value from its arguments, and the HTTP routes see only
their key's tenant."""

from __future__ import annotations

import base64
import json

import httpx
import pytest

from riverbed.agent.secrets import SecretStore, keygen
from riverbed.client.session import Bus
from riverbed.errors import ConfigError, InputError
from riverbed.serve import ServeConfig
from tests.kit.cli import assert_one_sentence, ok
from tests.kit.cli import run as run_cli
from tests.kit.serve import assert_problem, bearer, new_key, running

pytestmark = pytest.mark.anyio

TOKEN = "ghp_s3cr3t-Value-0123456789"


def _store(bus: Bus, key: str | None) -> SecretStore:
    return SecretStore(bus.client, bus.keys, key)


async def _raw_redis(bus: Bus) -> bytes:
    """Every key and value under the test's prefix, as one blob (to look for a value in)."""
    blob = b""
    async for name in bus.redis.scan_iter(match=f"{bus.keys.prefix}:*"):
        kind = await bus.redis.type(name)
        blob += name
        if kind == b"hash":
            for field, value in (await bus.redis.hgetall(name)).items():
                blob += field + value
        elif kind == b"string":
            blob += await bus.redis.get(name) or b""
    return blob


async def test_a_secret_round_trips_encrypted_and_only_for_its_tenant_and_name(bus: Bus) -> None:
    store = _store(bus, keygen())
    set_at = await store.set("acme", "GITHUB_TOKEN", TOKEN)
    await store.set("acme", "OTHER_TOKEN", "another-value-42")
    assert await store.get_many("acme", ["GITHUB_TOKEN"]) == {"GITHUB_TOKEN": TOKEN}
    assert await store.list("acme") == [("GITHUB_TOKEN", set_at), ("OTHER_TOKEN", pytest.approx(set_at, abs=5))]
    stored = await _raw_redis(bus)
    assert b"GITHUB_TOKEN" in stored  # the names are there
    assert TOKEN.encode() not in stored
    assert base64.b64encode(TOKEN.encode()) not in stored

    # another tenant's secret gets the answer a missing one gets
    with pytest.raises(InputError, match=r"^no secret GITHUB_TOKEN for this tenant$"):
        await store.get_many("globex", ["GITHUB_TOKEN"])
    with pytest.raises(InputError, match=r"^no secret MISSING_ONE for this tenant$"):
        await store.get_many("acme", ["MISSING_ONE"])

    # a record copied to another tenant, or to another name, does not decrypt
    record = await bus.redis.hget(bus.keys.tenant_secrets("acme"), "GITHUB_TOKEN")
    assert record is not None
    await bus.redis.hset(bus.keys.tenant_secrets("globex"), "GITHUB_TOKEN", record)
    await bus.redis.hset(bus.keys.tenant_secrets("acme"), "STOLEN_TOKEN", record)
    for tenant, name in (("globex", "GITHUB_TOKEN"), ("acme", "STOLEN_TOKEN")):
        with pytest.raises(ConfigError, match="does not decrypt") as refused:
            await store.get_many(tenant, [name])
        assert TOKEN not in str(refused.value)

    await store.remove("acme", "OTHER_TOKEN")
    with pytest.raises(InputError, match=r"^no secret OTHER_TOKEN for this tenant$"):
        await store.remove("acme", "OTHER_TOKEN")
    assert [name for name, _ in await store.list("acme")] == ["GITHUB_TOKEN", "STOLEN_TOKEN"]


async def test_bad_values_names_and_keys_are_refused_in_one_sentence(bus: Bus) -> None:
    store = _store(bus, keygen())
    for name, value, words in (
        ("SHORT", "1234567", "at least 8 characters"),
        ("lower_case", TOKEN, "is not a secret name"),
        ("1DIGIT", TOKEN, "is not a secret name"),
        ("SPACED", f" {TOKEN}", "may not begin or end with spaces"),
        ("TWO_LINES", f"{TOKEN}\n", "may not begin or end with spaces"),
    ):
        with pytest.raises(InputError, match=words) as refused:
            await store.set("acme", name, value)
        assert "\n" not in str(refused.value)
    await store.set("acme", "EIGHT_CHARS", "12345678")  # the shortest value taken

    keyless = _store(bus, None)
    for call in (
        lambda: keyless.set("acme", "A_TOKEN", TOKEN),
        lambda: keyless.list("acme"),
        lambda: keyless.get_many("acme", ["EIGHT_CHARS"]),
        lambda: keyless.remove("acme", "EIGHT_CHARS"),
        lambda: keyless.rotate(keygen()),
    ):
        with pytest.raises(ConfigError, match=r"RIVERBED_SECRETS_KEY.*riverbed secrets keygen"):
            await call()
    with pytest.raises(ConfigError, match="32 bytes in base64"):
        _store(bus, "not-a-key")

    # a wrong key reads nothing and writes nothing
    wrong = _store(bus, keygen())
    before = await _raw_redis(bus)
    for call in (
        lambda: wrong.get_many("acme", ["EIGHT_CHARS"]),
        lambda: wrong.set("acme", "A_TOKEN", TOKEN),
        lambda: wrong.rotate(keygen()),
    ):
        with pytest.raises(ConfigError, match="another key than RIVERBED_SECRETS_KEY"):
            await call()
    assert await _raw_redis(bus) == before


async def test_rotate_re_encrypts_every_tenant_under_the_new_key(bus: Bus) -> None:
    old, new = keygen(), keygen()
    store = _store(bus, old)
    for tenant in ("acme", "globex"):
        await store.set(tenant, "API_TOKEN", f"{tenant}-token-value")
    await store.set("acme", "DB_PASSWORD", "hunter2-but-longer")
    listed = await store.list("acme")
    before = await bus.redis.hgetall(bus.keys.tenant_secrets("acme"))

    rotated = await _store(bus, old).rotate(new)
    assert (rotated.tenants, rotated.secrets) == (2, 3)
    after = await bus.redis.hgetall(bus.keys.tenant_secrets("acme"))
    assert after.keys() == before.keys()
    assert all(after[k] != before[k] for k in before)
    fresh = _store(bus, new)
    assert await fresh.get_many("acme", ["API_TOKEN", "DB_PASSWORD"]) == {
        "API_TOKEN": "acme-token-value",
        "DB_PASSWORD": "hunter2-but-longer",
    }
    assert await fresh.get_many("globex", ["API_TOKEN"]) == {"API_TOKEN": "globex-token-value"}
    assert await fresh.list("acme") == listed  # when each was set is kept
    with pytest.raises(ConfigError, match="another key"):
        await _store(bus, old).get_many("acme", ["API_TOKEN"])


async def test_the_cli_takes_values_from_stdin_or_the_environment_never_from_arguments(
    bus: Bus, cli_env: dict[str, str]
) -> None:
    key = ok(cli_env, "secrets", "keygen").decode().strip()
    assert len(base64.b64decode(key, validate=True)) == 32
    env = {**cli_env, "RIVERBED_PREFIX": bus.keys.prefix, "RIVERBED_SECRETS_KEY": key}

    said = run_cli(env, "secrets", "set", "acme", "GITHUB_TOKEN", stdin=TOKEN.encode() + b"\n")
    assert said.returncode == 0, said.stderr
    assert TOKEN.encode() not in said.stdout + said.stderr
    said = run_cli(
        {**env, "MY_VAR": "from-the-env-0001"}, "secrets", "set", "acme", "ENV_TOKEN", "--from-env", "MY_VAR"
    )
    assert said.returncode == 0, said.stderr
    assert await _store(bus, key).get_many("acme", ["GITHUB_TOKEN", "ENV_TOKEN"]) == {
        "GITHUB_TOKEN": TOKEN,  # the line's newline is not part of it
        "ENV_TOKEN": "from-the-env-0001",
    }

    listed = [json.loads(line) for line in ok(env, "secrets", "list", "acme", "--json").splitlines()]
    assert [row["name"] for row in listed] == ["ENV_TOKEN", "GITHUB_TOKEN"]
    assert all(set(row) == {"name", "set_at"} for row in listed)
    table = ok(env, "secrets", "list", "acme")
    status = run_cli(env, "status")
    for shown in (table, status.stdout + status.stderr, json.dumps(listed).encode()):
        assert TOKEN.encode() not in shown
        assert key.encode() not in shown

    # a value is never an argument: an extra one is refused before anything is stored
    said = assert_one_sentence(run_cli(env, "secrets", "set", "acme", "ARG_TOKEN", TOKEN), 2, "never from the command")
    assert TOKEN not in said
    assert_one_sentence(
        run_cli(env, "secrets", "set", "acme", "SHORT_ONE", stdin=b"short\n"), 2, "at least 8 characters"
    )
    assert_one_sentence(run_cli(env, "secrets", "set", "acme", "EMPTY_ONE", stdin=b""), 2, "stdin")
    assert_one_sentence(run_cli(env, "secrets", "set", "acme", "X", "--from-env", "UNSET_VAR"), 2, "UNSET_VAR")
    assert_one_sentence(run_cli(env, "secrets", "rm", "acme", "NOT_THERE"), 2, "no secret NOT_THERE for this tenant")
    assert [name for name, _ in await _store(bus, key).list("acme")] == ["ENV_TOKEN", "GITHUB_TOKEN"]
    keyless = {k: v for k, v in env.items() if k != "RIVERBED_SECRETS_KEY"}
    assert_one_sentence(
        run_cli(keyless, "secrets", "list", "acme"), 2, "RIVERBED_SECRETS_KEY", "riverbed secrets keygen"
    )

    ok(env, "secrets", "rm", "acme", "ENV_TOKEN")
    new_key_value = keygen()
    rotated = run_cli(env, "secrets", "rotate", stdin=new_key_value.encode() + b"\n")
    assert rotated.returncode == 0, rotated.stderr
    assert b"RIVERBED_SECRETS_KEY" in rotated.stderr
    assert new_key_value.encode() not in rotated.stdout + rotated.stderr
    assert await _store(bus, new_key_value).get_many("acme", ["GITHUB_TOKEN"]) == {"GITHUB_TOKEN": TOKEN}
    assert_one_sentence(run_cli(env, "secrets", "list", "acme"), 2, "another key than RIVERBED_SECRETS_KEY")


async def test_the_http_routes_see_only_their_keys_tenant(bus: Bus) -> None:
    secrets_key = keygen()
    acme, globex = await new_key(bus, "acme"), await new_key(bus, "globex")
    config = ServeConfig(secrets_key=secrets_key)
    async with running(bus, config) as base, httpx.AsyncClient(base_url=base) as http:
        put = await http.put("/v1/secrets/GITHUB_TOKEN", content=TOKEN, headers=bearer(acme))
        assert put.status_code == 200, put.text
        assert TOKEN not in put.text
        put = await http.put("/v1/secrets/JSON_TOKEN", json={"value": "json-value-123"}, headers=bearer(acme))
        assert put.status_code == 200, put.text
        listed = await http.get("/v1/secrets", headers=bearer(acme))
        assert [row["name"] for row in listed.json()["secrets"]] == ["GITHUB_TOKEN", "JSON_TOKEN"]
        assert TOKEN not in listed.text
        assert (await http.get("/v1/secrets", headers=bearer(globex))).json()["secrets"] == []
        # the same name for another tenant is its own secret; a tenant's key cannot name another tenant
        put = await http.put("/v1/secrets/GITHUB_TOKEN", content="globex-value\n", headers=bearer(globex))
        assert put.status_code == 200, put.text
        other = await http.get("/v1/secrets?tenant=acme", headers=bearer(globex))
        assert_problem(other, 400, "only its own tenant's secrets")
        admin = await new_key(bus, None, admin=True)
        assert_problem(await http.get("/v1/secrets", headers=bearer(admin)), 400, "?tenant=T")
        by_admin = await http.get("/v1/secrets?tenant=globex", headers=bearer(admin))
        assert [row["name"] for row in by_admin.json()["secrets"]] == ["GITHUB_TOKEN"]
        gone = await http.delete("/v1/secrets/JSON_TOKEN", headers=bearer(globex))  # acme's
        assert_problem(gone, 404, "no secret JSON_TOKEN for this tenant")
        assert_problem(await http.put("/v1/secrets/SHORT", content="short", headers=bearer(acme)), 400, "8 characters")
        assert_problem(await http.put("/v1/secrets/bad-name", content=TOKEN, headers=bearer(acme)), 400, "secret name")
        assert_problem(await http.get("/v1/secrets"), 401)
        assert (await http.delete("/v1/secrets/GITHUB_TOKEN", headers=bearer(acme))).status_code == 204
    assert await _store(bus, secrets_key).get_many("acme", ["JSON_TOKEN"]) == {"JSON_TOKEN": "json-value-123"}
    assert await _store(bus, secrets_key).get_many("globex", ["GITHUB_TOKEN"]) == {"GITHUB_TOKEN": "globex-value"}
    with pytest.raises(InputError, match="no secret GITHUB_TOKEN"):
        await _store(bus, secrets_key).get_many("acme", ["GITHUB_TOKEN"])

    async with running(bus, ServeConfig()) as base, httpx.AsyncClient(base_url=base) as http:
        refused = await http.get("/v1/secrets", headers=bearer(acme))
        assert_problem(refused, 503, "RIVERBED_SECRETS_KEY")
