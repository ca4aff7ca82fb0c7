"""docs/http_api.md against the binaries: every ferryd flag and every CLI command and flag is
documented, nothing documented is missing from them, and every route in the table is one that
a running ferryd serves."""

from __future__ import annotations

import re
import subprocess

import pytest

import helpers

DOC = helpers.HERE.parent.parent / "docs" / "http_api.md"
SOURCE = helpers.HERE.parent.parent / "server" / "http_api.cc"
# Flags that are there for the tests and left out of --help.
HIDDEN = {"--test-fail-gpu-writes"}
# Registered so that their bodies are read and they answer 405, not 404; no route of the table.
NOT_ALLOWED_HERE = {("POST", "/v1/objects/X")}


def doc() -> str:
    return DOC.read_text()


def help_flags(*argv: str) -> set[str]:
    """The long flags a --help lists, --help aside."""
    out = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    flags = set(re.findall(r"^\s+(?:-\w,)?(--[a-z][a-z-]*)", out.stdout, re.M))
    return flags - {"--help"}


def test_every_ferryd_flag_is_documented_and_every_documented_one_exists():
    text = doc()
    flags_paragraph = text[text.index("Flags:"):text.index("Logs go to stderr.")]
    documented = set(re.findall(r"`(--[a-z][a-z-]*)", flags_paragraph))
    listed = help_flags(str(helpers.FERRYD))
    assert listed - documented == set()
    assert documented - listed == HIDDEN


def test_every_cli_command_and_flag_is_documented():
    text = doc()
    cli = text[text.index("The CLI ("):]
    out = subprocess.run([str(helpers.FERRY_CLI), "--help"], capture_output=True, text=True,
                         timeout=30).stdout
    commands = re.findall(r"^  ([a-z]+)\s{2,}", out[out.index("Subcommands:"):], re.M)
    assert len(commands) >= 10, out
    for command in commands:
        assert re.search(rf"\bferry (--node \S+ )?{command}\b", cli), command
        for flag in help_flags(str(helpers.FERRY_CLI), command):
            assert flag in cli, f"ferry {command} {flag}"
    assert "--node" in help_flags(str(helpers.FERRY_CLI))


def documented_routes() -> list[tuple[str, str]]:
    """(method, path) of every route in the table, placeholders and options as written."""
    routes = []
    for row in re.findall(r"^\| (`[A-Z]+ .*?) \|", doc(), re.M):
        for method, path in re.findall(r"`([A-Z]+) (/[^`\s]*)", row):
            routes.append((method, path))
    return routes


def concrete(path: str) -> str:
    """A path to request for a documented one: options dropped, placeholders filled."""
    path = re.sub(r"\[.*?\]", "", path).split("?")[0]
    path = path.replace("{name}", "doc-probe").replace("{id}", "999").replace("{H}", "999")
    return path.replace("/v3/lease/*", "/v3/lease/grant").replace("/v3/kv/*", "/v3/kv/range")


@pytest.fixture
def ferryd(tmp_path):
    d = helpers.start_ferryd(tmp_path / "ferryd", "--serve-directory")
    yield d
    assert d.stop() == 0


def test_every_documented_route_is_served(ferryd):
    routes = documented_routes()
    assert len(routes) >= 20, routes
    served = 0
    for method, path in routes:
        if path == "/v1/drain":
            continue  # served: it stops the node (test_drain.py)
        body = {} if method in ("POST", "PUT") else None
        status, _, answer = helpers.call(ferryd.url + concrete(path), method, body)
        no_route = status == 404 and isinstance(answer, dict) and \
            answer.get("error", {}).get("message") == "no such route"
        assert not no_route, f"{method} {path}: {status} {answer}"
        served += 1
    assert served == len(routes) - 1
    # And a route nobody documented is not served: the check above can tell.
    status, _, answer = helpers.call(ferryd.url + "/v1/undocumented", "POST", {})
    assert (status, answer["error"]["message"]) == (404, "no such route")
    # POST under an object's path is taken only to be refused (NOT_ALLOWED_HERE below).
    status, _, answer = helpers.call(ferryd.url + "/v1/objects/doc-probe", "POST", {})
    assert (status, answer["error"]["code"]) == (405, "UNIMPLEMENTED")


def test_every_route_the_server_registers_is_documented():
    """Each pattern server/http_api.cc registers has a row (its regex groups stand for the
    table's {placeholders})."""
    def shape(path: str) -> str:
        path = re.sub(r"\[.*?\]", "", path).split("?")[0]
        return re.sub(r"\{[a-z]+\}|\(.+?\)|\*", "X", path)

    documented = {(m, shape(p)) for m, p in documented_routes()}
    documented_prefixes = {(m, p.split("X")[0]) for m, p in documented}
    registered = re.findall(r'server\.(Get|Post|Put|Delete)\(\s*"(/[^"]*)"', SOURCE.read_text())
    assert len(registered) >= 15, registered
    for method, pattern in registered:
        key = (method.upper(), shape(pattern))
        if key in NOT_ALLOWED_HERE:
            continue
        if key[1].endswith("X"):  # a pattern that takes a name takes every route under it
            assert any(m == key[0] and p.startswith(key[1][:-1])
                       for m, p in documented_prefixes | documented), key
        else:
            assert key in documented, key
