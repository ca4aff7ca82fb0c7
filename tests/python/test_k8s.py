"""deploy/k8s: kubectl (Debian's kubernetes-client) reads every manifest client-side, and what
they say agrees with what ferryd and the image really use: the image's name and version, the
flags (a real ferryd started with them), the port, the probes' routes, the preStop drain."""

from __future__ import annotations

import json
import re
import subprocess

import yaml

import helpers
from helpers import call

ROOT = helpers.HERE.parent.parent
K8S = ROOT / "deploy" / "k8s"
TOOLS_ENV = helpers.TOOLS_ENV


def kubectl(*argv) -> str:
    r = subprocess.run(["kubectl", *argv], capture_output=True, text=True, env=TOOLS_ENV,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def manifests() -> dict[str, dict]:
    """{kind: document} of what kustomize renders from deploy/k8s."""
    return {d["kind"]: d for d in yaml.safe_load_all(kubectl("kustomize", str(K8S)))}


def test_kubectl_reads_every_manifest_and_drops_no_field():
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        # Decoded into the API's types and written back (client side, no cluster): a
        # misspelled or misplaced field would be missing from what comes back.
        back = json.loads(kubectl("annotate", "--local", "--dry-run=client", "-o", "json",
                                  "-f", str(path), "ferry-check=1"))
        back["metadata"]["annotations"].pop("ferry-check")
        if not back["metadata"]["annotations"]:
            del back["metadata"]["annotations"]
        assert back == yaml.safe_load(path.read_text()), path.name


def test_image_flags_port_probes_and_drain_agree_with_ferryd(tmp_path):
    docs = manifests()
    pod = docs["DaemonSet"]["spec"]["template"]
    container = pod["spec"]["containers"][0]
    config = docs["ConfigMap"]["data"]

    version = re.search(r"project\(ferry VERSION ([0-9.]+)",
                        (ROOT / "CMakeLists.txt").read_text()).group(1)
    assert container["image"] == f"ferry:{version}"
    build_sh = (ROOT / "deploy" / "image" / "build.sh").read_text()
    assert "tag=ferry-$version" in build_sh

    port = container["ports"][0]["containerPort"]
    assert f"--listen=0.0.0.0:{port}" in container["args"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] == port
    # The drain must end before the kubelet's SIGKILL.
    assert int(config["FERRY_DRAIN_GRACE_S"]) < pod["spec"]["terminationGracePeriodSeconds"]
    # Names the manifests share.
    assert container["envFrom"][0]["configMapRef"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    secret = docs["Secret"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["token"]["secret"]["secretName"] == secret["metadata"]["name"]
    assert {m["name"] for m in container["volumeMounts"]} <= set(volumes)

    # The directory: the example etcd's members, by the names its Service gives them.
    etcd, service = docs["StatefulSet"], docs["Service"]
    assert etcd["spec"]["serviceName"] == service["metadata"]["name"]
    namespace = service["metadata"]["namespace"]
    client_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "client")
    members = [f"etcd-{i}.{service['metadata']['name']}.{namespace}.svc:{client_port}"
               for i in range(etcd["spec"]["replicas"])]
    assert config["FERRY_DIRECTORY"] == "etcd://" + ",".join(members)
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    assert f"--advertise-url=http://$(NODE_IP):{port}" in container["args"]

    # ferryd started with the DaemonSet's arguments: the ConfigMap's values, this machine's
    # provider, loopback, files here, and an etcd of this test's own as the directory.
    token = tmp_path / "token"
    token.write_text(secret["stringData"]["token"] + "\n")
    etcd_port, peer_port, port_here = helpers.free_port(), helpers.free_port(), helpers.free_port()
    local = {"FERRY_PROVIDER": "tcp", "FERRY_RAILS": "1", "NODE_IP": "127.0.0.1",
             "NODE_NAME": "worker-1", "FERRY_DIRECTORY": f"etcd://127.0.0.1:{etcd_port}"}
    args = []
    for a in container["args"]:
        a = re.sub(r"\$\((\w+)\)", lambda m: {**config, **local}[m.group(1)], a)
        flag, _, value = a.partition("=")
        value = {"--listen": f"127.0.0.1:{port_here}", "--data-dir": str(tmp_path / "data"),
                 "--token-file": str(token),
                 "--advertise-url": value.replace(f":{port}", f":{port_here}")}.get(flag, value)
        args.append(f"{flag}={value}" if value else flag)
    client, peer = f"http://127.0.0.1:{etcd_port}", f"http://127.0.0.1:{peer_port}"
    etcd_proc = subprocess.Popen(
        ["etcd", "--name", "t", "--data-dir", str(tmp_path / "etcd"), "--listen-client-urls",
         client, "--advertise-client-urls", client, "--listen-peer-urls", peer,
         "--initial-advertise-peer-urls", peer, "--initial-cluster", f"t={peer}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=TOOLS_ENV)
    node = helpers.Ready([str(helpers.FERRYD), *args])
    url = "http://" + node.info["listen"]
    try:
        # Joined under the advertised address, with the node's name as a label.
        auth = helpers.auth(secret["stringData"]["token"])
        helpers.wait_until(lambda: call(url + "/v1/node", headers=auth)[2]["directory"]["state"]
                           == "joined",
                           "the node in the directory: "
                           + json.dumps(call(url + "/v1/node", headers=auth)[2].get("directory")))
        me = [n for n in call(url + "/v1/cluster", headers=auth)[2]["nodes"]
              if n["id"] == node.info["node"]]
        assert me and me[0]["url"] == url and me[0]["labels"] == {"k8s-node": "worker-1"}, me
        for probe in ("readinessProbe", "livenessProbe"):
            assert call(url + container[probe]["httpGet"]["path"])[0] == 200
        assert call(url + pod["metadata"]["annotations"]["prometheus.io/path"])[0] == 200
        # The preStop hook: the image's CLI with the Secret's token, as env gives it.
        hook = container["lifecycle"]["preStop"]["exec"]["command"]
        assert hook[0] == "/usr/local/bin/ferry" and "/usr/local/bin/" in build_sh
        env = {e["name"]: e for e in container["env"]}
        assert env["FERRY_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] in secret["stringData"]
        cli = [str(helpers.FERRY_CLI), *[h if h != "http://127.0.0.1:7070" else url
                                         for h in hook[1:]]]
        r = subprocess.run(cli, capture_output=True, text=True, timeout=60,
                           env={**TOOLS_ENV, "FERRY_TOKEN": secret["stringData"]["token"]})
        assert r.returncode == 0, r.stderr
        assert node.proc.wait(60) == 0
    finally:
        node.stop()
        etcd_proc.kill()
        etcd_proc.wait()
