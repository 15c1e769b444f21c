"""The Ray Serve application on two Ray nodes (Ray's own multi-node test cluster, both on this host): a
replica on each node, the ingress beside one of them, driven by the ``openai`` client."""

from __future__ import annotations

import concurrent.futures as cf
import socket

import openai
import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is the optional extra slotinfer[ray]")
serve = pytest.importorskip("ray.serve")
pytestmark = pytest.mark.slow  # two Ray nodes, a Serve application

from ray.cluster_utils import Cluster
from ray.util.state import list_actors

import slotinfer.ray as sr

NAME = "qwen3"  # the tiny model's folder: its name in the API
DEPLOYMENT = f"slotinfer-{NAME}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_nodes():
    """A head and a second node of one CPU each, told apart by a resource of their own."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_a": 1},
                                                            "dashboard_port": _free_port()})  # for the state API
    cluster.add_node(num_cpus=1, resources={"node_b": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_two_replicas_on_two_nodes_both_answer(two_nodes, model_dir):
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    try:
        # a replica asks for a whole node's CPU: Serve can place the two only one on each node
        serve.run(sr.serve_app(str(model_dir("qwen3")), replicas=2, num_cpus=1, ingress_cpus=0, slots=2, max_queue=4,
                               max_len=128), name="slotinfer", route_prefix="/")
        nodes = {n["NodeID"]: next(k for k in n["Resources"] if k.startswith("node_"))
                 for n in ray.nodes() if n["Alive"]}
        replicas = {a.name.rsplit("#", 1)[-1]: nodes[a.node_id]
                    for a in list_actors(address=two_nodes.address, filters=[("state", "=", "ALIVE")], detail=True)
                    if a.name and f"#{DEPLOYMENT}#" in a.name}
        assert sorted(replicas.values()) == ["node_a", "node_b"]
        handle = serve.get_deployment_handle(DEPLOYMENT, app_name="slotinfer")

        def submitted():  # requests each replica took, asked of that replica (a call pinned to it)
            return {rid: handle.info.remote(pin=rid).result(timeout_s=60)["stats"]["submitted"] for rid in replicas}

        before = submitted()  # its warm-up's
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [NAME]
        chunks = list(client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "Tell me about the sea."}], max_tokens=6,
            temperature=0, stream=True, extra_body={"ignore_eos": True}))
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

        def ask(i):  # prompts that share no prefix, at once: each goes to the less loaded replica
            msgs = [{"role": "user", "content": f"{i} " * 20 + "Count on."}]
            return client.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, temperature=0,
                                                  extra_body={"ignore_eos": True}).usage.completion_tokens

        with cf.ThreadPoolExecutor(4) as ex:
            assert list(ex.map(ask, range(4))) == [6] * 4
        served = {rid: n - before[rid] for rid, n in submitted().items()}
        assert sum(served.values()) == 5 and all(served.values()), served  # both nodes' replicas answered
    finally:
        serve.shutdown()
